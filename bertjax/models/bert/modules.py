"""The BERT encoder (Devlin et al., 2018) as functional Flax linen modules.

Every parameter carries logical axis names (`vocab`, `embed`, `mlp`, `heads`, `kv`, and
`layers` for scanned stacks); `bertjax.train.sharding` maps them onto a device mesh.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import dense as dense_lib
from bertjax.models.bert.config import BertConfig
from bertjax.models.dense import Dense
from bertjax.models.kernels import attention as attn_lib
from bertjax.models.kernels import dropout_attention
from bertjax.models.kernels import flash_attention as flash_lib
from bertjax.models.layers import Dropout, gelu, maybe_remat

Array = jax.Array


def activation(name: str):
    return {
        "gelu": gelu,  # exact erf GELU
        "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
        "relu": jax.nn.relu,
    }[name]


def kernel_init(config: BertConfig, axes: tuple[str | None, ...]):
    # Truncated normal with the *untruncated* stddev 0.02, like tf.truncated_normal_initializer.
    init = nn.initializers.truncated_normal(stddev=config.initializer_range)
    return nn.with_logical_partitioning(init, axes)


def zeros_init(axes: tuple[str | None, ...]):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


def layer_norm(config: BertConfig, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=config.layer_norm_eps,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
        bias_init=zeros_init(("embed",)),
        name=name,
    )


def dense(config: BertConfig, features: int, axes: tuple[str | None, str | None], name: str,
          truncated: bool = True):
    """A dense layer of `features` outputs, kernel drawn with stddev initializer_range
    (`truncated`: Dense.truncated), bias zeros."""
    return Dense(
        features,
        kernel_axes=axes,
        bias_axes=axes[1:],
        stddev=config.initializer_range,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        truncated=truncated,
        name=name,
    )


class Embeddings(nn.Module):
    """Word + learned position + token type embeddings, then LayerNorm and dropout."""

    config: BertConfig

    def setup(self):
        cfg = self.config

        def embed(num, axes, name):
            return nn.Embed(
                num,
                cfg.hidden_size,
                dtype=cfg.dtype,
                param_dtype=cfg.param_dtype,
                embedding_init=kernel_init(cfg, axes),
                name=name,
            )

        self.word_embeddings = embed(cfg.vocab_size, ("vocab", "embed"), "word_embeddings")
        self.position_embeddings = embed(
            cfg.max_position_embeddings, (None, "embed"), "position_embeddings"
        )
        self.token_type_embeddings = embed(
            cfg.type_vocab_size, (None, "embed"), "token_type_embeddings"
        )
        self.layer_norm = layer_norm(cfg, "layer_norm")
        self.dropout = Dropout(cfg.hidden_dropout_prob)

    def __call__(self, input_ids, segment_ids, position_ids, deterministic: bool) -> Array:
        """input_ids, segment_ids, position_ids: [batch, seq] int → [batch, seq, hidden]."""
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(position_ids)
            + self.token_type_embeddings(segment_ids)
        )
        x = self.layer_norm(x)
        x = self.dropout(x, deterministic=deterministic)
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class SelfAttention(nn.Module):
    """Multi-head self-attention: Q/K/V projections, attention, output projection."""

    config: BertConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: Array, mask: Array | None, queries: Array | None = None) -> Array:
        """x: [batch, seq, hidden]; mask: [batch, 1, seq, seq] bool, or for
        attention_impl "flash" / "flash_jax" segment ids [batch, seq] int
        (flash_attention.segment_ids)
        → [batch, seq, hidden].

        queries (einsum and fused paths only): [batch, q, hidden], the rows that attend (keys
        and values still come from all of x); mask then [batch, 1, q or 1, seq]
        → [batch, q, hidden].
        """
        cfg = self.config
        impl = cfg.attention_impl
        packed = impl == "flash"  # [batch, seq, heads·head_dim] throughout: the kernel's layout

        def projection(name):  # parameters [hidden, heads, head_dim], [heads, head_dim]
            return Dense(
                (cfg.num_heads, cfg.head_dim),
                kernel_axes=("embed", "heads", "kv"),
                bias_axes=("heads", "kv"),
                stddev=cfg.initializer_range,
                dtype=cfg.dtype,
                param_dtype=cfg.param_dtype,
                name=name,
            )

        def project(name, rows=x):
            return nn.with_logical_constraint(projection(name)(rows),
                                              ("batch", "length", "heads", "kv"))

        dropout_active = not self.deterministic and cfg.attention_dropout_prob > 0
        if impl == "flash":  # one matmul for q, k and v; dropout drawn inside the kernel
            hidden = x.shape[-1]
            kernels, biases = zip(*(projection(name).weights((hidden,))
                                    for name in ("query", "key", "value")))
            kernel = dropout_attention.fuse_qkv(*(k.reshape(hidden, -1) for k in kernels),
                                                cfg.num_heads)  # [hidden, 3·heads·head_dim]
            bias = dropout_attention.fuse_qkv(*(b.reshape(-1) for b in biases), cfg.num_heads)
            # [batch, seq, 3·heads·head_dim]; the kernels add the bias
            qkv = dense_lib.dense(x.astype(cfg.dtype), kernel, None)
            qkv = nn.with_logical_constraint(qkv, ("batch", "length", "heads"))
            seed, rate = jnp.zeros((1,), jnp.int32), 0.0
            if dropout_active:
                bits = jax.random.bits(self.make_rng("dropout"), (1,), jnp.uint32)
                seed = jax.lax.bitcast_convert_type(bits, jnp.int32)
                rate = cfg.attention_dropout_prob
            context = dropout_attention.dropout_attention(qkv, bias, mask, seed, rate,
                                                          cfg.num_heads, cfg.causal)
        else:
            query = project("query", x if queries is None else queries)
            key, value = project("key"), project("value")
            if impl == "flash_jax":  # BertConfig rules out attention dropout with it
                context = flash_lib.flash_attention(query, key, value, mask, cfg.causal)
            elif impl == "einsum" or (impl == "auto" and dropout_active):
                dropout = None
                if dropout_active:
                    dropout = Dropout(cfg.attention_dropout_prob).keep_mask
                context = attn_lib.einsum_attention(query, key, value, mask, dropout)
            else:
                if dropout_active:
                    raise ValueError(
                        f"model.attention_impl={impl!r} cannot apply attention dropout; set "
                        "model.attention_dropout_prob=0.0 or model.attention_impl='auto'"
                    )
                implementation = None if impl == "auto" else impl
                context = attn_lib.fused_attention(query, key, value, mask, implementation)
        out = Dense(
            cfg.hidden_size,
            kernel_axes=("heads", "kv", "embed"),
            bias_axes=("embed",),
            stddev=cfg.initializer_range,
            num_contract=2,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            flat=packed,
            in_features=(cfg.num_heads, cfg.head_dim),
            name="output",
        )(context)
        return nn.with_logical_constraint(out, ("batch", "length", "embed"))


class EncoderLayer(nn.Module):
    """Post-LN Transformer layer: x = LN(x + Attn(x)); x = LN(x + FFN(x))."""

    config: BertConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: Array, mask: Array | None, query_index: Array | None = None) -> Array:
        """x: [batch, seq, hidden] → [batch, seq, hidden].

        query_index [batch] int (einsum and fused attention): compute the layer for that one
        token of each row only (its attention still reads every token) → [batch, 1, hidden];
        a head that reads one token needs no more of the final layer.
        """
        cfg = self.config
        drop = functools.partial(
            Dropout(cfg.hidden_dropout_prob), deterministic=self.deterministic
        )
        queries = None
        if query_index is not None:
            queries = jnp.take_along_axis(x, query_index[:, None, None], axis=1)
            if mask is not None and mask.shape[2] > 1:  # packed or causal: that token's row
                mask = jnp.take_along_axis(mask, query_index[:, None, None, None], axis=2)
        attended = SelfAttention(cfg, self.deterministic, name="attention")(x, mask, queries)
        x = x if queries is None else queries
        x = layer_norm(cfg, "attention_layer_norm")(x + drop(attended))
        h = dense(cfg, cfg.intermediate_size, ("embed", "mlp"), "intermediate")(x)
        h = nn.with_logical_constraint(activation(cfg.hidden_act)(h), ("batch", "length", "mlp"))
        h = dense(cfg, cfg.hidden_size, ("mlp", "embed"), "output")(h)
        x = layer_norm(cfg, "output_layer_norm")(x + drop(h))
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class _ScannedLayer(nn.Module):
    """EncoderLayer with the (carry, xs) → (carry, ys) signature that nn.scan needs."""

    config: BertConfig
    deterministic: bool = True
    collect: bool = False

    @nn.compact
    def __call__(self, x: Array, mask: Array | None):
        layer_cls = maybe_remat(EncoderLayer, self.config.remat_policy, scanned=True)
        x = layer_cls(self.config, self.deterministic, name="layer")(x, mask)
        return x, (x if self.collect else None)


class Encoder(nn.Module):
    """A stack of `num_layers` encoder layers, unrolled or as one scanned layer."""

    config: BertConfig

    @nn.compact
    def __call__(self, x, mask, deterministic: bool, return_all_layers: bool = False,
                 final_index: Array | None = None):
        """x: [batch, seq, hidden] → (final [batch, seq, hidden],
        per-layer outputs [num_layers, batch, seq, hidden] or None).

        final_index [batch] int: the final layer is computed for that token of each row only
        (EncoderLayer's query_index; unrolled layers, einsum or fused attention, no
        return_all_layers); final is then [batch, 1, hidden].
        """
        cfg = self.config
        if cfg.scan_layers:
            stack = nn.scan(
                _ScannedLayer,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast,),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, per_layer = stack(cfg, deterministic, return_all_layers, name="layers")(x, mask)
            return x, per_layer
        layer_cls = maybe_remat(EncoderLayer, cfg.remat_policy)
        outputs = []
        for i in range(cfg.num_layers):
            last = final_index if i == cfg.num_layers - 1 else None
            x = layer_cls(cfg, deterministic, name=f"layer_{i}")(x, mask, last)
            outputs.append(x)
        return x, (jnp.stack(outputs) if return_all_layers else None)


class Pooler(nn.Module):
    """dense + tanh on one token per row: [CLS], or for a causal (left-to-right) model, whose
    [CLS] sees nothing after it, the last real token (the final [SEP]), which sees the whole
    input (as GPT classifies from its last token)."""

    config: BertConfig

    @nn.compact
    def __call__(self, sequence_output: Array, index: Array | None = None) -> Array:
        """[batch, seq, hidden], index [batch] int (None: position 0) → [batch, hidden]."""
        if index is None:
            token = sequence_output[:, 0]
        else:
            token = jnp.take_along_axis(sequence_output, index[:, None, None], axis=1)[:, 0]
        # ("embed", "embed_out"): a square matrix cannot put `embed` on both axes.
        pooled = dense(self.config, self.config.hidden_size, ("embed", "embed_out"), "dense")(token)
        return jnp.tanh(pooled)


class BertModel(nn.Module):
    """Embeddings → encoder → pooler.

    Returns a dict: `sequence_output` [batch, seq, hidden], `pooled_output` [batch, hidden],
    and, with `return_all_layers`, `hidden_states` [num_layers + 1, batch, seq, hidden]
    (index 0 = embedding output, index i = output of layer i).
    """

    config: BertConfig

    def setup(self):
        # "auto" attention is decided where the program is traced: the kernels on a TPU.
        self.cfg = self.config.for_tpu() if flash_lib.traced_for_tpu() else self.config
        self.embeddings = Embeddings(self.cfg)
        self.encoder = Encoder(self.cfg)
        self.pooler = Pooler(self.cfg)

    def __call__(
        self,
        input_ids: Array,
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
        *,
        packing_ids: Array | None = None,
        position_ids: Array | None = None,
        deterministic: bool = True,
        return_all_layers: bool = False,
        pooled_only: bool = False,
    ) -> dict[str, Any]:
        """input_ids, segment_ids, input_mask: [batch, seq] int.

        packing_ids: [batch, seq] int, optional: several examples packed in one row; attention
          stays within an example and position ids restart at each example (unless given).
        pooled_only: for heads that read the pooled token alone: the final layer is computed
          for that token only (the same values, less of the last layer's work), and
          `sequence_output` is [batch, 1, hidden], that token's final vector.
        """
        cfg = self.cfg
        if segment_ids is None:
            segment_ids = jnp.zeros_like(input_ids)
        if position_ids is None:
            if packing_ids is not None:
                position_ids = attn_lib.positions_from_packing(packing_ids)
            else:
                position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
        if cfg.attention_impl in ("flash", "flash_jax"):  # kernels mask by segment ids
            mask = flash_lib.segment_ids(input_mask, packing_ids, input_ids.shape)
        else:
            mask = attn_lib.attention_mask(
                input_mask, packing_ids, causal=cfg.causal, seq_len=input_ids.shape[1]
            )
        embedded = self.embeddings(input_ids, segment_ids, position_ids, deterministic)
        pool_at = jnp.zeros(input_ids.shape[:1], jnp.int32)
        if cfg.causal:
            last = input_ids.shape[1] - 1
            pool_at = (jnp.full(input_ids.shape[:1], last) if input_mask is None
                       else jnp.maximum(jnp.sum(input_mask, axis=-1) - 1, 0))
        # The flash kernels and a scanned stack take whole sequences: there the final layer
        # is computed in full and the token picked after.
        early = (pooled_only and not return_all_layers and not cfg.scan_layers
                 and cfg.attention_impl not in ("flash", "flash_jax"))
        sequence_output, per_layer = self.encoder(
            embedded, mask, deterministic, return_all_layers, pool_at if early else None
        )
        if pooled_only and not early:
            sequence_output = jnp.take_along_axis(sequence_output, pool_at[:, None, None], axis=1)
        outputs = {
            "sequence_output": sequence_output,
            "pooled_output": self.pooler(
                sequence_output, pool_at if cfg.causal and not pooled_only else None),
        }
        if return_all_layers:
            outputs["hidden_states"] = jnp.concatenate([embedded[None], per_layer], axis=0)
        return outputs

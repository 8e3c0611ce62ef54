"""A NeoBERT-style encoder as Flax linen modules: token embeddings (no norm, no positions),
pre-norm layers x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x)) with rotary embeddings on
queries and keys, a final RMSNorm, and no biases anywhere in the encoder. Packed rows
(`packing_ids`) attend within their own example and restart their rotary positions there.

Parameters (every one with logical axis names):
    model/embeddings/embedding             [vocab, hidden]          ("vocab", "embed")
    model/layers_{i}/attn_norm/scale        [hidden]                 ("embed",)
    model/layers_{i}/attn/qkv/kernel        [hidden, 3, heads, head_dim]
    model/layers_{i}/attn/out/kernel        [heads, head_dim, hidden]
    model/layers_{i}/mlp_norm/scale         [hidden]
    model/layers_{i}/mlp/w12/kernel         [hidden, 2, intermediate]  (SiLU half, gate half)
    model/layers_{i}/mlp/w3/kernel          [intermediate, hidden]
    model/final_norm/scale                  [hidden]
    decoder_bias                            [vocab]  (NeoBertForMaskedLM; the decoder matrix
                                                      is the embedding table, tied)
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import dense as dense_lib
from bertjax.models.kernels import attention as attn_lib
from bertjax.models.layers import Dropout, apply_rope, gather_positions, maybe_remat, rope_tables
from bertjax.models.neobert.config import NeoConfig

Array = jax.Array


def _init(stddev: float, axes: tuple[str | None, ...]):
    return nn.with_logical_partitioning(nn.initializers.normal(stddev), axes)


def rms_norm(config: NeoConfig, name: str) -> nn.RMSNorm:
    return nn.RMSNorm(epsilon=config.norm_eps, dtype=jnp.dtype(config.dtype),
                      param_dtype=jnp.dtype(config.param_dtype),
                      scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(),
                                                              ("embed",)),
                      name=name)


class Linear(nn.Module):
    """x [..., *in] · kernel [*in, *features] without a bias; `in_shape`: the kernel's input
    dimensions where x has them flattened into its last one. The result is flattened to
    [..., prod(features)]."""

    config: NeoConfig
    features: tuple[int, ...]
    kernel_axes: tuple[str | None, ...]
    stddev: float
    in_shape: tuple[int, ...] | None = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        in_shape = tuple(self.in_shape or x.shape[-1:])
        kernel = self.param("kernel", _init(self.stddev, self.kernel_axes),
                            in_shape + tuple(self.features), jnp.dtype(cfg.param_dtype))
        dtype = jnp.dtype(cfg.dtype)
        width = math.prod(self.features)
        kernel = kernel.astype(dtype).reshape(x.shape[-1], width)
        return dense_lib.dense(x.astype(dtype), kernel, jnp.zeros((width,), dtype))


def _out_stddev(config: NeoConfig) -> float:
    # Projections back into the residual stream start smaller (GPT-2's scaling).
    return config.initializer_range / math.sqrt(2.0 * config.num_layers)


class NeoAttention(nn.Module):
    """Fused Q/K/V projection, RoPE on queries and keys, attention, output projection."""

    config: NeoConfig

    @nn.compact
    def __call__(self, x: Array, mask: Array | None, cos: Array, sin: Array) -> Array:
        """x [batch, seq, hidden]; mask [batch, 1, q or 1, k] bool or None; cos, sin [batch,
        seq, heads·head_dim] → [batch, seq, hidden]."""
        cfg = self.config
        heads, head_dim = cfg.num_heads, cfg.head_dim
        width = heads * head_dim
        qkv = Linear(cfg, (3, heads, head_dim), ("embed", None, "heads", "kv"),
                     cfg.initializer_range, name="qkv")(x)  # [batch, seq, 3·width]
        query, key, value = (qkv[..., i * width:(i + 1) * width] for i in range(3))
        query, key = (apply_rope(t, cos, sin, head_dim) for t in (query, key))
        query, key, value = (t.reshape(*t.shape[:2], heads, head_dim)
                             for t in (query, key, value))
        if cfg.attention_impl == "einsum":
            context = attn_lib.einsum_attention(query, key, value, mask)
        else:
            context = jax.nn.dot_product_attention(query, key, value, mask=mask,
                                                   implementation="xla")
        context = context.reshape(*context.shape[:2], width)
        out = Linear(cfg, (cfg.hidden_size,), ("heads", "kv", "embed"), _out_stddev(cfg),
                     in_shape=(heads, head_dim), name="out")(context)
        return nn.with_logical_constraint(out, ("batch", "length", "embed"))


class NeoMLP(nn.Module):
    """SwiGLU: w12 projects to [2, intermediate]; silu(first half) · second half, then w3."""

    config: NeoConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        """[batch, seq, hidden] → [batch, seq, hidden]."""
        cfg = self.config
        h = Linear(cfg, (2, cfg.intermediate_size), ("embed", None, "mlp"),
                   cfg.initializer_range, name="w12")(x)
        h = jax.nn.silu(h[..., :cfg.intermediate_size]) * h[..., cfg.intermediate_size:]
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        out = Linear(cfg, (cfg.hidden_size,), ("mlp", "embed"), _out_stddev(cfg), name="w3")(h)
        return nn.with_logical_constraint(out, ("batch", "length", "embed"))


class NeoLayer(nn.Module):
    """x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x)), each branch with dropout."""

    config: NeoConfig

    @nn.compact
    def __call__(self, x: Array, mask: Array | None, cos: Array, sin: Array,
                 deterministic: bool) -> Array:
        cfg = self.config
        drop = Dropout(cfg.dropout)
        x = x + drop(NeoAttention(cfg, name="attn")(rms_norm(cfg, "attn_norm")(x), mask, cos,
                                                    sin), deterministic=deterministic)
        x = x + drop(NeoMLP(cfg, name="mlp")(rms_norm(cfg, "mlp_norm")(x)),
                     deterministic=deterministic)
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class NeoBertModel(nn.Module):
    """Embeddings → pre-norm layers → final RMSNorm."""

    config: NeoConfig

    def setup(self):
        cfg = self.config
        self.embeddings = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=jnp.dtype(cfg.dtype),
                                   param_dtype=jnp.dtype(cfg.param_dtype),
                                   embedding_init=_init(cfg.initializer_range,
                                                        ("vocab", "embed")))
        # deterministic (argument 5, counting self) is a Python bool: static under remat.
        layer_cls = maybe_remat(NeoLayer, cfg.remat_policy, static_argnums=(5,))
        self.layers = [layer_cls(cfg, name=f"layers_{i}") for i in range(cfg.num_layers)]
        self.final_norm = rms_norm(cfg, "final_norm")
        self.dropout = Dropout(cfg.dropout)

    def __call__(self, input_ids: Array, input_mask: Array | None = None, *,
                 packing_ids: Array | None = None, deterministic: bool = True,
                 return_all_layers: bool = False) -> Array:
        """input_ids, input_mask (1 real, 0 padding), packing_ids (packed rows: the example of
        each token) [batch, seq] int → the final hidden states [batch, seq, hidden]; with
        `return_all_layers` [num_layers + 1, batch, seq, hidden]: the embeddings' output, each
        layer's, the last final-normed."""
        cfg = self.config
        positions = (attn_lib.positions_from_packing(packing_ids) if packing_ids is not None
                     else jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape))
        cos, sin = rope_tables(positions, cfg.num_heads, cfg.head_dim, cfg.rope_theta)
        mask = attn_lib.attention_mask(input_mask, packing_ids)
        x = self.dropout(self.embeddings(input_ids), deterministic=deterministic)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        states = [x]
        for layer in self.layers:
            x = layer(x, mask, cos, sin, deterministic)
            states.append(x)
        x = self.final_norm(x)
        return jnp.stack(states[:-1] + [x]) if return_all_layers else x


class NeoBertForMaskedLM(nn.Module):
    """The encoder and a decoder tied to the token embeddings, with its own bias."""

    config: NeoConfig

    @nn.compact
    def __call__(self, input_ids: Array, input_mask: Array | None = None,
                 masked_lm_positions: Array | None = None, *,
                 packing_ids: Array | None = None, deterministic: bool = True) -> Array:
        """input_ids, input_mask [batch, seq] int → logits [batch, seq, vocab], or with
        masked_lm_positions [batch, n] the logits there only, [batch, n, vocab]."""
        cfg = self.config
        model = NeoBertModel(cfg, name="model")
        hidden = model(input_ids, input_mask, packing_ids=packing_ids,
                       deterministic=deterministic)
        if masked_lm_positions is not None:
            hidden = gather_positions(hidden, masked_lm_positions)
        bias = self.param("decoder_bias", nn.with_logical_partitioning(
            nn.initializers.zeros_init(), ("vocab",)), (cfg.vocab_size,),
            jnp.dtype(cfg.param_dtype))
        embedding = jnp.asarray(model.embeddings.embedding, hidden.dtype)
        logits = dense_lib.dense(hidden, embedding.T, jnp.asarray(bias, hidden.dtype))
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))

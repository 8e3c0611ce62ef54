"""A ModernBERT-class encoder (Warner et al., 2024) as Flax linen modules: what transformers'
`ModernBertModel` / `ModernBertForMaskedLM` compute, parameter for parameter.

Compared with BERT: no position embeddings (rotary embeddings on queries and keys, with one
theta for global layers and another for local ones), pre-norm layers (the first layer's
attention norm is the identity, the embedding norm already did it) with a final norm,
LayerNorms without bias, no biases in the projections, a fused Q/K/V projection, a GeGLU MLP,
and layers that alternate global attention with sliding-window (local) attention: layer i is
global when i % global_attn_every_n_layers == 0.

Local attention: a token attends to the tokens at distance <= local_attention // 2 on either
side (inclusive; 129 keys for local_attention=128), as transformers' eager / sdpa masks do.
Packed rows (`packing_ids`) additionally stay within their own document, and rotary positions
restart at each document.

Attention (`attention_impl`): "einsum" is the reference, `einsum_attention` under a dense
[batch, 1, q, k] boolean mask per layer type. "xla" is `jax.nn.dot_product_attention(...,
implementation="xla")` given the structure instead of a mask: the window as
`local_window_size=(r, r)`, key padding as `key_value_seq_lengths` (right-padded rows; any other
padding as a [batch, 1, 1, k] key mask), and a [batch, 1, q, k] mask only for packed rows.
"splash" is our block-sparse Pallas TPU kernels (`splash_attention`, interpreted off a TPU),
for long sequences: a local layer's chunks of 128 queries read their window's keys only, a
global layer's per-row block tables built from the segment ids skip every pair of blocks
between different documents (or padding); inside, window and segments are masked. Neither
"xla" nor "splash" forms a dense mask, and neither applies attention dropout (a ConfigError).
"auto" (the default) runs einsum where attention dropout is active (training with
attention_dropout > 0) and on a CPU, "splash" on a TPU (also when compiled ahead of time for
one; a global layer where its rows fit the chip's VMEM, `splash_common.fits`: on a v4's 16
MiB up to 12,288 tokens, a local layer in pieces past it) and the "xla" path elsewhere (GPUs).

Parameters (every one with logical axis names):
    model/embeddings/tok_embeddings/embedding [vocab, hidden]   ("vocab", "embed")
    model/embeddings/norm/scale               [hidden]          ("embed",)
    model/layers_{i}/attn_norm/scale          [hidden]          (not in layer 0)
    model/layers_{i}/attn/wqkv/kernel         [hidden, 3, heads, head_dim]
    model/layers_{i}/attn/wo/kernel           [heads, head_dim, hidden]
    model/layers_{i}/mlp_norm/scale           [hidden]
    model/layers_{i}/mlp/wi/kernel            [hidden, 2, intermediate]  (GELU half, gate half)
    model/layers_{i}/mlp/wo/kernel            [intermediate, hidden]
    model/final_norm/scale                    [hidden]
    head/dense/kernel, head/norm/scale, decoder_bias [vocab]  (ModernBertForMaskedLM; the
                                              decoder matrix is tok_embeddings, tied)
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.errors import ConfigError
from bertjax.models import dense as dense_lib
from bertjax.models.kernels import attention as attn_lib
from bertjax.models.kernels import splash_attention as splash_lib
from bertjax.models.layers import Dropout, apply_rope, gather_positions, maybe_remat, rope_tables
from bertjax.models.modernbert.config import GLOBAL, LOCAL, ModernConfig

Array = jax.Array
# ---------------------------------------------------------------------------------------------
# Masks


def local_window(seq_len: int, radius: int) -> Array:
    """[seq, seq] bool: key k is within `radius` positions of query q (inclusive)."""
    index = jnp.arange(seq_len)
    return jnp.abs(index[:, None] - index[None, :]) <= radius


def attention_masks(
    input_mask: Array | None,
    packing_ids: Array | None,
    seq_len: int,
    radius: int,
) -> dict[str, Array | None]:
    """{layer type: [batch or 1, 1, q or 1, k] bool mask (True = may attend) or None}.

    Global layers: the padding mask (keys only, as transformers: a padded query still attends,
    its output is never read) and, for packed rows, the same document. Local layers: that and
    |q - k| <= radius. input_mask / packing_ids: [batch, seq] int.
    """
    common = attn_lib.attention_mask(input_mask, packing_ids)
    window = local_window(seq_len, radius)[None, None]
    return {GLOBAL: common, LOCAL: window if common is None else common & window}


def fused_attention(
    query: Array,
    key: Array,
    value: Array,
    input_mask: Array | None,
    packing_ids: Array | None,
    radius: int | None,
) -> Array:
    """The "xla" path: `jax.nn.dot_product_attention(implementation="xla")`, the same values
    as `einsum_attention` under `attention_masks` (float32 scores and softmax, masked scores
    set to a large finite negative, so a query with no key left, a padded one outside every
    window, averages the values instead of giving NaN).

    query/key/value [batch, seq, heads, head_dim]; input_mask / packing_ids [batch, seq] int or
    None; radius: the local window's (inclusive, each side), None for a global layer. No
    [q, k] mask is formed except for packed rows; key padding goes in as key lengths when every
    row is right-padded (real tokens first), else as a [batch, 1, 1, k] key mask.
    """
    window = None if radius is None else (radius, radius)

    def run(mask=None, lengths=None):
        return jax.nn.dot_product_attention(
            query, key, value, mask=mask, key_value_seq_lengths=lengths,
            local_window_size=window, implementation="xla")

    if packing_ids is not None:
        return run(mask=attn_lib.attention_mask(input_mask, packing_ids))
    if input_mask is None:
        return run()
    real = input_mask.astype(bool)
    lengths = jnp.sum(real, axis=1, dtype=jnp.int32)
    right_padded = jnp.all(real == (jnp.arange(real.shape[1]) < lengths[:, None]))
    return jax.lax.cond(right_padded, lambda: run(lengths=lengths),
                        lambda: run(mask=real[:, None, None, :]))


# ---------------------------------------------------------------------------------------------
# Modules


def activation(name: str):
    return {
        # exact erf GELU with autodiff's backward: in the GeGLU, layers.gelu's custom VJP
        # compiled to more HBM bytes and time on TPU (docs/tpu_aot.md, "Toward the roofline")
        "gelu": functools.partial(jax.nn.gelu, approximate=False),
        "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
        "relu": jax.nn.relu,
        "silu": jax.nn.silu,
    }[name]


def _init(config: ModernConfig, stddev: float, axes: tuple[str | None, ...]):
    """transformers' initialisation: normal(0, stddev) truncated at ± cutoff stddevs."""
    cut = config.initializer_cutoff_factor
    init = nn.initializers.truncated_normal(stddev=stddev, lower=-cut, upper=cut)
    return nn.with_logical_partitioning(init, axes)


def _out_stddev(config: ModernConfig) -> float:
    # Projections back into the residual stream start smaller, as transformers does.
    return config.initializer_range / math.sqrt(2.0 * config.num_layers)


def norm(config: ModernConfig, name: str) -> nn.LayerNorm:
    """LayerNorm without bias. Two-pass variance, as torch: the pre-norm residual stream is
    never normalised itself, and its mean can dwarf its spread."""
    return nn.LayerNorm(
        epsilon=config.norm_eps,
        dtype=jnp.dtype(config.dtype),
        param_dtype=jnp.dtype(config.param_dtype),
        use_bias=False,
        use_fast_variance=False,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
        name=name,
    )


class Linear(nn.Module):
    """x [*free, *in] · kernel [*in, *features], no bias, through `dense.dense` (bf16 / f16
    matmuls accumulate in float32). in_shape: the kernel's input dimensions where x has them
    flattened into its last one; flat: the features come out flattened into one dimension
    ([*free, prod(features)]). The parameter keeps its shape and axes either way."""

    config: ModernConfig
    features: tuple[int, ...]
    kernel_axes: tuple[str | None, ...]
    stddev: float
    num_contract: int = 1
    in_shape: tuple[int, ...] | None = None
    flat: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        contracted = x.shape[x.ndim - self.num_contract:]
        kernel = self.param("kernel", _init(cfg, self.stddev, self.kernel_axes),
                            tuple(self.in_shape or contracted) + tuple(self.features),
                            jnp.dtype(cfg.param_dtype))
        dtype = jnp.dtype(cfg.dtype)
        features = (math.prod(self.features),) if self.flat else tuple(self.features)
        kernel = kernel.astype(dtype).reshape(contracted + features)
        return dense_lib.dense(x.astype(dtype), kernel, None, self.num_contract)


class ModernEmbeddings(nn.Module):
    """Token embeddings, then LayerNorm (no bias) and dropout; no position embeddings."""

    config: ModernConfig

    def setup(self):
        cfg = self.config
        self.tok_embeddings = nn.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=jnp.dtype(cfg.dtype),
            param_dtype=jnp.dtype(cfg.param_dtype),
            embedding_init=_init(cfg, cfg.initializer_range, ("vocab", "embed")))
        self.norm = norm(cfg, "norm")
        self.dropout = Dropout(cfg.embedding_dropout)

    def __call__(self, input_ids: Array, deterministic: bool) -> Array:
        """input_ids [batch, seq] int → [batch, seq, hidden]."""
        x = self.dropout(self.norm(self.tok_embeddings(input_ids)), deterministic=deterministic)
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class ModernAttention(nn.Module):
    """Fused Q/K/V projection, RoPE on queries and keys, attention, output projection."""

    config: ModernConfig
    local: bool = False  # a sliding-window layer

    @nn.compact
    def __call__(self, x: Array, mask: Array | None, cos: Array, sin: Array,
                 deterministic: bool, input_mask: Array | None = None,
                 packing_ids: Array | None = None) -> Array:
        """x [batch, seq, hidden]; mask [batch or 1, 1, q or 1, k] bool or None (the einsum
        path's, from `attention_masks`; None under attention_impl "xla" / "splash"); cos, sin
        [batch, seq, heads·head_dim] (`rope_tables`); input_mask, packing_ids [batch, seq] int
        or None (the "xla" and "splash" paths') → [batch, seq, hidden]."""
        cfg = self.config
        # q, k, v and the context stay [batch, seq, heads·head_dim], the projections' layout
        # and the splash kernels': the other paths see [.., heads, head_dim] views (`split`).
        width = cfg.num_heads * cfg.head_dim
        qkv = Linear(cfg, (3, cfg.num_heads, cfg.head_dim), ("embed", None, "heads", "kv"),
                     cfg.initializer_range, flat=True, name="wqkv")(x)  # [b, s, 3·width]
        dropout_active = not deterministic and cfg.attention_dropout > 0
        impl = cfg.attention_impl

        def split(attend):
            """attend on q, k, v sliced from qkv, q and k rotated, as [.., heads, head_dim]
            views, the result flat. (The splash kernels read qkv as it is and rotate q and k
            themselves.)"""
            def run(qkv, *rest):
                q, k, v = (nn.with_logical_constraint(qkv[..., i * width:(i + 1) * width],
                                                      ("batch", "length", "heads"))
                           for i in range(3))
                q, k = (apply_rope(t, cos, sin, cfg.head_dim) for t in (q, k))
                q, k, v = (t.reshape(*t.shape[:2], cfg.num_heads, cfg.head_dim)
                           for t in (q, k, v))
                out = attend(q, k, v, *rest)
                return out.reshape(*out.shape[:2], width)
            return run

        if impl == "einsum" or (impl == "auto" and dropout_active):
            keep_mask = Dropout(cfg.attention_dropout).keep_mask if dropout_active else None
            context = split(attn_lib.einsum_attention)(qkv, mask, keep_mask)
        else:
            if dropout_active:
                raise ConfigError(
                    f"model.attention_impl={impl!r} cannot apply attention dropout; set "
                    "model.attention_dropout=0.0 or model.attention_impl='auto'")
            radius = cfg.window_radius if self.local else None
            fused = split(functools.partial(fused_attention, radius=radius))
            splash = functools.partial(splash_lib.splash_attention, radius=radius,
                                       num_heads=cfg.num_heads, rope=(cos, sin))
            if impl == "xla":
                context = fused(qkv, input_mask, packing_ids)
            elif impl == "splash":
                context = splash(qkv, input_mask, packing_ids)
            else:  # "auto": chosen when lowering, as attention.fused_attention
                context = jax.lax.platform_dependent(
                    qkv, mask, input_mask, packing_ids,
                    cpu=lambda qkv, m, _i, _p: split(attn_lib.einsum_attention)(qkv, m),
                    tpu=lambda qkv, _m, i, p: (
                        splash(qkv, i, p) if self.local or splash_lib.fits(qkv.shape[1], False)
                        else fused(qkv, i, p)),
                    default=lambda qkv, _m, i, p: fused(qkv, i, p))
        out = Linear(cfg, (cfg.hidden_size,), ("heads", "kv", "embed"), _out_stddev(cfg),
                     in_shape=(cfg.num_heads, cfg.head_dim), name="wo")(context)
        out = Dropout(cfg.attention_dropout)(out, deterministic=deterministic)
        return nn.with_logical_constraint(out, ("batch", "length", "embed"))


class ModernMLP(nn.Module):
    """GeGLU: wi projects to [2, intermediate]; act(first half) · second half, then wo."""

    config: ModernConfig

    @nn.compact
    def __call__(self, x: Array, deterministic: bool) -> Array:
        """[batch, seq, hidden] → [batch, seq, hidden]."""
        cfg = self.config
        h = Linear(cfg, (2, cfg.intermediate_size), ("embed", None, "mlp"),
                   cfg.initializer_range, name="wi")(x)  # [batch, seq, 2, intermediate]
        h = activation(cfg.hidden_act)(h[:, :, 0]) * h[:, :, 1]
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        h = Dropout(cfg.mlp_dropout)(h, deterministic=deterministic)
        out = Linear(cfg, (cfg.hidden_size,), ("mlp", "embed"), _out_stddev(cfg), name="wo")(h)
        return nn.with_logical_constraint(out, ("batch", "length", "embed"))


class ModernLayer(nn.Module):
    """Pre-norm layer: x += Attn(norm(x)); x += MLP(norm(x)). Layer 0 has no attention norm
    (its input is the embedding norm's output)."""

    config: ModernConfig
    index: int

    @nn.compact
    def __call__(self, x: Array, mask: Array | None, cos: Array, sin: Array,
                 deterministic: bool, input_mask: Array | None = None,
                 packing_ids: Array | None = None) -> Array:
        """x [batch, seq, hidden] → [batch, seq, hidden]."""
        cfg = self.config
        h = x if self.index == 0 else norm(cfg, "attn_norm")(x)
        local = cfg.layer_types[self.index] == LOCAL
        x = x + ModernAttention(cfg, local, name="attn")(h, mask, cos, sin, deterministic,
                                                         input_mask, packing_ids)
        x = x + ModernMLP(cfg, name="mlp")(norm(cfg, "mlp_norm")(x), deterministic)
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class ModernBertModel(nn.Module):
    """Embeddings → global / local layers → final norm (transformers' ModernBertModel)."""

    config: ModernConfig

    def setup(self):
        cfg = self.config
        self.embeddings = ModernEmbeddings(cfg)
        # deterministic (argument 5, counting self) is a Python bool: static under remat.
        layer_cls = maybe_remat(ModernLayer, cfg.remat_policy, static_argnums=(5,))
        self.layers = [layer_cls(cfg, i, name=f"layers_{i}") for i in range(cfg.num_layers)]
        self.final_norm = norm(cfg, "final_norm")

    def __call__(
        self,
        input_ids: Array,
        input_mask: Array | None = None,
        *,
        packing_ids: Array | None = None,
        position_ids: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        """input_ids, input_mask (1 real, 0 padding): [batch, seq] int → the last hidden state
        [batch, seq, hidden].

        packing_ids [batch, seq] int, optional: several documents packed in one row; attention
          stays within a document and rotary positions restart at each (unless given).
        position_ids [batch, seq] int, optional: the rotary positions (default 0, 1, ...).
        """
        cfg = self.config
        seq_len = input_ids.shape[1]
        if position_ids is None:
            position_ids = (attn_lib.positions_from_packing(packing_ids)
                            if packing_ids is not None
                            else jnp.broadcast_to(jnp.arange(seq_len), input_ids.shape))
        # The "xla" and "splash" paths take the padding and packing themselves, and form no
        # dense mask.
        masks = ({GLOBAL: None, LOCAL: None} if cfg.attention_impl in ("xla", "splash") else
                 attention_masks(input_mask, packing_ids, seq_len, cfg.window_radius))
        rope = {kind: rope_tables(position_ids, cfg.num_heads, cfg.head_dim, theta)
                for kind, theta in ((GLOBAL, cfg.global_rope_theta),
                                    (LOCAL, cfg.local_rope_theta))}
        x = self.embeddings(input_ids, deterministic)
        for layer, kind in zip(self.layers, cfg.layer_types):
            x = layer(x, masks[kind], *rope[kind], deterministic, input_mask, packing_ids)
        return self.final_norm(x)


class ModernPredictionHead(nn.Module):
    """dense (no bias) + activation + LayerNorm (transformers' ModernBertPredictionHead)."""

    config: ModernConfig

    @nn.compact
    def __call__(self, hidden: Array) -> Array:
        """[batch, n, hidden] → [batch, n, hidden]."""
        cfg = self.config
        # ("embed", "embed_out"): a square matrix cannot put `embed` on both axes.
        h = Linear(cfg, (cfg.hidden_size,), ("embed", "embed_out"), _out_stddev(cfg),
                   name="dense")(hidden)
        return norm(cfg, "norm")(activation(cfg.head_act)(h))


class ModernBertForMaskedLM(nn.Module):
    """The encoder, the prediction head, and the decoder tied to the token embeddings (its bias
    `decoder_bias` separate)."""

    config: ModernConfig

    @nn.compact
    def __call__(
        self,
        input_ids: Array,
        input_mask: Array | None = None,
        masked_lm_positions: Array | None = None,
        *,
        packing_ids: Array | None = None,
        position_ids: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        """input_ids, input_mask: [batch, seq] int → logits [batch, seq, vocab], or with
        masked_lm_positions [batch, n] int the logits there only, [batch, n, vocab] (the
        [seq, vocab] product over the other tokens is never formed)."""
        cfg = self.config
        model = ModernBertModel(cfg, name="model")
        hidden = model(input_ids, input_mask, packing_ids=packing_ids,
                       position_ids=position_ids, deterministic=deterministic)
        if masked_lm_positions is not None:
            hidden = gather_positions(hidden, masked_lm_positions)
        h = ModernPredictionHead(cfg, name="head")(hidden)
        bias = self.param("decoder_bias", nn.with_logical_partitioning(
            nn.initializers.zeros_init(), ("vocab",)), (cfg.vocab_size,),
            jnp.dtype(cfg.param_dtype))
        embedding = jnp.asarray(model.embeddings.tok_embeddings.embedding, h.dtype)
        logits = dense_lib.dense(h, embedding.T, jnp.asarray(bias, h.dtype))
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))

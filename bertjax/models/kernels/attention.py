"""Attention masks and the two attention paths (fused `dot_product_attention` and einsum)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp


def attention_mask(
    input_mask: jax.Array | None,
    packing_ids: jax.Array | None = None,
    causal: bool = False,
    seq_len: int | None = None,
) -> jax.Array | None:
    """Boolean mask `[batch, 1, q, k]` (True = may attend), or None when nothing is masked.

    input_mask: [batch, seq], 1 for real tokens, 0 for padding.
    packing_ids: [batch, seq], which packed example a token belongs to; tokens attend only
      within their own example (block-diagonal mask).
    causal: each token attends only to itself and earlier tokens (left-to-right LM).
    """
    mask = None
    if input_mask is not None:
        mask = input_mask.astype(bool)[:, None, None, :]
    if packing_ids is not None:
        same_example = packing_ids[:, None, :, None] == packing_ids[:, None, None, :]
        mask = same_example if mask is None else mask & same_example
    if causal:
        if seq_len is None:
            raise ValueError("causal attention needs seq_len")
        lower = jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))[None, None]
        mask = lower if mask is None else mask & lower
    return mask


def positions_from_packing(packing_ids: jax.Array) -> jax.Array:
    """Position ids `[batch, seq]` that restart at 0 wherever `packing_ids` changes."""
    seq_len = packing_ids.shape[-1]
    index = jnp.broadcast_to(jnp.arange(seq_len), packing_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(packing_ids[:, :1], dtype=bool), packing_ids[:, 1:] != packing_ids[:, :-1]],
        axis=1,
    )
    start_index = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    return (index - start_index).astype(jnp.int32)


KeepMaskFn = Callable[[tuple[int, ...]], tuple[jax.Array, float]]


def einsum_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    dropout: KeepMaskFn | None = None,
    heads_first: bool = False,
) -> jax.Array:
    """Reference attention. query/key/value: [batch, seq, heads, head_dim] → same shape.

    dropout (if given): shape → (bool keep mask of that shape, keep probability), for dropout
    on the attention probabilities [batch, heads, q, k], as in the paper.

    The softmax is arranged to keep the [batch, heads, q, k] tensors few and narrow (the
    formulation of Google's MLPerf BERT): exp(scores − max) in float32, cast once to the compute
    dtype, masked unnormalised, multiplied with the values; the normalisation (sum of the
    float32 exponentials, times the keep probability) divides the smaller [batch, q, heads,
    head_dim] product instead. Equal to softmax → dropout → probabilities · values.

    heads_first: the operands transposed to [batch, heads, seq, head_dim] first, so that both
    products are plain batched matrix products (XLA:CPU runs those much faster than the
    contraction over the interleaved layout); the same values.
    """
    scores_spec, context_spec = "bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd"
    if heads_first:
        query, key, value = (jnp.swapaxes(x, 1, 2) for x in (query, key, value))
        scores_spec, context_spec = "bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd"
    scale = 1.0 / jnp.sqrt(jnp.asarray(query.shape[-1], jnp.float32))
    logits = jnp.einsum(scores_spec, query, key).astype(jnp.float32) * scale
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    # The max only keeps exp in range; it cancels in the division (as in jax.nn.softmax).
    peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    unnormalised = jnp.exp(logits - peak)
    total = jnp.sum(unnormalised, axis=-1)  # [batch, heads, q] float32
    weights = unnormalised.astype(value.dtype)
    if dropout is not None:
        keep, keep_prob = dropout(weights.shape)
        weights = jnp.where(keep, weights, jnp.zeros_like(weights))
        total = total * keep_prob
    context = jnp.einsum(context_spec, weights, value, preferred_element_type=jnp.float32)
    if heads_first:
        return jnp.swapaxes((context / total[..., None]).astype(value.dtype), 1, 2)
    return (context / jnp.swapaxes(total, 1, 2)[..., None]).astype(value.dtype)


def fused_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None,
    implementation: str | None = None,
) -> jax.Array:
    """`jax.nn.dot_product_attention`, letting XLA / cuDNN / TPU pick a fused kernel.

    implementation: None (let JAX choose; on CPU, which has no fused kernel, the heads-first
    `einsum_attention`), "xla" or "cudnn". Shapes as `einsum_attention`.
    """

    def fused(q, k, v, m):
        return jax.nn.dot_product_attention(q, k, v, mask=m, implementation=implementation)

    if implementation is not None:
        return fused(query, key, value, mask)
    # Chosen when lowering: a TPU compile on a CPU host (--dry_run --topology) keeps `fused`.
    return jax.lax.platform_dependent(
        query, key, value, mask, cpu=functools.partial(einsum_attention, heads_first=True),
        default=fused)


def attention_path(cfg, training: bool, platform: str) -> str:
    """Which attention BertSelfAttention runs for `cfg` on `platform` ("cpu", "gpu", "tpu"),
    in training (dropout active) or not, as benchmarks report it. "auto" runs the flash kernels
    on a TPU where they take the model (`BertConfig.for_tpu`); elsewhere it applies attention
    dropout on the einsum path (XLA), and without dropout runs `fused_attention`: the
    heads-first einsum on a CPU, `jax.nn.dot_product_attention`'s XLA path elsewhere."""
    impl = cfg.for_tpu().attention_impl if platform == "tpu" else cfg.attention_impl
    if impl == "flash":
        return {"tpu": "flash (Pallas TPU)", "gpu": "flash (Pallas GPU)"}.get(
            platform, "flash (interpreted)")
    if impl != "auto":
        return impl
    if training and cfg.attention_dropout_prob > 0:
        return "einsum (dropout)"
    return "einsum, heads first" if platform == "cpu" else "xla fused"

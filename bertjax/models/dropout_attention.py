"""Fused attention with attention dropout inside the kernel (Pallas TPU; interpreted off TPU).

For `attention_impl="flash"` with `attention_dropout_prob > 0` in training. Sequences up to
512 tokens fit one block, so each grid step (batch row, head) holds its whole score tile in
VMEM: no online softmax, and the backward is one kernel that recomputes the probabilities
once and writes dq, dk and dv. The tile is kept transposed, [keys, queries]: the softmax's
reductions over keys then leave [1, queries] rows, so the per-query residuals (log-sum-exp,
and di = Σ out·d_out for the backward) travel as float32 [batch, heads, 1, seq], not
broadcast to 128 lanes as in JAX's flash kernels, and the backward needs one transpose.

The keep mask is a stateless hash of (seed, batch row, head, query, key) computed in the
kernel from iotas: the forward and the backward draw the same mask, nothing of it is stored,
and the pure-jnp `keep_mask` gives the same bits (tests compare against it). 24-bit draws: the
keep probability is 1 − round(rate·2²⁴)/2²⁴.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bertjax.models import flash_attention as flash

LANES = flash.LANES
SUBLANES = flash.SUBLANES
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
BITS = 24  # draw width: the top 24 bits of each 32-bit hash


def _u32(value: int) -> jnp.ndarray:
    """A uint32 constant as the int32 with the same bits (the kernels compute in int32)."""
    return jnp.int32(value - (1 << 32) if value >= 1 << 31 else value)


def _mix(x):
    """murmur3's 32-bit finaliser on int32 bit patterns (wrapping multiplies, logical shifts)."""
    x = x ^ lax.shift_right_logical(x, jnp.int32(16))
    x = x * _u32(0x85EBCA6B)
    x = x ^ lax.shift_right_logical(x, jnp.int32(13))
    x = x * _u32(0xC2B2AE35)
    return x ^ lax.shift_right_logical(x, jnp.int32(16))


def keep_bits(seed, row, head, num_heads: int, query, key, key_len: int):
    """Keep-decision draws int32 in [0, 2²⁴) for one (batch row, head): a hash of the position
    query·key_len + key (query, key: int32 index arrays of one shape), salted by (row, head)
    and the seed. Used in the kernels and outside."""
    salt = _mix(row * num_heads + head + _u32(0x9E3779B9))
    bits = _mix(_mix(query * key_len + key) ^ salt) ^ seed
    return lax.shift_right_logical(_mix(bits), jnp.int32(32 - BITS))


def threshold(rate: float) -> int:
    """Draws below this are dropped."""
    return round(rate * (1 << BITS))


def keep_probability(rate: float) -> float:
    return 1.0 - threshold(rate) / (1 << BITS)


def keep_mask(seed, shape: tuple[int, int, int, int], rate: float) -> jax.Array:
    """The kernels' keep mask [batch, heads, q, k] bool, computed with plain jnp."""
    batch, heads, q_len, k_len = shape

    def one(row, head):
        query = lax.broadcasted_iota(jnp.int32, (q_len, k_len), 0)
        key = lax.broadcasted_iota(jnp.int32, (q_len, k_len), 1)
        return keep_bits(seed, row, head, heads, query, key, k_len) >= threshold(rate)

    rows = jnp.arange(batch, dtype=jnp.int32)
    return jax.vmap(jax.vmap(one, (None, 0)), (0, None))(rows, jnp.arange(heads, dtype=jnp.int32))


@dataclasses.dataclass(frozen=True)
class Static:
    """The kernels' compile-time settings."""

    causal: bool
    scale: float
    rate: float
    num_heads: int


def _scores(static, q, k, key_ids, query_ids):
    """Masked, scaled scores transposed, [k, q] float32: reductions over keys run along the
    sublanes and leave [1, q] rows, which broadcast over a tile without relayout."""
    s = lax.dot_general(k, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = s * static.scale
    key_ids = jnp.tile(key_ids, (1, q.shape[0] // LANES))  # [k, 128] column → [k, q]
    mask = key_ids == query_ids  # against the [1, q] row
    if static.causal:
        mask &= (lax.broadcasted_iota(jnp.int32, s.shape, 1)
                 >= lax.broadcasted_iota(jnp.int32, s.shape, 0))
    return jnp.where(mask, s, MASK_VALUE)


def _keep(static, seed_ref, shape):
    """The keep mask [k, q] of this grid step's (batch row, head), or None at rate 0 (no hash
    computed)."""
    if static.rate == 0:
        return None
    key = lax.broadcasted_iota(jnp.int32, shape, 0)
    query = lax.broadcasted_iota(jnp.int32, shape, 1)
    bits = keep_bits(seed_ref[0], pl.program_id(0), pl.program_id(1), static.num_heads,
                     query, key, shape[0])
    return bits >= threshold(static.rate)


def _drop(keep, x):
    return x if keep is None else jnp.where(keep, x, 0.0)


def _forward_kernel(seed_ref, q_ref, k_ref, v_ref, key_ids_ref, query_ids_ref, o_ref, lse_ref,
                    *, static):
    q, k, v = q_ref[0, 0], k_ref[0, 0], v_ref[0, 0]
    s = _scores(static, q, k, key_ids_ref[0], query_ids_ref[0, :1])
    m = jnp.max(s, axis=0, keepdims=True)  # [1, q]
    p = jnp.exp(s - m)
    total = jnp.sum(p, axis=0, keepdims=True)
    scale = 1.0 / (total * keep_probability(static.rate))
    p = _drop(_keep(static, seed_ref, s.shape), p * scale)  # dropped probabilities
    o_ref[0, 0] = lax.dot(p.T.astype(v.dtype), v,
                          preferred_element_type=jnp.float32).astype(o_ref.dtype)
    lse_ref[0, 0] = m + jnp.log(total)


def _backward_kernel(seed_ref, q_ref, k_ref, v_ref, key_ids_ref, query_ids_ref, lse_ref,
                     do_ref, di_ref, dq_ref, dk_ref, dv_ref, *, static):
    q, k, v, do = q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], do_ref[0, 0]
    s = _scores(static, q, k, key_ids_ref[0], query_ids_ref[0, :1])
    p = jnp.exp(s - lse_ref[0, 0])  # the softmax [k, q], before dropout
    keep = _keep(static, seed_ref, s.shape)
    inverse = 1.0 / keep_probability(static.rate)
    dropped = _drop(keep, p * inverse)
    dv = lax.dot(dropped.astype(do.dtype), do, preferred_element_type=jnp.float32)
    d_dropped = lax.dot_general(v, do, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
    dp = _drop(keep, d_dropped * inverse)
    ds = p * (dp - di_ref[0, 0]) * static.scale  # [k, q]
    dk = lax.dot(ds.astype(q.dtype), q, preferred_element_type=jnp.float32)
    dq = lax.dot(ds.T.astype(k.dtype), k, preferred_element_type=jnp.float32)
    dq_ref[0, 0] = dq.astype(dq_ref.dtype)
    dk_ref[0, 0] = dk.astype(dk_ref.dtype)
    dv_ref[0, 0] = dv.astype(dv_ref.dtype)


def _row_spec(seq, width):
    return pl.BlockSpec((1, 1, seq, width), lambda b, h, seed: (b, h, 0, 0))


def _vector_spec(seq):
    """A [batch, heads, 1, seq] float32 per-query vector (log-sum-exp, di)."""
    return pl.BlockSpec((1, 1, 1, seq), lambda b, h, seed: (b, h, 0, 0))


def _segment_inputs(segments, seq):
    """The segment ids as the kernels read them (the shipped kernels' layout): keys as a
    column [batch, seq, 128] (lane-broadcast), queries as a row [batch, 8, seq]
    (sublane-broadcast)."""
    batch = segments.shape[0]
    key_ids = lax.broadcast_in_dim(segments, (batch, seq, LANES), (0, 1))
    query_ids = lax.broadcast_in_dim(segments, (batch, SUBLANES, seq), (0, 2))
    specs = [pl.BlockSpec((1, seq, LANES), lambda b, h, seed: (b, 0, 0)),
             pl.BlockSpec((1, SUBLANES, seq), lambda b, h, seed: (b, 0, 0))]
    return [key_ids, query_ids], specs


def _shape(q):
    return flash.Shape(*q.shape, q.dtype.itemsize)


def forward_cost(shape: flash.Shape) -> pl.CostEstimate:
    """One grid step per (batch row, head) reads its q, k, v and writes o and the log-sum-exp
    (float32 per query), the segment ids once per batch row; q·kᵀ and p·v are 4·B·H·S²·D
    FLOPs, one exp per score, and ELEMENTWISE FLOPs per score."""
    s = shape
    scores = s.scores
    return pl.CostEstimate(
        flops=4 * scores * s.head_dim + ELEMENTWISE * scores, transcendentals=scores,
        bytes_accessed=4 * s.qkv_bytes + s.vector_bytes + s.segment_bytes())


def backward_cost(shape: flash.Shape) -> pl.CostEstimate:
    """Reads q, k, v, do, the log-sum-exp and di (float32 per query) and the segment ids,
    writes dq, dk, dv; five [S, S]·[S, D] matmuls (k·qᵀ recomputed, dropped·do, v·doᵀ,
    ds·q, dsᵀ·k): 10·B·H·S²·D FLOPs, one exp per score."""
    s = shape
    scores = s.scores
    return pl.CostEstimate(
        flops=10 * scores * s.head_dim + 2 * ELEMENTWISE * scores, transcendentals=scores,
        bytes_accessed=7 * s.qkv_bytes + 2 * s.vector_bytes + s.segment_bytes())


# FLOPs per score besides the matmuls (scale, max, subtract, sum, normalise-and-drop; the
# backward about twice that); the keep hash is integer work, which the estimate leaves out.
ELEMENTWISE = 5


def _forward_call(static, interpret, seed, q, k, v, segments):
    batch, heads, seq, head_dim = q.shape
    seg_inputs, seg_specs = _segment_inputs(segments, seq)
    return pl.pallas_call(
        functools.partial(_forward_kernel, static=static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(batch, heads),
            in_specs=[_row_spec(seq, head_dim)] * 3 + seg_specs,
            out_specs=[_row_spec(seq, head_dim), _vector_spec(seq)]),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, 1, seq), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=forward_cost(_shape(q)),
        interpret=interpret,
    )(seed, q, k, v, *seg_inputs)


def _backward_call(static, interpret, seed, q, k, v, segments, lse, d_out, di):
    batch, heads, seq, head_dim = q.shape
    seg_inputs, seg_specs = _segment_inputs(segments, seq)
    row = _row_spec(seq, head_dim)
    return pl.pallas_call(
        functools.partial(_backward_kernel, static=static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(batch, heads),
            in_specs=[row] * 3 + seg_specs + [_vector_spec(seq), row, _vector_spec(seq)],
            out_specs=[row] * 3),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)] * 3,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=backward_cost(_shape(q)),
        interpret=interpret,
    )(seed, q, k, v, *seg_inputs, lse, d_out, di)


def _on_platform(call, static, *args):
    """The Mosaic kernel when lowered for a TPU, the interpreter elsewhere."""
    return lax.platform_dependent(*args, tpu=functools.partial(call, static, False),
                                  default=functools.partial(call, static, True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attend(seed, q, k, v, segments, static):
    return _attend_fwd(seed, q, k, v, segments, static)[0]


def _attend_fwd(seed, q, k, v, segments, static):
    out, lse = _on_platform(_forward_call, static, seed, q, k, v, segments)
    return out, (seed, q, k, v, segments, out, lse)


def _attend_bwd(static, residuals, d_out):
    seed, q, k, v, segments, out, lse = residuals
    # Σ_d out · d_out per query: [batch, heads, 1, seq], the layout of the log-sum-exp.
    di = jnp.einsum("bhqd,bhqd->bhq", out.astype(jnp.float32), d_out.astype(jnp.float32))[
        :, :, None, :]
    dq, dk, dv = _on_platform(_backward_call, static, seed, q, k, v, segments, lse, d_out, di)
    return None, dq, dk, dv, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def dropout_attention(query, key, value, segments, seed, rate: float, causal: bool = False):
    """Attention with dropout `rate` on the probabilities. query/key/value:
    [batch, seq, heads, head_dim] → same shape; segments: [batch, seq] int; seed: int32 [1]
    (the draws differ per seed, batch row, head, query and key).

    Under `flash.sharded_like` each batch shard draws with its shard index folded into the
    seed, so no two rows of the global batch share a mask.
    """
    static = Static(causal, float(query.shape[-1]) ** -0.5, rate, query.shape[2])

    def attend(q, k, v, segments, shard, seed):
        seed = seed ^ _mix(shard.astype(jnp.int32) + 1)  # another mask on every batch shard
        return _attend(seed.astype(jnp.int32), q, k, v, segments, static)

    return flash.run_padded(attend, query, key, value, segments, seed)

"""Fused attention with attention dropout inside the kernel (Pallas TPU; interpreted off TPU).

For `attention_impl="flash"` with `attention_dropout_prob > 0` in training. Sequences up to a
few hundred tokens (BERT's 128 and 512) fit one block, so each grid step (batch row, head)
holds its whole [seq, seq] score tile in VMEM: no online softmax, and the backward is one
kernel that recomputes the probabilities once and writes dq, dk and dv.

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


def keep_bits(seed, row, head, num_heads: int, shape: tuple[int, int]):
    """Keep-decision draws [q, k] int32 in [0, 2²⁴) for one (batch row, head): a hash of the
    position q·k_len + k, salted by (row, head) and the seed. Used in the kernels and outside."""
    query = lax.broadcasted_iota(jnp.int32, shape, 0)
    key = lax.broadcasted_iota(jnp.int32, shape, 1)
    salt = _mix(row * num_heads + head + _u32(0x9E3779B9))
    bits = _mix(_mix(query * shape[1] + key) ^ salt) ^ seed
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
        return keep_bits(seed, row, head, heads, (q_len, k_len)) >= threshold(rate)

    rows = jnp.arange(batch, dtype=jnp.int32)
    return jax.vmap(jax.vmap(one, (None, 0)), (0, None))(rows, jnp.arange(heads, dtype=jnp.int32))


@dataclasses.dataclass(frozen=True)
class Static:
    """The kernels' compile-time settings."""

    causal: bool
    scale: float
    rate: float
    num_heads: int


def _scores(static, q, k, q_segments, kv_segments):
    """Masked, scaled scores [q, k] float32."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = s * static.scale
    mask = q_segments == kv_segments  # [q, 128]-tiled column against a [1, k] row
    if static.causal:
        mask &= (lax.broadcasted_iota(jnp.int32, s.shape, 0)
                 >= lax.broadcasted_iota(jnp.int32, s.shape, 1))
    return jnp.where(mask, s, MASK_VALUE)


def _segments(q_seg_ref, kv_seg_ref, k_len):
    q_seg = jnp.tile(q_seg_ref[0], (1, k_len // LANES))  # [q, k]
    return q_seg, kv_seg_ref[0, :1]  # [1, k]


def _keep(static, seed_ref, shape):
    bits = keep_bits(seed_ref[0], pl.program_id(0), pl.program_id(1), static.num_heads, shape)
    return bits >= threshold(static.rate)


def _forward_kernel(seed_ref, q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, o_ref, lse_ref, *,
                    static):
    q, k, v = q_ref[0, 0], k_ref[0, 0], v_ref[0, 0]
    s = _scores(static, q, k, *_segments(q_seg_ref, kv_seg_ref, k.shape[0]))
    m = jnp.max(s, axis=1, keepdims=True)
    p = jnp.exp(s - m)
    total = jnp.sum(p, axis=1, keepdims=True)
    p = jnp.where(_keep(static, seed_ref, s.shape), p, 0.0)
    out = lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o_ref[0, 0] = (out / (total * keep_probability(static.rate))).astype(o_ref.dtype)
    lse_ref[0, 0] = jnp.broadcast_to(m + jnp.log(total), lse_ref.shape[2:])


def _backward_kernel(seed_ref, q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, lse_ref, do_ref,
                     di_ref, dq_ref, dk_ref, dv_ref, *, static):
    q, k, v, do = q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], do_ref[0, 0]
    s = _scores(static, q, k, *_segments(q_seg_ref, kv_seg_ref, k.shape[0]))
    tiles = (1, k.shape[0] // LANES)
    p = jnp.exp(s - jnp.tile(lse_ref[0, 0], tiles))  # the softmax, before dropout
    keep = _keep(static, seed_ref, s.shape)
    inverse = 1.0 / keep_probability(static.rate)
    dropped = jnp.where(keep, p * inverse, 0.0)
    dv = lax.dot(dropped.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
    d_dropped = lax.dot_general(do, v, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
    dp = jnp.where(keep, d_dropped * inverse, 0.0)
    ds = p * (dp - jnp.tile(di_ref[0, 0], tiles)) * static.scale
    dq = lax.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)
    dk = lax.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32)
    dq_ref[0, 0] = dq.astype(dq_ref.dtype)
    dk_ref[0, 0] = dk.astype(dk_ref.dtype)
    dv_ref[0, 0] = dv.astype(dv_ref.dtype)


def _row_spec(seq, width):
    return pl.BlockSpec((1, 1, seq, width), lambda b, h, seed: (b, h, 0, 0))


def _segment_inputs(segments, seq):
    """The segment ids as the kernels read them (as the shipped kernels do): queries
    [batch, seq, 128] (lane-broadcast), keys [batch, 8, seq] (sublane-broadcast)."""
    batch = segments.shape[0]
    q_ids = lax.broadcast_in_dim(segments, (batch, seq, LANES), (0, 1))
    kv_ids = lax.broadcast_in_dim(segments, (batch, SUBLANES, seq), (0, 2))
    specs = [pl.BlockSpec((1, seq, LANES), lambda b, h, seed: (b, 0, 0)),
             pl.BlockSpec((1, SUBLANES, seq), lambda b, h, seed: (b, 0, 0))]
    return [q_ids, kv_ids], specs


def _shape(q):
    return flash.Shape(*q.shape, q.dtype.itemsize)


def forward_cost(shape: flash.Shape) -> pl.CostEstimate:
    """One grid step per (batch row, head) reads its q, k, v and writes o and the log-sum-exp
    [seq, 128] float32 (the segment ids once per batch row); q·kᵀ and p·v are 4·B·H·S²·D FLOPs, one exp per
    score, and ELEMENTWISE FLOPs per score (scale, max, subtract, sum, dropout select)."""
    s = shape
    scores = s.batch * s.heads * s.seq * s.seq
    return pl.CostEstimate(
        flops=4 * scores * s.head_dim + ELEMENTWISE * scores, transcendentals=scores,
        bytes_accessed=4 * s.qkv_bytes + s.lane_bytes + s.segment_bytes())


def backward_cost(shape: flash.Shape) -> pl.CostEstimate:
    """Reads q, k, v, do, the log-sum-exp and di ([seq, 128] float32 each) and the segment
    ids, writes dq, dk, dv; five [S, S]·[S, D] matmuls (q·kᵀ recomputed, dropped·do,
    do·vᵀ, ds·k, dsᵀ·q): 10·B·H·S²·D FLOPs, one exp per score."""
    s = shape
    scores = s.batch * s.heads * s.seq * s.seq
    return pl.CostEstimate(
        flops=10 * scores * s.head_dim + 2 * ELEMENTWISE * scores, transcendentals=scores,
        bytes_accessed=7 * s.qkv_bytes + 2 * s.lane_bytes + s.segment_bytes())


ELEMENTWISE = 5  # FLOPs per score besides the matmuls; the keep hash is integer work


def _forward_call(static, interpret, seed, q, k, v, segments):
    batch, heads, seq, head_dim = q.shape
    seg_inputs, seg_specs = _segment_inputs(segments, seq)
    return pl.pallas_call(
        functools.partial(_forward_kernel, static=static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(batch, heads),
            in_specs=[_row_spec(seq, head_dim)] * 3 + seg_specs,
            out_specs=[_row_spec(seq, head_dim), _row_spec(seq, LANES)]),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, seq, LANES), jnp.float32)],
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
            in_specs=[row] * 3 + seg_specs + [_row_spec(seq, LANES), row,
                                              _row_spec(seq, LANES)],
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
    di = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1, keepdims=True)
    di = jnp.broadcast_to(di, (*di.shape[:-1], LANES))
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

"""Fused attention with attention dropout inside the kernel (Pallas TPU; interpreted off TPU).

For `attention_impl="flash"` with `attention_dropout_prob > 0` in training. Sequences up to
512 tokens fit one block, so each grid step (batch rows, group of heads) holds its whole score
tiles in VMEM: no online softmax, and the backward is one kernel that recomputes the
probabilities once and writes dq, dk and dv. Short rows go several to a step
(`rows_per_step`), so that a step has enough independent work to fill its schedule. q, k, v
and o are [batch, seq, heads·head_dim], each token's heads side by side, as the projections
write them: a grid step takes [seq, 128] tiles holding 128 // head_dim heads, and no
[..., heads, head_dim] layout with 64-lane rows (half-empty vector registers, and a relayout
copy at each end) is ever made. The score tile is kept transposed, [keys, queries]: the
softmax's reductions over keys then leave [1, queries] rows, so the log-sum-exp travels as
float32 [batch, heads, 1, seq], not broadcast to 128 lanes as in JAX's flash kernels, and the
backward computes di = Σ out·d_out per query itself, as such a row.

The keep mask is a stateless hash of (seed, batch row, head, query, key) computed in the
kernel from iotas (dropout_hash.py): the forward and the backward draw the same mask, nothing
of it is stored, and the pure-jnp `dropout_hash.keep_mask` gives the same bits (tests compare
against it). Lowered for a GPU, the same contract runs on the Triton kernels of
dropout_attention_gpu.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bertjax.models.kernels import dropout_attention_gpu as gpu
from bertjax.models.kernels import flash_attention as flash
from bertjax.models.kernels.dropout_hash import _mix, keep_bits, keep_probability, threshold
from bertjax.models.kernels.flash_attention import heads_per_tile

LANES = flash.LANES
SUBLANES = flash.SUBLANES
MASK_VALUE = flash.MASK_VALUE


@dataclasses.dataclass(frozen=True)
class Static:
    """The kernels' compile-time settings."""

    causal: bool
    scale: float
    rate: float
    num_heads: int
    head_dim: int
    rows: int = 1  # batch rows per grid step

    @property
    def group(self) -> int:
        """Heads per grid step, side by side in a tile's lanes."""
        return heads_per_tile(self.num_heads, self.head_dim)

    @property
    def width(self) -> int:
        """Lanes of a grid step's q, k, v, o tiles: its heads side by side."""
        return self.group * self.head_dim


def _lanes_of(static, j: int, shape):
    """Where head j of a grid step's group sits in its tile's lanes: bool of `shape`."""
    lane = lax.broadcasted_iota(jnp.int32, shape, 1)
    return (lane >= j * static.head_dim) & (lane < (j + 1) * static.head_dim)


def _only(static, j: int, x):
    """x [seq, width] with every lane outside head j zeroed: a matmul contracting or producing
    the lanes then acts on head j alone (exactly: the others add zeros), so no head is sliced
    out of a tile (the MXU is 128 lanes wide either way)."""
    return jnp.where(_lanes_of(static, j, x.shape), x, jnp.zeros_like(x))


def _scores(static, q, k_j, key_ids, query_ids):
    """Masked, scaled scores of one head transposed, [k, q] float32 (k_j: the keys with the
    other heads' lanes zeroed): reductions over keys run along the sublanes and leave [1, q]
    rows, which broadcast over a tile without relayout."""
    s = lax.dot_general(k_j, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = s * static.scale
    key_ids = jnp.tile(key_ids, (1, q.shape[0] // LANES))  # [k, 128] column → [k, q]
    mask = key_ids == query_ids  # against the [1, q] row
    if static.causal:
        mask &= (lax.broadcasted_iota(jnp.int32, s.shape, 1)
                 >= lax.broadcasted_iota(jnp.int32, s.shape, 0))
    return jnp.where(mask, s, MASK_VALUE)


def _keep(static, seed_ref, r: int, j: int, shape):
    """The keep mask [k, q] of row r and head j of this grid step's (batch rows, head group),
    or None at rate 0 (no hash computed)."""
    if static.rate == 0:
        return None
    key = lax.broadcasted_iota(jnp.int32, shape, 0)
    query = lax.broadcasted_iota(jnp.int32, shape, 1)
    row = pl.program_id(0) * static.rows + r
    head = pl.program_id(1) * static.group + j
    bits = keep_bits(seed_ref[0], row, head, static.num_heads, query, key, shape[0])
    return bits >= threshold(static.rate)


def _drop(keep, x):
    return x if keep is None else jnp.where(keep, x, 0.0)


def _forward_kernel(seed_ref, q_ref, k_ref, v_ref, key_ids_ref, query_ids_ref, o_ref, lse_ref,
                    *, static):
    for r in range(static.rows):  # independent rows: their work interleaves in the schedule
        q, k, v = q_ref[r], k_ref[r], v_ref[r]  # [seq, width]: the group's heads side by side
        out = jnp.zeros(q.shape, jnp.float32)
        for j in range(static.group):
            s = _scores(static, q, _only(static, j, k), key_ids_ref[r], query_ids_ref[r, :1])
            m = jnp.max(s, axis=0, keepdims=True)  # [1, q]
            p = jnp.exp(s - m)
            total = jnp.sum(p, axis=0, keepdims=True)
            scale = 1.0 / (total * keep_probability(static.rate))
            p = _drop(_keep(static, seed_ref, r, j, s.shape), p * scale)  # dropped
            out += lax.dot(p.T.astype(v.dtype), _only(static, j, v),
                           preferred_element_type=jnp.float32)
            lse_ref[r, j] = m + jnp.log(total)
        o_ref[r] = out.astype(o_ref.dtype)


def _backward_kernel(seed_ref, q_ref, k_ref, v_ref, key_ids_ref, query_ids_ref, lse_ref,
                     o_ref, do_ref, dq_ref, dk_ref, dv_ref, *, static):
    for r in range(static.rows):
        _backward_row(static, r, seed_ref, q_ref, k_ref, v_ref, key_ids_ref, query_ids_ref,
                      lse_ref, o_ref, do_ref, dq_ref, dk_ref, dv_ref)


def _backward_row(static, r, seed_ref, q_ref, k_ref, v_ref, key_ids_ref, query_ids_ref, lse_ref,
                  o_ref, do_ref, dq_ref, dk_ref, dv_ref):
    """dq, dk, dv of batch row r of the grid step."""
    q, k, v, do = q_ref[r], k_ref[r], v_ref[r], do_ref[r]
    dq, dk, dv = (jnp.zeros(q.shape, jnp.float32) for _ in range(3))
    inverse = 1.0 / keep_probability(static.rate)
    # o·do per lane, transposed [width, q]: a head's sum over its lanes is then a [1, q] row
    # (di, the softmax backward's per-query term), like the log-sum-exp.
    o_do = (o_ref[r].astype(jnp.float32) * do.astype(jnp.float32)).T
    for j in range(static.group):
        q_j, k_j, v_j, do_j = (_only(static, j, x) for x in (q, k, v, do))
        s = _scores(static, q, k_j, key_ids_ref[r], query_ids_ref[r, :1])
        p = jnp.exp(s - lse_ref[r, j])  # the softmax [k, q], before dropout
        keep = _keep(static, seed_ref, r, j, s.shape)
        dropped = _drop(keep, p * inverse)
        dv += lax.dot(dropped.astype(do.dtype), do_j, preferred_element_type=jnp.float32)
        d_dropped = lax.dot_general(v_j, do, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
        dp = _drop(keep, d_dropped * inverse)
        lanes = lax.broadcasted_iota(jnp.int32, o_do.shape, 0) // static.head_dim
        di = jnp.sum(jnp.where(lanes == j, o_do, 0.0), axis=0, keepdims=True)  # [1, q]
        ds = p * (dp - di) * static.scale  # [k, q]
        dk += lax.dot(ds.astype(q.dtype), q_j, preferred_element_type=jnp.float32)
        dq += lax.dot(ds.T.astype(k.dtype), k_j, preferred_element_type=jnp.float32)
    dq_ref[r] = dq.astype(dq_ref.dtype)
    dk_ref[r] = dk.astype(dk_ref.dtype)
    dv_ref[r] = dv.astype(dv_ref.dtype)


def _tile_spec(static, seq):
    """A grid step's [rows, seq, width] tile of a [batch, seq, heads·head_dim] array."""
    return pl.BlockSpec((static.rows, seq, static.width), lambda b, g, seed: (b, 0, g))


def _vector_spec(static, seq):
    """A [batch, heads, 1, seq] float32 per-query vector (log-sum-exp, di), the group's heads."""
    return pl.BlockSpec((static.rows, static.group, 1, seq), lambda b, g, seed: (b, g, 0, 0))


def _segment_inputs(static, segments, seq):
    """The segment ids as the kernels read them (the shipped kernels' layout): keys as a
    column [batch, seq, 128] (lane-broadcast), queries as a row [batch, 8, seq]
    (sublane-broadcast)."""
    batch = segments.shape[0]
    key_ids = lax.broadcast_in_dim(segments, (batch, seq, LANES), (0, 1))
    query_ids = lax.broadcast_in_dim(segments, (batch, SUBLANES, seq), (0, 2))
    specs = [pl.BlockSpec((static.rows, seq, LANES), lambda b, g, seed: (b, 0, 0)),
             pl.BlockSpec((static.rows, SUBLANES, seq), lambda b, g, seed: (b, 0, 0))]
    return [key_ids, query_ids], specs


def _shape(static, q):
    batch, seq, _ = q.shape
    return flash.Shape(batch, static.num_heads, seq, static.head_dim, q.dtype.itemsize)


def forward_cost(shape: flash.Shape, group: int = 1) -> pl.CostEstimate:
    """One grid step per (batch row, group of heads) reads its q, k, v and writes o and the
    log-sum-exp (float32 per query), the segment ids once per batch row; q·kᵀ and p·v run on
    the group's whole tile width, 4·B·H·S²·D·group FLOPs, one exp per score, and ELEMENTWISE
    FLOPs per score."""
    s = shape
    scores = s.scores
    return pl.CostEstimate(
        flops=4 * scores * s.head_dim * group + ELEMENTWISE * scores, transcendentals=scores,
        bytes_accessed=4 * s.qkv_bytes + s.vector_bytes + s.segment_bytes())


def backward_cost(shape: flash.Shape, group: int = 1) -> pl.CostEstimate:
    """Reads q, k, v, o, do, the log-sum-exp (float32 per query) and the segment ids, writes
    dq, dk, dv; five [S, S]·[S, D] matmuls per head (k·qᵀ recomputed, dropped·do, v·doᵀ,
    ds·q, dsᵀ·k) on the group's tile width: 10·B·H·S²·D·group FLOPs, one exp per score."""
    s = shape
    scores = s.scores
    return pl.CostEstimate(
        flops=10 * scores * s.head_dim * group + 2 * ELEMENTWISE * scores,
        transcendentals=scores,
        bytes_accessed=8 * s.qkv_bytes + s.vector_bytes + s.segment_bytes())


# FLOPs per score besides the matmuls (scale, max, subtract, sum, normalise-and-drop; the
# backward about twice that); the keep hash is integer work, which the estimate leaves out.
ELEMENTWISE = 5


def _forward_call(static, interpret, seed, q, k, v, segments):
    batch, seq, _ = q.shape
    seg_inputs, seg_specs = _segment_inputs(static, segments, seq)
    tile = _tile_spec(static, seq)
    return pl.pallas_call(
        functools.partial(_forward_kernel, static=static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(batch // static.rows, static.num_heads // static.group),
            in_specs=[tile] * 3 + seg_specs,
            out_specs=[tile, _vector_spec(static, seq)]),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, static.num_heads, 1, seq), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=forward_cost(_shape(static, q), static.group),
        interpret=interpret,
    )(seed, q, k, v, *seg_inputs)


def _backward_call(static, interpret, seed, q, k, v, segments, lse, out, d_out):
    batch, seq, _ = q.shape
    seg_inputs, seg_specs = _segment_inputs(static, segments, seq)
    tile, vector = _tile_spec(static, seq), _vector_spec(static, seq)
    return pl.pallas_call(
        functools.partial(_backward_kernel, static=static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(batch // static.rows, static.num_heads // static.group),
            in_specs=[tile] * 3 + seg_specs + [vector, tile, tile],
            out_specs=[tile] * 3),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)] * 3,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=backward_cost(_shape(static, q), static.group),
        interpret=interpret,
    )(seed, q, k, v, *seg_inputs, lse, out, d_out)


def _on_platform(call, gpu_call, static, *args):
    """The Mosaic kernel when lowered for a TPU, the Triton one (dropout_attention_gpu.py) for
    a GPU, the TPU kernel's interpreter elsewhere."""
    return lax.platform_dependent(*args, tpu=functools.partial(call, static, False),
                                  cuda=functools.partial(gpu_call, gpu_static(static, args[1]),
                                                         False),
                                  default=functools.partial(call, static, True))


def gpu_static(static: Static, q) -> gpu.Static:
    """The GPU kernels' settings for `static` on q [batch, seq, heads·head_dim]."""
    return gpu.padded_static(q.shape[1], static.causal, static.scale, static.rate,
                             static.num_heads, static.head_dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attend(seed, q, k, v, segments, static):
    """q, k, v: [batch, seq, heads·head_dim], each token's heads side by side → the same."""
    return _attend_fwd(seed, q, k, v, segments, static)[0]


def _attend_fwd(seed, q, k, v, segments, static):
    out, lse = _on_platform(_forward_call, gpu.forward_padded, static, seed, q, k, v,
                            segments)
    return out, (seed, q, k, v, segments, out, lse)


def _attend_bwd(static, residuals, d_out):
    seed, q, k, v, segments, out, lse = residuals
    dq, dk, dv = _on_platform(_backward_call, gpu.backward_padded, static, seed, q, k, v,
                              segments, lse, out, d_out)
    return None, dq, dk, dv, None


_attend.defvjp(_attend_fwd, _attend_bwd)


ROW_TOKENS = 512  # a grid step takes as many batch rows as fit this many tokens


def rows_per_step(batch: int, seq: int) -> int:
    """Batch rows per grid step: short rows leave a step's matmuls and vector work too small
    to hide its fixed cost, so up to ROW_TOKENS tokens' worth of rows (dividing the batch)."""
    return max(r for r in range(1, max(1, ROW_TOKENS // seq) + 1) if batch % r == 0)


def dropout_attention(query, key, value, segments, seed, rate: float, num_heads: int,
                      causal: bool = False):
    """Attention with dropout `rate` on the probabilities. query/key/value:
    [batch, seq, heads·head_dim] (each token's heads side by side) → the same shape;
    segments: [batch, seq] int; seed: int32 [1] (the draws differ per seed, batch row, head,
    query and key).

    Under `flash.sharded_like` each batch shard draws with its shard index folded into the
    seed, so no two rows of the global batch share a mask.
    """
    head_dim = query.shape[-1] // num_heads
    static = Static(causal, float(head_dim) ** -0.5, rate, num_heads, head_dim)

    def attend(q, k, v, segments, shard, seed):
        seed = seed ^ _mix(shard.astype(jnp.int32) + 1)  # another mask on every batch shard
        rows = rows_per_step(q.shape[0], q.shape[1])
        return _attend(seed.astype(jnp.int32), q, k, v, segments,
                       dataclasses.replace(static, rows=rows))

    return flash.run_padded(attend, query, key, value, segments, seed)

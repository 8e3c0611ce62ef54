"""Fused attention with attention dropout inside the kernel (Pallas TPU; interpreted off TPU).

For `attention_impl="flash"` with `attention_dropout_prob > 0` in training. Sequences up to
512 tokens fit one block, so each grid step (batch rows, group of heads) holds its whole score
tiles in VMEM: no online softmax, and the backward is one kernel that recomputes the
probabilities once and writes dq, dk and dv. Short rows go several to a step
(`rows_per_step`), so that a step has enough independent work to fill its schedule.

q, k and v come as one array, [batch, seq, 3·heads·head_dim], as one fused projection writes
it (`fuse_qkv`): each token's heads side by side, in groups of as many heads as fill 128
lanes, each group's q, k and v next to each other, [q_g | k_g | v_g]. A grid step takes one
contiguous [seq, 3·128] tile of it, and the backward writes dq, dk and dv as one such tile, so
the projection is one matmul forward and backward, and no [..., heads, head_dim] layout with
64-lane rows (half-empty vector registers, and a relayout copy at each end) is ever made. o
is [batch, seq, heads·head_dim]. The kernels add the projection's bias to the tiles they read,
and the backward sums its gradient over the tiles it writes: as a reduction of the whole
[batch, seq, 3·heads·head_dim] gradient in XLA it cost twice the projection's matmul.

The score tile is kept transposed, [keys, queries]: the softmax's reductions over keys then
leave [1, queries] rows, so the log-sum-exp travels as float32 [batch, heads, 1, seq], not
broadcast to 128 lanes as in JAX's flash kernels, and the backward computes di = Σ out·d_out
per query itself, as such a row.

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


def fuse_qkv(q: jax.Array, k: jax.Array, v: jax.Array, num_heads: int) -> jax.Array:
    """q, k, v [..., heads·head_dim] (each token's heads side by side; also projection kernels
    [in, heads·head_dim] and biases) → [..., 3·heads·head_dim], the kernels' input: per group
    of `heads_per_tile` heads, that group's q, k and v side by side."""
    width = heads_per_tile(num_heads, q.shape[-1] // num_heads) * (q.shape[-1] // num_heads)
    groups = [x.reshape(*x.shape[:-1], -1, 1, width) for x in (q, k, v)]
    return jnp.concatenate(groups, axis=-2).reshape(*q.shape[:-1], 3 * q.shape[-1])


def split_qkv(qkv: jax.Array, num_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`fuse_qkv`'s inverse: [..., 3·heads·head_dim] → (q, k, v) [..., heads·head_dim]."""
    features = qkv.shape[-1] // 3
    head_dim = features // num_heads
    width = heads_per_tile(num_heads, head_dim) * head_dim
    groups = qkv.reshape(*qkv.shape[:-1], -1, 3, width)
    return tuple(groups[..., i, :].reshape(*qkv.shape[:-1], features) for i in range(3))


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


def _qkv(static, qkv_ref, bias_ref, r: int):
    """Row r's q, k, v [seq, width] of a grid step's [rows, seq, 3·width] tile, each plus its
    bias (added in float32, as the projection would; lane-aligned slices of the refs)."""
    w = static.width

    def biased(i):
        x = qkv_ref[r, :, i * w:(i + 1) * w].astype(jnp.float32)
        return (x + bias_ref[:, i * w:(i + 1) * w].astype(jnp.float32)).astype(qkv_ref.dtype)

    return tuple(biased(i) for i in range(3))


def _forward_kernel(seed_ref, qkv_ref, bias_ref, key_ids_ref, query_ids_ref, o_ref, lse_ref, *,
                    static):
    for r in range(static.rows):  # independent rows: their work interleaves in the schedule
        q, k, v = _qkv(static, qkv_ref, bias_ref, r)  # [seq, width]: the group's heads
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


def _backward_kernel(seed_ref, qkv_ref, bias_ref, key_ids_ref, query_ids_ref, lse_ref, o_ref,
                     do_ref, dqkv_ref, dbias_ref, *, static):
    sums = [_backward_row(static, r, seed_ref, qkv_ref, bias_ref, key_ids_ref, query_ids_ref,
                          lse_ref, o_ref, do_ref, dqkv_ref) for r in range(static.rows)]
    w = static.width
    for i in range(3):  # the bias gradient of the step's rows, [1, width] each of q, k, v
        dbias_ref[0, :, i * w:(i + 1) * w] = sum(row[i] for row in sums)


def _backward_row(static, r, seed_ref, qkv_ref, bias_ref, key_ids_ref, query_ids_ref, lse_ref,
                  o_ref, do_ref, dqkv_ref):
    """dq, dk, dv of batch row r of the grid step, into its [seq, 3·width] tile; returns
    their sums over the row's tokens, [1, width] float32 each."""
    (q, k, v), do = _qkv(static, qkv_ref, bias_ref, r), do_ref[r]
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
    w = static.width
    for i, grad in enumerate((dq, dk, dv)):
        dqkv_ref[r, :, i * w:(i + 1) * w] = grad.astype(dqkv_ref.dtype)
    return [jnp.sum(grad, axis=0, keepdims=True) for grad in (dq, dk, dv)]


def _tile_spec(static, seq, arrays: int = 1):
    """A grid step's [rows, seq, arrays·width] tile of a [batch, seq, arrays·heads·head_dim]
    array: its group of heads (of q, k and v together for the fused array, arrays=3)."""
    return pl.BlockSpec((static.rows, seq, arrays * static.width),
                        lambda b, g, seed: (b, 0, g))


def _bias_spec(static, leading: tuple = ()):
    """A grid step's [*leading, 1, 3·width] block of a [..., 1, 3·heads·head_dim] bias (or the
    bias gradient's per-step sums, leading (1,): the step's block of rows)."""
    return pl.BlockSpec((*leading, 1, 3 * static.width),
                        lambda b, g, seed: (*((b,) if leading else ()), 0, g))


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


def _shape(static, qkv):
    batch, seq, _ = qkv.shape
    return flash.Shape(batch, static.num_heads, seq, static.head_dim, qkv.dtype.itemsize)


def _bias_bytes(shape: flash.Shape) -> int:
    """The q, k, v bias, [1, 3·heads·head_dim]."""
    return 3 * shape.heads * shape.head_dim * shape.itemsize


def forward_cost(shape: flash.Shape, static: Static) -> pl.CostEstimate:
    """One grid step per (batch rows, group of heads) reads its q, k, v and their bias and
    writes o and the log-sum-exp (float32 per query), the segment ids once per batch row; q·kᵀ
    and p·v run on the group's whole tile width, 4·B·H·S²·D·group FLOPs, one exp per score,
    and ELEMENTWISE FLOPs per score."""
    s = shape
    scores = s.scores
    return pl.CostEstimate(
        flops=4 * scores * s.head_dim * static.group + ELEMENTWISE * scores,
        transcendentals=scores,
        bytes_accessed=4 * s.qkv_bytes + _bias_bytes(s) + s.vector_bytes + s.segment_bytes())


def backward_cost(shape: flash.Shape, static: Static) -> pl.CostEstimate:
    """Reads q, k, v and their bias, o, do, the log-sum-exp (float32 per query) and the
    segment ids, writes dq, dk, dv and the bias gradient's sums per grid step's rows (float32);
    five [S, S]·[S, D] matmuls per head (k·qᵀ recomputed, dropped·do, v·doᵀ, ds·q, dsᵀ·k) on
    the group's tile width: 10·B·H·S²·D·group FLOPs, one exp per score."""
    s = shape
    scores = s.scores
    bias_sums = s.batch // static.rows * _bias_bytes(s) // s.itemsize * 4
    return pl.CostEstimate(
        flops=10 * scores * s.head_dim * static.group + 2 * ELEMENTWISE * scores,
        transcendentals=scores,
        bytes_accessed=(8 * s.qkv_bytes + _bias_bytes(s) + bias_sums + s.vector_bytes
                        + s.segment_bytes()))


# FLOPs per score besides the matmuls (scale, max, subtract, sum, normalise-and-drop; the
# backward about twice that); the keep hash is integer work, which the estimate leaves out.
ELEMENTWISE = 5


def _forward_call(static, interpret, seed, qkv, bias, segments):
    batch, seq, _ = qkv.shape
    seg_inputs, seg_specs = _segment_inputs(static, segments, seq)
    return pl.pallas_call(
        functools.partial(_forward_kernel, static=static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(batch // static.rows, static.num_heads // static.group),
            in_specs=[_tile_spec(static, seq, 3), _bias_spec(static)] + seg_specs,
            out_specs=[_tile_spec(static, seq), _vector_spec(static, seq)]),
        out_shape=[jax.ShapeDtypeStruct((batch, seq, qkv.shape[2] // 3), qkv.dtype),
                   jax.ShapeDtypeStruct((batch, static.num_heads, 1, seq), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=forward_cost(_shape(static, qkv), static),
        interpret=interpret,
    )(seed, qkv, bias[None], *seg_inputs)


def _backward_call(static, interpret, seed, qkv, bias, segments, lse, out, d_out):
    batch, seq, features = qkv.shape
    seg_inputs, seg_specs = _segment_inputs(static, segments, seq)
    fused, tile = _tile_spec(static, seq, 3), _tile_spec(static, seq)
    d_qkv, bias_sums = pl.pallas_call(
        functools.partial(_backward_kernel, static=static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(batch // static.rows, static.num_heads // static.group),
            in_specs=[fused, _bias_spec(static)] + seg_specs
            + [_vector_spec(static, seq), tile, tile],
            out_specs=[fused, _bias_spec(static, (1,))]),
        out_shape=[jax.ShapeDtypeStruct(qkv.shape, qkv.dtype),
                   jax.ShapeDtypeStruct((batch // static.rows, 1, features), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=backward_cost(_shape(static, qkv), static),
        interpret=interpret,
    )(seed, qkv, bias[None], *seg_inputs, lse, out, d_out)
    return d_qkv, jnp.sum(bias_sums, axis=(0, 1))


def _gpu_forward(static, interpret, seed, qkv, bias, segments):
    """The GPU kernels (dropout_attention_gpu.py), which take q, k and v apart, biased."""
    q, k, v = split_qkv(qkv + bias, static.num_heads)
    return gpu.forward_padded(gpu_static(static, q), interpret, seed, q, k, v, segments)


def _gpu_backward(static, interpret, seed, qkv, bias, segments, lse, out, d_out):
    q, k, v = split_qkv(qkv + bias, static.num_heads)
    grads = gpu.backward_padded(gpu_static(static, q), interpret, seed, q, k, v, segments, lse,
                                out, d_out)
    d_qkv = fuse_qkv(*grads, static.num_heads)
    return d_qkv, jnp.sum(d_qkv.astype(jnp.float32), axis=(0, 1))


def _on_platform(call, gpu_call, static, *args):
    """The Mosaic kernel when lowered for a TPU, the Triton one (dropout_attention_gpu.py) for
    a GPU, the TPU kernel's interpreter elsewhere."""
    return lax.platform_dependent(*args, tpu=functools.partial(call, static, False),
                                  cuda=functools.partial(gpu_call, static, False),
                                  default=functools.partial(call, static, True))


def gpu_static(static: Static, q) -> gpu.Static:
    """The GPU kernels' settings for `static` on q [batch, seq, ...]."""
    return gpu.padded_static(q.shape[1], static.causal, static.scale, static.rate,
                             static.num_heads, static.head_dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend(seed, qkv, bias, segments, static):
    """qkv: [batch, seq, 3·heads·head_dim] (`fuse_qkv`), bias [3·heads·head_dim] (added to it)
    → [batch, seq, heads·head_dim]."""
    return _attend_fwd(seed, qkv, bias, segments, static)[0]


def _attend_fwd(seed, qkv, bias, segments, static):
    out, lse = _on_platform(_forward_call, _gpu_forward, static, seed, qkv, bias, segments)
    return out, (seed, qkv, bias, segments, out, lse)


def _attend_bwd(static, residuals, d_out):
    seed, qkv, bias, segments, out, lse = residuals
    d_qkv, d_bias = _on_platform(_backward_call, _gpu_backward, static, seed, qkv, bias,
                                 segments, lse, out, d_out)
    return None, d_qkv, d_bias.astype(bias.dtype), None


_attend.defvjp(_attend_fwd, _attend_bwd)


ROW_TOKENS = 512  # a grid step takes as many batch rows as fit this many tokens


def rows_per_step(batch: int, seq: int) -> int:
    """Batch rows per grid step: short rows leave a step's matmuls and vector work too small
    to hide its fixed cost, so up to ROW_TOKENS tokens' worth of rows (dividing the batch)."""
    return max(r for r in range(1, max(1, ROW_TOKENS // seq) + 1) if batch % r == 0)


def dropout_attention(qkv, bias, segments, seed, rate: float, num_heads: int,
                      causal: bool = False):
    """Attention with dropout `rate` on the probabilities. qkv: [batch, seq,
    3·heads·head_dim], the queries, keys and values as `fuse_qkv` lays them out, before their
    bias [3·heads·head_dim] (laid out the same) → [batch, seq, heads·head_dim] (each token's
    heads side by side); segments: [batch, seq] int; seed: int32 [1] (the draws differ per
    seed, batch row, head, query and key).

    Under `flash.sharded_like` each batch shard draws with its shard index folded into the
    seed, so no two rows of the global batch share a mask.
    """
    head_dim = qkv.shape[-1] // (3 * num_heads)
    static = Static(causal, float(head_dim) ** -0.5, rate, num_heads, head_dim)

    def attend(tokens, segments, shard, seed, bias):
        (qkv,) = tokens
        seed = seed ^ _mix(shard.astype(jnp.int32) + 1)  # another mask on every batch shard
        rows = rows_per_step(qkv.shape[0], qkv.shape[1])
        return _attend(seed.astype(jnp.int32), qkv, bias, segments,
                       dataclasses.replace(static, rows=rows))

    return flash.run_padded(attend, (qkv,), segments, seed, bias)

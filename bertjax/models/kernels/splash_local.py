"""The splash kernels of a local layer (ModernBERT's sliding window, |q - k| <= radius): every
score the window needs and a few more, not whole blocks of them.

A grid step is one (row, head group, block of 512 / 256 / 128 tokens); nothing is walked. The
block is taken 128 tokens at a time, and each such chunk reads the `span` tokens of the other
side around it (`Static.reach` on each side, the radius rounded up to whole chunks: 384 for
radius 64) from the whole row, which stays in VMEM while the grid moves along it (a block is
copied in only when its index changes, and the row's index does not). All of a chunk's keys
are at hand, so the forward's softmax is taken in one pass: no running maximum, no rescaling.
At 1,024 tokens a query reads 384 keys where a walk over blocks of 512 computed all 1,024; at
8,192, 384 where the walk's band computed 1,536.

Kernels (layout and masks: `splash_common`):
  * forward, per query chunk: s = k·qᵀ [span, 128] per head, p = exp(s - max), o =
    vᵀ·p / Σp, transposed back once per chunk; the log-sum-exp as a row.
  * dq, per query chunk: p from the log-sum-exp, dp = v·doᵀ, ds = p·(dp - di), dq = dsᵀ·k.
  * dk/dv, per key chunk (the queries' `span` around it): dv = p·do, dk = ds·q.
The di and RoPE passes are the global layers' (`splash_passes`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bertjax.models.kernels import flash_attention as flash
from bertjax.models.kernels import splash_passes as passes
from bertjax.models.kernels.splash_common import (
    LANES,
    NT,
    SUBLANES,
    TN,
    allowed,
    head_lanes_of,
    head_rows_of,
    kernel_costs,
    only,
    segment_arrays,
)

# The whole rows held in VMEM (k, v and the key ids at 8,192 tokens: 2 + 2 + 4 MiB, double
# buffered) exceed the default scoped limit.
VMEM_LIMIT = 64 * 2 ** 20


def _chunks(static, block):
    """(rows of the chunk in the block, first token of the chunk, the other side's span) for
    each chunk of 128 in grid block `block` (traced)."""
    for c in range(static.block // LANES):
        first = block * static.block + c * LANES
        start = static.span_start(first)
        yield pl.ds(c * LANES, LANES), first, start, pl.ds(start, static.span)


def _forward_kernel(q_ref, k_ref, v_ref, q_ids_ref, k_ids_ref, o_ref, lse_ref, *, static):
    """Refs: q, o [block, width]; k, v [seq, width]; query ids [8, block]; key ids [seq, 128];
    lse [group, 8, block]."""
    for lanes, first, start, keys in _chunks(static, pl.program_id(2)):
        q, k, v = q_ref[lanes, :], k_ref[keys, :], v_ref[keys, :]
        kept = allowed(static, q_ids_ref[:1, lanes], k_ids_ref[keys, :], first, start)
        outs = []
        for j in range(static.group):
            s = lax.dot_general(k, only(static, j, q), NT, preferred_element_type=jnp.float32)
            s = jnp.where(kept, s, flash.MASK_VALUE)  # [span, 128]
            peak = jnp.max(s, axis=0, keepdims=True)
            p = jnp.exp(s - peak)
            total = jnp.sum(p, axis=0, keepdims=True)
            o_t = lax.dot_general(v, p.astype(v.dtype), TN, preferred_element_type=jnp.float32)
            outs.append(o_t * (1.0 / total))  # [width, 128]: head j's rows are kept
            lse_ref[j, :, lanes] = jnp.broadcast_to(peak + jnp.log(total), (SUBLANES, LANES))
        o_ref[lanes, :] = head_rows_of(static, outs).T.astype(o_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, q_ids_ref, k_ids_ref, dq_ref, *,
               static):
    """Refs: q, do, dq [block, width]; k, v [seq, width]; lse, di [group, 8, block]; query ids
    [8, block]; key ids [seq, 128]."""
    for lanes, first, start, keys in _chunks(static, pl.program_id(2)):
        q, do, k, v = q_ref[lanes, :], do_ref[lanes, :], k_ref[keys, :], v_ref[keys, :]
        kept = allowed(static, q_ids_ref[:1, lanes], k_ids_ref[keys, :], first, start)
        dqs = []
        for h in range(static.group):
            s = lax.dot_general(k, only(static, h, q), NT, preferred_element_type=jnp.float32)
            p = jnp.exp(jnp.where(kept, s, flash.MASK_VALUE) - lse_ref[h, :1, lanes])
            dp = lax.dot_general(v, only(static, h, do), NT,
                                 preferred_element_type=jnp.float32)  # [span, 128]
            ds = p * (dp - di_ref[h, :1, lanes])
            dqs.append(lax.dot_general(ds.astype(k.dtype), k, TN,
                                       preferred_element_type=jnp.float32))  # [128, width]
        dq_ref[lanes, :] = head_lanes_of(static, dqs).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, q_ids_ref, k_ids_ref, dk_ref,
                dv_ref, *, static):
    """Refs: q, do [seq, width]; k, v, dk, dv [block, width]; lse, di [group, 8, seq]; query
    ids [8, seq]; key ids [block, 128]."""
    for rows, first, start, queries in _chunks(static, pl.program_id(2)):
        k, v, q, do = k_ref[rows, :], v_ref[rows, :], q_ref[queries, :], do_ref[queries, :]
        kept = allowed(static, q_ids_ref[:1, queries], k_ids_ref[rows, :], start, first)
        dks, dvs = [], []
        for h in range(static.group):
            s = lax.dot_general(only(static, h, k), q, NT, preferred_element_type=jnp.float32)
            p = jnp.exp(jnp.where(kept, s, flash.MASK_VALUE) - lse_ref[h, :1, queries])
            dp = lax.dot_general(only(static, h, v), do, NT,
                                 preferred_element_type=jnp.float32)  # [128, span]
            ds = p * (dp - di_ref[h, :1, queries])
            dvs.append(lax.dot(p.astype(do.dtype), do, preferred_element_type=jnp.float32))
            dks.append(lax.dot(ds.astype(q.dtype), q, preferred_element_type=jnp.float32))
        dk_ref[rows, :] = head_lanes_of(static, dks).astype(dk_ref.dtype)
        dv_ref[rows, :] = head_lanes_of(static, dvs).astype(dv_ref.dtype)


class _Specs:
    """Block specs on the grid (b, g, block): a block's own tokens or the whole row, of a
    [batch, seq, heads·head_dim] array (part 0, 1, 2 of the fused qkv: q, k, v), of
    [batch, heads, 8, seq] rows (log-sum-exp, di), of the segment ids' row and column."""

    def __init__(self, static):
        self.static = static

    def _at(self, length):
        return lambda i: 0 if length == self.static.seq else i

    def tile(self, length, part=0):
        at, s = self._at(length), self.static
        return pl.BlockSpec((None, length, s.width),
                            lambda b, g, i: (b, at(i), part * s.groups + g))

    def head_rows(self, length):
        at, s = self._at(length), self.static
        return pl.BlockSpec((None, s.group, SUBLANES, length), lambda b, g, i: (b, g, 0, at(i)))

    def ids_row(self, length):
        at = self._at(length)
        return pl.BlockSpec((None, SUBLANES, length), lambda b, g, i: (b, 0, at(i)))

    def ids_column(self, length):
        at = self._at(length)
        return pl.BlockSpec((None, length, LANES), lambda b, g, i: (b, at(i), 0))


def _call(kernel, static, interpret, specs, out_specs, out_shape, cost, name, *args):
    batch = args[0].shape[0]
    return pl.pallas_call(
        functools.partial(kernel, static=static), grid=(batch, static.groups, static.blocks),
        in_specs=specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3,
                                             vmem_limit_bytes=VMEM_LIMIT),
        cost_estimate=cost, interpret=interpret, name=name,
    )(*args)


def forward_call(static, interpret, qk, qkv, segments):
    """(o [batch, seq, heads·head_dim], lse [batch, heads, 8, seq]): q (rotated, scaled) and
    k (rotated) read in place from qk [batch, seq, 2·heads·head_dim], v from qkv."""
    batch, seq, _ = qkv.shape
    q = jax.ShapeDtypeStruct((batch, seq, qkv.shape[-1] // 3), qkv.dtype)
    column, row = segment_arrays(segments)
    at, block = _Specs(static), static.block
    return _call(
        _forward_kernel, static, interpret,
        [at.tile(block), at.tile(seq, 1), at.tile(seq, 2), at.ids_row(block),
         at.ids_column(seq)],
        [at.tile(block), at.head_rows(block)],
        [q, jax.ShapeDtypeStruct((batch, static.heads, SUBLANES, seq), jnp.float32)],
        kernel_costs(static, q)["fwd"], "splash_fwd", qk, qk, qkv, row, column)


def backward_call(static, interpret, qk, qkv, segments, out, lse, d_out):
    """(dq, dk, dv) [batch, seq, heads·head_dim] of `forward_call`'s q, k (in qk) and v."""
    q = jax.ShapeDtypeStruct(out.shape, out.dtype)
    seq = out.shape[1]
    column, row = segment_arrays(segments)
    di = passes.di_call(static, interpret, out, d_out)
    costs = kernel_costs(static, q)
    at, block = _Specs(static), static.block
    dk, dv = _call(
        _dkv_kernel, static, interpret,
        [at.tile(seq), at.tile(block, 1), at.tile(block, 2), at.tile(seq), at.head_rows(seq),
         at.head_rows(seq), at.ids_row(seq), at.ids_column(block)],
        [at.tile(block)] * 2, [q] * 2, costs["dkv"], "splash_dkv",
        qk, qk, qkv, d_out, lse, di, row, column)
    (dq,) = _call(
        _dq_kernel, static, interpret,
        [at.tile(block), at.tile(seq, 1), at.tile(seq, 2), at.tile(block),
         at.head_rows(block), at.head_rows(block), at.ids_row(block), at.ids_column(seq)],
        [at.tile(block)], [q], costs["dq"], "splash_dq",
        qk, qk, qkv, d_out, lse, di, row, column)
    return dq, dk, dv

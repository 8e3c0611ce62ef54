"""The splash kernels of a local layer (ModernBERT's sliding window, |q - k| <= radius): every
score the window needs and few more, not whole blocks of them.

A grid step is one (row, head group, block of 512 / 256 / 128 queries); nothing is walked. The
block is taken 128 queries at a time, and each such chunk reads the `span` keys around it
(`Static.reach` on each side: the radius rounded up to a bf16 tile's 16 rows, so 256 keys for
radius 64) from the whole row of keys and values, which stays in VMEM while the grid moves
along it (a block is copied in only when its index changes, and the row's does not). All of a
chunk's keys are at hand, so the forward's softmax is taken in one pass: no running maximum, no
rescaling. At 1,024 tokens a query's scores are 256 where a walk over blocks of 512 computed
1,024; at 8,192, 256 where the walk's band computed 1,536.

Kernels (layout and masks: `splash_common`), per chunk and head:
  * forward: s = k·qᵀ [span, 128], p = exp(s - max), o = vᵀ·p / Σp (transposed back once per
    chunk), the log-sum-exp as a row.
  * backward, one kernel: p from the log-sum-exp, dp = v·doᵀ, ds = p·(dp - di); dq = dsᵀ·k is
    the chunk's, dk = ds·q and dv = p·do are added into float32 accumulators of the row's keys,
    zeroed and written out a block at a time as the grid moves along the row
    (`_accumulated_rows`; the blocks are "arbitrary", in order). p and ds are computed once
    for all three.
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
    TILE_ROWS,
    TN,
    VMEM_LIMIT,
    allowed,
    head_lanes_of,
    head_rows_of,
    kernel_costs,
    only,
    segment_arrays,
)


def _chunks(static, block):
    """(the chunk's rows in the block, its first token, its span's first key, its span) for
    each chunk of 128 queries in grid block `block` (traced)."""
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


def _overhang(static) -> int:
    """How far past its block's end (and before its start) a block's spans reach."""
    return static.span - LANES


def _piecewise(static) -> bool:
    """Whether the backward's accumulators are zeroed and written a block at a time (the
    spans overhang a block by less than a block), not once per row (counted every grid step
    by a static schedule)."""
    return _overhang(static) < static.block


def _accumulated_rows(static, i, acc_refs, out_refs):
    """The backward's accumulators around grid block i: before it, zero the rows the next
    block first reaches ([(i + 1)·block + overhang, + block): the scratch has a block and the
    overhang past the row) and, at the row's start, those of block 0; after it, write out the
    rows no later block reaches ([i·block - overhang, + block), the row's ends included)."""
    block, over = static.block, _overhang(static)

    def zero(rows):
        for acc in acc_refs:
            acc[rows, :] = jnp.zeros((rows.size, static.width), jnp.float32)

    def write(rows):
        for acc, out in zip(acc_refs, out_refs):
            out[rows, :] = acc[rows, :].astype(out.dtype)

    if not _piecewise(static):
        pl.when(i == 0)(lambda: zero(pl.ds(0, static.seq)))
        return lambda: pl.when(i == static.blocks - 1)(lambda: write(pl.ds(0, static.seq)))
    pl.when(i == 0)(lambda: zero(pl.ds(0, block + over)))
    zero(pl.ds(pl.multiple_of((i + 1) * block + over, TILE_ROWS), block))

    def finish():
        pl.when(i == 0)(lambda: write(pl.ds(0, block - over)))
        pl.when(i > 0)(lambda: write(pl.ds(pl.multiple_of(i * block - over, TILE_ROWS), block)))
        if over:
            pl.when(i == static.blocks - 1)(lambda: write(pl.ds(static.seq - over, over)))

    return finish


def _backward_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, q_ids_ref, k_ids_ref,
                     dq_ref, dk_ref, dv_ref, dk_acc, dv_acc, *, static):
    """dq, dk and dv from one computation of each chunk's p and ds: dq = dsᵀ·k is the chunk's
    own, dk = ds·q and dv = p·do are added to the keys' rows of float32 accumulators for the
    whole row (`_accumulated_rows`). Refs: q, do, dq [block, width]; k, v, dk, dv [seq,
    width]; lse, di [group, 8, block]; query ids [8, block]; key ids [seq, 128]; scratch dk, dv
    [rows, width] float32."""
    i = pl.program_id(2)
    finish = _accumulated_rows(static, i, (dk_acc, dv_acc), (dk_ref, dv_ref))
    for lanes, first, start, keys in _chunks(static, i):
        q, do, k, v = q_ref[lanes, :], do_ref[lanes, :], k_ref[keys, :], v_ref[keys, :]
        kept = allowed(static, q_ids_ref[:1, lanes], k_ids_ref[keys, :], first, start)
        dqs, dk, dv = [], 0.0, 0.0
        for h in range(static.group):
            q_h, do_h = only(static, h, q), only(static, h, do)
            s = lax.dot_general(k, q_h, NT, preferred_element_type=jnp.float32)  # [span, 128]
            p = jnp.exp(jnp.where(kept, s, flash.MASK_VALUE) - lse_ref[h, :1, lanes])
            dp = lax.dot_general(v, do_h, NT, preferred_element_type=jnp.float32)
            ds = p * (dp - di_ref[h, :1, lanes])
            p, ds = p.astype(k.dtype), ds.astype(k.dtype)
            dqs.append(lax.dot_general(ds, k, TN, preferred_element_type=jnp.float32))
            # head h's lanes only (q_h, do_h are zero elsewhere): the heads' sum is exact
            dk += lax.dot(ds, q_h, preferred_element_type=jnp.float32)  # [span, width]
            dv += lax.dot(p, do_h, preferred_element_type=jnp.float32)
        dq_ref[lanes, :] = head_lanes_of(static, dqs).astype(dq_ref.dtype)
        dk_acc[keys, :] += dk
        dv_acc[keys, :] += dv
    finish()


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


def _call(kernel, static, interpret, specs, out_specs, out_shape, cost, name, *args,
          scratch=(), along_the_row="parallel"):
    batch = args[0].shape[0]
    return pl.pallas_call(
        functools.partial(kernel, static=static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0, grid=(batch, static.groups, static.blocks),
            in_specs=specs, out_specs=out_specs, scratch_shapes=scratch),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", along_the_row),
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
    at, block = _Specs(static), static.block
    rows = seq + static.block + _overhang(static) if _piecewise(static) else seq
    accumulator = pltpu.VMEM((rows, static.width), jnp.float32)
    return _call(
        _backward_kernel, static, interpret,
        [at.tile(block), at.tile(seq, 1), at.tile(seq, 2), at.tile(block),
         at.head_rows(block), at.head_rows(block), at.ids_row(block), at.ids_column(seq)],
        [at.tile(block), at.tile(seq), at.tile(seq)], [q] * 3, kernel_costs(static, q)["bwd"],
        "splash_bwd", qk, qk, qkv, d_out, lse, di, row, column,
        scratch=[accumulator, accumulator], along_the_row="arbitrary")

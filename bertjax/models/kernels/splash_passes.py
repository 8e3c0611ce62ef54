"""The splash kernels' passes over whole arrays, each a small Pallas kernel beside the attention
kernels (splash_attention.py), on the same [batch, seq, heads·head_dim] layout and tiles:
q and k rotated (RoPE, the model's `apply_rope` in float32) and q scaled by 1/sqrt(head_dim)
once before them, the transpose of that after them (writing the fused d qkv, dv copied in),
and di = Σ o·do per query as [8, seq] rows. `static` is the attention kernels' Static.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bertjax.models.kernels import flash_attention as flash
from bertjax.models.kernels.splash_costs import ROPE_ELEMENTWISE, di_cost

SUBLANES = flash.SUBLANES


def _shape(static, x) -> flash.Shape:
    """x [batch, seq, heads·head_dim] as the cost estimates take it."""
    return flash.Shape(x.shape[0], static.heads, x.shape[1], static.head_dim, x.dtype.itemsize)


def _parallel(dims: int):
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * dims)


def _di_kernel(o_ref, do_ref, di_ref, *, static):
    """di = Σ o·do over each head's lanes for a block of queries, the softmax backward's
    per-query term: [block, width] tiles → [group, 8, block] rows (as the log-sum-exp)."""
    product = (o_ref[...].astype(jnp.float32) * do_ref[...].astype(jnp.float32)).T
    for j in range(static.group):  # head j's lanes are rows of the transposed product
        di = jnp.sum(product[j * static.head_dim:(j + 1) * static.head_dim], axis=0,
                     keepdims=True)
        di_ref[j] = jnp.broadcast_to(di, (SUBLANES, static.block))


def di_call(static, interpret, out, d_out):
    """di rows [batch, heads, 8, seq] float32 of o, do [batch, seq, heads·head_dim]."""
    batch, seq, _ = out.shape

    def spec(block_shape, index_map):
        return pl.BlockSpec(block_shape, lambda b, g, i: index_map(b, g, i))

    tile = spec((None, static.block, static.width), lambda b, g, i: (b, i, g))
    return pl.pallas_call(
        functools.partial(_di_kernel, static=static),
        grid=(batch, static.groups, static.blocks),
        in_specs=[tile, tile],
        out_specs=spec((None, static.group, SUBLANES, static.block),
                       lambda b, g, i: (b, g, 0, i)),
        out_shape=jax.ShapeDtypeStruct((batch, static.heads, SUBLANES, seq), jnp.float32),
        compiler_params=_parallel(3),
        cost_estimate=di_cost(_shape(static, out)), interpret=interpret, name="splash_di",
    )(out, d_out)


def _rotate_half(static, x):
    """x [rows, width] f32 → each head's second half negated, then its first (lane rolls)."""
    half = static.head_dim // 2
    first = lax.broadcasted_iota(jnp.int32, x.shape, 1) % static.head_dim < half
    return jnp.where(first, -pltpu.roll(x, x.shape[1] - half, 1), pltpu.roll(x, half, 1))


def _rope_kernel(*refs, static, rope: bool):
    """One (row, block, lane tile c) of [q | k]: q's tiles (c < groups) rotated and scaled by
    1/sqrt(head_dim), k's rotated, in float32 (the model's `apply_rope`), cast back. Refs:
    qkv tile, [cos, sin tiles,] out tile."""
    x_ref, o_ref = refs[0], refs[-1]
    y = x_ref[...].astype(jnp.float32)
    if rope:
        cos, sin = (r[...].astype(jnp.float32) for r in refs[1:3])
        y = y * cos + _rotate_half(static, y) * sin
    scale = jnp.where(pl.program_id(2) < static.groups, static.scale, 1.0)
    o_ref[...] = (y * scale).astype(o_ref.dtype)


def _rope_back_kernel(*refs, static, rope: bool):
    """One (row, block, lane tile c) of d qkv: the transpose of `_rope_kernel` applied to dq'
    (c < groups) and dk' (the next groups), dv copied (the last). Refs: dq', dk', dv tiles,
    [cos, sin tiles,] out tile."""
    dq_ref, dk_ref, dv_ref, o_ref = refs[0], refs[1], refs[2], refs[-1]
    groups = static.groups
    part = pl.program_id(2) // groups

    def back(g_ref, scale):
        g = g_ref[...].astype(jnp.float32) * scale
        if rope:  # rotate_half's transpose is its negation
            cos, sin = (r[...].astype(jnp.float32) for r in refs[3:5])
            g = g * cos - _rotate_half(static, g * sin)
        o_ref[...] = g.astype(o_ref.dtype)

    @pl.when(part == 0)
    def _q():
        back(dq_ref, static.scale)

    @pl.when(part == 1)
    def _k():
        back(dk_ref, 1.0)

    @pl.when(part == 2)
    def _v():
        o_ref[...] = dv_ref[...]


def _lane_tile(static, shift: int = 0, tiles: int | None = None):
    """A (row, block, lane tile c) step's [block, width] tile of a [batch, seq, n·width] array
    at tile c - shift, clipped to [0, tiles) (an unchanged index is not fetched again)."""
    def index_map(b, i, c):
        tile = c - shift if tiles is None else jnp.clip(c - shift, 0, tiles - 1)
        return (b, i, tile)

    return pl.BlockSpec((None, static.block, static.width), index_map)


def _table_spec(static):
    return pl.BlockSpec((None, static.block, static.width), lambda b, i, c: (b, i, 0))


def rope_call(static, interpret, qkv, tables):
    """[q' | k'] [batch, seq, 2·heads·head_dim] of qkv [batch, seq, 3·heads·head_dim]: q
    rotated and scaled, k rotated (`_rope_kernel`); tables [batch, seq, width] or ()."""
    batch, seq, features = qkv.shape
    groups = static.groups
    return pl.pallas_call(
        functools.partial(_rope_kernel, static=static, rope=bool(tables)),
        grid=(batch, static.blocks, 2 * groups),
        in_specs=[_lane_tile(static)] + [_table_spec(static)] * len(tables),
        out_specs=_lane_tile(static),
        out_shape=jax.ShapeDtypeStruct((batch, seq, features * 2 // 3), qkv.dtype),
        compiler_params=_parallel(3),
        cost_estimate=rope_cost(static, qkv, len(tables), back=False),
        interpret=interpret, name="splash_rope",
    )(qkv, *tables)


def rope_back_call(static, interpret, dq, dk, dv, tables):
    """d qkv [batch, seq, 3·heads·head_dim] from the kernels' dq', dk' (of the rotated,
    scaled q and the rotated k) and dv, each [batch, seq, heads·head_dim]."""
    batch, seq, width = dq.shape
    groups = static.groups
    return pl.pallas_call(
        functools.partial(_rope_back_kernel, static=static, rope=bool(tables)),
        grid=(batch, static.blocks, 3 * groups),
        in_specs=[_lane_tile(static, part * groups, groups) for part in range(3)]
        + [_table_spec(static)] * len(tables),
        out_specs=_lane_tile(static),
        out_shape=jax.ShapeDtypeStruct((batch, seq, 3 * width), dq.dtype),
        compiler_params=_parallel(3),
        cost_estimate=rope_cost(static, dq, len(tables), back=True),
        interpret=interpret, name="splash_rope_back",
    )(dq, dk, dv, *tables)


def rope_cost(static, x, tables: int, back: bool) -> pl.CostEstimate:
    """The rope kernels: per element of q and k, ROPE_ELEMENTWISE FLOPs and their tables'
    reads; forward reads q, k and writes them rotated; backward also copies dv."""
    batch, seq = x.shape[:2]
    elements = 2 * batch * seq * static.heads * static.head_dim
    tables_bytes = tables * batch * seq * static.width * 4 * 2 * static.groups
    moved = elements * x.dtype.itemsize * (2 + (1 if back else 0))
    return pl.CostEstimate(flops=ROPE_ELEMENTWISE * elements, transcendentals=0,
                           bytes_accessed=moved + tables_bytes)

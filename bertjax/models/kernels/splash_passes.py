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
    """One (row, block) of [q | k]: q's heads rotated and scaled by 1/sqrt(head_dim), k's
    rotated, in float32 (the model's `apply_rope`), cast back, a group's 128-lane tile at a
    time (the tables are a group's). Refs: q, k [block, heads · head_dim] (of qkv), [cos, sin
    tiles,] out [block, 2 · heads · head_dim]."""
    q_ref, k_ref, o_ref = refs[0], refs[1], refs[-1]
    if rope:
        cos, sin = (r[...].astype(jnp.float32) for r in refs[2:4])
    for part, (x_ref, scale) in enumerate(((q_ref, static.scale), (k_ref, 1.0))):
        for lanes, out in _group_lanes(static, part):
            y = x_ref[:, lanes].astype(jnp.float32)
            if rope:
                y = y * cos + _rotate_half(static, y) * sin
            o_ref[:, out] = (y * scale).astype(o_ref.dtype)


def _rope_back_kernel(*refs, static, rope: bool):
    """One (row, block) of d qkv: the transpose of `_rope_kernel` applied to dq' and dk', dv
    copied. Refs: dq', dk', dv [block, heads · head_dim], [cos, sin tiles,] out [block,
    3 · heads · head_dim]."""
    dq_ref, dk_ref, dv_ref, o_ref = refs[0], refs[1], refs[2], refs[-1]
    if rope:
        cos, sin = (r[...].astype(jnp.float32) for r in refs[3:5])
    for part, (g_ref, scale) in enumerate(((dq_ref, static.scale), (dk_ref, 1.0))):
        for lanes, out in _group_lanes(static, part):
            g = g_ref[:, lanes].astype(jnp.float32) * scale
            if rope:  # rotate_half's transpose is its negation
                g = g * cos - _rotate_half(static, g * sin)
            o_ref[:, out] = g.astype(o_ref.dtype)
    features = static.groups * static.width
    o_ref[:, 2 * features:] = dv_ref[...]


def _group_lanes(static, part: int):
    """(a head group's 128 lanes of a [rows, heads · head_dim] tile, the same of part `part`
    of [rows, n · heads · head_dim]) for each group."""
    features = static.groups * static.width
    return [(slice(g * static.width, (g + 1) * static.width),
             slice(part * features + g * static.width, part * features + (g + 1) * static.width))
            for g in range(static.groups)]


def _tokens(static, parts: int = 1, part: int = 0):
    """A (row, block) step's [block, parts · heads · head_dim] tile of a [batch, seq, n ·
    heads · head_dim] array, at `part` (in units of the tile's width)."""
    features = parts * static.groups * static.width
    return pl.BlockSpec((None, static.block, features), lambda b, i: (b, i, part))


def _table_spec(static):
    return pl.BlockSpec((None, static.block, static.width), lambda b, i: (b, i, 0))


def rope_call(static, interpret, qkv, tables):
    """[q' | k'] [batch, seq, 2·heads·head_dim] of qkv [batch, seq, 3·heads·head_dim]: q
    rotated and scaled, k rotated (`_rope_kernel`); tables [batch, seq, width] or ()."""
    batch, seq, features = qkv.shape
    return pl.pallas_call(
        functools.partial(_rope_kernel, static=static, rope=bool(tables)),
        grid=(batch, static.blocks),
        in_specs=[_tokens(static, 1, 0), _tokens(static, 1, 1)]
        + [_table_spec(static)] * len(tables),
        out_specs=_tokens(static, 2),
        out_shape=jax.ShapeDtypeStruct((batch, seq, features * 2 // 3), qkv.dtype),
        compiler_params=_parallel(2),
        cost_estimate=rope_cost(static, qkv, len(tables), back=False),
        interpret=interpret, name="splash_rope",
    )(qkv, qkv, *tables)


def rope_back_call(static, interpret, dq, dk, dv, tables):
    """d qkv [batch, seq, 3·heads·head_dim] from the kernels' dq', dk' (of the rotated,
    scaled q and the rotated k) and dv, each [batch, seq, heads·head_dim]."""
    batch, seq, width = dq.shape
    return pl.pallas_call(
        functools.partial(_rope_back_kernel, static=static, rope=bool(tables)),
        grid=(batch, static.blocks),
        in_specs=[_tokens(static)] * 3 + [_table_spec(static)] * len(tables),
        out_specs=_tokens(static, 3),
        out_shape=jax.ShapeDtypeStruct((batch, seq, 3 * width), dq.dtype),
        compiler_params=_parallel(2),
        cost_estimate=rope_cost(static, dq, len(tables), back=True),
        interpret=interpret, name="splash_rope_back",
    )(dq, dk, dv, *tables)


def rope_cost(static, x, tables: int, back: bool) -> pl.CostEstimate:
    """The rope kernels: per element of q and k, ROPE_ELEMENTWISE FLOPs and their tables'
    reads; forward reads q, k and writes them rotated; backward also copies dv."""
    batch, seq = x.shape[:2]
    elements = 2 * batch * seq * static.heads * static.head_dim
    tables_bytes = tables * batch * seq * static.width * x.dtype.itemsize  # once per block
    moved = elements * x.dtype.itemsize * (2 + (1 if back else 0))
    return pl.CostEstimate(flops=ROPE_ELEMENTWISE * elements, transcendentals=0,
                           bytes_accessed=moved + tables_bytes)

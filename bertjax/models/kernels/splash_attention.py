"""Splash (sparse flash) attention: ModernBERT's attention on our Pallas TPU kernels, which
compute only the scores a layer's masks keep, at the granularity of blocks
(`model.attention_impl="splash"`).

Why: a local layer needs only |q - k| <= r (r = 64: 129 keys of 8,192), and a packed row's
documents see only themselves, yet a dense or flash kernel computes every pair of blocks.

  * A local layer (`splash_local`): each chunk of 128 queries reads the keys of its window,
    rounded out to whole tiles of 16 rows (256 keys for r = 64), from the row held in VMEM;
    one grid step per block, no walk, a one-pass softmax.
  * A global layer (this module): query block i walks every key block of the row; step t's key
    block is `index[b, i, t]`, computed where `live[b, i, t]`, i.e. where the two blocks'
    segment ranges [min, max] overlap (implied by any query and key sharing a document;
    equivalent to it for packed rows, whose documents are contiguous). The per-row table is
    built on device from the segment ids (`block_table`, a few integer ops over [batch,
    blocks]) and read as scalar-prefetched memory. A dead step computes nothing and repeats
    the previous live step's block index, so nothing is fetched for it either (a block is
    copied in only when its index changes between steps). The backward walks the same table
    and computes each live pair's p and ds once, for dq, dk and dv (`_backward_kernel`).

Inside what is computed, scores are masked by segment and window, elementwise. Segment ids are
`flash.segment_ids` (the document; padding is given PAD, above every document: its own segment,
so a padding query attends to the padding keys, itself at least, and no row is empty). A
padding query's output is never read by a real token, whose values and gradients equal the
einsum path's.

Shapes: the fused qkv [batch, seq, 3·heads·head_dim] (each token's heads side by side, as the
projection writes them) → [batch, seq, heads·head_dim]. Per batch shard
(`flash.sharded_like`: XLA cannot partition a Mosaic kernel), with the sequence padded to a
multiple of 128 (`flash.run_padded`). Tiles hold a group of heads (`splash_common`): no [..,
heads, head_dim] layout, whose 64-lane rows fill half of each vector register and of each HBM
tile, is made, and nothing is transposed to or from the kernels. A global layer's grids are
(batch, head groups, blocks, steps): the forward's first three "parallel" (megacore splits
them), the steps "arbitrary" (an online softmax); the backward's blocks "arbitrary" too (its
dk and dv accumulate over them). The forward accumulates o transposed, [width, queries], and
transposes it once as a block finishes; a small kernel (`splash_passes.di_call`) writes di from
o and do. RoPE and the 1/sqrt(head_dim) scale are applied to q and k once, by a
small kernel (`splash_passes`, lane rolls in VMEM) writing [q' | k'] before the attention
kernels, and its transpose after them (which also writes dv into the fused gradient): rotating
each tile as an attention kernel read it cost 16% of each kernel's compiled schedule (v5p,
1,024 and 8,192 tokens); the same rotation as XLA ops cost more than it saved (lane shuffles
through HBM). v is read in place from the fused qkv.

Blocks (`block_size`): 512 x 512 where the padded sequence allows (1,024 and 8,192 tokens),
else 256, else 128. A grid step has a fixed cost (~0.35 µs) that a 128 x 128 x 64 step's
matmuls (4 MFLOP) leave uncovered and a 512 x 512 step's (67 MFLOP) roughly cover; its float32
[512, 512] scores (1 MiB) and double-buffered blocks fit VMEM.

Interpret or kernel is decided when lowering (`lax.platform_dependent`, as flash_attention): a
TPU, also an ahead-of-time compile for a TPU topology on a CPU host, gets the Mosaic kernels,
anything else the Pallas interpreter (plain HLO). Costs (`pl.CostEstimate`) must be known when
compiling, documents are not: each kernel's estimate counts the scores of a row with no
document boundary (`splash_common.computed_scores`), an upper bound.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bertjax.errors import ConfigError
from bertjax.models.kernels import flash_attention as flash
from bertjax.models.kernels import splash_local as local
from bertjax.models.kernels import splash_passes as passes
from bertjax.models.kernels.flash_attention import heads_per_tile
from bertjax.models.kernels.splash_common import (  # noqa: F401  (Static, PAD, ... as attributes)
    LANES,
    NT,
    PAD,
    SUBLANES,
    VMEM_LIMIT,
    Static,
    allowed,
    block_size,
    computed_scores,
    fits,
    head_rows_of,
    kernel_costs,
    only,
    segment_arrays,
    vmem_capacity,
    vmem_needed,
)
from bertjax.models.kernels.splash_costs import (  # noqa: F401  (its costs, as attributes)
    ROPE_ELEMENTWISE,
    WINDOW_ELEMENTWISE,
)


def block_table(segments: jax.Array, static: Static) -> tuple[jax.Array, jax.Array]:
    """A global layer's walk over one shard: (index, live), each [batch, blocks, blocks]
    int32: step t of block i walks block index[b, i, t], computed where live.

    segments: [batch, padded seq] int32 (PAD on padding)."""
    batch = segments.shape[0]
    by_block = segments.reshape(batch, static.blocks, static.block)
    low, high = by_block.min(axis=-1), by_block.max(axis=-1)  # [batch, blocks]
    walked = np.broadcast_to(np.arange(static.blocks, dtype=np.int32),
                             (static.blocks, static.blocks))
    live = (low[:, :, None] <= high[:, None, :]) & (low[:, None, :] <= high[:, :, None])
    # A dead step repeats the last live block before it (the first live one at the start):
    # the block index does not change, so nothing is fetched. The diagonal is always live.
    index = lax.cummax(jnp.where(live, walked[None], -1), axis=2)
    first = jnp.min(jnp.where(live, walked[None], static.blocks), axis=2, keepdims=True)
    index = jnp.where(index < 0, first, index)
    return index.astype(jnp.int32), live.astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Kernels. Scalar-prefetched: index_ref, live_ref [batch, blocks, blocks] int32. A grid step
# holds a group of heads side by side in [block, width] tiles (`splash_common`).


def _forward_kernel(index_ref, live_ref, *refs, static):
    """One (row, head group, query block) over its key steps: the online softmax of each head,
    its scores transposed, kᵀ·q as [k, q], so that the reductions over keys run down the
    sublanes and leave [1, q] rows. Refs: q, k, v, query ids (a [8, q] row), key ids (a
    [k, 128] column), o, lse rows [group, 8, q], then scratch peak, total ([group, 8, q]
    rows), acc [width, q] (o transposed)."""
    q_ref, k_ref, v_ref, q_ids_ref, k_ids_ref, o_ref, lse_ref, peak_ref, total_ref, acc_ref = refs
    b, i, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(t == 0)
    def _init():
        peak_ref[...] = jnp.full(peak_ref.shape, flash.MASK_VALUE, jnp.float32)
        total_ref[...] = jnp.zeros(total_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(live_ref[b, i, t] != 0)
    def _compute():
        q, k = q_ref[...], k_ref[...]
        v_t = v_ref[...].astype(jnp.float32).T.astype(v_ref.dtype)  # [width, k]
        kept = allowed(static, q_ids_ref[:1, :], k_ids_ref[...])
        for j in range(static.group):
            s = lax.dot_general(only(static, j, k), q, NT, preferred_element_type=jnp.float32)
            s = jnp.where(kept, s, flash.MASK_VALUE)  # [k, q]
            peak = peak_ref[j, :1, :]
            new_peak = jnp.maximum(peak, jnp.max(s, axis=0, keepdims=True))  # [1, q]
            p = jnp.exp(s - new_peak)
            alpha = jnp.exp(peak - new_peak)
            total = alpha * total_ref[j, :1, :] + jnp.sum(p, axis=0, keepdims=True)
            total_ref[j] = jnp.broadcast_to(total, total_ref.shape[1:])
            peak_ref[j] = jnp.broadcast_to(new_peak, peak_ref.shape[1:])
            # head j's rows of oᵀ, from its rows of vᵀ only
            rows = _head_slice(static, j)
            update = lax.dot(v_t[rows], p.astype(v_t.dtype), preferred_element_type=jnp.float32)
            acc_ref[rows, :] = alpha * acc_ref[rows, :] + update

    @pl.when(t == static.blocks - 1)
    def _finish():
        totals = [total_ref[j, :1, :] for j in range(static.group)]
        out = acc_ref[...] * head_rows_of(static, [1.0 / x for x in totals])
        o_ref[...] = out.T.astype(o_ref.dtype)
        for j in range(static.group):
            lse_ref[j] = peak_ref[j] + jnp.log(total_ref[j])


def _head_slice(static, j: int) -> slice:
    """Head j's rows of a transposed [width, rows] tile: its head_dim of the group's lanes.
    Transposed operands let a head's matmul stream its head_dim rows alone, half of what a
    [rows, width] tile with the other head's lanes zeroed streams through the MXU."""
    return slice(j * static.head_dim, (j + 1) * static.head_dim)


def _transposed(x):
    """A [rows, width] bf16 tile as [width, rows] (by way of float32, which Mosaic transposes)."""
    return x.astype(jnp.float32).T.astype(x.dtype)


def _probabilities(static, j, q, k, lse_ref, kept):
    """Head j's softmax probabilities of a (key block, query block) pair, transposed:
    [k, q]. lse_ref: [group, 8, q] rows."""
    s = lax.dot_general(only(static, j, k), q, NT, preferred_element_type=jnp.float32)
    return jnp.exp(jnp.where(kept, s, flash.MASK_VALUE) - lse_ref[j, :1, :])


def _backward_kernel(index_ref, live_ref, *refs, static):
    """One (row, head group, query block i) over its key steps t: p and ds of each live block
    pair computed once; dq = Σ ds·k accumulated for block i, dk = Σ dsᵀ·q and dv = Σ pᵀ·do for
    the walked key block in accumulators of the whole row, all transposed per head
    (`_head_slice`). The key blocks' columns are zeroed as the first query block walks them
    (it walks every block, in order) and written out as the last one leaves them. Refs: q, k,
    v, do, lse, di, query ids, key ids, dq, dk, dv (key block t while the last query block
    walks, else block 0, never written back before: see `_backward_call`), then scratch dqᵀ
    [width, q], dkᵀ, dvᵀ [width, seq] float32."""
    (q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, q_ids_ref, k_ids_ref, dq_ref, dk_ref, dv_ref,
     dq_acc, dk_acc, dv_acc) = refs
    b, i, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    last = static.blocks - 1

    @pl.when(t == 0)
    def _init_dq():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    @pl.when(i == 0)
    def _init_dkv():
        columns = pl.ds(pl.multiple_of(t * static.block, static.block), static.block)
        dk_acc[:, columns] = jnp.zeros((static.width, static.block), jnp.float32)
        dv_acc[:, columns] = jnp.zeros((static.width, static.block), jnp.float32)

    @pl.when(live_ref[b, i, t] != 0)
    def _compute():
        q, k = q_ref[...], k_ref[...]
        v, do = v_ref[...], do_ref[...]
        kept = allowed(static, q_ids_ref[:1, :], k_ids_ref[...])
        k_t, q_t, do_t = _transposed(k), _transposed(q), _transposed(do)
        k_block = index_ref[b, i, t]
        columns = pl.ds(pl.multiple_of(k_block * static.block, static.block), static.block)
        for h in range(static.group):
            p = _probabilities(static, h, q, k, lse_ref, kept)
            dp = lax.dot_general(only(static, h, v), do, NT,
                                 preferred_element_type=jnp.float32)  # [k, q]
            ds = (p * (dp - di_ref[h, :1, :])).astype(q.dtype)
            p = p.astype(do.dtype)
            rows = _head_slice(static, h)  # head h's dqᵀ [head_dim, q], dkᵀ, dvᵀ [head_dim, k]
            dq_acc[rows, :] += lax.dot(k_t[rows], ds, preferred_element_type=jnp.float32)
            dk_acc[rows, columns] += lax.dot_general(q_t[rows], ds, NT,
                                                     preferred_element_type=jnp.float32)
            dv_acc[rows, columns] += lax.dot_general(do_t[rows], p, NT,
                                                     preferred_element_type=jnp.float32)

    @pl.when(t == last)
    def _finish_dq():
        dq_ref[...] = dq_acc[...].T.astype(dq_ref.dtype)

    @pl.when(i == last)
    def _finish_dkv():
        # key block t is complete: later steps walk later blocks (or repeat one, dead)
        columns = pl.ds(pl.multiple_of(t * static.block, static.block), static.block)
        dk_ref[...] = dk_acc[:, columns].T.astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[:, columns].T.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------------------------
# Block specs: index maps take (b, g, block, step, index_ref, live_ref), g the head group.
# "own" is the grid's query block, "walked" the step's key block.


def _tile(static, walked: bool, part: int = 0):
    """A block's [block, width] tile of a [batch, seq, heads·head_dim] array, its group's
    heads; of the fused [batch, seq, 3·heads·head_dim] q, k, v: `part` 0, 1, 2 (q, k or v)."""
    groups = static.groups

    def index_map(b, g, i, t, index, live):
        return (b, index[b, i, t] if walked else i, part * groups + g)

    return pl.BlockSpec((None, static.block, static.width), index_map)


def _column(static, walked: bool):
    """Segment ids of a block as a [block, 128] column of the [batch, seq, 128] array."""
    def index_map(b, g, i, t, index, live):
        return (b, index[b, i, t] if walked else i, 0)

    return pl.BlockSpec((None, static.block, LANES), index_map)


def _row(static, walked: bool):
    """A block's [8, block] row of the [batch, 8, seq] segment ids."""
    def index_map(b, g, i, t, index, live):
        return (b, 0, index[b, i, t] if walked else i)

    return pl.BlockSpec((None, SUBLANES, static.block), index_map)


def _head_rows(static, walked: bool):
    """A block's [group, 8, block] rows of a [batch, heads, 8, seq] float32 array (log-sum-exp,
    di: one per query, sublane-broadcast)."""
    def index_map(b, g, i, t, index, live):
        return (b, g, 0, index[b, i, t] if walked else i)

    return pl.BlockSpec((None, static.group, SUBLANES, static.block), index_map)


def _grid(q, static):
    return (q.shape[0], static.groups, static.blocks, static.blocks)


def _params():
    return pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


def _forward_call(static, interpret, qk, qkv, segments, index, live):
    """q (rotated, scaled) and k (rotated) read in place from qk [batch, seq,
    2·heads·head_dim] (`_rope_call`), v from qkv [batch, seq, 3·heads·head_dim]."""
    batch, seq, _ = qkv.shape
    q = jax.ShapeDtypeStruct((batch, seq, qkv.shape[-1] // 3), qkv.dtype)
    column, row = segment_arrays(segments)
    stats = (static.group, SUBLANES, static.block)
    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, static=static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=_grid(q, static),
            in_specs=[_tile(static, False), _tile(static, True, 1), _tile(static, True, 2),
                      _row(static, False), _column(static, True)],
            out_specs=[_tile(static, False), _head_rows(static, False)],
            scratch_shapes=[pltpu.VMEM(stats, jnp.float32), pltpu.VMEM(stats, jnp.float32),
                            pltpu.VMEM((static.width, static.block), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, static.heads, SUBLANES, seq), jnp.float32)],
        compiler_params=_params(), cost_estimate=kernel_costs(static, q)["fwd"],
        interpret=interpret, name="splash_fwd",
    )(index, live, qk, qk, qkv, row, column)
    return out, lse


def _backward_call(static, interpret, qk, qkv, segments, index, live, out, lse, d_out):
    """(dq, dk, dv) [batch, seq, heads·head_dim]: of the rotated, scaled q and the rotated k
    (`_forward_call`'s inputs, in qk), and of v."""
    q = jax.ShapeDtypeStruct(out.shape, out.dtype)
    batch, seq, _ = out.shape
    column, row = segment_arrays(segments)
    di = passes.di_call(static, interpret, out, d_out)
    last = static.blocks - 1

    def finished(b, g, i, t, index, live):
        # dk, dv's key block t once the last query block walks it; block 0 until then, which
        # is written back only when the index moves on, after the last block wrote it
        return (b, jnp.where(i == last, t, 0), g)

    key_block = pl.BlockSpec((None, static.block, static.width), finished)
    return pl.pallas_call(
        functools.partial(_backward_kernel, static=static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=_grid(q, static),
            in_specs=[_tile(static, False), _tile(static, True, 1), _tile(static, True, 2),
                      _tile(static, False), _head_rows(static, False),
                      _head_rows(static, False), _row(static, False), _column(static, True)],
            out_specs=[_tile(static, False), key_block, key_block],
            scratch_shapes=[pltpu.VMEM((static.width, static.block), jnp.float32),
                            pltpu.VMEM((static.width, seq), jnp.float32),
                            pltpu.VMEM((static.width, seq), jnp.float32)]),
        out_shape=[q] * 3,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=VMEM_LIMIT),
        cost_estimate=kernel_costs(static, q)["bwd"], interpret=interpret, name="splash_bwd",
    )(index, live, qk, qk, qkv, d_out, lse, di, row, column)


def _on_platform(call, static, *args):
    """The Mosaic kernels when lowered for a TPU, their interpreter elsewhere."""
    return lax.platform_dependent(*args, tpu=functools.partial(call, static, False),
                                  default=functools.partial(call, static, True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _splash(qkv, segments, walk, tables, static):
    """walk: a global layer's (index, live) (`block_table`), () in a local layer; tables:
    (cos, sin) [batch, seq, width] (q and k given un-rotated), or ()."""
    return _splash_fwd(qkv, segments, walk, tables, static)[0]


def _splash_fwd(qkv, segments, walk, tables, static):
    qk = _on_platform(passes.rope_call, static, qkv, tables)
    if walk:
        out, lse = _on_platform(_forward_call, static, qk, qkv, segments, *walk)
    else:
        out, lse = _on_platform(local.forward_call, static, qk, qkv, segments)
    return out, (qk, qkv, segments, walk, tables, out, lse)


def _splash_bwd(static, residuals, d_out):
    qk, qkv, segments, walk, tables, out, lse = residuals
    if walk:
        dq, dk, dv = _on_platform(_backward_call, static, qk, qkv, segments, *walk, out, lse,
                                  d_out)
    else:
        dq, dk, dv = _on_platform(local.backward_call, static, qk, qkv, segments, out, lse,
                                  d_out)
    d_qkv = _on_platform(passes.rope_back_call, static, dq, dk, dv, tables)
    return d_qkv, None, None if walk else (), None


_splash.defvjp(_splash_fwd, _splash_bwd)


def splash_attention(
    qkv: jax.Array,
    input_mask: jax.Array | None,
    packing_ids: jax.Array | None,
    radius: int | None,
    num_heads: int,
    rope: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Attention through the splash kernels, the values of `attention.einsum_attention` under
    `modernbert.attention_masks` on every real query (padding queries: see the module docstring).

    qkv: [batch, seq, 3·heads·head_dim], the queries, keys and values side by side, each
    [.., heads·head_dim] with each token's heads side by side (the fused projection's output;
    the kernels read v from it in place) → [batch, seq, heads·head_dim]. input_mask (1 real, 0
    pad) / packing_ids: [batch, seq] int or None. radius: the local window's (|q - k| <=
    radius), None for a global layer. Scaled by 1/sqrt(head_dim). rope: (cos, sin) [batch, seq,
    heads·head_dim], alike for every head (`rope_tables`): q and k are given un-rotated and
    are rotated once before the attention kernels (`splash_passes`, the model's `apply_rope`
    in float32), from the tables' first head group.
    """
    if radius is not None and radius < 0:
        raise ConfigError(f"splash attention's window radius must be >= 0, got {radius}")
    batch, seq, features = qkv.shape
    if radius is None and not fits(seq, False):
        kind = flash.traced_device_kind()
        raise ConfigError(
            f"model.attention_impl='splash' needs ~{vmem_needed(seq, radius is not None) >> 20} "
            f"MiB of VMEM for {seq}-token rows in a global layer; "
            f"{kind} has {vmem_capacity(kind) >> 20}: use 'auto' (the 'xla' path there) or "
            "shorter rows")
    head_dim = features // (3 * num_heads)
    segments = flash.segment_ids(input_mask, packing_ids, (batch, seq))
    width = heads_per_tile(num_heads, head_dim) * head_dim
    tables = () if rope is None else tuple(t[..., :width].astype(qkv.dtype) for t in rope)

    def attend(tokens, segments, shard):
        del shard
        segments = jnp.where(segments == flash.PAD_SEGMENT, PAD, segments)
        padded = tokens[0].shape[1]
        if radius is not None and not fits(padded, True):
            return _local_in_pieces(tokens, segments, radius, num_heads, head_dim)
        static = Static(padded, block_size(padded), radius, num_heads, head_dim)
        walk = block_table(segments, static) if radius is None else ()
        return _splash(tokens[0], segments, walk, tuple(tokens[1:]), static)

    return flash.run_padded(attend, (qkv, *tables), segments)


PIECES = (4096, 2048, 1024, 512, 256, 128)  # a local layer's pieces, longest first


def _local_in_pieces(tokens, segments, radius, num_heads, head_dim):
    """A local layer whose rows outgrow VMEM (`fits`), by pieces: each row is cut into pieces
    of the longest length in PIECES whose rows, widened by the window's reach (in tiles of 128)
    on both sides, fit; the pieces are attended as rows of their own (a query's keys all lie
    within its piece and the reach) and their middles put back. tokens: qkv [batch, seq, ..]
    and the RoPE tables; segments [batch, seq] → [batch, seq, heads·head_dim]."""
    batch, seq = segments.shape
    halo = flash.BLOCK * -(-radius // flash.BLOCK)
    piece = next((p for p in PIECES if fits(p + 2 * halo, True)), PIECES[-1])
    count = -(-seq // piece)

    def cut(x, fill):  # [batch, seq, ..] → [batch · count, piece + 2·halo, ..]
        widths = [(0, 0), (halo, count * piece - seq + halo)] + [(0, 0)] * (x.ndim - 2)
        x = jnp.pad(x, widths, constant_values=fill)
        pieces = [x[:, i * piece:i * piece + piece + 2 * halo] for i in range(count)]
        return jnp.stack(pieces, axis=1).reshape(batch * count, *pieces[0].shape[1:])

    length = piece + 2 * halo
    static = Static(length, block_size(length), radius, num_heads, head_dim)
    out = _splash(cut(tokens[0], 0), cut(segments, PAD), (), tuple(cut(t, 0) for t in tokens[1:]),
                  static)
    out = out[:, halo:halo + piece].reshape(batch, count * piece, -1)
    return out[:, :seq]

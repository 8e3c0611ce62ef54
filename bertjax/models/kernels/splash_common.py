"""What the splash kernels share (`splash_attention`'s global layers, `splash_local`'s local
ones, `splash_passes`): a call's compile-time settings (`Static`), the score masks, the heads'
layout in a tile, and the cost estimates.

Layout: operands are [batch, seq, heads·head_dim] (each token's heads side by side, as the
projections write them); a grid step takes [rows, width] tiles holding a group of heads (2 for
head_dim 64). Head j is computed on the whole tile with the other heads' lanes of one operand
zeroed (`only`), which costs the MXU nothing (it is 128 lanes deep and wide either way) and
slices no head out of a tile. Scores are kept transposed, [keys, queries]: the softmax's
reductions over keys run down the sublanes and leave [1, queries] rows, and per-query
statistics (log-sum-exp, di) are stored as such rows, [batch, heads, 8, seq]
(sublane-broadcast).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bertjax.models.kernels import flash_attention as flash
from bertjax.models.kernels.flash_attention import heads_per_tile
from bertjax.models.kernels.splash_costs import (
    di_cost,
    forward_cost,
    fused_backward_cost,
)

BLOCKS = (512, 256, 128)  # preferred first; all multiples of the kernels' 128 lanes
PAD = int(np.iinfo(np.int32).max)  # padding's segment in the kernels: above every document
LANES = flash.LANES
SUBLANES = flash.SUBLANES
TILE_ROWS = 16  # a bf16 tile's rows: where a slice of rows may start
NT = (((1,), (1,)), ((), ()))  # a @ b.T
TN = (((0,), (0,)), ((), ()))  # a.T @ b
# The kernels' scoped VMEM: whole rows (at 8,192 tokens k, v, dk, dv 2 MiB each and the key
# ids 4 MiB, double buffered; the accumulators 4.5 MiB each) exceed the default limit.
VMEM_LIMIT = 64 * 2 ** 20


def block_size(seq: int) -> int:
    """The block (query and key, every kernel) for a sequence padded to a multiple of 128."""
    return next(block for block in BLOCKS if seq % block == 0)


@dataclasses.dataclass(frozen=True)
class Static:
    """A call's compile-time settings. radius: the local window's (|q - k| <= radius), None
    for a global layer; heads, head_dim: the layout of the [batch, seq, heads·head_dim]
    operands (`group` heads side by side in each 128-lane tile)."""

    seq: int  # padded
    block: int
    radius: int | None
    heads: int = 1
    head_dim: int = LANES

    @property
    def scale(self) -> float:
        """The scores' 1/sqrt(head_dim), applied to q before the kernels."""
        return self.head_dim ** -0.5

    @property
    def blocks(self) -> int:
        return self.seq // self.block

    @property
    def group(self) -> int:
        """Heads per grid step: side by side in a tile's lanes (2 for head_dim 64)."""
        return heads_per_tile(self.heads, self.head_dim)

    @property
    def width(self) -> int:
        return self.group * self.head_dim

    @property
    def groups(self) -> int:
        """Head groups: grid steps along the heads."""
        return self.heads // self.group

    @property
    def reach(self) -> int:
        """A local layer's keys read on each side of a chunk of 128 queries: the radius
        rounded up to whole tiles of rows (`TILE_ROWS`)."""
        return -(-self.radius // TILE_ROWS) * TILE_ROWS

    @property
    def span(self) -> int:
        """A local layer's keys read for a chunk of 128 queries: the chunk and `reach` on
        each side, within the row."""
        return min(2 * self.reach + LANES, self.seq)

    def span_start(self, first):
        """The first of the `span` keys read for the chunk starting at token `first`
        (traced): `reach` before it, shifted into the row at its ends."""
        start = jnp.clip(first - self.reach, 0, self.seq - self.span)
        return pl.multiple_of(start, TILE_ROWS)


# Device kinds (as jax names them) → Pallas's chip versions, for their VMEM.
_CHIPS = (("v6", pltpu.ChipVersion.TPU_V6E), ("v5 lite", pltpu.ChipVersion.TPU_V5E),
          ("v5e", pltpu.ChipVersion.TPU_V5E), ("v5", pltpu.ChipVersion.TPU_V5P),
          ("v4", pltpu.ChipVersion.TPU_V4))


def vmem_needed(seq: int, local: bool) -> int:
    """Bytes of VMEM the kernels of a layer need at `seq` padded tokens (heads' tiles of 128
    lanes): a local layer's backward holds whole rows of k, v, their ids, dk, dv (double
    buffered) and float32 dk, dv accumulators, ~4 KiB per token; a global layer's its float32
    dk, dv accumulators, 1 KiB; and 4 MiB of tiles and spills (as libtpu reports them)."""
    return (4 if local else 1) * 1024 * seq + 4 * 2 ** 20


def vmem_capacity(device_kind: str) -> int | None:
    """A TPU's VMEM bytes per core by its device kind, None where not known."""
    kind = device_kind.lower()
    for name, chip in _CHIPS:
        if f"tpu {name}" in kind or f"tpu{name}" in kind:
            return pltpu.get_tpu_info_for_chip(chip, 1).vmem_capacity_bytes
    return None


def fits(seq: int, local: bool, device_kind: str | None = None) -> bool:
    """Whether a layer's splash kernels fit the VMEM of the TPU being traced for (or of
    `device_kind`) at `seq` tokens; true where the chip is not known."""
    capacity = vmem_capacity(device_kind or flash.traced_device_kind())
    return capacity is None or vmem_needed(flash.BLOCK * -(-seq // flash.BLOCK), local) <= capacity


def computed_scores(static: Static, batch: int) -> int:
    """Scores the kernels compute over a shard's rows and heads, as the cost estimates count
    them: every block pair in a global layer (a row of one document), `span` keys per query
    in a local one."""
    per_head = static.seq * (static.seq if static.radius is None else static.span)
    return batch * static.heads * per_head


def only(static, j: int, x):
    """x [rows, width] with every lane outside head j zeroed."""
    lane = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    inside = (lane >= j * static.head_dim) & (lane < (j + 1) * static.head_dim)
    return jnp.where(inside, x, jnp.zeros_like(x))


def allowed(static, q_ids, k_ids, q_first=0, k_first=0):
    """[k, q] bool, the pairs a score is kept for (one mask for a step's heads): q_ids [1, q]
    (a row) and k_ids [k, 128] (a column) in the same segment, and in a local layer within
    the window, the queries and keys starting at tokens q_first and k_first."""
    lanes = q_ids.shape[1]
    same = (jnp.tile(k_ids, (1, lanes // LANES)) if lanes > LANES else k_ids) == q_ids
    if static.radius is None:
        return same
    distance = ((q_first - k_first) + lax.broadcasted_iota(jnp.int32, same.shape, 1)
                - lax.broadcasted_iota(jnp.int32, same.shape, 0))
    return same & (jnp.abs(distance) <= static.radius)


def head_rows_of(static, rows: list):
    """[width, q]: head j's rows (its head_dim lanes of o, transposed) from rows[j], either
    [1, q] (broadcast down them) or [width, q]."""
    shape = (static.width, rows[0].shape[1])
    head = lax.broadcasted_iota(jnp.int32, shape, 0) // static.head_dim
    out = jnp.broadcast_to(rows[0], shape)
    for j in range(1, len(rows)):
        out = jnp.where(head == j, rows[j], out)
    return out


def head_lanes_of(static, tiles: list):
    """[rows, width]: head j's lanes from tiles[j] (each [rows, width])."""
    head = lax.broadcasted_iota(jnp.int32, tiles[0].shape, 1) // static.head_dim
    out = tiles[0]
    for j in range(1, len(tiles)):
        out = jnp.where(head == j, tiles[j], out)
    return out


def segment_arrays(segments):
    """segments [batch, seq] → as a column [batch, seq, 128] and a row [batch, 8, seq]."""
    batch, seq = segments.shape
    return (lax.broadcast_in_dim(segments, (batch, seq, LANES), (0, 1)),
            lax.broadcast_in_dim(segments, (batch, SUBLANES, seq), (0, 2)))


def kernel_costs(static: Static, q) -> dict[str, pl.CostEstimate]:
    """The kernels' estimates ("fwd", "bwd", "di") for q [batch, seq, heads·head_dim] (a
    shard's, padded): a global layer fetches a key block per computed block, a local one
    reads whole rows once."""
    shape = flash.Shape(q.shape[0], static.heads, q.shape[1], static.head_dim,
                        q.dtype.itemsize)
    computed = computed_scores(static, q.shape[0])
    windowed = static.radius is not None
    reuse = static.span if windowed else static.block
    # a global layer's p·v, dq, dk and dv matmuls stream one head's rows (splash_attention)
    head_rows = not windowed
    return {"fwd": forward_cost(shape, computed, reuse, static.group, windowed, head_rows),
            "bwd": fused_backward_cost(shape, computed, reuse, static.group, windowed,
                                       head_rows),
            "di": di_cost(shape)}

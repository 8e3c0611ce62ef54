"""The splash kernels' cost estimates (what `pl.CostEstimate` tells the compiler, and the cost
instrument's roofline): FLOPs, transcendentals and HBM bytes of the forward and backward kernels
over their computed blocks."""

from __future__ import annotations

from jax.experimental import pallas as pl

from bertjax.models.kernels import flash_attention as flash

SUBLANES = flash.SUBLANES

# Per rotated element of q or k (two rolls, a negation, a choice, two products, a sum, the
# scale).
ROPE_ELEMENTWISE = 8
# Elementwise FLOPs per score of the window's mask in a local layer (positions from iotas,
# their distance, its absolute value, the comparison, the conjunction).
WINDOW_ELEMENTWISE = 5


def forward_cost(shape: flash.Shape, computed: int, reuse: int, group: int = 1,
                 windowed: bool = False, head_rows: bool = False) -> pl.CostEstimate:
    """The forward kernel. computed: scores computed over the batch and heads; reuse: scores
    computed per key row fetched (a global layer's block: a block fetched per computed block;
    a local layer's span: its whole rows fetched once). q·kᵀ and p·v are 2·D FLOPs per score
    each, on the group's whole tile width (`group` heads side by side: 2·D·group), p·v on one
    head's D rows where it streams them alone (`head_rows`); one exp each, and the elementwise
    work
    (WINDOW_ELEMENTWISE more in a local layer, `windowed`); it reads q and the query segment
    ids (an [8, seq] int32 row) once per head group, the fetched keys' and values' rows and
    their segment ids (a column of 128 lanes), and writes o and the log-sum-exp ([8, seq]
    rows, float32)."""
    s = shape
    fetched = computed // reuse  # key rows fetched
    return pl.CostEstimate(
        flops=(2 * computed * s.head_dim * (group + (1 if head_rows else group))
               + (flash.FORWARD_ELEMENTWISE + WINDOW_ELEMENTWISE * windowed) * computed),
        transcendentals=computed,
        bytes_accessed=(2 * s.qkv_bytes + 2 * fetched * s.head_dim * s.itemsize
                        + 2 * SUBLANES * s.vector_bytes + fetched * flash.LANES * 4))


def fused_backward_cost(shape: flash.Shape, computed: int, reuse: int, group: int = 1,
                        windowed: bool = False, head_rows: bool = False) -> pl.CostEstimate:
    """The one backward kernel over the computed scores (`reuse` per key row fetched, as
    `forward_cost`): kᵀ·q and v·doᵀ recomputed, then dsᵀ·k, ds·q and p·do (2·D FLOPs per score
    each on the group's tile width, the last three on one head's rows with `head_rows`), one
    exp each, the elementwise work (the window's mask
    in a local layer); it reads q, do, the log-sum-exp and di ([8, seq] rows) and the query
    ids once, the fetched keys' and values' rows and their ids, and writes dq, dk, dv."""
    s = shape
    fetched = computed // reuse  # key rows fetched
    return pl.CostEstimate(
        flops=(2 * computed * s.head_dim * (2 * group + 3 * (1 if head_rows else group))
               + (flash.BACKWARD_ELEMENTWISE + WINDOW_ELEMENTWISE * windowed) * computed),
        transcendentals=computed,
        bytes_accessed=(5 * s.qkv_bytes + 2 * fetched * s.head_dim * s.itemsize
                        + 2 * SUBLANES * s.vector_bytes + SUBLANES * s.batch * s.seq * 4
                        + fetched * flash.LANES * 4))


def di_cost(shape: flash.Shape) -> pl.CostEstimate:
    """The di kernel: reads o and do, writes di as [8, seq] rows (float32); a product and a
    sum per element."""
    s = shape
    return pl.CostEstimate(flops=2 * s.batch * s.heads * s.seq * s.head_dim, transcendentals=0,
                           bytes_accessed=2 * s.qkv_bytes + SUBLANES * s.vector_bytes)

"""Flash attention on the Pallas TPU kernels shipped with JAX (`model.attention_impl="flash"`).

The kernels (jax.experimental.pallas.ops.tpu.flash_attention, jax 0.10.2) take
[batch, heads, seq, head_dim] and mask with segment ids (a query attends to keys of its own
segment) and a causal flag. Padding and packing become segment ids: a real token's segment is
its packed example (0 without packing), a padding token's is `PAD_SEGMENT`, which no real
query shares; so a padding query attends to the padding keys only (at least to itself: no
row is ever fully masked, no NaN) and its output, never read by a real token, is harmless.
The sequence is padded to a multiple of the kernels' 128-token blocks the same way.

Interpret or kernel is decided when the step is lowered, from the platform it is lowered for
(`lax.platform_dependent`): a TPU (also an ahead-of-time compile for a TPU topology on a CPU
host) gets the Mosaic kernels, anything else the Pallas interpreter (plain HLO). The shipped
backward kernels carry no `pl.CostEstimate` (XLA's cost model would count them as free), and
the forward's counts k and v once however many query blocks re-read them: all three get the
analytic estimates below (equal to the shipped forward one where a block covers the keys).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax._src import config as jax_config
from jax.experimental import pallas as pl
from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash
from jax.sharding import NamedSharding, PartitionSpec

PAD_SEGMENT = -1  # packing ids and the 0 of unpacked input are >= 0
BLOCK = 128  # the kernels' smallest block along the sequence (and their lane width)
LANES = tpu_flash.NUM_LANES
SUBLANES = tpu_flash.NUM_SUBLANES


_BATCH_SHARDING: contextvars.ContextVar[NamedSharding | None] = contextvars.ContextVar(
    "flash_batch_sharding", default=None)


@contextlib.contextmanager
def sharded_like(batch_sharding: NamedSharding | None):
    """Flash attention traced inside runs per shard of `batch_sharding` (a shard_map over its
    mesh, batch split as its leading axis): Mosaic kernels cannot be partitioned by XLA, and
    the model does not know the mesh. Step builders enter this around tracing."""
    token = _BATCH_SHARDING.set(batch_sharding)
    try:
        yield
    finally:
        _BATCH_SHARDING.reset(token)


def segment_ids(input_mask: jax.Array | None, packing_ids: jax.Array | None,
                shape: tuple[int, int]) -> jax.Array:
    """Segment ids [batch, seq] int32: the packed example (0 unpacked), PAD_SEGMENT on padding.

    input_mask, packing_ids: [batch, seq] or None; shape: (batch, seq).
    """
    segments = (jnp.zeros(shape, jnp.int32) if packing_ids is None
                else packing_ids.astype(jnp.int32))
    if input_mask is not None:
        segments = jnp.where(input_mask.astype(bool), segments, PAD_SEGMENT)
    return segments


@contextlib.contextmanager
def _interpret(on: bool):
    """Run every pallas_call traced inside in the Pallas interpreter (plain HLO) or not.

    The shipped kernels take no `interpret` argument; this is the switch `pallas_call`
    reads at trace time (jax 0.10.2's `jax._src.config`; the public `force_tpu_interpret_mode`
    sets the same switch to its TPU simulator, which runs through host callbacks).
    """
    flag = jax_config.pallas_tpu_interpret_mode_context_manager
    previous = flag.swap_local(True if on else None)
    try:
        yield
    finally:
        flag.set_local(previous)


def block_sizes(seq_len: int) -> tpu_flash.BlockSizes:
    """The kernels' blocks for a padded sequence (a multiple of BLOCK): the shipped default."""
    return tpu_flash.BlockSizes.get_default(None, None, seq_len, seq_len, None)


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the kernels' costs depend on. seq: padded to a multiple of BLOCK."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    itemsize: int  # bytes of one q/k/v/o element

    @property
    def qkv_bytes(self) -> int:
        """One [batch, heads, seq, head_dim] array."""
        return self.batch * self.heads * self.seq * self.head_dim * self.itemsize

    @property
    def lane_bytes(self) -> int:
        """One float32 [batch, heads, seq, 128] array (l, m, di broadcast to the lanes)."""
        return self.batch * self.heads * self.seq * LANES * 4

    def segment_bytes(self, q_blocks: int, k_blocks: int) -> int:
        """The segment ids as the kernels read them: q ids as [batch, seq, 128] int32, kv ids
        as [batch, 8, seq]; a block is fetched again whenever its index changes between grid
        steps (grid batch, heads, outer, inner), so once per batch row when there is one
        block, else once per head (q) and per head and outer block (kv)."""
        q = self.batch * self.seq * LANES * 4 * (1 if q_blocks == 1 else self.heads)
        kv = self.batch * SUBLANES * self.seq * 4 * (1 if k_blocks == 1 else self.heads * q_blocks)
        return q + kv


def forward_cost(shape: Shape, blocks: tpu_flash.BlockSizes) -> pl.CostEstimate:
    """HBM bytes and FLOPs of the forward kernel (with the l, m residuals), non-causal grid.

    FLOPs: q·kᵀ and p·v, 4·B·H·S²·D, plus 4 elementwise FLOPs per score (what the shipped
    estimate, XLA's count of its reference softmax, gives), one exp per score. As the shipped
    estimate, causal masking is not discounted (the kernels skip whole blocks above the
    diagonal only, none at one block). Bytes: q, o, l,
    m once; k and v once per query block when the keys span several blocks (the block index
    changes every step), once when they fit one; the segment ids as `Shape.segment_bytes`.
    """
    s = shape
    q_blocks, k_blocks = s.seq // blocks.block_q, s.seq // blocks.block_k_major
    scores = s.batch * s.heads * s.seq * s.seq
    kv_reads = 1 if k_blocks == 1 else q_blocks
    bytes_ = (2 * s.qkv_bytes + 2 * kv_reads * s.qkv_bytes + 2 * s.lane_bytes
              + s.segment_bytes(q_blocks, k_blocks))
    return pl.CostEstimate(flops=4 * scores * s.head_dim + FORWARD_ELEMENTWISE * scores,
                           transcendentals=scores, bytes_accessed=bytes_)


FORWARD_ELEMENTWISE = 4


def backward_costs(shape: Shape, blocks: tpu_flash.BlockSizes
                   ) -> tuple[pl.CostEstimate, pl.CostEstimate]:
    """(dk/dv kernel, dq kernel) HBM bytes and FLOPs, non-causal grid.

    dk/dv recomputes q·kᵀ, then pᵀ·do, do·vᵀ, dsᵀ·q: 8·B·H·S²·D; dq recomputes q·kᵀ and do·vᵀ,
    then ds·k: 6·B·H·S²·D; each one exp per score and ~6 elementwise FLOPs per score
    (scale, subtract, normalise, subtract di, multiply, mask). Bytes: the dk/dv grid keeps
    its k, v, dk, dv block and streams q, do, l, m, di per key block (once when one block
    covers the keys); the dq grid the converse.
    """
    s = shape
    scores = s.batch * s.heads * s.seq * s.seq
    q_blocks_dkv = s.seq // blocks.block_q_major_dkv
    k_blocks_dkv = s.seq // blocks.block_k_major_dkv
    # Streamed per key block: q, do (q-shaped) and l, m, di (lane-shaped).
    q_side = 2 * s.qkv_bytes + 3 * s.lane_bytes
    streamed = 1 if q_blocks_dkv == 1 else k_blocks_dkv
    dkv = pl.CostEstimate(
        flops=8 * scores * s.head_dim + BACKWARD_ELEMENTWISE * scores,
        transcendentals=scores,
        bytes_accessed=(4 * s.qkv_bytes + streamed * q_side
                        + s.segment_bytes(k_blocks_dkv, q_blocks_dkv)))
    q_blocks_dq = s.seq // blocks.block_q_dq
    k_blocks_dq = s.seq // blocks.block_k_major_dq
    kv_reads = 1 if k_blocks_dq == 1 else q_blocks_dq
    dq = pl.CostEstimate(
        flops=6 * scores * s.head_dim + BACKWARD_ELEMENTWISE * scores,
        transcendentals=scores,
        bytes_accessed=(q_side + s.qkv_bytes + 2 * kv_reads * s.qkv_bytes
                        + s.segment_bytes(q_blocks_dq, k_blocks_dq)))
    return dkv, dq


BACKWARD_ELEMENTWISE = 6


def _with_costs(fn, costs: dict[str, pl.CostEstimate]):
    """fn with each pallas_call given the estimate of `costs` whose key its kernel's name
    contains (the traced jaxpr's equation parameters rewritten): the shipped backward kernels
    have none, and the forward's counts k and v once however many query blocks read them."""

    def run(*args):
        closed = jax.make_jaxpr(fn)(*args)
        eqns = []
        for eqn in closed.jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                name = eqn.params["jaxpr"].debug_info.func_name
                match = [cost for key, cost in costs.items() if key in name]
                if len(match) != 1:
                    raise RuntimeError(f"no cost estimate for the Pallas kernel {name}")
                eqn = eqn.replace(params={**eqn.params, "cost_estimate": match[0]})
            eqns.append(eqn)
        return jax.core.eval_jaxpr(closed.jaxpr.replace(eqns=eqns), closed.consts, *args)

    return run


def _on_platform(fn, *args):
    """fn(*args) as the Mosaic kernels when lowered for a TPU, interpreted elsewhere."""

    def branch(interpret):
        def call(*a):
            with _interpret(interpret):
                return fn(*a)
        return call

    return jax.lax.platform_dependent(*args, tpu=branch(False), default=branch(True))


def _forward(q, k, v, segments, causal, scale):
    """Per-shard forward: (out [b, h, s, d], l, m [b, h, s] float32 softmax residuals)."""
    blocks = block_sizes(q.shape[2])

    def forward(q, k, v, segments):
        ids = tpu_flash.SegmentIds(segments, segments)
        return tpu_flash._flash_attention_impl(
            q, k, v, None, ids, True, causal, scale, blocks.block_b, blocks.block_q,
            blocks.block_k_major, blocks.block_k, False)

    cost = forward_cost(Shape(*q.shape, q.dtype.itemsize), blocks)
    costed = _with_costs(forward, {"_flash_attention_kernel": cost})
    return tuple(_on_platform(costed, q, k, v, segments))


def _backward(q, k, v, segments, out, l, m, d_out, causal, scale):
    """Per-shard backward: (dq, dk, dv), each [b, h, s, d]."""
    blocks = block_sizes(q.shape[2])
    dkv_cost, dq_cost = backward_costs(Shape(*q.shape, q.dtype.itemsize), blocks)

    def backward(q, k, v, segments, out, l, m, d_out):
        ids = tpu_flash.SegmentIds(segments, segments)
        dq, dk, dv, _, _ = tpu_flash._flash_attention_bwd(
            False, causal, scale, blocks, False, (q, k, v, None, ids, out, l, m), d_out)
        return dq, dk, dv

    costed = _with_costs(backward, {"dkv_kernel": dkv_cost, "dq_kernel": dq_cost})
    return tuple(_on_platform(costed, q, k, v, segments, out, l, m, d_out))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, segments, causal, scale):
    return _forward(q, k, v, segments, causal, scale)[0]


def _flash_fwd(q, k, v, segments, causal, scale):
    out, l, m = _forward(q, k, v, segments, causal, scale)
    return out, (q, k, v, segments, out, l, m)


def _flash_bwd(causal, scale, residuals, d_out):
    dq, dk, dv = _backward(*residuals, d_out, causal, scale)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    segments: jax.Array,
    causal: bool = False,
) -> jax.Array:
    """Attention through the Pallas kernels. query/key/value: [batch, seq, heads, head_dim]
    → same shape; segments: [batch, seq] int (`segment_ids`), tokens attend within theirs.
    Scaled by 1/sqrt(head_dim)."""
    scale = float(query.shape[-1]) ** -0.5

    def attend(q, k, v, segments, shard):
        del shard
        return _flash(q, k, v, segments, causal, scale)

    return run_padded(attend, query, key, value, segments)


def run_padded(attend, query, key, value, segments, *extra):
    """attend(q, k, v, segments, shard, *extra) → out, on [batch, heads, padded, head_dim]
    (the kernels' layout, the sequence padded to a multiple of BLOCK with PAD_SEGMENT tokens,
    dropped again from the output), per batch shard under `sharded_like` (shard: the shard's
    int32 index, 0 unsharded); query/key/value and the result [batch, seq, heads, head_dim]."""
    _, seq, _, _ = query.shape
    padded = -(-seq // BLOCK) * BLOCK

    def to_kernel(x):  # [batch, seq, heads, head_dim] → [batch, heads, padded, head_dim]
        x = jnp.swapaxes(x, 1, 2)
        return jnp.pad(x, ((0, 0), (0, 0), (0, padded - seq), (0, 0)))

    segments = jnp.pad(segments.astype(jnp.int32), ((0, 0), (0, padded - seq)),
                       constant_values=PAD_SEGMENT)

    def run(q, k, v, segments, *extra):
        return attend(q, k, v, segments, jnp.int32(0), *extra)

    sharding = _BATCH_SHARDING.get()
    if sharding is not None and sharding.mesh.size > 1:
        batch_axes = tuple(sharding.spec)[0] if len(sharding.spec) else None
        rows, tokens = PartitionSpec(batch_axes), PartitionSpec(batch_axes, None)

        def per_shard(q, k, v, segments, *extra):
            shard = jnp.int32(0) if batch_axes is None else jax.lax.axis_index(batch_axes)
            return attend(q, k, v, segments, shard, *extra)

        run = jax.shard_map(per_shard, mesh=sharding.mesh,
                            in_specs=(rows, rows, rows, tokens) + (PartitionSpec(),) * len(extra),
                            out_specs=rows, check_vma=False)
    out = run(to_kernel(query), to_kernel(key), to_kernel(value), segments, *extra)
    return jnp.swapaxes(out[:, :, :seq], 1, 2)

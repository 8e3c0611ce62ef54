"""Flash attention on the Pallas TPU kernels shipped with JAX (`model.attention_impl="flash"`).

The kernels (jax.experimental.pallas.ops.tpu.flash_attention, jax 0.10.2) take
[batch, heads, seq, head_dim] and mask with segment ids (a query attends to keys of its own
segment) and a causal flag. Padding and packing become segment ids: a real token's segment is
its packed example (0 without packing), a padding token's is `PAD_SEGMENT`, which no real
query shares; so a padding query attends to the padding keys only (at least to itself: no
row is ever fully masked, no NaN) and its output, never read by a real token, is harmless.
The sequence is padded to a multiple of 128 tokens the same way, and each kernel holds all
of it in one block (up to MAX_SEQ tokens).

Interpret or kernel is decided when the step is lowered, from the platform it is lowered for
(`lax.platform_dependent`): a TPU (also an ahead-of-time compile for a TPU topology on a CPU
host) gets the Mosaic kernels, anything else the Pallas interpreter (plain HLO). The shipped
backward kernels carry no `pl.CostEstimate` (XLA's cost model would count them as free):
all three kernels get the analytic estimates below (the forward's equals the shipped one).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax._src import config as jax_config
from jax.experimental import pallas as pl
from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash
from jax.sharding import NamedSharding, PartitionSpec

from bertjax.errors import ConfigError

TILE_LANES = 128  # a TPU vector register's lanes


def heads_per_tile(num_heads: int, head_dim: int) -> int:
    """Heads side by side in one tile of the flash kernel: as many as fill its 128 lanes (2
    for head_dim 64) and divide the heads."""
    return math.gcd(num_heads, max(1, TILE_LANES // head_dim))


MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # a masked score (finite: no NaN)
PAD_SEGMENT = -1  # packing ids and the 0 of unpacked input are >= 0
BLOCK = 128  # the kernels' smallest block along the sequence (and their lane width)
MAX_SEQ = 512  # one block holds the whole sequence (BERT's longest)
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


def _traced_device():
    """The first device of the step's mesh (`sharded_like`), None outside a step."""
    sharding = _BATCH_SHARDING.get()
    devices = getattr(getattr(sharding, "mesh", None), "devices", None)
    return devices.flat[0] if devices is not None and devices.size else None


def traced_device_kind() -> str:
    """The device kind ("TPU v5 lite", "cpu", ...) of the program being traced: the step's mesh
    (`sharded_like`), else this process's first device."""
    return (_traced_device() or jax.devices()[0]).device_kind


def traced_for_tpu() -> bool:
    """Whether the program being traced runs on TPUs: the step's mesh (`sharded_like`) is of
    TPU chips (also a slice compiled ahead of time on another machine), or, outside a step,
    this process's backend is a TPU."""
    device = _traced_device()
    return device.platform == "tpu" if device is not None else jax.default_backend() == "tpu"


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
    """One block over the whole (padded) sequence: BERT's sequences fit VMEM, nothing is
    fetched twice, and the forward's softmax needs no rescaling across blocks."""
    if seq_len > MAX_SEQ:
        raise ConfigError(f"model.attention_impl='flash' takes sequences of up to {MAX_SEQ} "
                          f"tokens (one block), got {seq_len}")
    # Except dq's key blocks: that kernel reads di broadcast to its key block's width, which
    # at one block would be a float32 [seq, seq] array per head.
    return tpu_flash.BlockSizes(
        block_q=seq_len, block_k_major=seq_len, block_k=seq_len, block_b=1,
        block_q_major_dkv=seq_len, block_k_major_dkv=seq_len, block_k_dkv=seq_len,
        block_q_dkv=seq_len, block_k_major_dq=BLOCK, block_k_dq=BLOCK, block_q_dq=seq_len)


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the kernels' costs depend on. seq: padded to a multiple of BLOCK."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    itemsize: int  # bytes of one q/k/v/o element

    @property
    def scores(self) -> int:
        return self.batch * self.heads * self.seq * self.seq

    @property
    def qkv_bytes(self) -> int:
        """One [batch, heads, seq, head_dim] array."""
        return self.batch * self.heads * self.seq * self.head_dim * self.itemsize

    @property
    def vector_bytes(self) -> int:
        """One float32 [batch, heads, seq] array (a per-query scalar)."""
        return self.batch * self.heads * self.seq * 4

    @property
    def lane_bytes(self) -> int:
        """One float32 [batch, heads, seq, 128] array (l, m, di broadcast to the lanes)."""
        return self.batch * self.heads * self.seq * LANES * 4

    def segment_bytes(self, key_ids_per_head: bool = False) -> int:
        """The segment ids as the kernels read them, query ids [batch, seq, 128] and key ids
        [batch, 8, seq] int32: a block is fetched again only when its index changes between
        grid steps, so once per batch row, the heads stepping inside, but the key ids once
        per head where a kernel walks several key blocks (dq's)."""
        key_ids = self.batch * SUBLANES * self.seq * 4
        return (self.batch * self.seq * LANES * 4
                + key_ids * (self.heads if key_ids_per_head else 1))


# Elementwise FLOPs per score besides the matmuls and the exp: the forward's is what the
# shipped estimate (XLA's count of its reference softmax) gives; the backward's are scale,
# subtract, normalise, subtract di, multiply, mask.
FORWARD_ELEMENTWISE = 4
BACKWARD_ELEMENTWISE = 6


def forward_cost(shape: Shape) -> pl.CostEstimate:
    """The forward kernel (with its l, m residuals): reads q, k, v and the segment ids, writes
    o, l, m ([seq, 128] float32 each); q·kᵀ and p·v are 4·B·H·S²·D FLOPs, one exp per score.
    Causal masking is not discounted (with one block the kernel computes every score)."""
    s = shape
    return pl.CostEstimate(
        flops=4 * s.scores * s.head_dim + FORWARD_ELEMENTWISE * s.scores,
        transcendentals=s.scores,
        bytes_accessed=4 * s.qkv_bytes + 2 * s.lane_bytes + s.segment_bytes())


def backward_costs(shape: Shape) -> tuple[pl.CostEstimate, pl.CostEstimate]:
    """(dk/dv kernel, dq kernel). Both read q, k, v, do, l, m, di and the segment ids; dk/dv
    recomputes q·kᵀ, then pᵀ·do, do·vᵀ, dsᵀ·q (8·B·H·S²·D FLOPs) and writes dk, dv; dq
    recomputes q·kᵀ and do·vᵀ, then ds·k (6·B·H·S²·D) and writes dq. One exp per score each."""
    s = shape
    reads = 4 * s.qkv_bytes + 3 * s.lane_bytes

    def cost(matmuls, writes, key_ids_per_head):
        return pl.CostEstimate(
            flops=2 * matmuls * s.scores * s.head_dim + BACKWARD_ELEMENTWISE * s.scores,
            transcendentals=s.scores,
            bytes_accessed=reads + writes * s.qkv_bytes + s.segment_bytes(key_ids_per_head))

    return cost(4, 2, False), cost(3, 1, s.seq > BLOCK)


def _with_costs(fn, costs: dict[str, pl.CostEstimate]):
    """fn with each pallas_call given the estimate of `costs` whose key its kernel's name
    contains (the traced jaxpr's equation parameters rewritten): the shipped backward kernels
    have none."""

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
    """Per-shard forward: (out [b, h, s, d], total, peak [b, h, s] float32: the softmax's
    row sums and maxima, the kernels' l and m)."""
    blocks = block_sizes(q.shape[2])

    def forward(q, k, v, segments):
        ids = tpu_flash.SegmentIds(segments, segments)
        return tpu_flash._flash_attention_impl(
            q, k, v, None, ids, True, causal, scale, blocks.block_b, blocks.block_q,
            blocks.block_k_major, blocks.block_k, False)

    cost = forward_cost(Shape(*q.shape, q.dtype.itemsize))
    costed = _with_costs(forward, {"_flash_attention_kernel": cost})
    return tuple(_on_platform(costed, q, k, v, segments))


def _backward(q, k, v, segments, out, total, peak, d_out, causal, scale):
    """Per-shard backward: (dq, dk, dv), each [b, h, s, d]."""
    blocks = block_sizes(q.shape[2])
    dkv_cost, dq_cost = backward_costs(Shape(*q.shape, q.dtype.itemsize))

    def backward(q, k, v, segments, out, total, peak, d_out):
        ids = tpu_flash.SegmentIds(segments, segments)
        dq, dk, dv, _, _ = tpu_flash._flash_attention_bwd(
            False, causal, scale, blocks, False, (q, k, v, None, ids, out, total, peak), d_out)
        return dq, dk, dv

    costed = _with_costs(backward, {"dkv_kernel": dkv_cost, "dq_kernel": dq_cost})
    return tuple(_on_platform(costed, q, k, v, segments, out, total, peak, d_out))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, segments, causal, scale):
    return _forward(q, k, v, segments, causal, scale)[0]


def _flash_fwd(q, k, v, segments, causal, scale):
    out, total, peak = _forward(q, k, v, segments, causal, scale)
    return out, (q, k, v, segments, out, total, peak)


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

    def attend(tokens, segments, shard):
        del shard
        return _flash(*tokens, segments, causal, scale)

    return run_padded(attend, (query, key, value), segments)


def _batch_axes(sharding: NamedSharding):
    """The mesh axes the batch is split over here: by the logical-axis rules in force where
    they are set (inside a vmap over the `data` axis, as the bfloat16 gradient reduction runs
    its replicas, they no longer name it, and the vmap adds it), else by `sharding`."""
    rules = nn.get_logical_axis_rules()
    spec = nn.logical_to_mesh_axes(("batch",), rules) if rules else sharding.spec
    return tuple(spec)[0] if len(spec) else None


def run_padded(attend, tokens: tuple, segments, *extra):
    """attend(tokens, segments, shard, *extra) → out, on the kernels' layout with the sequence
    padded to a multiple of BLOCK with PAD_SEGMENT tokens (dropped again from the output), per
    batch shard under `sharded_like` (shard: the shard's int32 index, 0 unsharded).

    tokens: arrays [batch, seq, ...] (q, k, v and the like), padded and split that way: a
    [batch, seq, heads, head_dim] one is given to the kernels as [batch, heads, padded,
    head_dim], a [batch, seq, features] one as it is (padded). The result is laid out as the
    first. extra: given whole to every shard."""
    seq = tokens[0].shape[1]
    padded = -(-seq // BLOCK) * BLOCK

    def to_kernel(x):
        if x.ndim == 3:
            return jnp.pad(x, ((0, 0), (0, padded - seq), (0, 0)))
        x = jnp.swapaxes(x, 1, 2)  # [batch, heads, seq, head_dim]
        return jnp.pad(x, ((0, 0), (0, 0), (0, padded - seq), (0, 0)))

    def from_kernel(out):
        return out[:, :seq] if tokens[0].ndim == 3 else jnp.swapaxes(out[:, :, :seq], 1, 2)

    segments = jnp.pad(segments.astype(jnp.int32), ((0, 0), (0, padded - seq)),
                       constant_values=PAD_SEGMENT)

    def run(tokens, segments, *rest):
        return attend(tokens, segments, jnp.int32(0), *rest)

    sharding = _BATCH_SHARDING.get()
    if sharding is not None and sharding.mesh.size > 1:
        batch_axes = _batch_axes(sharding)
        rows = PartitionSpec(batch_axes)

        def per_shard(tokens, segments, *rest):
            shard = jnp.int32(0) if batch_axes is None else jax.lax.axis_index(batch_axes)
            return attend(tokens, segments, shard, *rest)

        run = jax.shard_map(per_shard, mesh=sharding.mesh,
                            in_specs=((rows,) * len(tokens), PartitionSpec(batch_axes, None))
                            + (PartitionSpec(),) * len(extra),
                            out_specs=rows, check_vma=False)
    return from_kernel(run(tuple(map(to_kernel, tokens)), segments, *extra))

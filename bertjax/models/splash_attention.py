"""Splash attention: ModernBERT's attention on JAX's Pallas TPU splash kernel
(`model.attention_impl="splash"`, jax.experimental.pallas.ops.tpu.splash_attention, jax 0.10.2).

Why: at 8,192 tokens a local layer needs |q - k| <= r (r = 64: 129 keys), yet a dense or flash
kernel computes every [query block, key block] pair. Splash is driven by a static mask,
turned once in NumPy into per-block MaskInfo (`block_mask`: 0 empty / 1 partial / 2 full;
`data_next`: the key block to fetch next). Empty blocks are skipped, not computed and masked:
the grid is shrunk to the band's widest row (`data_next.shape[-1]` key steps per query block
instead of seq / block; dk/dv's the other way round), and a step left empty (the shorter rows
at the ends) computes nothing. So the window is the static `LocalMask(window_size=(r, r))`
(inclusive, as `modern.local_window`); a global layer is a `FullMask`.

Documents and padding vary per row, so they are segment ids, as in `flash_attention`
(`segment_ids`: the document, `PAD_SEGMENT` on padding). The kernel applies segment ids only as
an elementwise mask inside the blocks it computes: it skips no block for them (a block wholly
across two documents, or wholly padding, is computed and masked). Block sparsity comes from the
window alone: local layers cost the band, global layers the whole square, packed or not.
A padding query attends to the padding keys (at least itself: no empty row, no NaN) where the
einsum path lets it attend to the real keys; no real token reads it (keys are masked alike on
both paths), so real tokens' outputs and all gradients through them are equal.

Shapes: query / key / value [batch, seq, heads, head_dim] → the same. Per batch shard
(`flash_attention.sharded_like`: XLA cannot partition a Mosaic kernel) the kernels take
[heads, padded, head_dim] per row, vmapped over the shard's rows (a "parallel" grid axis,
which megacore splits); the sequence is padded to a multiple of 128 with padding tokens
(`flash_attention.run_padded`). The kernel does not scale the scores: the queries are scaled
by 1/sqrt(head_dim) first (exactly, in bfloat16 too, for head_dim 64).

Blocks (`block_size`): 512 x 512 where the padded sequence allows (1,024 and 8,192 tokens),
else 256, else 128, in all three kernels. A grid step has a fixed cost (~0.35 µs) that a
128 x 128 x 64 step's matmuls (4 MFLOP) leave uncovered and a 512 x 512 step's (67 MFLOP)
roughly cover; its float32 [512, 512] scores (1 MiB) and double-buffered q / k / v blocks fit
VMEM. The price is a coarser band: with r = 64 a query block of 512 meets 3 key blocks, 46 of
256 at 8,192 tokens (18% of the dense work; blocks of 128 would compute 190 of 4,096, 4.6%).

Interpret or kernel is decided when lowering (`lax.platform_dependent`, as flash_attention): a
TPU, also an ahead-of-time compile for a TPU topology on a CPU host, gets the Mosaic kernels,
anything else the Pallas interpreter (plain HLO). The shipped kernels carry no
`pl.CostEstimate` (XLA would count them as free): all three get the estimates below, which
count the computed blocks only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash_kernel,
)

from bertjax.errors import ConfigError
from bertjax.models import flash_attention as flash

BLOCKS = (512, 256, 128)  # preferred first; all multiples of the kernels' 128 lanes


def block_size(seq: int) -> int:
    """The block (query and key, every kernel) for a sequence padded to a multiple of 128."""
    return next(block for block in BLOCKS if seq % block == 0)


def block_sizes(block: int) -> splash.BlockSizes:
    return splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        block_q_dq=block, block_kv_dq=block)


@functools.lru_cache(maxsize=32)
def kernel(heads: int, seq: int, radius: int | None,
           block: int) -> splash_kernel.SplashAttentionKernel:
    """The splash kernel for `heads` heads over a padded sequence of `seq`: its forward, dq and
    dk/dv MaskInfos (static, built in NumPy once per shape) and its mask function. radius: the
    local window's (inclusive, each side), None for a global layer."""
    shape = (seq, seq)
    mask = (splash.FullMask(shape) if radius is None
            else splash.LocalMask(shape, window_size=(radius, radius), offset=0))
    # Concrete arrays even when first asked for inside a trace: they are cached, and become
    # constants of every program that uses them (a cached tracer would leak).
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha(splash.MultiHeadMask([mask] * heads),
                                      block_sizes=block_sizes(block), head_shards=1,
                                      q_seq_shards=1)


def computed_blocks(info) -> int:
    """Blocks of one head that a kernel computes (the rest are skipped): the nonzero entries
    of its MaskInfo's block mask (one row for all heads: they share the mask)."""
    return int(np.count_nonzero(np.asarray(info.block_mask)[0]))


def forward_cost(shape: flash.Shape, computed: int, block: int) -> pl.CostEstimate:
    """The forward kernel (with its logsumexp residual). computed: scores computed over the
    batch and heads (computed blocks · block²). q·kᵀ and p·v are 4·D FLOPs per score, one exp
    each; it reads q and the query segment ids ([seq, 128] int32) once per head, a key and a
    value block and its key segment ids ([8, block]) per computed block, and writes o and the
    logsumexp ([seq, 128] float32)."""
    s = shape
    fetched = computed // block  # key rows fetched: `block` of them per computed block
    return pl.CostEstimate(
        flops=4 * computed * s.head_dim + flash.FORWARD_ELEMENTWISE * computed,
        transcendentals=computed,
        bytes_accessed=(2 * s.qkv_bytes + 2 * fetched * s.head_dim * s.itemsize
                        + 2 * s.lane_bytes + fetched * flash.SUBLANES * 4))


def backward_costs(shape: flash.Shape, computed: int,
                   block: int) -> tuple[pl.CostEstimate, pl.CostEstimate]:
    """(dk/dv kernel, dq kernel), over the computed blocks as `forward_cost`. dk/dv recomputes
    q·kᵀ, then pᵀ·do, do·vᵀ, dsᵀ·q (8·D FLOPs per score), reading k and v once and a q, do,
    logsumexp, di and query-id block per computed block, writing dk, dv; dq recomputes q·kᵀ and
    do·vᵀ, then ds·k (6·D), reading q, do, logsumexp and di once and a k, v and key-id block per
    computed block, writing dq. One exp per score each."""
    s = shape
    fetched = computed // block
    rows = 2 * fetched * s.head_dim * s.itemsize  # two [block, head_dim] operands per block
    ids = fetched * flash.SUBLANES * 4

    def cost(matmuls, bytes_accessed):
        return pl.CostEstimate(
            flops=2 * matmuls * computed * s.head_dim + flash.BACKWARD_ELEMENTWISE * computed,
            transcendentals=computed, bytes_accessed=bytes_accessed)

    # dk/dv reads logsumexp and di as [8, block] float32 blocks (broadcast to the sublanes).
    dkv = cost(4, 4 * s.qkv_bytes + rows + 2 * fetched * flash.SUBLANES * 4 + ids
               + s.lane_bytes)
    dq = cost(3, 2 * s.qkv_bytes + rows + 2 * s.vector_bytes + ids + s.lane_bytes)
    return dkv, dq


def _forward(q, k, v, segments, radius, block):
    """Per-shard forward on [b, h, s, d] (q scaled): (out [b, h, s, d], logsumexp [b, h, s]
    float32)."""
    attn = kernel(q.shape[1], q.shape[2], radius, block)

    def one_row(q, k, v, ids):
        out, (logsumexp,) = splash_kernel._splash_attention_forward(
            attn.fwd_mask_info, q, k, v, splash.SegmentIds(ids, ids), None,
            mask_value=flash.MASK_VALUE, is_mqa=False, block_sizes=attn.kwargs["block_sizes"],
            residual_checkpoint_name=None, save_residuals=True,
            mask_function=attn.kwargs["mask_function"])
        return out, logsumexp

    shape = flash.Shape(*q.shape, q.dtype.itemsize)
    computed = q.shape[0] * q.shape[1] * computed_blocks(attn.fwd_mask_info) * block * block
    costed = flash._with_costs(jax.vmap(one_row),
                               {"_fwd": forward_cost(shape, computed, block)})
    return tuple(flash._on_platform(costed, q, k, v, segments))


def _backward(q, k, v, segments, out, logsumexp, d_out, radius, block):
    """Per-shard backward: (dq, dk, dv), each [b, h, s, d] (dq for the scaled q)."""
    attn = kernel(q.shape[1], q.shape[2], radius, block)

    def one_row(q, k, v, ids, out, logsumexp, d_out):
        residuals = (q, k, v, splash.SegmentIds(ids, ids), None, out, logsumexp,
                     attn.dq_mask_info, attn.dkv_mask_info)
        grads = splash_kernel._splash_attention_bwd(
            False, flash.MASK_VALUE, False, attn.kwargs["block_sizes"], None,
            attn.kwargs["mask_function"], None, False, residuals, d_out)
        return grads[3:6]  # (mask infos, dq, dk, dv, segment ids, sinks)

    shape = flash.Shape(*q.shape, q.dtype.itemsize)
    heads_batch = q.shape[0] * q.shape[1]
    dkv_cost, _ = backward_costs(
        shape, heads_batch * computed_blocks(attn.dkv_mask_info) * block * block, block)
    _, dq_cost = backward_costs(
        shape, heads_batch * computed_blocks(attn.dq_mask_info) * block * block, block)
    costed = flash._with_costs(jax.vmap(one_row), {"_dkv": dkv_cost, "_dq": dq_cost})
    return tuple(flash._on_platform(costed, q, k, v, segments, out, logsumexp, d_out))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _splash(q, k, v, segments, radius, block):
    return _forward(q, k, v, segments, radius, block)[0]


def _splash_fwd(q, k, v, segments, radius, block):
    out, logsumexp = _forward(q, k, v, segments, radius, block)
    return out, (q, k, v, segments, out, logsumexp)


def _splash_bwd(radius, block, residuals, d_out):
    dq, dk, dv = _backward(*residuals, d_out, radius, block)
    return dq, dk, dv, None


_splash.defvjp(_splash_fwd, _splash_bwd)


def splash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    input_mask: jax.Array | None,
    packing_ids: jax.Array | None,
    radius: int | None,
) -> jax.Array:
    """Attention through the splash kernels, the values of `modern.einsum_attention` under
    `modern.attention_masks` on every real query (padding queries: see the module docstring).

    query/key/value: [batch, seq, heads, head_dim] → same shape. input_mask (1 real, 0 pad) /
    packing_ids: [batch, seq] int or None. radius: the local window's (|q - k| <= radius),
    None for a global layer. Scaled by 1/sqrt(head_dim).
    """
    if radius is not None and radius < 0:
        raise ConfigError(f"splash attention's window radius must be >= 0, got {radius}")
    batch, seq, _, head_dim = query.shape
    segments = flash.segment_ids(input_mask, packing_ids, (batch, seq))
    query = query * jnp.asarray(head_dim ** -0.5, query.dtype)

    def attend(q, k, v, segments, shard):
        del shard
        return _splash(q, k, v, segments, radius, block_size(q.shape[2]))

    return flash.run_padded(attend, query, key, value, segments)

"""The GPU kernels of `attention_impl="flash"`: attention with the paper's dropout inside the
kernel (Pallas on Triton; interpreted on a CPU, where the tests run them).

The same contract as the TPU kernels of dropout_attention.py, which dispatches here when it is
lowered for a GPU: q, k, v and o [batch, seq, heads·head_dim] (each token's heads side by
side), segment ids [batch, seq] (attend where they are equal), the log-sum-exp float32
[batch, heads, 1, seq], and the same keep mask, drawn from the same stateless hash of (seed,
batch row, head, query, key) with the key length the TPU kernels hash with. So a GPU and a TPU
step with one seed drop the same probabilities.

BERT's rows are at most 512 tokens: a program holds a block of queries against every key, so
the softmax needs no online rescaling. Triton's blocks are powers of two, so the sequence is
padded to one with padding segments. The backward runs two kernels, one per block of queries
(dq) and one per block of keys (dk, dv); both recompute the probabilities from the
log-sum-exp and the keep mask from the hash.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bertjax.models.kernels.dropout_hash import keep_bits, keep_probability, threshold
from bertjax.models.kernels.flash_attention import MASK_VALUE, PAD_SEGMENT

BLOCK = 64  # queries (keys, in the dk/dv kernel) per program


@dataclasses.dataclass(frozen=True)
class Static:
    """The kernels' compile-time settings."""

    causal: bool
    scale: float
    rate: float
    num_heads: int
    head_dim: int
    key_len: int  # the sequence length the keep hash takes (the TPU kernels')
    seq: int  # the padded length the kernels run on, a power of two
    num_warps: int = 4

    @property
    def block(self) -> int:
        return min(BLOCK, self.seq)


def _valid(static, query_ids, key_ids, query, key):
    """Where a query may attend a key: the same segment (and, causal, not a later key)."""
    valid = query_ids == key_ids
    if static.causal:
        valid &= query >= key
    return valid


def _keep(static, seed, query, key):
    """The keep mask at (query, key) index arrays of program (batch row, head), or None at
    rate 0."""
    if static.rate == 0:
        return None
    row, head = pl.program_id(0), pl.program_id(1)
    return keep_bits(seed, row, head, static.num_heads, query, key,
                     static.key_len) >= threshold(static.rate)


def _drop(keep, x):
    return x if keep is None else jnp.where(keep, x, 0.0)


def _dot(a, b, contract_a: int = 1, contract_b: int = 0):
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                           preferred_element_type=jnp.float32)


def _forward_gpu_kernel(seed_ref, q_ref, k_ref, v_ref, query_ids_ref, key_ids_ref, o_ref, lse_ref,
                    *, static):
    """Queries [block, D] of one (batch row, head) against every key [seq, D]."""
    start = pl.program_id(2) * static.block
    query = start + lax.broadcasted_iota(jnp.int32, (static.block, static.seq), 0)
    key = lax.broadcasted_iota(jnp.int32, (static.block, static.seq), 1)
    s = _dot(q_ref[...], k_ref[...], 1, 1) * static.scale  # [block, seq]
    valid = _valid(static, query_ids_ref[...][:, None], key_ids_ref[...][None, :], query, key)
    s = jnp.where(valid, s, MASK_VALUE)
    m = jnp.max(s, axis=1)
    p = jnp.exp(s - m[:, None])
    total = jnp.sum(p, axis=1)
    scale = 1.0 / (total * keep_probability(static.rate))  # as the TPU kernel: then dropped
    p = _drop(_keep(static, seed_ref[0], query, key), p * scale[:, None])
    o_ref[...] = _dot(p.astype(v_ref.dtype), v_ref[...]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(total)


def _probabilities(static, seed, q, k, lse, query, key, query_ids, key_ids):
    """The softmax (before dropout) of queries q against keys k from the forward's
    log-sum-exp, and the keep mask, both of the (query, key) index arrays' shape."""
    s = _dot(q, k, 1, 1) * static.scale
    s = jnp.where(_valid(static, query_ids, key_ids, query, key), s, MASK_VALUE)
    return jnp.exp(s - lse), _keep(static, seed, query, key)


def _dq_gpu_kernel(seed_ref, q_ref, k_ref, v_ref, query_ids_ref, key_ids_ref, lse_ref, di_ref,
               do_ref, dq_ref, *, static):
    """dq of a block of queries: Σ over every key of ds · k."""
    start = pl.program_id(2) * static.block
    query = start + lax.broadcasted_iota(jnp.int32, (static.block, static.seq), 0)
    key = lax.broadcasted_iota(jnp.int32, (static.block, static.seq), 1)
    p, keep = _probabilities(static, seed_ref[0], q_ref[...], k_ref[...], lse_ref[...][:, None],
                             query, key, query_ids_ref[...][:, None], key_ids_ref[...][None, :])
    dp = _drop(keep, _dot(do_ref[...], v_ref[...], 1, 1) / keep_probability(static.rate))
    ds = p * (dp - di_ref[...][:, None]) * static.scale
    dq_ref[...] = _dot(ds.astype(k_ref.dtype), k_ref[...]).astype(dq_ref.dtype)


def _dkv_gpu_kernel(seed_ref, q_ref, k_ref, v_ref, query_ids_ref, key_ids_ref, lse_ref, di_ref,
                do_ref, dk_ref, dv_ref, *, static):
    """dk and dv of a block of keys against every query, the scores transposed [keys,
    queries]."""
    start = pl.program_id(2) * static.block
    key = start + lax.broadcasted_iota(jnp.int32, (static.block, static.seq), 0)
    query = lax.broadcasted_iota(jnp.int32, (static.block, static.seq), 1)
    inverse = 1.0 / keep_probability(static.rate)
    p, keep = _probabilities(static, seed_ref[0], k_ref[...], q_ref[...],
                             lse_ref[...][None, :], query, key, query_ids_ref[...][None, :],
                             key_ids_ref[...][:, None])
    do = do_ref[...]
    dv_ref[...] = _dot(_drop(keep, p * inverse).astype(do.dtype), do).astype(dv_ref.dtype)
    dp = _drop(keep, _dot(v_ref[...], do, 1, 1) * inverse)
    ds = p * (dp - di_ref[...][None, :]) * static.scale
    dk_ref[...] = _dot(ds.astype(q_ref.dtype), q_ref[...]).astype(dk_ref.dtype)


def _specs(static):
    """BlockSpecs over a grid (batch row, head, block): a block of a [batch, seq, heads·D]
    array, all of its rows, a block / all of the segment ids, a block / all of a [batch, heads,
    seq] per-query vector; the seed whole."""
    d, n, block = static.head_dim, static.seq, static.block
    return dict(
        seed=pl.BlockSpec((1,), lambda b, h, i: (0,)),
        block=pl.BlockSpec((None, block, d), lambda b, h, i: (b, i, h)),
        rows=pl.BlockSpec((None, n, d), lambda b, h, i: (b, 0, h)),
        ids_block=pl.BlockSpec((None, block), lambda b, h, i: (b, i)),
        ids=pl.BlockSpec((None, n), lambda b, h, i: (b, 0)),
        vector_block=pl.BlockSpec((None, None, block), lambda b, h, i: (b, h, i)),
        vector=pl.BlockSpec((None, None, n), lambda b, h, i: (b, h, 0)))


def _call(kernel, static, interpret, in_specs, out_specs, out_shape, *args):
    batch = args[1].shape[0]
    return pl.pallas_call(
        functools.partial(kernel, static=static),
        grid=(batch, static.num_heads, static.seq // static.block),
        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=static.num_warps, num_stages=1),
        interpret=interpret)(*args)


def forward(static, interpret, seed, q, k, v, segments):
    """(o [batch, seq, heads·D], log-sum-exp [batch, heads, seq] float32) on the padded
    length static.seq."""
    s = _specs(static)
    batch = q.shape[0]
    return _call(_forward_gpu_kernel, static, interpret,
                 [s["seed"], s["block"], s["rows"], s["rows"], s["ids_block"], s["ids"]],
                 [s["block"], s["vector_block"]],
                 [jax.ShapeDtypeStruct(q.shape, q.dtype),
                  jax.ShapeDtypeStruct((batch, static.num_heads, static.seq), jnp.float32)],
                 seed, q, k, v, segments, segments)


def backward(static, interpret, seed, q, k, v, segments, lse, out, d_out):
    """(dq, dk, dv) on the padded length; di = Σ o·do per query and head, outside."""
    s = _specs(static)
    batch, seq, _ = q.shape
    heads = (batch, seq, static.num_heads, static.head_dim)
    di = jnp.sum(out.astype(jnp.float32).reshape(heads) * d_out.astype(jnp.float32)
                 .reshape(heads), axis=-1).transpose(0, 2, 1)  # [batch, heads, seq]
    common = (seed, q, k, v, segments, segments, lse, di, d_out)
    dq = _call(_dq_gpu_kernel, static, interpret,
               [s["seed"], s["block"], s["rows"], s["rows"], s["ids_block"], s["ids"],
                s["vector_block"], s["vector_block"], s["block"]],
               s["block"], jax.ShapeDtypeStruct(q.shape, q.dtype), *common)
    dk, dv = _call(_dkv_gpu_kernel, static, interpret,
                   [s["seed"], s["rows"], s["block"], s["block"], s["ids"], s["ids_block"],
                    s["vector"], s["vector"], s["rows"]],
                   [s["block"], s["block"]], [jax.ShapeDtypeStruct(q.shape, q.dtype)] * 2,
                   *common)
    return dq, dk, dv


def padded_static(seq: int, causal: bool, scale: float, rate: float, num_heads: int,
                  head_dim: int) -> Static:
    """The kernels' settings for sequences of `seq` tokens (the TPU kernels' padded length,
    which the keep hash takes): run on the next power of two."""
    return Static(causal, scale, rate, num_heads, head_dim, key_len=seq,
                  seq=max(16, 1 << (seq - 1).bit_length()))


def _pad(x, seq: int, value=0):
    return jnp.pad(x, ((0, 0), (0, seq - x.shape[1])) + ((0, 0),) * (x.ndim - 2),
                   constant_values=value)


def forward_padded(static, interpret, seed, q, k, v, segments):
    """`forward` on [batch, key_len, ...] inputs: padded to static.seq and cut back; the
    log-sum-exp as the TPU kernels give it, [batch, heads, 1, key_len]."""
    n = static.key_len
    q, k, v = (_pad(x, static.seq) for x in (q, k, v))
    out, lse = forward(static, interpret, seed, q, k, v,
                       _pad(segments, static.seq, PAD_SEGMENT))
    return out[:, :n], lse[:, :, None, :n]


def backward_padded(static, interpret, seed, q, k, v, segments, lse, out, d_out):
    """`backward` on [batch, key_len, ...] inputs (lse as forward_padded gives it)."""
    n = static.key_len
    q, k, v, out, d_out = (_pad(x, static.seq) for x in (q, k, v, out, d_out))
    lse = jnp.pad(lse[:, :, 0], ((0, 0), (0, 0), (0, static.seq - n)))
    grads = backward(static, interpret, seed, q, k, v, _pad(segments, static.seq, PAD_SEGMENT),
                     lse, out, d_out)
    return tuple(g[:, :n] for g in grads)

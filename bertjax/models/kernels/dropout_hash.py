"""The stateless dropout draws of the attention kernels (TPU and GPU) and of the hidden
dropout on TPU: murmur3 finalisers of a position keyed by (seed, batch row, head), so that a
kernel's forward and backward draw the same mask from iotas, nothing of it is stored, and
plain jnp (`keep_mask`) gives the same bits. 24-bit draws: the keep probability is
1 − round(rate·2²⁴)/2²⁴."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

BITS = 24  # draw width: the top 24 bits of each 32-bit hash


def _u32(value: int) -> jnp.ndarray:
    """A uint32 constant as the int32 with the same bits (the kernels compute in int32)."""
    return jnp.int32(value - (1 << 32) if value >= 1 << 31 else value)


def _mix(x):
    """murmur3's 32-bit finaliser on int32 bit patterns (wrapping multiplies, logical shifts)."""
    x = x ^ lax.shift_right_logical(x, jnp.int32(16))
    x = x * _u32(0x85EBCA6B)
    x = x ^ lax.shift_right_logical(x, jnp.int32(13))
    x = x * _u32(0xC2B2AE35)
    return x ^ lax.shift_right_logical(x, jnp.int32(16))


def position_hash(seed, row, position):
    """int32 hash bits of `position` keyed by (`row`, `seed`) (int32 arrays that broadcast):
    two murmur3 finalisers, one of the salted row, one of the position mixed with it. The
    hidden dropout's draws on TPU (layers.hashed_words)."""
    return _mix(position ^ _mix(row * _u32(0x9E3779B9) + seed))


def keep_bits(seed, row, head, num_heads: int, query, key, key_len: int):
    """Keep-decision draws int32 in [0, 2²⁴) for one (batch row, head): one murmur3 finaliser
    of the position query·key_len + key (query, key: int32 index arrays of one shape) XORed
    with a salt of (row, head, seed). The salt is a scalar per grid step, so a score costs one
    finaliser (three were a third of the kernels' scheduled cycles). Used in the kernels and
    outside."""
    salt = _mix(_mix(row * num_heads + head + _u32(0x9E3779B9)) ^ seed)
    return lax.shift_right_logical(_mix((query * key_len + key) ^ salt), jnp.int32(32 - BITS))


def threshold(rate: float) -> int:
    """Draws below this are dropped."""
    return round(rate * (1 << BITS))


def keep_probability(rate: float) -> float:
    return 1.0 - threshold(rate) / (1 << BITS)


def keep_mask(seed, shape: tuple[int, int, int, int], rate: float) -> jax.Array:
    """The kernels' keep mask [batch, heads, q, k] bool, computed with plain jnp."""
    batch, heads, q_len, k_len = shape

    def one(row, head):
        query = lax.broadcasted_iota(jnp.int32, (q_len, k_len), 0)
        key = lax.broadcasted_iota(jnp.int32, (q_len, k_len), 1)
        return keep_bits(seed, row, head, heads, query, key, k_len) >= threshold(rate)

    rows = jnp.arange(batch, dtype=jnp.int32)
    return jax.vmap(jax.vmap(one, (None, 0)), (0, None))(rows, jnp.arange(heads, dtype=jnp.int32))

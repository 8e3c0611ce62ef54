"""The layers every encoder uses: dropout from 16-bit draws (`Dropout`), rematerialisation
(`maybe_remat`), row reshapes and gathers, the pooled vector of a sequence (`pool`) and rotary
position embeddings (`rope_tables`, `apply_rope`)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bertjax.errors import ConfigError
from bertjax.models.kernels import dropout_hash

Array = jax.Array

REMAT_POLICIES = ("none", "full", "dots")


def sequence_rows(x: Array | None) -> Array | None:
    """[batch, k, seq] → [batch * k, seq]: each of a row's k sequences (multiple-choice
    endings, an embedding row's texts) encoded as its own sequence."""
    return None if x is None else x.reshape(-1, x.shape[-1])


def gather_positions(sequence: Array, positions: Array) -> Array:
    """sequence: [batch, seq, hidden], positions: [batch, n] → [batch, n, hidden].

    A one-hot matmul rather than a gather: it partitions cleanly under every mesh (XLA's SPMD
    partitioner mis-compiled the backward pass of gather + tied projection on a 2x2x2
    data/fsdp/tensor mesh), and it costs 2·n·seq·hidden FLOPs per sequence, < 0.1% of a step.
    HIGHEST precision keeps the selection exact where f32 matmuls default to bf16 passes (TPU).
    """
    one_hot = jax.nn.one_hot(positions, sequence.shape[1], dtype=sequence.dtype)
    return jnp.einsum("bns,bsh->bnh", one_hot, sequence, precision=jax.lax.Precision.HIGHEST)


POOLINGS = ("cls", "mean")  # transformers' ModernBERT classifier_pooling


def pool(hidden: Array, input_mask: Array | None, mode: str) -> Array:
    """hidden [batch, seq, hidden], input_mask [batch, seq] (1 = real token) → [batch, hidden]:
    "cls" the first token (the rows are right-padded, where transformers' first real token is
    the first), "mean" the mean over the real tokens (a row without one, a filler row, gives
    zeros instead of transformers' 0 / 0)."""
    if mode == "cls":
        return hidden[:, 0]
    if mode != "mean":
        raise ConfigError(f"config.task.classifier_pooling={mode!r} is not one of "
                          f"{' | '.join(POOLINGS)}")
    mask = (jnp.ones(hidden.shape[:2], hidden.dtype) if input_mask is None
            else input_mask.astype(hidden.dtype))[..., None]
    return jnp.sum(hidden * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1)


def pool_packed(hidden: Array, packing_ids: Array, example_starts: Array, mode: str) -> Array:
    """The pooled vector of each example of packed rows: hidden [rows, seq, hidden],
    packing_ids [rows, seq] (slot s's example has id s + 1, padding 0), example_starts
    [rows, slots] (each example's first position) → [rows, slots, hidden]: "cls" each example's
    first token, "mean" the mean over its tokens (an empty slot gives zeros), what `pool` gives
    the example alone in a row."""
    if mode == "cls":
        return jnp.take_along_axis(hidden, example_starts[..., None], axis=1)
    if mode != "mean":
        raise ConfigError(f"config.task.classifier_pooling={mode!r} is not one of "
                          f"{' | '.join(POOLINGS)}")
    slots = jnp.arange(1, example_starts.shape[1] + 1)
    member = (packing_ids[:, None, :] == slots[None, :, None]).astype(hidden.dtype)
    total = jnp.einsum("rks,rsh->rkh", member, hidden)  # [rows, slots, hidden]
    return total / jnp.maximum(jnp.sum(member, axis=-1), 1)[..., None]


def dropout_keep_mask(rng: Array, shape: tuple[int, ...], rate: float) -> tuple[Array, float]:
    """(keep mask of `shape`, its keep probability) for dropout at `rate`, from 16-bit draws.

    On CPU each 32-bit threefry output yields two draws, its halves side by side
    (`interleaved_halves`: half the PRNG work of `nn.Dropout`). Where the step is compiled for
    a TPU each element's draw is the top half of a counter hash of its position
    (`hashed_words`): elementwise from iotas, so it is computed inside the fusion that applies
    the mask, where threefry's twenty rounds were the costliest vector work of a layer
    (docs/tpu_aot.md, "Levers"). The drop rate is rounded to a multiple of 2^-16 (0.1 →
    0.100006). An odd last axis takes 32-bit threefry draws and the exact rate.
    """
    if shape[-1] % 2:
        return jax.random.bernoulli(rng, 1.0 - rate, shape), 1.0 - rate
    threshold = round(rate * 65536)
    words = shape[:-1] + (shape[-1] // 2,)
    draws = jax.lax.platform_dependent(
        rng, cpu=lambda key: interleaved_halves(jax.random.bits(key, words, jnp.uint32)),
        default=lambda key: (hashed_words(key, shape) >> 16).astype(jnp.uint16))
    return draws >= threshold, 1.0 - threshold / 65536


def hashed_words(rng: Array, shape: tuple[int, ...]) -> Array:
    """uint32 draws of `shape`: `dropout_hash.position_hash` of each element's position
    within its leading-axis row, keyed by the row and a 32-bit seed drawn from `rng`."""
    seed = jax.lax.bitcast_convert_type(jax.random.bits(rng, (), jnp.uint32), jnp.int32)
    grid = shape if len(shape) > 1 else (1, *shape)
    row = jax.lax.broadcasted_iota(jnp.int32, grid, 0)
    position = jnp.zeros(grid, jnp.int32)
    for axis in range(1, len(grid)):
        position = position * grid[axis] + jax.lax.broadcasted_iota(jnp.int32, grid, axis)
    bits = dropout_hash.position_hash(seed, row, position)
    return jax.lax.bitcast_convert_type(bits, jnp.uint32).reshape(shape)


def interleaved_halves(words: Array) -> Array:
    """uint32 [..., n] → uint16 [..., 2n], each word's halves side by side: a free bitcast on
    CPU."""
    return jax.lax.bitcast_convert_type(words, jnp.uint16).reshape(*words.shape[:-1], -1)


_SQRT_HALF = float(np.sqrt(0.5))
_INV_SQRT_2PI = float(1.0 / np.sqrt(2.0 * np.pi))


@jax.custom_vjp
def gelu(x: Array) -> Array:
    """The exact (erf) GELU, x · Φ(x), evaluated in float32 (or x's wider dtype) and returned
    in x's dtype; its gradient Φ(x) + x · φ(x) is recomputed from x alone. Autodiff of
    `jax.nn.gelu` keeps a float32 copy of the [tokens, intermediate] activation for the
    backward pass (twice the bytes of a bfloat16 x, written and read once per layer)."""
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return (0.5 * x32 * (1.0 + jax.lax.erf(x32 * _SQRT_HALF))).astype(x.dtype)


def _gelu_fwd(x: Array) -> tuple[Array, Array]:
    return gelu(x), x


def _gelu_bwd(x: Array, g: Array) -> tuple[Array]:
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    cdf = 0.5 * (1.0 + jax.lax.erf(x32 * _SQRT_HALF))
    pdf = jnp.exp(-0.5 * x32 * x32) * _INV_SQRT_2PI
    return ((g.astype(x32.dtype) * (cdf + x32 * pdf)).astype(x.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


class Dropout(nn.Module):
    """Inverted dropout (kept values scaled by 1 / keep probability) with `dropout_keep_mask`."""

    rate: float

    def keep_mask(self, shape: tuple[int, ...]) -> tuple[Array, float]:
        """(keep mask of `shape`, keep probability) from this module's dropout stream: what
        `__call__` applies, for callers that scale elsewhere (einsum_attention)."""
        return dropout_keep_mask(self.make_rng("dropout"), shape, self.rate)

    @nn.compact
    def __call__(self, x: Array, deterministic: bool) -> Array:
        if deterministic or self.rate == 0.0:
            return x
        keep, keep_prob = self.keep_mask(x.shape)
        return jnp.where(keep, x / jnp.asarray(keep_prob, x.dtype), jnp.zeros_like(x))


def maybe_remat(module_cls, policy: str, scanned: bool = False,
                static_argnums: tuple[int, ...] = ()):
    """module_cls rematerialised under `policy` (REMAT_POLICIES), or as it is for "none"."""
    if policy == "none":
        return module_cls
    saveable = {
        "full": None,  # save nothing, recompute the whole layer in the backward pass
        # save matmul outputs; the bf16 dense layer is a custom VJP the dot policy cannot see
        "dots": jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            jax.checkpoint_policies.save_only_these_names("dense")),
    }[policy]
    # Inside scan, XLA cannot CSE across iterations, so prevent_cse is unnecessary there.
    return nn.remat(module_cls, policy=saveable, prevent_cse=not scanned,
                    static_argnums=static_argnums)


def rope_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies theta^(-2i / head_dim), computed in float64
    (a constant: it is folded into the compiled program)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    return (1.0 / theta ** exponents).astype(np.float32)


def rope_tables(positions: Array, heads: int, head_dim: int, theta: float
                ) -> tuple[Array, Array]:
    """positions [batch, seq] int → (cos, sin) [batch, seq, heads·head_dim] float32, laid out
    as the queries and keys (each token's heads side by side).

    transformers' layout within a head: the frequencies repeated as two halves, [f, f]
    (rotate_half), not interleaved pairs.
    """
    frequencies = rope_frequencies(head_dim, theta)
    frequencies = np.tile(np.concatenate([frequencies, frequencies]), heads)  # [heads·head_dim]
    angles = positions.astype(jnp.float32)[..., None] * frequencies
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Array, cos: Array, sin: Array, head_dim: int) -> Array:
    """x [batch, seq, heads·head_dim] (each token's heads side by side) rotated by (cos, sin)
    of that shape (`rope_tables`), in x's dtype as transformers does (cos and sin cast to it).

    rotate_half (each head's second half negated, then its first) is two lane rolls of half a
    head and a choice per lane, on the projection's own layout: a [.., heads, head_dim] view
    (64-lane rows on a TPU) would be copied to and fro."""
    half = head_dim // 2
    first = (jnp.arange(x.shape[-1]) % head_dim) < half
    rotated = jnp.where(first, -jnp.roll(x, -half, axis=-1), jnp.roll(x, half, axis=-1))
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)

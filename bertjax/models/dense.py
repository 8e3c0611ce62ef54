"""The dense layer, whose bf16/f16 matmuls accumulate in float32 forward and backward.

TPUs and GPUs accumulate bf16 matmuls in float32 anyway. Saying so explicitly
(`preferred_element_type=float32`, then a cast back) changes nothing there, but it is what lets
XLA:CPU run its bf16 kernels (AMX / AVX512-BF16) instead of upcasting both operands to float32.
JAX's own transpose of such a dot would feed a float32 cotangent into the backward matmuls and
lose that again, hence the custom VJP: both backward matmuls also take bf16 operands and
accumulate in float32, and the bias gradient is summed in float32 (XLA:CPU sums bf16 through a
slow tree reduction).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

_LOW_PRECISION = (jnp.bfloat16, jnp.float16)


def _dot(lhs, rhs, lhs_contract, rhs_contract, out_dtype):
    dims = ((tuple(lhs_contract), tuple(rhs_contract)), ((), ()))
    return lax.dot_general(lhs, rhs, dims, preferred_element_type=jnp.float32).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dense(x: jax.Array, kernel: jax.Array, bias: jax.Array | None,
           num_contract: int) -> jax.Array:
    """x: [*free, *contract], kernel: [*contract, *out], bias: [*out] or None → [*free, *out]."""
    y = _dot(x, kernel, range(x.ndim - num_contract, x.ndim), range(num_contract), jnp.float32)
    return (y if bias is None else y + bias.astype(jnp.float32)).astype(x.dtype)


def _dense_fwd(x, kernel, bias, num_contract):
    return _dense(x, kernel, bias, num_contract), (x, kernel, bias)


def _dense_bwd(num_contract, residuals, grad):
    x, kernel, bias = residuals
    grad = grad.astype(x.dtype)
    num_free = x.ndim - num_contract
    num_out = kernel.ndim - num_contract
    # d x [*free, *contract] = grad [*free, *out] · kernel [*contract, *out] over *out.
    grad_x = _dot(grad, kernel, range(num_free, num_free + num_out),
                  range(num_contract, kernel.ndim), x.dtype)
    # d kernel [*contract, *out] = x [*free, *contract] · grad [*free, *out] over *free.
    grad_kernel = _dot(x, grad, range(num_free), range(num_free), kernel.dtype)
    if bias is None:
        return grad_x, grad_kernel, None
    return grad_x, grad_kernel, bias_grad_by_sum(grad, num_free).astype(bias.dtype)


def bias_grad_by_sum(grad: jax.Array, num_free: int) -> jax.Array:
    """Σ of grad [*free, *out] over its free axes, in float32 → [*out]."""
    return jnp.sum(grad.astype(jnp.float32), axis=tuple(range(num_free)))


_dense.defvjp(_dense_fwd, _dense_bwd)


def dense(x: jax.Array, kernel: jax.Array, bias: jax.Array | None,
          num_contract: int = 1) -> jax.Array:
    """x [*free, *contract] · kernel [*contract, *out] + bias [*out] (None: no bias), all in
    x.dtype.

    bf16/f16: the float32-accumulating matmuls above; float32: plain `lax.dot_general`.
"""
    if x.dtype in _LOW_PRECISION:
        return checkpoint_name(_dense(x, kernel, bias, num_contract), "dense")
    dims = ((tuple(range(x.ndim - num_contract, x.ndim)), tuple(range(num_contract))), ((), ()))
    y = lax.dot_general(x, kernel, dims)
    return y if bias is None else y + bias


class Dense(nn.Module):
    """`nn.DenseGeneral` over the last `num_contract` axes: the same parameters (`kernel`
    [*in, *features] and `bias` [*features], initialised as flax does, through the flat
    [prod(in), prod(features)] matrix) and maths, with `dense` as the computation.

    kernel_axes / bias_axes: logical axis names of the parameters. flat: x's last axis holds
    the input axes flattened (`in_features`, or just that axis) and so does the result's
    features: the same parameters, applied as the [prod(in), prod(features)] matrix, so that
    [batch, seq, heads·head_dim] activations never take a [..., heads, head_dim] layout (on TPU
    a relayout copy when head_dim is below 128 lanes).
    """

    features: int | tuple[int, ...]
    kernel_axes: tuple[str | None, ...]
    bias_axes: tuple[str | None, ...]
    stddev: float = 0.02
    num_contract: int = 1
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    flat: bool = False
    in_features: tuple[int, ...] | None = None
    # The kernel's draw: truncated at 2 stddev (the stddev of the untruncated normal, so the
    # draws' own is 0.88x: the original reference's pre-training init), or a plain normal of
    # `stddev` (transformers' init of a new task head: tasks/ heads, models/heads.py).
    truncated: bool = True

    @nn.compact
    def weights(self, in_shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
        """(kernel [*in, *features], bias [*features]) in `dtype`, declared for inputs whose
        contracted axes are `in_shape` (a caller that fuses several layers' matmuls into one
        takes them from here)."""
        features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
        draw = (nn.initializers.truncated_normal(stddev=self.stddev) if self.truncated
                else nn.initializers.normal(stddev=self.stddev))

        def kernel_init(rng, shape, dtype):
            flat = draw(rng, (math.prod(in_shape), math.prod(features)), dtype)
            return flat.reshape(shape)

        kernel = self.param("kernel", nn.with_logical_partitioning(kernel_init, self.kernel_axes),
                            in_shape + features, self.param_dtype)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                                               self.bias_axes),
                          features, self.param_dtype)
        return jnp.asarray(kernel, self.dtype), jnp.asarray(bias, self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        in_shape = x.shape[x.ndim - self.num_contract:]
        if self.flat:
            in_shape = tuple(self.in_features or x.shape[-1:])
        kernel, bias = self.weights(in_shape)
        x = jnp.asarray(x, self.dtype)
        if self.flat:  # the flash kernels' layout: [batch, seq, heads·head_dim] in
            kernel = kernel.reshape(math.prod(in_shape), -1)
            return dense(x, kernel, bias.reshape(-1), 1)
        return dense(x, kernel, bias, self.num_contract)

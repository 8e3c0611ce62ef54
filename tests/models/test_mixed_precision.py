"""bf16 dense layers with float32 accumulation (bertjax.models.dense) and the 16-bit dropout."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.models import BertConfig, BertForPreTraining
from bertjax.models.dense import bias_grad_by_sum, dense
from bertjax.models.layers import Dropout, dropout_keep_mask, hashed_words

# (x shape, kernel shape, contracted axes): nn.Dense, a QKV projection, the attention output.
DENSE_CASES = [
    ((3, 5, 16), (16, 24), 1),
    ((3, 5, 16), (16, 4, 8), 1),
    ((3, 5, 4, 8), (4, 8, 16), 2),
]


def _bf16_values(key, shape):
    """Random values exactly representable in bf16, as float64 NumPy and as bf16."""
    x = jax.random.normal(key, shape).astype(jnp.bfloat16)
    return np.asarray(x, np.float64), x


@pytest.mark.slow
@pytest.mark.parametrize("x_shape,kernel_shape,n", DENSE_CASES)
def test_bf16_forward_and_gradients_equal_float64_of_the_bf16_operands(x_shape, kernel_shape, n):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    x64, x = _bf16_values(k1, x_shape)
    w64, w = _bf16_values(k2, kernel_shape)
    b64, b = _bf16_values(k4, kernel_shape[n:])
    free = len(x_shape) - n
    g64, g = _bf16_values(k3, x_shape[:free] + kernel_shape[n:])

    y, vjp = jax.vjp(lambda a, k, c: dense(a, k, c, n), x, w, b)
    dx, dw, db = vjp(g)
    assert y.dtype == dx.dtype == dw.dtype == db.dtype == jnp.bfloat16

    y64 = np.tensordot(x64, w64, (list(range(free, x64.ndim)), list(range(n)))) + b64
    dx64 = np.tensordot(g64, w64, (list(range(free, g64.ndim)), list(range(n, w64.ndim))))
    dw64 = np.tensordot(x64, g64, (list(range(free)), list(range(free))))
    db64 = g64.sum(axis=tuple(range(free)))
    # float32 accumulation, then one rounding to bf16: within a bf16 ulp of the exact result.
    for got, want in ((y, y64), (dx, dx64), (dw, dw64), (db, db64)):
        got = np.asarray(got, np.float64)
        np.testing.assert_allclose(got, want, rtol=2**-8, atol=1e-5 * np.abs(want).max())


def test_bf16_backward_keeps_bf16_matmul_operands_and_sums_the_bias_in_float32():
    x = jnp.ones((4, 8, 16), jnp.bfloat16)
    w = jnp.ones((16, 32), jnp.bfloat16)
    b = jnp.zeros((32,), jnp.bfloat16)
    grad = jax.grad(lambda a, k, c: jnp.sum(dense(a, k, c).astype(jnp.float32)), (0, 1, 2))
    eqns = []

    def collect(jaxpr):
        for e in jaxpr.eqns:
            eqns.append(e)
            for sub in jax.core.jaxprs_in_params(e.params):
                collect(sub)

    collect(jax.make_jaxpr(grad)(x, w, b).jaxpr)
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3  # forward, d x, d kernel (some nested in the custom VJP's jaxprs)
    for e in dots:
        assert [v.aval.dtype for v in e.invars] == [jnp.bfloat16, jnp.bfloat16]
        assert e.params["preferred_element_type"] == jnp.float32
    sums = [e for e in eqns if e.primitive.name == "reduce_sum" and e.invars[0].aval.ndim == 3]
    assert sums and all(e.invars[0].aval.dtype == jnp.float32 for e in sums)


def test_float32_dense_is_plain_dot_general_plus_bias():
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(2, 4, 16)), jnp.float32)
    w = jnp.asarray(r.normal(size=(16, 8)), jnp.float32)
    b = jnp.asarray(r.normal(size=(8,)), jnp.float32)
    np.testing.assert_array_equal(dense(x, w, b), x @ w + b)


@pytest.mark.slow
@pytest.mark.parametrize("batch,seq", [(2, 16), (1, 1), (3, 7)])
@pytest.mark.extended
def test_bf16_model_tracks_float32_model(batch, seq):
    """The whole pre-training model in bf16 compute stays close to float32 (same params), for
    odd shapes too (XLA:CPU picks other kernels for tiny matmuls)."""
    cfg = dict(vocab_size=120, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
               max_position_embeddings=32)
    r = np.random.default_rng(1)
    ids = jnp.asarray(r.integers(5, 120, (batch, seq)), jnp.int32)
    positions = jnp.asarray(r.integers(0, seq, (batch, 2)), jnp.int32)
    f32 = BertForPreTraining(BertConfig(**cfg, dtype="float32"))
    bf16 = BertForPreTraining(BertConfig(**cfg, dtype="bfloat16"))
    params = nn.unbox(f32.init(jax.random.key(0), ids, None, None, positions))["params"]

    def logits(model, p):
        return model.apply({"params": p}, ids, None, None, positions)["mlm_logits"]

    ref, got = logits(f32, params), logits(bf16, params).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(got - ref))) < 0.05 * float(jnp.max(jnp.abs(ref)))
    g_ref = jax.grad(lambda p: jnp.sum(logits(f32, p) ** 2))(params)
    g_bf16 = jax.grad(lambda p: jnp.sum(logits(bf16, p).astype(jnp.float32) ** 2))(params)
    largest = max(float(jnp.max(jnp.abs(a))) for a in jax.tree.leaves(g_ref))
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_bf16)):
        assert b.dtype == jnp.float32  # gradients arrive in the params' dtype
        # Relative to each leaf, except leaves whose gradient is ~0 (unused token types, NSP).
        scale = max(float(jnp.max(jnp.abs(a))), 1e-3 * largest)
        assert float(jnp.max(jnp.abs(a - b))) < 0.1 * scale


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_dropout_keeps_the_right_fraction_and_preserves_the_mean(rate):
    shape = (64, 128, 128)  # 1M elements: the keep fraction's std is below 5e-4
    keep, keep_prob = dropout_keep_mask(jax.random.key(3), shape, rate)
    assert abs(keep_prob - (1 - rate)) < 2**-16
    assert abs(float(jnp.mean(keep)) - keep_prob) < 0.003
    x = jnp.ones(shape)
    y = Dropout(rate).apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(4)})
    values = np.unique(np.asarray(y))
    assert len(values) == 2 and values[0] == 0.0
    np.testing.assert_allclose(values[1], 1 / keep_prob, rtol=1e-6)
    assert abs(float(jnp.mean(y)) - 1.0) < 0.01  # inverted dropout: E[y] = x
    # Elements from the two halves of one 32-bit draw (neighbours, on CPU) are independent.
    pairs = np.asarray(keep).reshape(-1, 2)
    both = float(np.mean(pairs[:, 0] & pairs[:, 1]))
    assert abs(both - keep_prob**2) < 0.003


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_hashed_dropout_draws_are_uniform_and_independent(rate):
    """The TPU's draws (`hashed_words`, a counter hash; the top 16 bits decide): the keep
    rate, and keep decisions independent between neighbouring positions, neighbouring rows,
    far positions and two keys; the 16-bit draws uniform (chi-squared over 256 bins) and
    every bit fair."""
    shape = (64, 128, 128)
    words = hashed_words(jax.random.key(3), shape)
    assert words.dtype == jnp.uint32 and words.shape == shape
    draws = np.asarray(words) >> 16
    threshold = round(rate * 65536)
    keep, keep_prob = draws >= threshold, 1 - threshold / 65536
    assert abs(float(np.mean(keep)) - keep_prob) < 0.003
    other = (np.asarray(hashed_words(jax.random.key(4), shape)) >> 16) >= threshold
    for a, b in [(keep[..., :64], keep[..., 64:]), (keep[..., 1:], keep[..., :-1]),
                 (keep[1:], keep[:-1]), (keep[:, 1:], keep[:, :-1]), (keep, other)]:
        assert abs(float(np.mean(a & b)) - keep_prob**2) < 0.003
    counts = np.bincount(draws.ravel() >> 8, minlength=256)
    expected = draws.size / 256
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 255 + 5 * np.sqrt(2 * 255)  # five standard deviations
    bits = np.unpackbits(np.asarray(words).view(np.uint8)).reshape(-1, 32).mean(axis=0)
    assert np.all(np.abs(bits - 0.5) < 0.005)
    # a vector (a rank-1 shape) gets draws too, and the same key gives the same draws
    np.testing.assert_array_equal(hashed_words(jax.random.key(5), (10,)),
                                  hashed_words(jax.random.key(5), (10,)))


def test_dropout_is_identity_when_deterministic_and_differs_between_keys():
    x = jnp.arange(1.0, 65.0).reshape(8, 8)
    d = Dropout(0.5)
    np.testing.assert_array_equal(d.apply({}, x, deterministic=True), x)
    a = d.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(0)})
    b = d.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    assert not np.array_equal(np.asarray(a) == 0, np.asarray(b) == 0)
    odd = jnp.ones((4, 7))  # an odd last axis takes 32-bit draws
    y = d.apply({}, odd, deterministic=False, rngs={"dropout": jax.random.key(2)})
    assert set(np.unique(np.asarray(y)).tolist()) <= {0.0, 2.0}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bias_gradient_is_the_row_sum_in_float32(dtype):
    """The dense layer's bias gradient, summed in float32 over [batch, seq] (bf16 inputs
    too), against the float64 sum."""
    grad = jax.random.normal(jax.random.key(0), (8, 128, 256), jnp.float32).astype(dtype)
    want = np.sum(np.asarray(grad, np.float64), axis=(0, 1))
    got = bias_grad_by_sum(grad, 2)
    assert got.dtype == jnp.float32 and got.shape == (256,)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)

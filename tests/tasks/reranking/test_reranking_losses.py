"""The cross-encoder losses against float64 NumPy references; filler rows (weight 0) change
neither the loss nor the gradients of the real rows, whatever their logits hold; accumulated
micro-batches over the whole batch's denominator sum to the batch's loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.tasks.reranking import losses


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def ref_bce(x, y):
    p = _sigmoid(x)
    return np.mean(-(y * np.log(p) + (1 - y) * np.log(1 - p)))


def ref_listwise(x):
    z = x - x.max(axis=1, keepdims=True)
    log_softmax = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return np.mean(-log_softmax[:, 0])


def ref_mse(x, t):
    return np.mean((x - t) ** 2)


def ref_margin_mse(x, m):
    return np.mean((x[:, 0] - x[:, 1] - m) ** 2)


rng = np.random.default_rng(0)
BATCH = 6
LOGITS_1 = rng.normal(0, 3, BATCH)
LOGITS_GROUP = rng.normal(0, 3, (BATCH, 4))  # [batch, 1 + negatives]
LOGITS_2 = rng.normal(0, 3, (BATCH, 2))
LABELS = np.array([1.0, 0.0, 1.0, 0.25, 0.0, 0.9])
TARGETS = rng.normal(0, 2, BATCH)

# name → (loss(logits, targets, weights, denominator), reference(logits, targets), logits)
CASES = {
    "bce": (losses.bce_loss, ref_bce, LOGITS_1, LABELS),
    "listwise": (lambda x, t, w, d=None: losses.listwise_loss(x, w, d),
                 lambda x, t: ref_listwise(x), LOGITS_GROUP, np.zeros(BATCH)),
    "mse": (losses.mse_loss, ref_mse, LOGITS_1, TARGETS),
    "margin_mse": (losses.margin_mse_loss, ref_margin_mse, LOGITS_2, TARGETS),
}


@pytest.mark.parametrize("name", CASES)
def test_each_loss_is_its_float64_reference(name):
    loss_fn, reference, logits, targets = CASES[name]
    loss, metrics = loss_fn(jnp.asarray(logits, jnp.float32), jnp.asarray(targets, jnp.float32),
                            jnp.ones(BATCH))
    assert loss.dtype == jnp.float32 and metrics["loss"] == loss
    np.testing.assert_allclose(float(loss), reference(logits, targets), rtol=2e-6, atol=1e-6)


def test_accuracies_count_the_positive_first_and_the_sign():
    _, metrics = losses.listwise_loss(jnp.array([[3.0, 1.0, 2.0], [0.0, 5.0, 1.0]]),
                                      jnp.ones(2))
    assert float(metrics["accuracy"]) == 0.5
    _, metrics = losses.bce_loss(jnp.array([2.0, -1.0, 1.0]), jnp.array([1.0, 0.0, 0.0]),
                                 jnp.ones(3))
    np.testing.assert_allclose(float(metrics["accuracy"]), 2 / 3)


@pytest.mark.parametrize("name", CASES)
def test_filler_rows_change_neither_the_loss_nor_the_real_rows_gradients(name):
    """A partial last batch: 2 filler rows of weight 0 whose logits hold huge, infinite and
    NaN values (the loader makes zeros; nothing may leak whatever they are)."""
    loss_fn, _, logits, targets = CASES[name]
    filler = np.full((2,) + logits.shape[1:], 1e30)
    filler[1] = np.nan
    filler.reshape(2, -1)[0, 0] = np.inf
    padded = np.concatenate([logits, filler]).astype(np.float32)
    padded_targets = np.concatenate([targets, [5.0, -3.0]]).astype(np.float32)
    weights = np.concatenate([np.ones(BATCH), np.zeros(2)]).astype(np.float32)

    def loss_of(x, t, w):
        return loss_fn(x, t, w)[0]

    real_loss, real_grad = jax.value_and_grad(loss_of)(
        jnp.asarray(logits, jnp.float32), jnp.asarray(targets, jnp.float32), jnp.ones(BATCH))
    loss, grad = jax.value_and_grad(loss_of)(jnp.asarray(padded), jnp.asarray(padded_targets),
                                             jnp.asarray(weights))
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad)).all()
    np.testing.assert_allclose(float(loss), float(real_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad)[:BATCH], np.asarray(real_grad), rtol=1e-5,
                               atol=1e-8)
    assert not np.asarray(grad)[BATCH:].any()


def test_an_all_filler_batch_gives_zero_not_nan():
    loss, metrics = losses.listwise_loss(jnp.zeros((3, 4)), jnp.zeros(3))
    assert float(loss) == 0.0 and float(metrics["accuracy"]) == 0.0


@pytest.mark.parametrize("name", CASES)
def test_micro_batches_over_the_whole_denominator_sum_to_the_batch(name):
    loss_fn, _, logits, targets = CASES[name]
    weights = np.array([1, 1, 1, 1, 0, 0], np.float32)  # the last rows are filler
    x, t = jnp.asarray(logits, jnp.float32), jnp.asarray(targets, jnp.float32)
    whole = loss_fn(x, t, jnp.asarray(weights))[0]
    denominator = losses.weight_sum(jnp.asarray(weights))
    parts = sum(loss_fn(x[s], t[s], jnp.asarray(weights[s]), denominator)[0]
                for s in (slice(0, 3), slice(3, 6)))
    np.testing.assert_allclose(float(parts), float(whole), rtol=1e-6)

"""The embedding losses against sentence-transformers' own (values and gradients on the same
vectors), filler rows ignored, and global negatives: the loss of a batch sharded over 4 CPU
devices is the one-device loss of the whole batch, not the mean of per-device losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import run_python
from sentence_transformers.sentence_transformer.losses import (
    CoSENTLoss,
    MultipleNegativesRankingLoss,
)

from bertjax.tasks.embedding import losses


def vectors(batch, columns, hidden=16, seed=0):
    return np.random.default_rng(seed).normal(size=(batch, columns, hidden)).astype(np.float32)


def reference_grad(loss_fn, v):
    """sentence-transformers' loss and its gradient w.r.t. the vectors [batch, columns, hidden]."""
    leaves = [torch.tensor(v[:, c], requires_grad=True) for c in range(v.shape[1])]
    loss = loss_fn(leaves)
    loss.backward()
    return float(loss.detach()), np.stack([t.grad.numpy() for t in leaves], axis=1)


@pytest.mark.parametrize("columns,symmetric", [(2, False), (4, False), (2, True)])
def test_in_batch_loss_and_gradients_equal_multiple_negatives_ranking_loss(columns, symmetric):
    v = vectors(8, columns)
    directions = ("query_to_doc", "doc_to_query") if symmetric else ("query_to_doc",)
    reference = MultipleNegativesRankingLoss(None, scale=20.0, directions=directions,
                                             partition_mode="per_direction")
    expected, expected_grad = reference_grad(
        lambda leaves: reference.compute_loss_from_embeddings(leaves, None), v)

    def loss(x):
        return losses.in_batch_loss(x, jnp.ones(8), 20.0, symmetric)[0]

    value, grad = jax.value_and_grad(loss)(jnp.asarray(v))
    np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("filler", ["random", "zeros"])
@pytest.mark.parametrize("weights", [[1, 1, 1, 0, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0, 0, 0]])
def test_filler_rows_are_neither_anchors_nor_candidates(symmetric, filler, weights):
    """A batch of real rows padded with weight-0 rows has the loss and gradients of the real
    rows alone: finite, also where the filler rows' vectors are zeros (what mean pooling makes
    of a row with no token: an epoch's partial last batch) and for a batch of one pair."""
    v = vectors(8, 3, seed=1)
    weights = jnp.array(weights, jnp.float32)
    real = np.flatnonzero(np.asarray(weights))
    if filler == "zeros":
        v[np.asarray(weights) == 0] = 0.0

    def loss(x, w):
        return losses.in_batch_loss(x, w, 20.0, symmetric)[0]

    padded, padded_grad = jax.value_and_grad(loss)(jnp.asarray(v), weights)
    alone, alone_grad = jax.value_and_grad(loss)(jnp.asarray(v[real]), jnp.ones(len(real)))
    assert np.isfinite(padded) and np.all(np.isfinite(padded_grad))
    np.testing.assert_allclose(padded, alone, rtol=1e-6)
    np.testing.assert_allclose(padded_grad[real], alone_grad, rtol=1e-5, atol=1e-7)
    assert not np.any(padded_grad[np.asarray(weights) == 0])


def test_scored_pair_losses_take_zero_filler_rows():
    """CoSENT and cosine losses over a batch whose filler rows are zero vectors: finite values
    and gradients, those of the real rows alone."""
    v = vectors(6, 2, seed=3)
    v[4:] = 0.0
    scores = jnp.array([0.1, 0.9, 0.5, 0.3, 0.0, 0.0])
    weights = jnp.array([1, 1, 1, 1, 0, 0], jnp.float32)
    for fn in (losses.cosent_loss, losses.cosine_loss):
        def loss(x, s, w, fn=fn):
            return fn(x, s, w)[0]

        padded, padded_grad = jax.value_and_grad(loss)(jnp.asarray(v), scores, weights)
        alone, alone_grad = jax.value_and_grad(loss)(jnp.asarray(v[:4]), scores[:4],
                                                     weights[:4])
        assert np.all(np.isfinite(padded_grad)), fn.__name__
        np.testing.assert_allclose(padded, alone, rtol=1e-6)
        np.testing.assert_allclose(padded_grad[:4], alone_grad, rtol=1e-5, atol=1e-7)


def test_cosent_loss_and_gradients_equal_sentence_transformers():
    v = vectors(10, 2, seed=2)
    scores = np.array([0.0, 1.5, 3.0, 3.0, 5.0, 2.2, 0.4, 4.1, 1.5, 2.9], np.float32)  # ties
    reference = CoSENTLoss(None, scale=20.0)
    expected, expected_grad = reference_grad(
        lambda leaves: reference.compute_loss_from_embeddings(leaves, torch.tensor(scores)), v)

    def loss(x, w):
        return losses.cosent_loss(x, jnp.asarray(scores), w, 20.0)[0]

    value, grad = jax.value_and_grad(loss)(jnp.asarray(v), jnp.ones(10))
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-6)
    # Filler rows change nothing.
    padded = np.concatenate([v, vectors(2, 2, seed=3)])
    scores = np.concatenate([scores, [9.0, -1.0]]).astype(np.float32)
    value_padded = losses.cosent_loss(jnp.asarray(padded), jnp.asarray(scores),
                                      jnp.array([1.0] * 10 + [0.0, 0.0]), 20.0)[0]
    np.testing.assert_allclose(value_padded, expected, rtol=1e-5)


def test_cosine_loss_is_the_squared_error_of_the_cosine():
    v = vectors(5, 2, seed=4).astype(np.float64)
    scores = np.linspace(-1, 1, 5)
    a, b = v[:, 0], v[:, 1]
    cosine = np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    value = losses.cosine_loss(jnp.asarray(v, jnp.float32), jnp.asarray(scores, jnp.float32),
                               jnp.ones(5))[0]
    np.testing.assert_allclose(value, np.mean((cosine - scores) ** 2), rtol=1e-5)


GLOBAL_NEGATIVES_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from bertjax.models import BertConfig
from bertjax.models.embedding import BertForEmbedding, Pooling
from bertjax.tasks.embedding import losses

config = BertConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                    intermediate_size=64, max_position_embeddings=32,
                    hidden_dropout_prob=0.0, attention_dropout_prob=0.0)
model = BertForEmbedding(config, Pooling("mean", True))
rng = np.random.default_rng(0)
batch = 16
ids = rng.integers(5, 64, size=(batch, 3, 12)).astype(np.int32)
mask = (np.arange(12)[None, None] < rng.integers(3, 13, size=(batch, 3, 1))).astype(np.int32)
weights = np.ones(batch, np.float32)
weights[-3:] = 0.0  # filler rows, on the last device
params = model.init(jax.random.key(0), ids[:1], ids[:1] * 0, mask[:1])["params"]

def loss(params, ids, mask, weights):
    v = model.apply({"params": params}, ids, jnp.zeros_like(ids), mask)
    return losses.in_batch_loss(v, weights, 20.0, False)[0]

step = jax.jit(jax.value_and_grad(loss))
one, one_grad = step(params, ids, mask, weights)
mesh = Mesh(np.array(jax.devices()), ("data",))
rows = NamedSharding(mesh, P("data"))
put = lambda x: jax.device_put(x, rows)
assert len(jax.devices()) == 4
four, four_grad = step(params, put(ids), put(mask), put(weights))
np.testing.assert_allclose(four, one, rtol=1e-6)
for a, b in zip(jax.tree.leaves(four_grad), jax.tree.leaves(one_grad)):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
# The cached mode (GradCache, 4 rows a chunk: one per device) on the sharded batch.
from bertjax.tasks.embedding.cached import cached_vectors

def cached_loss(params, ids, mask, weights):
    encode = lambda p, i, s, m, key: model.apply({"params": p}, i, s, m)
    v = cached_vectors(encode, params, (ids, jnp.zeros_like(ids), mask), None, 4)
    return losses.in_batch_loss(v, weights, 20.0, False)[0]

cached, cached_grad = jax.jit(jax.value_and_grad(cached_loss))(params, put(ids), put(mask),
                                                               put(weights))
np.testing.assert_allclose(cached, one, rtol=1e-6)
for a, b in zip(jax.tree.leaves(cached_grad), jax.tree.leaves(one_grad)):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
# Per-device negatives (each device's 4 rows alone) give another loss: the test can fail.
local = [loss(params, ids[i:i + 4], mask[i:i + 4], weights[i:i + 4]) for i in range(0, 16, 4)]
real = [weights[i:i + 4].sum() for i in range(0, 16, 4)]
local_mean = sum(l * r for l, r in zip(local, real)) / sum(real)
assert abs(float(local_mean) - float(one)) > 0.1, (local_mean, one)
print("GLOBAL_OK", float(one), float(local_mean))
"""


def test_global_negatives_on_4_devices_equal_one_device_with_the_whole_batch():
    """The step's batch sharded over 4 CPU devices: every anchor ranks its positive among the
    16 rows' candidates (the loss and gradients of one device), not among its device's 4;
    the same in the cached mode."""
    proc = run_python(["-c", GLOBAL_NEGATIVES_SCRIPT],
                      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert "GLOBAL_OK" in proc.stdout, proc.stdout + proc.stderr


def test_matryoshka_loss_sums_sentence_transformers_losses_of_the_leading_slices():
    from bertjax.errors import ConfigError
    from bertjax.tasks import get_task
    from experiments import embedding

    config = embedding.get_config("pairs")
    config.task.matryoshka_dims = "8,16,4"
    task = get_task(config)
    assert task.matryoshka_dims == (16, 8, 4)
    v = vectors(6, 3)  # hidden 16: the full slice counts once
    reference = MultipleNegativesRankingLoss(None, scale=20.0)
    expected = sum(float(reference.compute_loss_from_embeddings(
        [torch.tensor(v[:, c, :d]) for c in range(3)], None)) for d in (16, 8, 4))
    batch = {"weights": jnp.ones(6), "labels": jnp.zeros(6)}
    value, metrics = task.loss(jnp.asarray(v), batch)
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    assert metrics["loss"] == value
    config.task.matryoshka_dims = "64,x"
    with pytest.raises(ConfigError, match="matryoshka_dims='64,x': give positive sizes"):
        get_task(config)

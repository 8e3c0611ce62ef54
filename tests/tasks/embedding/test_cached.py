"""The cached large-batch mode (GradCache): a batch encoded 4 or 8 rows at a time has the loss
and gradients of the whole batch encoded at once, through the task's own training path (its
`outputs` and `loss` under jax.value_and_grad), with filler rows; on 4 devices too
(test_losses.py's global-negatives script)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.models import BertConfig
from bertjax.tasks import get_task
from bertjax.tasks.embedding.cached import _from_chunks, _to_chunks
from experiments import embedding


def test_chunks_are_every_nth_row_and_come_back_in_order():
    x = jnp.arange(24).reshape(12, 2)
    chunks = _to_chunks(x, 3)
    np.testing.assert_array_equal(chunks[1, :, 0], [2, 8, 14, 20])  # rows 1, 4, 7, 10
    np.testing.assert_array_equal(_from_chunks(chunks), x)


@pytest.mark.parametrize("chunk_rows,symmetric", [(4, False), (8, True)])
def test_cached_loss_and_gradients_equal_the_whole_batch(chunk_rows, symmetric):
    config = embedding.get_config("pairs")
    config.train.batch_size = 16
    config.task.symmetric = symmetric
    model_config = BertConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                              intermediate_size=64, max_position_embeddings=32,
                              hidden_dropout_prob=0.0, attention_dropout_prob=0.0)
    whole = get_task(config)
    config.task.cache_chunk_rows = chunk_rows
    cached = get_task(config)
    model = whole.model(model_config)
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 64, size=(16, 3, 12)).astype(np.int32)
    mask = (np.arange(12)[None, None] < rng.integers(3, 13, size=(16, 3, 1))).astype(np.int32)
    weights = np.ones(16, np.float32)
    weights[[5, 11]] = 0.0
    batch = {"input_ids": ids, "segment_ids": np.zeros_like(ids), "input_mask": mask,
             "weights": weights, "labels": np.zeros(16, np.float32)}
    params = model.init(jax.random.key(0), ids[:1], ids[:1], mask[:1])["params"]
    key = {"deterministic": False, "rngs": {"dropout": jax.random.key(1)}}

    def loss(task):
        def fn(params):
            return task.loss(task.outputs(model, params, batch, **key), batch)[0]
        return jax.jit(jax.value_and_grad(fn))(params)

    (value, grads), (cached_value, cached_grads) = loss(whole), loss(cached)
    np.testing.assert_allclose(cached_value, value, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(cached_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # The cached path is a different program: chunked (a map over 16 / chunk_rows chunks).
    jaxpr = str(jax.make_jaxpr(lambda p: cached.outputs(model, p, batch, **key))(params))
    assert "custom_vjp" in jaxpr


def test_a_chunk_size_that_does_not_divide_the_batch_is_refused():
    config = embedding.get_config("pairs")
    config.task.cache_chunk_rows = 48
    from bertjax.errors import ConfigError

    with pytest.raises(ConfigError, match="cache_chunk_rows=48 must divide "
                                          "config.train.batch_size=64"):
        get_task(config)

"""bertjax's compute paths against its default path (bertjax/parity/paths.py), 20 steps each.

Every path must follow the default path's losses within the row tolerances; a planted
mis-scaled accumulation (micro-batch losses summed instead of averaged) must fail its row.
"""

import jax
import numpy as np
import pytest

from bertjax.parity import paths
from bertjax.train import step as step_lib

STEPS = 20


def assert_passes(row):
    assert row.passed(), (row.job, row.max_rel_diff(first=50), row.max_rel_diff())
    # Adam hides a uniform gradient scale from the loss; the gradient norm does not.
    assert row.max_rel_diff("grad_norm") < row.tolerances[1], row.job
    assert row.max_param_diff() < 1e-4, row.job


def test_mesh_histories_round_trip(tmp_path):
    results = {"data": ({"loss": [1.0, 0.5]}, {"a.weight": np.arange(6.0).reshape(2, 3)}),
               "fsdp": ({"loss": [2.0]}, {"b.bias": np.ones(2, np.float32)})}
    paths.save_histories(str(tmp_path / "h.npz"), results)
    loaded = paths.load_histories(tmp_path / "h.npz")
    assert list(loaded) == ["data", "fsdp"]
    for name, (history, params) in results.items():
        assert loaded[name][0] == history
        for tensor, value in params.items():
            np.testing.assert_array_equal(loaded[name][1][tensor], value)


@pytest.mark.slow
@pytest.mark.parametrize("job", ["paths_attention", "paths_remat", "paths_scan"])
@pytest.mark.extended
def test_path_rows_follow_the_default_path(job, tmp_path):
    for row in paths.JOBS[job](STEPS, tmp_path):
        assert_passes(row)


@pytest.mark.slow
@pytest.mark.extended
def test_accumulation_with_equal_predictions_is_one_big_batch(tmp_path):
    equal, _ = paths.accumulation_rows(STEPS, tmp_path)
    assert_passes(equal)


@pytest.mark.slow
def test_accumulation_with_real_prediction_counts_is_one_big_batch(tmp_path):
    _, varying = paths.accumulation_rows(STEPS, tmp_path)
    assert varying.passed()


def _summed_step(original, scale_metrics: bool):
    """Planted slip: the micro-batch gradients (and, with scale_metrics, losses) summed
    instead of averaged."""
    def train_step(state, batch, *, loss_fn, tx, schedule, grad_accum_steps=1,
                   denominators=None, grad_reduce_dtype="float32"):
        k = grad_accum_steps

        def scaled(params, b, rng, denominators=None):
            loss, metrics = loss_fn(params, b, rng, denominators)
            if scale_metrics:
                metrics = jax.tree.map(lambda m: m * k, metrics)
            return loss * k, metrics

        state, metrics = original(state, batch, loss_fn=scaled, tx=tx, schedule=schedule,
                                  grad_accum_steps=k, denominators=denominators,
                                  grad_reduce_dtype=grad_reduce_dtype)
        return state, metrics

    return train_step


@pytest.mark.slow
def test_planted_summed_accumulation_fails_the_row(monkeypatch, tmp_path):
    monkeypatch.setattr(step_lib, "train_step", _summed_step(step_lib.train_step, True))
    equal, _ = paths.accumulation_rows(STEPS, tmp_path)
    assert not equal.passed()


@pytest.mark.slow
def test_planted_summed_gradients_fail_the_gradient_norm(monkeypatch, tmp_path):
    # Losses reported right, gradients k times too large: Adam (and clipping) make the loss
    # curve nearly blind to it; the recorded gradient norm is not.
    monkeypatch.setattr(step_lib, "train_step", _summed_step(step_lib.train_step, False))
    equal, _ = paths.accumulation_rows(STEPS, tmp_path)
    assert equal.max_rel_diff("grad_norm") > 1.0
    ratio = np.asarray(equal.ours["grad_norm"]) / np.asarray(equal.theirs["grad_norm"])
    np.testing.assert_allclose(ratio[:3], paths.ACCUM_STEPS, rtol=1e-3)


@pytest.mark.slow
@pytest.mark.extended
def test_meshes_follow_the_default_path(tmp_path):
    for row in paths.mesh_rows(STEPS, tmp_path):
        assert_passes(row)

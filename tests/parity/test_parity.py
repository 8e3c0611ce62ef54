"""The parity harness (bertjax.parity): the comparison record, the report and CLI, the
pre-training rows at 20 steps against transformers, and planted slips each row must catch."""

import math
import types

import flax
import numpy as np
import pytest
import scipy.stats

from bertjax.parity import harness, report
from bertjax.parity import modern as modern_parity
from bertjax.parity import pretraining as pre

STEPS = 20


def make_row(ours, theirs, **kw):
    return harness.Row("job", "ref", {"loss": list(ours)}, {"loss": list(theirs)}, **kw)


def test_row_verdict_follows_both_tolerances_and_a_nan_fails():
    base = np.linspace(5.0, 2.0, 100)
    assert make_row(base, base).passed()
    late = base.copy()
    late[80] *= 1 + 5e-4  # after step 50: only the all-steps bound (1e-3) applies
    assert make_row(late, base).passed()
    assert make_row(late, base).max_rel_diff(first=50) == 0.0
    early = base.copy()
    early[10] *= 1 + 5e-4  # inside the first 50 steps: over 1e-4
    assert not make_row(early, base).passed()
    assert make_row(early, base).max_rel_diff() == pytest.approx(5e-4, rel=1e-6)
    broken = base.copy()
    broken[3] = math.nan
    assert not make_row(broken, base).passed()


def test_param_tolerance_and_gradient_free_tensors():
    base = [3.0, 2.0]
    diffs = {"bert.embeddings.LayerNorm.weight": 2e-4,
             "bert.encoder.layer.0.attention.self.key.bias": 1.5}
    row = make_row(base, base, param_rel_diff=diffs, param_tolerance=1e-4)
    assert row.max_param_diff() == 2e-4  # the key bias has no gradient: left out
    assert not row.passed()
    row.param_tolerance = 1e-3
    assert row.passed()


def test_seed_rows_pass_within_the_seed_spread_only():
    rng = np.random.default_rng(0)
    steps = np.arange(300)
    curve = 5.0 * np.exp(-steps / 100) + 1.0

    def seeds(shift, late=0.0):
        return [list(curve + shift + late * (steps >= 200) + 0.05 * rng.standard_normal(300))
                for _ in range(8)]

    same = harness.Row("j", "r", {}, {}, ours_seeds=seeds(0.0), theirs_seeds=seeds(0.0))
    assert same.seeded and same.passed(), same.seed_t()
    shifted = harness.Row("j", "r", {}, {}, ours_seeds=seeds(0.5), theirs_seeds=seeds(0.0))
    assert not shifted.passed(), shifted.seed_t()
    # A gap in the last third only: that window fails the row.
    late = harness.Row("j", "r", {}, {}, ours_seeds=seeds(0.0, late=0.05),
                       theirs_seeds=seeds(0.0))
    t = late.seed_t()
    assert not late.passed() and abs(t[2]) > harness.SEED_T > max(abs(t[0]), abs(t[1])), t


def test_window_t_is_welchs_t_of_each_seeds_window_mean():
    rng = np.random.default_rng(1)
    ours, theirs = rng.normal(size=(5, 12)), rng.normal(0.3, 2.0, size=(7, 12))
    t = harness.window_t(ours, theirs, 3)
    for i, (lo, hi) in enumerate(((0, 4), (4, 8), (8, 12))):
        a, b = ours[:, lo:hi].mean(1), theirs[:, lo:hi].mean(1)
        reference = scipy.stats.ttest_ind(a, b, equal_var=False).statistic
        assert t[i] == pytest.approx(reference, rel=1e-10)


def test_unpack_puts_each_example_in_its_own_row_with_its_predictions():
    # Row 0 holds examples 1 (positions 0..3) and 2 (4..6); row 1 holds one (0..4).
    packing = np.array([[1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 0, 0, 0]], np.int32)
    ids = np.where(packing > 0, np.arange(8)[None] + 10 * np.arange(1, 3)[:, None], 0)
    batch = {"input_ids": ids.astype(np.int32), "input_mask": (packing > 0).astype(np.int32),
             "segment_ids": np.zeros_like(packing), "packing_ids": packing,
             "masked_lm_positions": np.array([[2, 5, 0], [1, 3, 0]], np.int32),
             "masked_lm_ids": np.array([[7, 8, 0], [9, 6, 0]], np.int32),
             "masked_lm_weights": np.array([[1, 1, 0], [1, 1, 0]], np.float32)}
    out = pre.unpack(batch, rows=4, seq_len=6)
    assert out["input_ids"].shape == (4, 6) and out["masked_lm_positions"].shape == (4, 3)
    np.testing.assert_array_equal(out["input_ids"][:3], [[10, 11, 12, 13, 0, 0],
                                                         [14, 15, 16, 0, 0, 0],
                                                         [20, 21, 22, 23, 24, 0]])
    np.testing.assert_array_equal(out["packing_ids"][:3], out["input_mask"][:3])
    assert not out["input_mask"][3].any() and not out["masked_lm_weights"][3].any()
    # Example 2's prediction at packed position 5 is at position 1 of its own row.
    np.testing.assert_array_equal(out["masked_lm_positions"][:3, :2], [[2, 0], [1, 0], [1, 3]])
    np.testing.assert_array_equal(out["masked_lm_ids"][:3, :2], [[7, 0], [8, 0], [9, 6]])
    np.testing.assert_array_equal(out["masked_lm_weights"].sum(1), [1, 1, 2, 0])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["from_peak", "reference"])
def test_reference_schedules_agree_with_bertjax_at_every_step(kind):
    from bertjax.train.optimizer import learning_rate_schedule

    opt = harness.optimizer_config(schedule=kind, learning_rate=2e-3, warmup_steps=7)
    theirs = harness.reference_lr(opt, 40)
    ours = learning_rate_schedule(2e-3, 7, 40, kind)
    for step in range(45):
        assert float(ours(step)) == pytest.approx(theirs(step), abs=1e-9), step
    assert theirs(0) == 0.0 and theirs(7) == pytest.approx(
        2e-3 if kind == "from_peak" else 2e-3 * (1 - 7 / 40))


def test_cli_writes_the_report_and_exits_1_on_a_failed_row(tmp_path, monkeypatch):
    from bertjax.parity import __main__ as cli_main

    def fake_job(steps, workdir):
        good = np.linspace(3, 1, steps)
        rng = np.random.default_rng(0)
        draws = [list(good + 0.01 * rng.standard_normal(steps)) for _ in range(16)]
        return [make_row(good, good), make_row(good * 1.01, good),
                harness.Row("seeds", "r", {}, {}, ours_seeds=draws[:8], theirs_seeds=draws[8:]),
                harness.Row("draws", "r", {}, {}, ours_seeds=draws[:8], theirs_seeds=draws[8:],
                            seed_windows=steps, x_label="batch")]

    monkeypatch.setattr(cli_main, "collect_jobs", lambda: {"fake": fake_job})
    flags = types.SimpleNamespace(workdir=str(tmp_path / "out"), steps=30, jobs="fake")
    with pytest.raises(SystemExit) as exit_info:
        cli_main.main(flags)
    assert "1 parity row(s) out of tolerance" in str(exit_info.value.code)
    table = (tmp_path / "out" / report.MARKDOWN).read_text()
    assert table.count("| PASS |") == 3 and table.count("| FAIL |") == 1
    assert "| 8 seeds a side, 3 windows of steps | max \\|t\\| " in table
    assert (tmp_path / "out" / report.PLOT).read_bytes()[:4] == b"\x89PNG"
    import json

    records = json.loads((tmp_path / "out" / report.JSON).read_text())
    assert [r["passed"] for r in records] == [True, False, True, True]
    assert len(records[2]["welch_t"]) == 3 and len(records[3]["welch_t"]) == 30
    assert records[1]["max_rel_loss_diff_all"] == pytest.approx(0.01, rel=1e-6)
    flags.jobs = "nope"
    from bertjax.errors import ConfigError

    with pytest.raises(ConfigError, match="--jobs: unknown job"):
        cli_main.main(flags)


# ---------------------------------------------------------------------------------------------
# The rows against transformers (slow: tf.data, compiles and two trainers per row)


@pytest.fixture(scope="module")
def datadir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("parity_data")
    pre.prepare_data(directory)
    return directory


@pytest.mark.slow
@pytest.mark.extended
def test_cli_runs_a_job_and_writes_parity_md_png_and_json(tmp_path):
    from conftest import run_python

    proc = run_python(["-m", "bertjax.parity", f"--workdir={tmp_path}", "--steps=5",
                       "--jobs=pretraining_ltr"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| PASS |" in (tmp_path / "parity.md").read_text()
    assert (tmp_path / "loss_vs_step.png").stat().st_size > 1000
    assert (tmp_path / "parity.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("job", sorted(pre.JOBS))
@pytest.mark.extended
def test_pretraining_rows_follow_transformers(job, datadir):
    rows = pre.JOBS[job](STEPS, datadir)
    for row in rows:
        assert row.steps > 0
        assert row.passed(), (row.job, row.max_rel_diff(), row.max_param_diff())
        # Training moved the loss: the rows compare trajectories, not a fixed point.
        assert row.ours["loss"][-1] != row.ours["loss"][0]


@pytest.mark.slow
@pytest.mark.extended
def test_modern_rows_follow_transformers_and_a_decay_on_norms_fails_them(datadir, monkeypatch):
    rows = modern_parity.run_mlm(STEPS, datadir)
    for row in rows:
        assert row.passed(), (row.job, row.max_rel_diff(), row.max_param_diff())
        assert row.ours["loss"][-1] != row.ours["loss"][0]
    _decay_on_layer_norm(monkeypatch)  # on every norm scale and the decoder bias too
    planted = modern_parity.run_mlm(STEPS, datadir)
    assert not planted[0].passed(), planted[0].max_param_diff()


def _schedule_one_step_ahead(monkeypatch):
    from bertjax.train import optimizer

    original = optimizer.learning_rate_schedule

    def shifted(*args, **kwargs):
        schedule = original(*args, **kwargs)
        return lambda step: schedule(step + 1)

    monkeypatch.setattr(optimizer, "learning_rate_schedule", shifted)


def _decay_on_layer_norm(monkeypatch):
    from bertjax.train import optimizer

    def mask(params):
        flat = flax.traverse_util.flatten_dict(params)
        return flax.traverse_util.unflatten_dict(
            {path: path[-1] not in ("bias", "output_bias") for path in flat})

    monkeypatch.setattr(optimizer, "weight_decay_mask", mask)


def _padding_in_the_mlm_mean(monkeypatch):
    from bertjax.tasks.pretraining import objective

    original = objective.pretraining_loss

    def loss(outputs, batch, nsp_weight=1.0, denominators=None):
        ones = np.ones(batch["masked_lm_weights"].shape, np.float32)
        return original(outputs, dict(batch, masked_lm_weights=ones), nsp_weight, denominators)

    monkeypatch.setattr(objective, "pretraining_loss", loss)


@pytest.mark.slow
@pytest.mark.parametrize("slip", [_schedule_one_step_ahead, _decay_on_layer_norm,
                                  _padding_in_the_mlm_mean])
@pytest.mark.extended
def test_a_planted_slip_fails_the_mlm_nsp_row(slip, datadir, monkeypatch):
    slip(monkeypatch)
    rows = pre.run_mlm_nsp(STEPS, datadir)
    assert not all(row.passed() for row in rows), [
        (row.max_rel_diff(), row.max_param_diff()) for row in rows]

"""Pre-training phases with their own batch size, accumulation and peak learning rate: the
schedule against hand-computed values, and a tiny synthetic run (in-process, `loop.train`)
whose phase 2 runs at another batch in micro-batches, resumes exactly in the middle of phase 2,
and refuses a resume with another phase batch."""

import importlib.util
import os
import shutil

import numpy as np
import pytest
from conftest import records_by_step
from subprocess_runs import final_params

from bertjax.errors import ConfigError
from bertjax.tasks.pretraining import PretrainingJob, make_input_fn
from bertjax.train import loop
from bertjax.train import step as step_lib
from bertjax.train.optimizer import learning_rate_schedule, make_optimizer
from experiments import pretrain as pretrain_experiment

# ------------------------------------------------------------------------- the schedule

PEAK, WARMUP, TOTAL, START2, REWARMUP = 1e-3, 10, 100, 60, 10


def optimizer_config(kind):
    config = pretrain_experiment.get_config("tiny").optimizer
    config.update(learning_rate=PEAK, warmup_steps=WARMUP, schedule=kind,
                  phase_warmup_steps=REWARMUP)
    return config


def test_from_peak_phase_two_rewarms_up_to_its_own_peak_then_decays_to_zero():
    """Global: 1e-3 after 10 steps, linear to 0 at step 100. Phase 2 (from step 60, peak 5e-4):
    the global value at the end of its re-warm-up (step 70) is 1e-3 * (1 - 60 / 90) = 1e-3 / 3,
    so phase 2 is the global schedule x 1.5: 5e-4 at step 70, then 5e-4 * (100 - s) / 30."""
    _, schedule = make_optimizer(optimizer_config("from_peak"), TOTAL, [START2],
                                 [(0, 0.0), (START2, 5e-4)])
    expected = {
        5: 0.5e-3, 10: 1e-3, 40: 1e-3 * (1 - 30 / 90), 59: 1e-3 * (1 - 49 / 90),  # global
        60: 0.0, 65: 0.5 * 1.5 * 1e-3 * (1 - 55 / 90),  # half-way up the re-warm-up
        70: 5e-4, 85: 5e-4 * 15 / 30, 99: 5e-4 / 30, 100: 0.0}
    for step, value in expected.items():
        assert float(schedule(step)) == pytest.approx(value, rel=1e-5, abs=1e-10), step


def test_reference_schedule_phase_peak_and_a_third_phase_back_on_the_global_one():
    """The reference decay counts from step 0: global 1e-3 * (1 - s / 100). Phase 2's peak
    2e-4 at step 70 (global 3e-4 there): x 2/3 from step 60; phase 3 (from 80, no peak of its
    own) re-warms up on the global schedule, x 1."""
    _, schedule = make_optimizer(optimizer_config("reference"), TOTAL, [START2, 80],
                                 [(0, 0.0), (START2, 2e-4), (80, 0.0)])
    expected = {50: 0.5e-3, 59: 0.41e-3, 70: 2e-4, 75: 2 / 3 * 0.25e-3,
                85: 0.5 * 0.15e-3, 90: 0.1e-3, 100: 0.0}
    for step, value in expected.items():
        assert float(schedule(step)) == pytest.approx(value, rel=1e-5, abs=1e-10), step


def test_first_phase_peak_is_at_the_end_of_the_warm_up_and_zero_means_the_global_schedule():
    config = optimizer_config("from_peak")
    _, doubled = make_optimizer(config, TOTAL, [START2], [(0, 2e-3), (START2, 0.0)])
    _, plain = make_optimizer(config, TOTAL, [START2])
    _, zeros = make_optimizer(config, TOTAL, [START2], [(0, 0.0), (START2, 0.0)])
    for step in (5, 10, 30, 59):
        assert float(doubled(step)) == pytest.approx(2 * float(plain(step)), rel=1e-6)
    for step in (61, 65, 80):  # phase 2 keeps the global schedule
        assert float(doubled(step)) == float(plain(step)) > 0
    steps = np.arange(TOTAL + 1)
    np.testing.assert_array_equal(zeros(steps), plain(steps))  # bit for bit
    # Without phases it is the plain warm-up and decay.
    base = learning_rate_schedule(PEAK, WARMUP, TOTAL, "from_peak")
    np.testing.assert_array_equal(plain(steps[:START2]), base(steps[:START2]))


# ------------------------------------------------------------------------- a tiny run

STEPS1, STEPS2 = 4, 4


def tiny_config(phase2_batch=4):
    """Phase 1: batch 8 at length 16; phase 2: batch `phase2_batch` at length 32 in 2
    micro-batches, with its own peak after a 1-step re-warm-up. Synthetic data."""
    config = pretrain_experiment.get_config("tiny")
    config.model.update(num_layers=1, hidden_size=32, num_heads=2, intermediate_size=64,
                        vocab_size=128, max_position_embeddings=32, dtype="float32")
    config.train.update(batch_size=8, num_train_steps=STEPS1 + STEPS2)
    config.phases.phase1.update(data="synthetic", seq_len=16, max_predictions=3, steps=STEPS1)
    config.phases.phase2.update(data="synthetic", seq_len=32, max_predictions=5, steps=STEPS2,
                                batch_size=phase2_batch, grad_accum_steps=2,
                                learning_rate=2e-3)
    config.optimizer.update(learning_rate=1e-3, warmup_steps=2, phase_warmup_steps=1)
    config.checkpoint.update(every_steps=2, max_to_keep=10)
    config.log_every_steps = 1
    return config


class Recorded:
    """A phase's input that records the shape of every batch it gives."""

    def __init__(self, inputs, seen):
        self.inputs, self.seen = inputs, seen

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.inputs)
        self.seen.append((batch["input_ids"].shape, batch["masked_lm_positions"].shape))
        return batch

    def save(self, prefix):
        self.inputs.save(prefix)

    def restore(self, prefix):
        self.inputs.restore(prefix)


def train(config, workdir, seen):
    make_input = make_input_fn(config)
    job = PretrainingJob(config, lambda phase, batch_size, split="train": Recorded(
        make_input(phase, batch_size, split), seen))
    lines = []
    summary = loop.train(job, config, str(workdir), log=lines.append)
    return summary, lines


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """The run, the batches its inputs gave, its log, metrics and final params, and the
    (batch shape, micro-batches) of every train step traced."""
    workdir = tmp_path_factory.mktemp("phase_batches") / "run"
    seen, traced, original = [], [], step_lib.gradients

    def gradients(params, batch, rng, **kwargs):  # runs when a train step is traced
        traced.append((batch["input_ids"].shape, kwargs["grad_accum_steps"]))
        return original(params, batch, rng, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_lib, "gradients", gradients)
        summary, lines = train(tiny_config(), workdir, seen)
    assert summary["status"] == "done"
    return (workdir, seen, lines, records_by_step(workdir, "train"), final_params(str(workdir), 8),
            traced)


def test_each_phase_runs_at_its_own_batch_and_learning_rate(straight_run):
    workdir, seen, lines, metrics, _, traced = straight_run
    assert seen == [((8, 16), (8, 3))] * STEPS1 + [((4, 32), (4, 5))] * STEPS2
    # Phase 1's step on batches of 8; phase 2's on 4, split into 2 micro-batches.
    assert traced == [((8, 16), 1), ((4, 32), 2)]
    assert [metrics[s]["phase_batch_size"] for s in range(1, 9)] == [8] * 4 + [4] * 4
    assert any("Phase phase2: steps 4..8, seq 32, 5 predictions, batch 4 in 2 micro-batches, "
               "peak learning rate 0.002" in line for line in lines)
    # Global (reference decay, warm-up 2): 1e-3 * (1 - s / 8) before phase 2. Phase 2 re-warms
    # up from 0 at step 4 to its peak 2e-3 at step 5 (global 3.75e-4 there: x 16/3 from step
    # 4), then decays linearly to 0 at step 8: 2e-3 * (8 - s) / 3.
    lrs = [metrics[s]["learning_rate"] for s in range(1, 9)]  # the rate of step s - 1
    np.testing.assert_allclose(lrs, [0.0, 5e-4, 7.5e-4, 6.25e-4, 0.0, 2e-3, 2e-3 * 2 / 3,
                                     2e-3 / 3], rtol=1e-5, atol=1e-10)


def test_resume_in_the_middle_of_phase_two_is_exact(straight_run, tmp_path):
    workdir, _, _, metrics, params, _ = straight_run
    resumed = tmp_path / "resumed"
    shutil.copytree(workdir, resumed)
    # The newest checkpoint left is step 6, two steps into phase 2.
    shutil.rmtree(resumed / "checkpoints" / "8")
    seen = []
    summary, lines = train(tiny_config(), resumed, seen)
    assert summary["status"] == "done"
    assert f"Resumed from {resumed / 'checkpoints' / '6'} at step 6" in lines
    assert not any(line.startswith("Phase phase1") for line in lines)
    assert seen == [((4, 32), (4, 5))] * 2  # phase 2's input at its saved position
    again = records_by_step(resumed, "train")
    for step in (7, 8):
        assert again[step]["loss"] == metrics[step]["loss"], step
    for name, value in final_params(str(resumed), 8).items():
        np.testing.assert_array_equal(value, params[name], err_msg=name)


def test_resume_with_another_phase_batch_is_refused_in_one_line(straight_run, tmp_path):
    workdir, *_ = straight_run
    resumed = tmp_path / "resumed"
    shutil.copytree(workdir, resumed)
    before = sorted(os.listdir(resumed / "checkpoints"))
    with pytest.raises(ConfigError) as error:
        train(tiny_config(phase2_batch=8), resumed, [])
    message = str(error.value)
    assert message.startswith(f"config.phases.phase2.batch_size: 4 in the run at {resumed}, 8 "
                              "now;") and "\n" not in message
    assert sorted(os.listdir(resumed / "checkpoints")) == before


# ------------------------------------------------------------------------- the dry run


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")
def test_dry_run_on_a_slice_compiles_each_phase_at_its_own_batch():
    """--dry_run --topology: each stage compiled at its own batch and accumulation; the header
    says both batches."""
    from bertjax.aot import measure as aot_measure
    from bertjax.aot import report as aot_report

    config = tiny_config(phase2_batch=8)
    config.train.batch_size = 16  # on 4 chips: 4 rows each; phase 2: 2 micro-batches of 4
    printed = []
    costs = aot_report.run_on_slice(lambda c: PretrainingJob(c, make_input=None), config,
                                 "v5litepod-4", exact=True, print_fn=printed.append)
    assert "; global batch phase1 16, phase2 8 in 2 micro-batches; " in printed[1]
    assert [(c.name, c.seq_len, c.batch_size) for c in costs] == [("phase1", 16, 16),
                                                                  ("phase2", 32, 8)]
    assert costs[1].model_flops == pytest.approx(8 * PretrainingJob(
        config, make_input=None).stages[1].flops_per_example)
    table = aot_report.stage_table(costs, aot_measure.topology_lib.parse("v5litepod-4"))
    assert [row.split()[:3] for row in table[1:]] == [["phase1", "16", "16"],
                                                      ["phase2", "32", "8"]]

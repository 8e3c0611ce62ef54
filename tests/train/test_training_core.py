"""The one training core: fine-tuning resumes exactly after SIGKILL, SIGTERM saves and exits 0,
a grid cell interrupted mid-run resumes from its checkpoint; models/train/tasks import no
TensorFlow; pre-training and fine-tuning resolve the same compute dtype; data patterns that
match nothing fail before step 0."""

import os
import signal
import subprocess
import sys

import finetune_task
import numpy as np
import pytest
from conftest import ROOT, run_python
from finetune_task import finetune_args, outputs, train_losses, write_task
from subprocess_runs import latest_checkpoint, one_line_error, pretrain_args, start, wait_for

checkpoint = finetune_task.checkpoint  # the module-scoped tiny-checkpoint fixture


@pytest.mark.slow
@pytest.mark.extended
def test_finetuning_resumes_bitwise_after_sigkill(checkpoint, tmp_path):
    """A run killed at a random moment and run again equals the straight run bitwise; the
    runs after the first load their programs from the straight run's compilation cache."""
    write_task(tmp_path)
    straight = str(tmp_path / "straight")
    cache = f"--compilation_cache={tmp_path / 'cache'}"
    proc = run_python(finetune_args(checkpoint, tmp_path, straight) + [cache])
    assert proc.returncode == 0, proc.stderr[-3000:]
    total = 18  # 3 epochs of 6 batches
    programs = set(os.listdir(tmp_path / "cache"))
    assert {p.split("-")[0] for p in programs} >= {"jit_train_step", "jit__predict"}

    resumed = str(tmp_path / "resumed")
    first = start(finetune_args(checkpoint, tmp_path, resumed) + [cache], quiet=True)
    # Kill at a random moment after the step-6 checkpoint (after an evaluation).
    assert wait_for(lambda: (latest_checkpoint(resumed) or 0) >= 6)
    import time

    time.sleep(np.random.default_rng().uniform(0, 0.5))
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed_at = latest_checkpoint(resumed)
    assert killed_at is not None and killed_at < total
    proc = run_python(finetune_args(checkpoint, tmp_path, resumed) + [cache])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Resumed from {os.path.join(resumed, 'checkpoints', str(killed_at))} at step " \
           f"{killed_at}" in proc.stdout
    assert set(os.listdir(tmp_path / "cache")) == programs  # nothing compiled again

    a, b = train_losses(straight), train_losses(resumed)
    assert sorted(a) == sorted(b) == list(range(1, total + 1))
    assert [a[s] for s in a] == [b[s] for s in a]  # bitwise: exact float equality
    (results_a, test_a), (results_b, test_b) = outputs(straight), outputs(resumed)
    assert results_a == results_b  # dev metrics of every evaluation, best step
    assert test_a == test_b
    assert a[total] != a[1]
    # The best and the last checkpoints are kept (max_to_keep=2 keeps two latest).
    kept = sorted(int(p) for p in os.listdir(os.path.join(resumed, "checkpoints")) if p.isdigit())
    assert results_b["best_step"] in kept and total in kept and len(kept) <= 3


@pytest.mark.slow
@pytest.mark.extended
def test_finetuning_sigterm_saves_and_exits_zero_then_continues(checkpoint, tmp_path):
    write_task(tmp_path)
    workdir = str(tmp_path / "run")
    args = finetune_args(checkpoint, tmp_path, workdir, epochs=200, every=1000)
    proc = start(args)
    assert wait_for(lambda: os.path.exists(os.path.join(workdir, "metrics.jsonl"))
                    and len(train_losses(workdir)) >= 3)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM: saved step" in out
    saved = latest_checkpoint(workdir)
    assert saved is not None and saved >= 3
    assert saved >= max(train_losses(workdir))
    # The next run continues from there (a shorter run: it is then already past some evals).
    proc = start(args)
    assert wait_for(lambda: max(train_losses(workdir)) > saved + 2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and f"at step {saved}" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.extended
def test_grid_cell_interrupted_mid_run_resumes_from_its_checkpoint(checkpoint, tmp_path):
    write_task(tmp_path)
    workdir = tmp_path / "grid"
    args = ["-m", "bertjax.finetune_grid", "--config=experiments/finetune_files.py:classification",
            f"--workdir={workdir}", "--grid=learning_rate=1e-3", "--seeds=1",
            *[a for a in finetune_args(checkpoint, tmp_path, "x", epochs=2, every=3)[3:]
              if not a.startswith("--workdir")]]
    cell = workdir / "learning_rate=1e-3" / "seed_0"
    proc = start(args)
    assert wait_for(lambda: (latest_checkpoint(str(cell)) or 0) >= 6)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = latest_checkpoint(str(cell))
    proc = run_python(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Resumed from {cell / 'checkpoints' / str(saved)} at step {saved}" in proc.stdout
    assert "ran 1, skipped 0" in proc.stdout
    assert (cell / "results.json").exists()


def test_models_train_tasks_never_import_tensorflow():
    code = ("import sys; import bertjax.models, bertjax.train.loop, bertjax.aot.dry_run, "
            "bertjax.tasks, bertjax.tasks.pretraining, bertjax.finetune; "
            "print('tensorflow' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_same_compute_dtype_in_pretraining_and_finetuning(checkpoint, dtype):
    from bertjax.tasks.base import load_pretrained_model
    from bertjax.train.configs import resolve_model_config
    from experiments import glue, pretrain

    config = pretrain.get_config("tiny")
    config.model.dtype = dtype
    pretraining_dtype = resolve_model_config(config.model).dtype
    finetune = glue.get_config("sst2")
    finetune.init_checkpoint = checkpoint
    finetune.model.dtype = dtype
    finetuning_dtype = load_pretrained_model(finetune)[0].dtype
    assert pretraining_dtype == finetuning_dtype
    assert pretraining_dtype == {"auto": "float32", "float32": "float32",
                                 "bfloat16": "bfloat16"}[dtype]  # on CPU


@pytest.mark.slow
def test_phase2_pattern_matching_nothing_fails_before_step_zero(tmp_path):
    workdir = str(tmp_path / "run")
    proc = run_python(pretrain_args(workdir, 8, phase1_steps=4, extra=[
        "--config.phases.phase2.data=/nonexistent/phase2-*.tfrecord"]))
    line = one_line_error(proc)
    assert "config.phases.phase2.data" in line and "/nonexistent/phase2-" in line
    assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))  # no step ran


@pytest.mark.slow
def test_test_split_matching_nothing_fails_before_step_zero(checkpoint, tmp_path):
    write_task(tmp_path)
    workdir = tmp_path / "run"
    args = finetune_args(checkpoint, tmp_path, workdir)
    args = [a if not a.startswith("--config.data.test=") else
            f"--config.data.test={tmp_path}/missing.jsonl" for a in args]
    line = one_line_error(run_python(args))
    assert "config.data.test" in line and "missing.jsonl" in line
    assert not (workdir / "metrics.jsonl").exists()


def test_nothing_under_bertjax_imports_experiments():
    """Configs are files that commands load (--config=FILE:ARG); bertjax never imports them."""
    import ast
    import pathlib

    offenders = []
    for path in pathlib.Path(ROOT, "bertjax").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path}: {n}" for n in names if n.split(".")[0] == "experiments"]
    assert offenders == []


TENSORBOARD_SCRIPT = r"""
import sys
from bertjax.train.metrics import MetricsWriter
writer = MetricsWriter(sys.argv[1])
for step, loss in ((1, 2.5), (2, 2.0)):
    writer.write(step, {"loss": loss})
writer.close()
assert "tensorflow" not in sys.modules
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
events = EventAccumulator(sys.argv[1] + "/tensorboard/train")
events.Reload()
print([(e.step, e.value) for e in events.Scalars("loss")])
"""


def test_tensorboard_events_are_written_without_tensorflow(tmp_path):
    proc = subprocess.run([sys.executable, "-c", TENSORBOARD_SCRIPT, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[(1, 2.5), (2, 2.0)]"

"""The pre-training loop end to end (subprocesses of `python -m bertjax.pretrain`):
resume after SIGKILL, SIGTERM preemption, phase hand-off, sharding equivalence across meshes
and processes, restore onto another mesh, and one-line errors for bad input."""

import json
import os
import signal
import socket
import time

import numpy as np
import pytest
from conftest import run_python
from subprocess_runs import (
    MODEL,
    final_params,
    latest_checkpoint,
    one_line_error,
    pretrain_args,
    start,
    wait_for,
)


def devices_env(n):
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "JAX_PLATFORMS": "cpu"}


def read_metrics(workdir, split="train"):
    """step → metrics, the last record of each step winning (a resumed run repeats steps)."""
    records = {}
    path = os.path.join(workdir, "metrics.jsonl")
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record["split"] == split:
                records[record["step"]] = record
    return records


@pytest.mark.slow
@pytest.mark.parametrize("rng_impl", ["threefry2x32", "rbg", "unsafe_rbg"])
@pytest.mark.extended
def test_resume_after_sigkill_is_exact(tmp_path, rng_impl):
    extra = [f"--config.rng_impl={rng_impl}"]
    straight = str(tmp_path / "straight")
    proc = run_python(pretrain_args(straight, 20, extra=extra))
    assert proc.returncode == 0, proc.stderr[-3000:]

    resumed = str(tmp_path / "resumed")
    first = start(pretrain_args(resumed, 20, extra=extra), quiet=True)
    # Kill at a random moment after the step-5 checkpoint is committed.
    assert wait_for(lambda: (latest_checkpoint(resumed) or 0) >= 5)
    time.sleep(np.random.default_rng().uniform(0, 0.5))
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed_at = latest_checkpoint(resumed)
    assert killed_at is not None and killed_at < 20
    proc = run_python(pretrain_args(resumed, 20, extra=extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Resumed from" in proc.stdout

    a, b = read_metrics(straight), read_metrics(resumed)
    assert sorted(a) == sorted(b) == list(range(1, 21))
    for step in range(1, 21):
        assert a[step]["loss"] == b[step]["loss"], step
    pa, pb = final_params(straight, 20), final_params(resumed, 20)
    for name in pa:
        np.testing.assert_array_equal(pa[name], pb[name], err_msg=name)


@pytest.mark.slow
@pytest.mark.extended
def test_sigterm_saves_the_current_step_and_exits_zero(tmp_path):
    workdir = str(tmp_path / "run")
    proc = start(pretrain_args(workdir, 10_000, every=1000))
    assert wait_for(lambda: os.path.exists(os.path.join(workdir, "metrics.jsonl"))
                    and len(read_metrics(workdir)) >= 3)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    saved = latest_checkpoint(workdir)
    logged = max(read_metrics(workdir))
    assert saved is not None and saved >= 3 and saved % 1000 != 0
    assert saved >= logged


@pytest.mark.slow
@pytest.mark.extended
def test_phase_hand_off_and_restart_in_phase_two(tmp_path):
    workdir = str(tmp_path / "run")
    proc = run_python(pretrain_args(workdir, 12, phase1_steps=8, every=10))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(workdir)
    assert [metrics[s]["phase_seq_len"] for s in range(1, 13)] == [32] * 8 + [64] * 4
    # One schedule across phases: the reference linear decay continues through the switch.
    peak, total = 1e-3, 12
    for s in range(4, 13):
        np.testing.assert_allclose(metrics[s]["learning_rate"], peak * (1 - (s - 1) / total),
                                   rtol=1e-5)
    # A restart after the switch (checkpoint at step 10, inside phase 2) stays in phase 2.
    proc = run_python(pretrain_args(workdir, 14, phase1_steps=8, every=10))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Resumed from" in proc.stdout and "Phase phase1" not in proc.stdout
    metrics = read_metrics(workdir)
    assert metrics[13]["phase_seq_len"] == metrics[14]["phase_seq_len"] == 64


MESHES = [(8, 1, 1), (2, 2, 2), (1, 4, 2), (1, 1, 8)]


@pytest.mark.slow
@pytest.mark.extended
def test_meshes_and_processes_give_the_single_device_losses_and_params(tmp_path):
    runs = {}
    reference = str(tmp_path / "single")
    proc = run_python(pretrain_args(reference, 10, every=10), env=devices_env(1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected_losses = [read_metrics(reference)[s]["loss"] for s in range(1, 11)]
    expected_params = final_params(reference, 10)
    # Two processes x 4 devices, through jax.distributed on localhost.
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    multi = str(tmp_path / "two_processes")
    for i in range(2):
        runs[f"{multi}#{i}"] = start(
            pretrain_args(multi, 10, every=10, extra=[
                f"--coordinator_address=localhost:{port}", "--num_processes=2",
                f"--process_id={i}"]),
            devices_env(4))
    # The pair's first step sets up its cross-process (gloo) context, which gives up after 30 s:
    # start the other runs only once it is up, so that 2 CPU cores are not shared six ways then.
    wait_for(lambda: os.path.exists(os.path.join(multi, "metrics.jsonl"))
             or any(p.poll() is not None for p in runs.values()), timeout=300)
    for data, fsdp, tensor in MESHES:
        workdir = str(tmp_path / f"mesh_{data}_{fsdp}_{tensor}")
        mesh = [f"--config.mesh.data={data}", f"--config.mesh.fsdp={fsdp}",
                f"--config.mesh.tensor={tensor}"]
        runs[workdir] = start(pretrain_args(workdir, 10, every=10, extra=mesh), devices_env(8))
    for name, proc in runs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, name + out[-3000:]
    for workdir in [w for w in runs if "#" not in w] + [multi]:
        losses = [read_metrics(workdir)[s]["loss"] for s in range(1, 11)]
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, err_msg=workdir)
        params = final_params(workdir, 10)
        for key in expected_params:
            np.testing.assert_allclose(params[key], expected_params[key], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{workdir}: {key}")


@pytest.mark.slow
@pytest.mark.extended
def test_restore_onto_a_different_mesh(tmp_path):
    workdir = str(tmp_path / "run")
    proc = run_python(pretrain_args(workdir, 10, every=5,
                                    extra=["--config.mesh.data=8", "--config.mesh.fsdp=1"]),
                      env=devices_env(8))
    assert proc.returncode == 0
    straight = read_metrics(workdir)
    # Drop the last checkpoint, then finish on a (1, 4, 2) mesh from step 5.
    import shutil

    shutil.rmtree(os.path.join(workdir, "checkpoints", "10"))
    proc = run_python(pretrain_args(workdir, 10, every=5, extra=[
        "--config.mesh.data=1", "--config.mesh.fsdp=4", "--config.mesh.tensor=2"]),
        env=devices_env(8))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Resumed from" in proc.stdout
    resumed = read_metrics(workdir)
    for step in range(6, 11):
        np.testing.assert_allclose(resumed[step]["loss"], straight[step]["loss"], rtol=1e-5)


@pytest.mark.parametrize("extra,needle,devices", [
    (["--config.train.batch_size=12"], "config.train.batch_size=12", 8),
    (["--config.mesh.data=16"], "config.mesh", 8),
    (["--config.phases.phase1.data=/nonexistent/train-*.tfrecord"], "/nonexistent/train-", 1),
    (["--config.trian.batch_size=8"], "trian", 1),
    (["--config.profile.steps=5,2"], "config.profile.steps='5,2'", 1),
    (["--config.profile.steps=3"], "config.profile.steps='3'", 1),
    (["--config.train.grad_reduce_dtype=fp8"], "config.train.grad_reduce_dtype='fp8'", 1),
])
def test_bad_input_fails_with_one_line(tmp_path, extra, needle, devices):
    proc = run_python(pretrain_args(str(tmp_path / "run"), 4, extra=extra),
                      env=devices_env(devices))
    assert needle in one_line_error(proc)


PROFILE_SCRIPT = r"""
import sys
from tensorflow.tsl.profiler.protobuf import xplane_pb2
space = xplane_pb2.XSpace()
space.ParseFromString(open(sys.argv[1], "rb").read())
names = {m.name for plane in space.planes for m in plane.event_metadata.values()}
print(sorted(n for n in names if "train_step" in n))
"""


def test_profile_steps_write_a_readable_trace(tmp_path):
    """profile.steps=2,3: one XSpace (.xplane.pb) under workdir/profile in the profile
    plugin's layout, which parses and holds the train step's program."""
    workdir = tmp_path / "run"
    proc = run_python(pretrain_args(str(workdir), 4, extra=["--config.profile.steps=2,3"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Profile of steps 2..3 written to" in proc.stdout, proc.stdout[-2000:]
    traces = list((workdir / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0, traces
    parsed = run_python(["-c", PROFILE_SCRIPT, str(traces[0])])
    assert parsed.returncode == 0, parsed.stderr[-3000:]
    assert "jit_train_step" in parsed.stdout, parsed.stdout


@pytest.mark.slow
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    workdir = str(tmp_path / "run")
    proc = run_python(pretrain_args(workdir, 200, every=2, extra=[
        "--config.optimizer.learning_rate=1e12", "--config.optimizer.clip_norm=0",
        "--config.optimizer.warmup_steps=1"]))
    line = one_line_error(proc)
    assert "loss is" in line and "last good checkpoint" in line
    saved = latest_checkpoint(workdir)
    if saved is not None:
        params = final_params(workdir, saved)
        assert all(np.isfinite(v).all() for v in params.values())


def _write_checkpoint_dir(directory, hidden_size=64):
    """A bertjax checkpoint directory (random params) for the MODEL above."""
    import jax

    from bertjax.checkpoint_dir import save_pretrained
    from bertjax.models import BertConfig, BertForPreTraining
    from bertjax.tasks import pretraining

    cfg = BertConfig(num_layers=2, hidden_size=hidden_size, num_heads=8,
                     intermediate_size=256, vocab_size=128)
    import flax.linen as nn

    params = nn.unbox(pretraining.init_params(BertForPreTraining(cfg), jax.random.PRNGKey(7)))
    vocab = directory / "vocab.txt"
    directory.mkdir()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab.write_text("\n".join(specials + [f"w{i}" for i in range(128 - 5)]) + "\n")
    save_pretrained(directory / "ckpt", cfg, params, str(vocab))
    import flax

    return {k: np.asarray(v) for k, v in flax.traverse_util.flatten_dict(params, sep="/").items()}


@pytest.mark.slow
def test_init_checkpoint_loads_params_only(tmp_path):
    expected = _write_checkpoint_dir(tmp_path / "source")
    workdir = str(tmp_path / "run")
    # Step 1 has learning rate 0 (warmup from 0), so its checkpoint holds the loaded params.
    proc = run_python(pretrain_args(workdir, 2, every=1, extra=[
        f"--config.init_checkpoint={tmp_path / 'source' / 'ckpt'}"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Initialised parameters from" in proc.stdout
    params = final_params(workdir, 1)
    for key, value in expected.items():
        np.testing.assert_array_equal(params[key], value, err_msg=key)


@pytest.mark.slow
def test_init_checkpoint_of_another_size_fails_with_one_line(tmp_path):
    _write_checkpoint_dir(tmp_path / "source", hidden_size=32)
    proc = run_python(pretrain_args(str(tmp_path / "run"), 2, extra=[
        f"--config.init_checkpoint={tmp_path / 'source' / 'ckpt'}"]))
    assert "model.hidden_size" in one_line_error(proc)


# ------------------------------------------------------------ packed no-NSP pre-training


@pytest.mark.slow
@pytest.mark.extended
def test_packed_no_nsp_run_learns(tmp_path):
    """corpus → segments (python -m data_pipeline.create_segments) → packed no-NSP training."""
    import re

    from news_corpus import write_segments

    data, vocab_size, stdout = write_segments(tmp_path, extra_args=["--report_seq_len=64"])
    # One report line per row length: padding before → after packing, and it falls.
    reports = re.findall(r"rows of (\d+): padding ([\d.]+)% → ([\d.]+)%", stdout)
    assert [r[0] for r in reports] == ["32", "64"], stdout
    assert all(float(after) < float(before) for _, before, after in reports)

    workdir = str(tmp_path / "run")
    steps = 40
    args = ["-m", "bertjax.pretrain", "--config=experiments/pretrain.py:tiny",
            f"--workdir={workdir}", *MODEL, f"--config.model.vocab_size={vocab_size}",
            "--config.packing.enabled=true", "--config.train.nsp_weight=0.0",
            f"--config.phases.phase1.data={data}/part-*",
            f"--config.phases.phase1.eval_data={data}/part-*",
            "--config.phases.phase1.seq_len=64", "--config.phases.phase1.max_predictions=10",
            f"--config.phases.phase1.steps={steps}", "--config.phases.phase2.steps=0",
            f"--config.train.num_train_steps={steps}", "--config.train.batch_size=16",
            "--config.log_every_steps=1", f"--config.checkpoint.every_steps={steps}",
            "--config.optimizer.warmup_steps=5", "--config.optimizer.learning_rate=2e-3",
            f"--config.eval.every_steps={steps}", "--config.eval.num_batches=2"]
    proc = run_python(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "packed" in proc.stdout
    metrics = read_metrics(workdir)
    assert sorted(metrics) == list(range(1, steps + 1))
    assert not any(k.startswith("nsp_") for k in metrics[1])  # no NSP in a packed run
    losses = [metrics[s]["loss"] for s in range(1, steps + 1)]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
    evaluation = read_metrics(workdir, "eval")[steps]
    assert "nsp_accuracy" not in evaluation and evaluation["mlm_accuracy"] > 0.1
    # The reader's position (tf.data iterator files) is saved inside the step's checkpoint.
    data_item = os.path.join(workdir, "checkpoints", str(steps), "data")
    assert any(f.startswith("position") for f in os.listdir(data_item))


def test_packed_with_nsp_fails_with_one_line(tmp_path):
    proc = run_python(pretrain_args(str(tmp_path / "run"), 4,
                                    extra=["--config.packing.enabled=true"]))
    line = one_line_error(proc)
    assert "config.packing.enabled=True needs config.train.nsp_weight=0.0" in line, line
    assert not (tmp_path / "run").exists()  # refused before anything is written

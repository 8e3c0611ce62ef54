"""Faults during a run: a corrupt latest checkpoint falls back to the previous one (and the run
ends as one resumed from there), a failed resume changes no file of the workdir, a stalled input
stops on SIGTERM or after config.train.input_timeout_s, a failed save is one line with the last
good checkpoint intact, transient write errors (metrics, input positions, checkpoint arrays)
are retried (also through a file system layer that fails write calls below Python and
tensorstore, tests/fault_fs.c), a checkpoint from before
config.rng_impl resumes exactly or is refused, and empty, truncated, corrupted or foreign
TFRecords are named.

The loop tests run `loop.train` in-process on a one-matrix regression job (tests/regression_job.py,
compiles in well under a second); the loop never looks inside a job, so pre-training and
fine-tuning take the same paths. The SIGTERM and file-system-layer tests start a subprocess.
"""

import dataclasses
import errno
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ROOT
from regression_job import RegressionInput, RegressionJob, losses, make_config, run, steps_on_disk

from bertjax.errors import CheckpointError, ConfigError, DataError, TrainingError
from bertjax.train import checkpoints, loop, multihost
from bertjax.train import metrics as metrics_lib
from bertjax.train import sharding as sharding_lib
from bertjax.train import step as step_lib

# ------------------------------------------------------------- the tiny job's workdirs


def snapshot(directory):
    """Every file under `directory` (relative path → bytes), and every folder."""
    files, folders = {}, set()
    for root, dirs, names in os.walk(directory):
        folders.update(os.path.relpath(os.path.join(root, d), directory) for d in dirs)
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, directory)] = f.read()
    return files, folders


def truncate_state(workdir, step):
    """Cuts the array data file of checkpoint `step` in half (a crash of the file system)."""
    data = os.path.join(workdir, "checkpoints", str(step), "state", "d")
    (name,) = os.listdir(data)
    path = os.path.join(data, name)
    with open(path, "rb+") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """A run of 4 steps with checkpoints at 2 and 4 (copied by each test that changes it)."""
    workdir = tmp_path_factory.mktemp("four") / "run"
    run(workdir, 4)
    assert steps_on_disk(workdir) == ["2", "4"]
    return workdir


def copy_of(run_dir, tmp_path, name):
    target = tmp_path / name
    shutil.copytree(run_dir, target)
    return target


# ------------------------------------------------------------------ checkpoint fallback


def delete_input_position(workdir, step):
    os.remove(os.path.join(workdir, "checkpoints", str(step), "data", "position.json"))


@pytest.mark.slow
@pytest.mark.parametrize("damage,culprit", [(truncate_state, "state/d"),
                                            (delete_input_position, "data/position.json")])
def test_corrupt_latest_checkpoint_falls_back_and_ends_like_a_run_resumed_there(
        four_steps, tmp_path, damage, culprit):
    corrupt = copy_of(four_steps, tmp_path, "corrupt")
    damage(corrupt, 4)
    bad_files, _ = snapshot(corrupt / "checkpoints" / "4")
    reference = copy_of(four_steps, tmp_path, "reference")  # the same run, resumed from step 2
    shutil.rmtree(reference / "checkpoints" / "4")

    summary, lines = run(corrupt, 6)
    assert summary["status"] == "done"
    (report,) = [line for line in lines if "unreadable" in line]
    assert report.startswith(f"checkpoint step 4 in {corrupt / 'checkpoints'} is unreadable (")
    assert str(corrupt / "checkpoints" / "4" / culprit) in report  # the file at fault
    assert report.endswith("resuming from step 2")
    assert f"Resumed from {corrupt / 'checkpoints' / '2'} at step 2" in lines
    # Kept, byte for byte, out of the way of the new step 4.
    assert snapshot(corrupt / "unreadable_checkpoints" / "4")[0] == bad_files

    run(reference, 6)
    a, b = losses(corrupt), losses(reference)
    assert [a[s] for s in (3, 4, 5, 6)] == [b[s] for s in (3, 4, 5, 6)]
    assert steps_on_disk(corrupt) == ["2", "4", "6"]


@pytest.mark.slow
def test_the_pretrain_command_says_one_line_for_a_truncated_latest_checkpoint(tmp_path):
    """As a user meets it: `python -m bertjax.pretrain` resumed over a latest checkpoint whose
    largest array file was cut in half says so in one line (the file's step, moved aside,
    resuming from the one before) and finishes; none of the checkpoint library's logged
    tracebacks reach the terminal."""
    from subprocess_runs import pretrain_args

    workdir = tmp_path / "run"
    first = subprocess.run([sys.executable, *pretrain_args(workdir, 4, every=2)], cwd=ROOT,
                           capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    arrays = [p for p in (workdir / "checkpoints" / "4" / "state").rglob("*") if p.is_file()]
    largest = max(arrays, key=lambda p: p.stat().st_size)
    os.truncate(largest, largest.stat().st_size // 2)
    done = subprocess.run([sys.executable, *pretrain_args(workdir, 6, every=2)], cwd=ROOT,
                          capture_output=True, text=True)
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 0, lines[-20:]
    (report,) = [line for line in lines if "unreadable" in line]
    assert report.endswith("resuming from step 2") and "TensorStore({" not in report, report
    noisy = [i for i, line in enumerate(lines) if "Traceback" in line or "ERROR" in line]
    assert not noisy, "\n".join(lines[max(noisy[0] - 3, 0):noisy[0] + 30])
    # The resume line, the steps, the phase and end lines: nothing else.
    assert len(lines) <= 12, lines


class NanGradientJob(RegressionJob):
    """A finite loss whose gradient is NaN: the square root of a zero that depends on w."""

    def loss(self, params, batch, rng):
        loss, metrics = super().loss(params, batch, rng)
        return loss + 0.0 * jnp.sqrt(jnp.sum(params["w"] * 0.0)), metrics


def test_a_nan_gradient_stops_the_run_and_names_the_batch(tmp_path):
    with pytest.raises(TrainingError, match=r"^grad_norm is nan at step 1 \(main's batch 1 of "
                                            r"4\); stopping without saving \(last good "
                                            r"checkpoint: none\); a batch whose rows"):
        loop.train(NanGradientJob(4), make_config(), str(tmp_path / "run"), log=lambda _: None)
    assert not os.path.isdir(tmp_path / "run" / "checkpoints") or not steps_on_disk(
        tmp_path / "run")


class FailingEvaluationJob(RegressionJob):
    """Evaluates every 2 steps; the evaluation at step 4 fails (a bad dev file, say)."""

    def __init__(self, total_steps):
        super().__init__(total_steps)
        self.stages = [dataclasses.replace(self.stages[0], eval_every=2)]

    def evaluate(self, params, stage, step, runner):
        if step == 4:
            raise DataError("dev.jsonl:3: no label")
        return {"score": float(step)}


def test_a_failed_evaluation_keeps_the_trained_state_and_a_rerun_resumes_there(tmp_path):
    lines = []
    with pytest.raises(DataError, match="dev.jsonl:3: no label"):
        loop.train(FailingEvaluationJob(6), make_config(every=100), str(tmp_path / "run"),
                   log=lines.append)
    assert steps_on_disk(tmp_path / "run") == ["2", "4"]
    (said,) = [line for line in lines if "evaluation at step 4 failed" in line]
    assert f"saved in {tmp_path / 'run' / 'checkpoints' / '4'}" in said
    resumed = []
    summary = loop.train(RegressionJob(6), make_config(every=100), str(tmp_path / "run"),
                         log=resumed.append)
    assert summary["status"] == "done"
    assert f"Resumed from {tmp_path / 'run' / 'checkpoints' / '4'} at step 4" in resumed


def test_read_params_gives_the_saved_params_alone(four_steps):
    """The params of checkpoints 2 and 4 equal an independent replay of Adam on the job's
    batches; nothing of the optimizer state comes with them."""
    params_rng, _ = jax.random.split(jax.random.PRNGKey(0))  # seed 0: (params, dropout)
    w = jax.random.normal(params_rng, (4, 2))
    tx = optax.adam(0.05)
    opt_state = tx.init(w)
    batches = RegressionInput()
    grad_fn = jax.grad(lambda w, x, y: jnp.mean((x @ w - y) ** 2))
    for step in (1, 2, 3, 4):
        batch = next(batches)
        grad = grad_fn(w, batch["x"], batch["y"])
        updates, opt_state = tx.update(grad, opt_state)
        w = optax.apply_updates(w, updates)
        if step % 2 == 0:
            params = checkpoints.read_params(str(four_steps), step)
            assert list(params) == ["w"] and isinstance(params["w"], np.ndarray)
            np.testing.assert_allclose(params["w"], w, rtol=1e-6, atol=1e-6)


def test_no_readable_checkpoint_fails_in_one_line_and_changes_nothing(four_steps, tmp_path):
    workdir = copy_of(four_steps, tmp_path, "run")
    truncate_state(workdir, 4)
    truncate_state(workdir, 2)
    before = snapshot(workdir)
    with pytest.raises(CheckpointError) as e:
        run(workdir, 6)
    message = str(e.value)
    assert message.startswith(f"no checkpoint in {workdir / 'checkpoints'} restores (steps 4, 2; "
                              "step 4: ")
    assert "\n" not in message
    assert snapshot(workdir) == before


# ------------------------------------------------------------------------ failed resume


def test_failed_resume_names_the_fields_and_leaves_every_file_byte_identical(four_steps,
                                                                             tmp_path):
    workdir = copy_of(four_steps, tmp_path, "run")
    before = snapshot(workdir)
    with pytest.raises(ConfigError) as e:
        run(workdir, 6, make_config(hidden_size=8, optimizer="lamb"))
    assert str(e.value).startswith(
        f"config.model.hidden_size: 4 in the run at {workdir}, 8 now; "
        f"config.optimizer.name: 'adam' in the run at {workdir}, 'lamb' now; ")
    assert snapshot(workdir) == before
    # Fields that do not fix the checkpoint may change (here the compute dtype and the
    # checkpoint interval); the recorded config then becomes the new one.
    changed = make_config(every=3)
    changed.model.dtype = "bfloat16"
    summary, _ = run(workdir, 6, changed)
    assert summary["status"] == "done"
    assert json.loads((workdir / "run_config.json").read_text())["model"]["dtype"] == "bfloat16"


def test_a_run_recorded_under_the_old_config_name_is_checked_and_resumed(four_steps, tmp_path):
    """A workdir from before the rename holds its config as config.json: a resume is checked
    against it (a differing field refused), an agreeing one resumes and records
    run_config.json."""
    workdir = copy_of(four_steps, tmp_path, "run")
    (workdir / "run_config.json").rename(workdir / "config.json")
    with pytest.raises(ConfigError, match=r"config.model.hidden_size: 4 in the run at .*, 8 now"):
        run(workdir, 6, make_config(hidden_size=8))
    summary, _ = run(workdir, 6, make_config())
    assert summary["status"] == "done"
    assert (json.loads((workdir / "run_config.json").read_text())
            == json.loads((workdir / "config.json").read_text()))


# ------------------------------------------------------- a checkpoint from before rng_impl


class DropoutRegressionJob(RegressionJob):
    """RegressionJob with dropout on its inputs: the losses depend on the dropout key."""

    def loss(self, params, batch, rng):
        keep = jax.random.bernoulli(rng, 0.5, batch["x"].shape)
        return super().loss(params, dict(batch, x=jnp.where(keep, batch["x"] * 2, 0.0)), rng)


def raw_dropout_key(rng, rng_impl="threefry2x32"):
    """The dropout key as the train state held it before config.rng_impl: raw uint32[2] data
    of the threefry key split from the seed."""
    return jax.random.key_data(jax.random.split(rng)[1])


def test_a_checkpoint_with_a_raw_dropout_key_resumes_exactly_or_is_refused(tmp_path,
                                                                           monkeypatch):
    def train(workdir, steps, config=None):
        lines = []
        loop.train(DropoutRegressionJob(steps), config or make_config(), str(workdir),
                   log=lines.append)
        return lines

    with monkeypatch.context() as old_code:
        old_code.setattr(step_lib, "dropout_base_key", raw_dropout_key)
        train(tmp_path / "straight", 4)  # the old code, never interrupted
        train(tmp_path / "old", 2)
    restored, _ = checkpoints.Checkpointer(str(tmp_path / "old")).restore(
        2, *step_lib.state_shardings(DropoutRegressionJob(2).init_params, optax.adam(0.05),
                                     sharding_lib.make_mesh(make_config().mesh),
                                     make_config().logical_axis_rules))
    assert restored.rng.dtype == jax.random.key(0).dtype  # typed once restored

    for impl in ("rbg", "unsafe_rbg"):
        before = snapshot(tmp_path / "old")
        config = make_config()
        config.rng_impl = impl
        with pytest.raises(CheckpointError) as e:
            train(tmp_path / "old", 4, config)
        assert str(e.value) == (
            f"{tmp_path / 'old' / 'checkpoints' / '2'} was saved before config.rng_impl "
            f"existed: its dropout key is a raw threefry2x32 key, which config.rng_impl="
            f"'{impl}' cannot continue; resume with config.rng_impl='threefry2x32' (its "
            "default), or use a new --workdir")
        assert snapshot(tmp_path / "old") == before

    lines = train(tmp_path / "old", 4)
    assert f"Resumed from {tmp_path / 'old' / 'checkpoints' / '2'} at step 2" in lines
    assert losses(tmp_path / "old") == losses(tmp_path / "straight")
    # The dropout key matters: other keys (same params) give other losses.
    config = make_config()
    config.rng_impl = "rbg"
    train(tmp_path / "rbg", 4, config)
    assert losses(tmp_path / "rbg")[1] != losses(tmp_path / "straight")[1]


# ------------------------------------------------------------------------ disk full


@pytest.mark.slow
def test_failed_save_is_one_line_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    workdir = tmp_path / "run"
    run(workdir, 2, pad=64)  # checkpoint 2: ~50 KB of arrays
    step2 = snapshot(workdir / "checkpoints" / "2")

    # A file size limit makes every write past 8 KB fail with EFBIG, the way a full disk
    # fails with ENOSPC, with no privilege needed; it is set only for the save of step 4.
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    original_save = checkpoints.Checkpointer.save

    def save_on_a_full_disk(self, step, *args, **kwargs):
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, previous[1]))
        return original_save(self, step, *args, **kwargs)

    monkeypatch.setattr(checkpoints.Checkpointer, "save", save_on_a_full_disk)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a kill
    try:
        with pytest.raises(CheckpointError) as e:
            run(workdir, 4, pad=64)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, old_handler)
    message = str(e.value)
    # The cause: EFBIG, from whichever write of the save hit the limit first (a data file
    # or, under load, the ocdbt directory's); the whole message shown if not.
    assert message.startswith(
        f"saving checkpoint step 4 to {workdir / 'checkpoints' / '4'} failed ("), message
    assert "File too large" in message or "errno 27" in message, message
    assert "step 2 is intact" in message and "\n" not in message
    assert not (workdir / "checkpoints" / "4").exists()  # orbax renames only complete steps
    assert snapshot(workdir / "checkpoints" / "2") == step2

    monkeypatch.setattr(checkpoints.Checkpointer, "save", original_save)
    summary, lines = run(workdir, 4, pad=64)
    assert summary["status"] == "done"
    assert f"Resumed from {workdir / 'checkpoints' / '2'} at step 2" in lines


# ------------------------------------------------------------------------ stalled input


def test_stalled_input_stops_after_the_timeout_saving_nothing_more(tmp_path):
    workdir = tmp_path / "run"
    stuck = threading.Event()
    make_input = lambda: RegressionInput(stall_at=3, release=stuck.wait)  # noqa: E731
    start = time.monotonic()
    with pytest.raises(TrainingError) as e:
        run(workdir, 6, make_config(input_timeout_s=1.0), make_input=make_input)
    stuck.set()
    assert str(e.value) == ("the input of main gave no batch for 1 s "
                            "(config.train.input_timeout_s) before step 4; stopping without "
                            "saving (last checkpoint: step 2)")
    assert time.monotonic() - start < 60
    assert steps_on_disk(workdir) == ["2"]


STALLED_RUN = """
import sys
import regression_job as rj

# Batch 3 opens a FIFO nobody writes to: the input thread blocks in a system call, as a
# TFRecord reader does on a file system that stopped answering.
stall = lambda: open(sys.argv[2], "rb")
summary, lines = rj.run(sys.argv[1], 6, make_input=lambda: rj.RegressionInput(3, stall))
print("\\n".join(lines), flush=True)
print("status", summary["status"], flush=True)
"""


@pytest.mark.slow
def test_sigterm_stops_a_run_whose_input_stalls_within_seconds(tmp_path):
    fifo, workdir = tmp_path / "shard.tfrecord", tmp_path / "run"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-c", STALLED_RUN, str(workdir), str(fifo)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while not (workdir / "checkpoints" / "2" / "commit_success.txt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        time.sleep(1.0)  # now waiting for batch 3
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert time.monotonic() - sent < loop.SIGTERM_GRACE_S + 10
    assert proc.returncode == 0, out[-3000:]
    assert ("SIGTERM while waiting for the input of step 4: exiting without saving (last "
            "checkpoint: step 2)") in out
    assert "status preempted" in out
    assert steps_on_disk(workdir) == ["2"]  # no step 3, no temporary directory


# ----------------------------------------------------------------------- bad TFRecords


def write_shard(path, n=8, seq_len=16, max_predictions=3):
    """n pre-masked records of the reference schema; returns each record's framed size."""
    from data_pipeline import tfrecords

    rng = np.random.default_rng(0)
    sizes = []
    with tfrecords.ShardWriter(str(path)) as writer:
        for _ in range(n):
            example = tfrecords.pad_example(
                rng.integers(5, 100, 10), np.zeros(10, np.int64), False, seq_len,
                (np.arange(1, 1 + max_predictions), rng.integers(5, 100, max_predictions)),
                max_predictions)
            record = tfrecords.serialize_example(example)
            sizes.append(len(tfrecords.tfrecord_frame(record)))
            writer.write(record)
    return sizes


def read(pattern, batches=4, seq_len=16):
    from data_pipeline import pretraining_input

    dataset = pretraining_input.make_dataset(pattern, seq_len=seq_len, max_predictions=3,
                                             batch_size=4, shuffle=False)
    iterator = pretraining_input.InputIterator(dataset)
    return [next(iterator) for _ in range(batches)]


def test_empty_shards_are_skipped_with_a_warning_or_refused_when_all_are(tmp_path, caplog):
    write_shard(tmp_path / "part-0.tfrecord")
    (tmp_path / "part-1.tfrecord").write_bytes(b"")
    alone = read(str(tmp_path / "part-0.tfrecord"))
    with_empty = read(str(tmp_path / "part-*.tfrecord"))
    for a, b in zip(alone, with_empty):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    assert any(str(tmp_path / "part-1.tfrecord") in r.getMessage() and "empty" in r.getMessage()
               for r in caplog.records)

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "part-0.tfrecord").write_bytes(b"")
    (tmp_path / "empty" / "part-1.tfrecord").write_bytes(b"")
    with pytest.raises(DataError) as e:
        read(str(tmp_path / "empty" / "*.tfrecord"))
    assert str(e.value).startswith(f"{tmp_path / 'empty' / '*.tfrecord'}: all 2 matching files "
                                   "are empty (0 bytes")


def test_truncated_and_corrupted_records_are_named_by_file_and_offset(tmp_path):
    sizes = write_shard(tmp_path / "good.tfrecord")
    good = (tmp_path / "good.tfrecord").read_bytes()
    (tmp_path / "truncated.tfrecord").write_bytes(good[:-10])
    flipped = bytearray(good)
    flipped[sum(sizes[:5]) + 20] ^= 0x04  # inside record 5's data
    (tmp_path / "flipped.tfrecord").write_bytes(bytes(flipped))

    # The first record is fine, so only tf.data finds these while reading (it names no file).
    with pytest.raises(DataError) as e:
        read(str(tmp_path / "truncated.tfrecord"))
    assert str(e.value) == (f"{tmp_path / 'truncated.tfrecord'}: truncated record (the file "
                            f"ends 10 bytes early) at byte {sum(sizes[:-1])}; recreate or remove "
                            "this file")
    with pytest.raises(DataError) as e:
        read(str(tmp_path / "flipped.tfrecord"))
    assert str(e.value) == (f"{tmp_path / 'flipped.tfrecord'}: corrupted record (data checksum "
                            f"mismatch) at byte {sum(sizes[:5])}; recreate or remove this file")


def test_framing_check_reads_what_tensorflow_reads(tmp_path):
    from bertjax.tf_setup import import_tensorflow
    from data_pipeline import tfrecords

    tf = import_tensorflow()
    sizes = write_shard(tmp_path / "good.tfrecord", n=5)
    with open(tmp_path / "good.tfrecord", "rb") as f:
        ours = list(tfrecords.frames(f))
    theirs = [r.numpy() for r in tf.data.TFRecordDataset(str(tmp_path / "good.tfrecord"))]
    assert [record for _, record in ours] == theirs
    assert [offset for offset, _ in ours] == np.cumsum([0] + sizes[:-1]).tolist()
    assert tfrecords.first_problem(str(tmp_path / "good.tfrecord")) is None


def test_foreign_or_wrong_length_records_are_named_before_reading(tmp_path):
    from data_pipeline import tfrecords

    with tfrecords.ShardWriter(str(tmp_path / "tagging.tfrecord")) as writer:
        writer.write(tfrecords.serialize_example({"input_ids": np.zeros(16, np.int64),
                                                  "label_ids": np.zeros(16, np.int64)}))
    with pytest.raises(DataError) as e:
        read(str(tmp_path / "tagging.tfrecord"))
    assert str(e.value).startswith(
        f"{tmp_path / 'tagging.tfrecord'}: records lack feature(s) input_mask, masked_lm_ids, "
        "masked_lm_positions, masked_lm_weights, next_sentence_labels, segment_ids (they have "
        "input_ids, label_ids)")

    write_shard(tmp_path / "seq16.tfrecord")
    with pytest.raises(DataError) as e:
        read(str(tmp_path / "seq16.tfrecord"), seq_len=32)
    assert str(e.value).startswith(f"{tmp_path / 'seq16.tfrecord'}: feature input_ids is "
                                   "int64_list of 16 values, expected int64_list of 32")

    (tmp_path / "text.tfrecord").write_text("a text file, not records\n")
    with pytest.raises(DataError) as e:
        read(str(tmp_path / "text.tfrecord"))
    assert str(e.value).startswith(f"{tmp_path / 'text.tfrecord'}: corrupted record")


# ------------------------------------------------------------- a flaky remote file system


def flaky(write, failing_calls, error):
    """`write` on a remote file system that fails the calls numbered in `failing_calls` (from
    0) with `error`, after writing half of what it was given where it takes text."""
    calls = []

    def wrapper(self, *args):
        calls.append(1)
        if len(calls) - 1 in failing_calls:
            if write is metrics_lib.MetricsWriter._append:  # a partial line, then the failure
                with open(os.path.join(self.workdir, "metrics.jsonl"), "a") as f:
                    f.write("".join(self._lines)[:10])
            raise error
        return write(self, *args)

    return wrapper


def test_transient_write_errors_are_retried_and_the_run_ends_as_an_undisturbed_one(
        four_steps, tmp_path, monkeypatch, caplog):
    """Metrics appends (each failing after half a line) and the input positions written into
    checkpoints fail now and then with a reset connection or a timeout: retried with backoff,
    the run writes what an undisturbed run writes."""
    monkeypatch.setattr(multihost, "RETRY_DELAYS_S", (0.01, 0.02, 0.04))
    monkeypatch.setattr(metrics_lib.MetricsWriter, "_append", flaky(
        metrics_lib.MetricsWriter._append, {0, 1, 4},
        ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")))
    monkeypatch.setattr(RegressionInput, "save", flaky(
        RegressionInput.save, {0, 2}, TimeoutError(errno.ETIMEDOUT, "Connection timed out")))
    workdir = tmp_path / "run"
    summary, _ = run(workdir, 4)
    assert summary["status"] == "done"
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert losses(workdir) == losses(four_steps)
    assert steps_on_disk(workdir) == ["2", "4"]
    for step in (2, 4):
        assert json.loads((workdir / "checkpoints" / str(step) / "data" / "position.json")
                          .read_text()) == {"index": step}
    assert caplog.text.count("trying again") == 5


def test_a_permanent_write_error_is_one_line_at_once_and_keeps_the_checkpoints(
        tmp_path, monkeypatch):
    monkeypatch.setattr(multihost, "RETRY_DELAYS_S", (30.0,))
    monkeypatch.setattr(metrics_lib.MetricsWriter, "_append", flaky(
        metrics_lib.MetricsWriter._append, {2},
        OSError(errno.ENOSPC, "No space left on device")))
    workdir = tmp_path / "run"
    start = time.monotonic()
    with pytest.raises(TrainingError) as e:
        run(workdir, 6)
    assert time.monotonic() - start < 30  # not retried
    assert str(e.value) == (f"writing metrics to {workdir} failed (No space left on device); "
                            "the checkpoints saved so far are kept")
    assert steps_on_disk(workdir) == ["2"]
    # The half-written line is cut off; the closing flush still writes step 3's record.
    assert [json.loads(line)["step"]
            for line in (workdir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


# ------------------------------------------- a flaky remote file system, below Python and C++

# The regression job as a command whose writes go through tests/fault_fs.c (LD_PRELOAD): the
# layer's rules (FAULT_FS) hold from the start, or from the save of step `arm_at` on (set once
# the saves before it are complete).
FAULT_FS_COMMAND = """
import ctypes
import sys

import regression_job as rj
from bertjax import cli
from bertjax.train import checkpoints, multihost

workdir, steps, rules, arm_at = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
multihost.RETRY_DELAYS_S = (0.05, 0.1, 0.2)
layer = ctypes.CDLL(None)
save = checkpoints.Checkpointer.save


def save_then_arm(self, step, *args, **kwargs):
    if step == arm_at:
        self.wait()
        layer.fault_fs_arm(rules.encode())
    return save(self, step, *args, **kwargs)


checkpoints.Checkpointer.save = save_then_arm
try:
    cli.report_errors(lambda: rj.run(workdir, steps))
finally:
    print(f"injected {layer.fault_fs_failed()} write errors", flush=True)
"""


def run_with_faults(fault_fs, workdir, steps, rules, arm_at=0):
    env = dict(os.environ, LD_PRELOAD=str(fault_fs), FAULT_FS=rules if arm_at == 0 else "")
    return subprocess.run([sys.executable, "-c", FAULT_FS_COMMAND, str(workdir), str(steps),
                           rules, str(arm_at)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_remote_write_errors_below_python_are_retried_or_one_line(fault_fs, four_steps,
                                                                  tmp_path):
    """Through a file system layer that fails writes with errno (not Python exceptions made up
    by the test): transient errors of the metrics appends (EIO twice) and of an input position
    written into a checkpoint (ETIMEDOUT) are retried, and the run ends as an undisturbed one.
    From the save of step 4 on, every checkpoint array write (tensorstore's) fails: step 4's
    asynchronous save fails, step 6 stands in for it, is tried again after each of the 3 delays,
    then the run stops with one line; step 2 stays the latest, and a rerun resumes from it."""
    workdir = tmp_path / "transient"
    proc = run_with_faults(fault_fs, workdir, 4, "metrics.jsonl:5:0:2;position.json:110:1:1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "injected 3 write errors" in proc.stdout
    # Each failed attempt is one warning (closing a file may make two write calls).
    for what in (f"writing {workdir}/metrics.jsonl failed (Input/output error)",
                 "writing the input position to ", "failed (Connection timed out)"):
        assert what in proc.stderr, proc.stderr[-3000:]
    assert losses(workdir) == losses(four_steps)
    assert steps_on_disk(workdir) == ["2", "4"]

    workdir = tmp_path / "permanent"
    start = time.monotonic()
    proc = run_with_faults(fault_fs, workdir, 6, "ocdbt.process_0/d/:5:0:-1", arm_at=4)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    # Nothing follows it: no traceback of orbax's abandoned writes at the interpreter's exit.
    assert proc.stderr.splitlines()[-1] == errors[0], proc.stderr[-3000:]
    assert f"saving checkpoint step 4 to {workdir / 'checkpoints' / '4'} failed (" in proc.stderr
    assert "training went on, so step 6, saved now, stands in for it" in proc.stderr
    retries = re.findall(
        r"saving checkpoint step 6 to .* failed \(.*\); trying again in ([\d.]+) s", proc.stderr)
    assert retries == ["0.05", "0.1", "0.2"], proc.stderr[-3000:]
    assert re.match(rf"error: saving checkpoint step 6 to {workdir / 'checkpoints' / '6'} failed "
                    r"\(.*Input/output error.*\); step 2 is intact; ", errors[0]), errors[0]
    print(f"permanent EIO: {len(retries)} retries, one line after {time.monotonic() - start:.1f} s "
          "(the command's whole run)")
    assert [name for name in steps_on_disk(workdir) if name.isdigit()] == ["2"]
    summary, lines = run(workdir, 4)
    assert f"Resumed from {workdir / 'checkpoints' / '2'} at step 2" in lines
    assert steps_on_disk(workdir) == ["2", "4"]  # the failed attempts' directories are gone
    # (the failed run went on to step 6 before its asynchronous save reported the error)
    assert {step: loss for step, loss in losses(workdir).items() if step <= 4} == losses(
        four_steps)


def assert_restores_as(workdir, reference, steps):
    """Each of `steps` in `workdir` restores (params, input position) as `reference`'s."""
    for step in steps:
        for name, value in checkpoints.read_params(str(workdir), step).items():
            np.testing.assert_array_equal(value, checkpoints.read_params(str(reference),
                                                                         step)[name])
        assert json.loads((workdir / "checkpoints" / str(step) / "data" / "position.json")
                          .read_text()) == {"index": step}


@pytest.mark.parametrize("arm_at,steps,saved", [(4, 4, ["2", "4"]), (2, 6, ["4", "6"])])
def test_transient_checkpoint_array_write_errors_are_retried(fault_fs, four_steps, tmp_path,
                                                             arm_at, steps, saved):
    """The first two array writes (tensorstore's) of the save of step `arm_at` fail with EIO.
    At the last step the state is at hand: the same step is saved again. Mid-run (step 2)
    training went on from its arrays: step 4's save stands in for it. Either way the run ends
    with the losses of an undisturbed run, and every checkpoint restores as its."""
    workdir = tmp_path / "run"
    start = time.monotonic()
    proc = run_with_faults(fault_fs, workdir, steps, "ocdbt.process_0/d/:5:0:2", arm_at=arm_at)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "injected 2 write errors" in proc.stdout
    retries = re.findall(r"saving checkpoint step \d+ to .* failed \(.*Input/output error.*\); "
                         r"(trying again|training went on)", proc.stderr)
    assert retries, proc.stderr[-3000:]
    print(f"EIO x2 at the save of step {arm_at} of {steps}: {len(retries)} retried attempt(s), "
          f"run {took:.1f} s")
    assert steps_on_disk(workdir) == saved  # no temporary directory left
    undisturbed = losses(four_steps)
    assert {step: loss for step, loss in losses(workdir).items() if step <= 4} == undisturbed
    assert_restores_as(workdir, four_steps, [int(step) for step in saved if int(step) <= 4])
    if steps > 4:  # beyond the reference: it restores
        assert checkpoints.read_params(str(workdir), steps)["w"].shape == (4, 2)


def test_steps_per_second_and_the_eta_start_after_the_first_step(tmp_path, monkeypatch):
    """The first step's call compiles (seconds to minutes): the throughput clock restarts
    once it returns, so the first ETA is that of the steps, not of the compile."""
    from bertjax.train import metrics as metrics_lib

    resets = []
    reset = metrics_lib.Throughput.reset
    monkeypatch.setattr(metrics_lib.Throughput, "reset",
                        lambda self, step: (resets.append(step), reset(self, step))[1])
    config = make_config(every=1000)
    config.log_every_steps = 2  # each measure (steps 2, 4) restarts the clock too
    run(tmp_path / "run", 4, config)
    assert resets == [0, 1, 2, 4]

"""Ctrl-C and time-based saves: once training runs, the first Ctrl-C (SIGINT) saves the step and
stops, a rerun resumes bitwise; a second Ctrl-C quits at once, unsaved; a run saves every
config.checkpoint.every_minutes, each such checkpoint kept until the next save.

On the least-squares job of tests/regression_job.py, in-process (the Python API: `loop.Interrupted`)
and, for the command's lines and exit status, in a subprocess through `cli.run`; on 2
processes (time-based saves agree); and `bertjax.finetune` itself.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import finetune_task
import numpy as np
import pytest
from conftest import ROOT, run_python
from finetune_task import finetune_args, outputs, train_losses, write_task
from regression_job import (
    Clock,
    RegressionInput,
    RegressionJob,
    losses,
    make_config,
    run,
    steps_on_disk,
    timed_input,
)
from subprocess_runs import start, wait_for

from bertjax.errors import TrainingError
from bertjax.train import checkpoints, loop

STEPS = 8
checkpoint = finetune_task.checkpoint  # the module-scoped tiny pre-trained checkpoint (fine-tuning)


def same_params(workdir, reference, step):
    for name, value in checkpoints.read_params(str(workdir), step).items():
        np.testing.assert_array_equal(value, checkpoints.read_params(str(reference), step)[name])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """STEPS steps, saved only at the end."""
    workdir = tmp_path_factory.mktemp("uninterrupted") / "run"
    run(workdir, STEPS, make_config(every=1000))
    return workdir


# ------------------------------------------------------------------------ the Python API


class CtrlCInput(RegressionInput):
    """Sends this process SIGINT as it gives batch `at` (0-based: step at + 1's)."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def __next__(self):
        if self.index == self.at:
            os.kill(os.getpid(), signal.SIGINT)
        return super().__next__()


def test_ctrl_c_saves_the_step_raises_interrupted_and_a_rerun_resumes_bitwise(tmp_path,
                                                                            uninterrupted):
    workdir = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)
    lines = []
    with pytest.raises(KeyboardInterrupt) as e:
        loop.train(RegressionJob(STEPS, make_input=lambda: CtrlCInput(3)),
                   make_config(every=1000), str(workdir), log=lines.append)
    saved = workdir / "checkpoints" / "4"
    assert isinstance(e.value, loop.Interrupted) and e.value.step == 4
    assert str(e.value) == f"Ctrl-C: saved step 4 to {saved}; run the same command to resume"
    assert lines[-1] == f"Ctrl-C: saving step 4 to {saved} (Ctrl-C again to quit without saving)"
    assert signal.getsignal(signal.SIGINT) is before  # the notebook's own handler is back
    assert steps_on_disk(workdir) == ["4"]

    summary, lines = run(workdir, STEPS, make_config(every=1000))
    assert summary["status"] == "done"
    assert f"Resumed from {saved} at step 4" in lines
    assert losses(workdir) == losses(uninterrupted)
    same_params(workdir, uninterrupted, STEPS)


def test_ctrl_c_while_the_input_stalls_stops_unsaved_after_the_grace(tmp_path):
    """Batch 3 sends SIGINT, then never comes: the input has moved on, so its position cannot
    be saved; the run stops SIGTERM_GRACE_S later, naming the last checkpoint."""
    stuck = threading.Event()

    class StallingInput(CtrlCInput):
        def __next__(self):
            batch = super().__next__()
            if self.index == 4:
                stuck.wait()
            return batch

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as e:
        run(tmp_path / "run", STEPS, make_config(every=2), make_input=lambda: StallingInput(3))
    stuck.set()
    assert isinstance(e.value, loop.Interrupted) and e.value.step is None
    assert str(e.value) == ("Ctrl-C while waiting for the input of step 4: exiting without "
                            "saving (last checkpoint: step 2)")
    assert time.monotonic() - start < loop.SIGTERM_GRACE_S + 30
    assert steps_on_disk(tmp_path / "run") == ["2"]


@pytest.fixture
def python_sigint():
    """SIGINT handled as in a plain script (a test worker's own handler may differ)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_before_the_first_step_is_done_is_a_plain_keyboard_interrupt(tmp_path,
                                                                            python_sigint):
    """Before the first step has run (the compile), Ctrl-C quits as anywhere else."""
    with pytest.raises(KeyboardInterrupt) as e:
        run(tmp_path / "run", STEPS, make_config(every=1000), make_input=lambda: CtrlCInput(0))
    assert not isinstance(e.value, loop.Interrupted)
    assert not os.path.exists(tmp_path / "run" / "checkpoints" / "1")


# -------------------------------------------------------------------- time-based saves


def test_saves_every_n_minutes_keeping_each_until_the_next_save(tmp_path, monkeypatch,
                                                                uninterrupted):
    """every_minutes=1, 24 s a batch: steps 3 and 6 are saved by time (the decision comes with
    the batch, 72 s and 144 s in; the clock restarts at each save). Step 6, the newest,
    survives a stalled input; the rerun resumes from it bitwise. At the end only the last
    checkpoint is left: a time-based one never takes the place of one kept by steps."""
    clock = Clock(24.0)
    monkeypatch.setattr(loop, "clock", clock)
    saved = []
    save = checkpoints.Checkpointer.save
    monkeypatch.setattr(checkpoints.Checkpointer, "save",
                        lambda self, step, *a, **k: (saved.append(step), save(self, step, *a, **k)))
    config = make_config(every=1000, input_timeout_s=1.0)
    config.checkpoint.every_minutes = 1
    stuck = threading.Event()
    workdir = tmp_path / "run"
    with pytest.raises(TrainingError, match=r"before step 8; .*\(last checkpoint: step 6\)"):
        run(workdir, STEPS, config, make_input=timed_input(clock, stall_at=7, release=stuck.wait))
    stuck.set()
    assert saved == [3, 6]
    assert steps_on_disk(workdir) == ["6"]  # 3 was a stop-gap: gone once 6 was saved

    clock.now = 0.0
    summary, lines = run(workdir, STEPS, config, make_input=timed_input(clock))
    assert f"Resumed from {workdir / 'checkpoints' / '6'} at step 6" in lines
    assert saved == [3, 6, 8]
    assert steps_on_disk(workdir) == ["8"]
    assert losses(workdir) == losses(uninterrupted)
    same_params(workdir, uninterrupted, STEPS)


def test_time_based_saves_never_evict_the_checkpoints_kept_by_steps(tmp_path, monkeypatch):
    """every_steps=2, max_to_keep=2, a time-based save after every other step, the input
    stalling before step 6: steps 2 and 4 are kept as without time-based saves, plus 5, the
    newest (orbax's LatestN alone would have dropped 2)."""
    clock = Clock(120.0)
    monkeypatch.setattr(loop, "clock", clock)
    config = make_config(every=2, input_timeout_s=1.0)
    config.checkpoint.update(max_to_keep=2, every_minutes=1)
    stuck = threading.Event()
    with pytest.raises(TrainingError, match=r"\(last checkpoint: step 5\)"):
        run(tmp_path / "run", STEPS, config,
            make_input=timed_input(clock, stall_at=5, release=stuck.wait))
    stuck.set()
    assert steps_on_disk(tmp_path / "run") == ["2", "4", "5"]


# --------------------------------------------------------------------------- the command

COMMAND = """
import functools, os, sys, time
import regression_job as rj
from bertjax import cli
from bertjax.train import checkpoints, loop


class SlowInput(rj.RegressionInput):
    def __next__(self):
        time.sleep(0.2)
        return super().__next__()


if os.environ.get("SLOW_SAVE"):  # a save that takes a minute: time for a second Ctrl-C
    save = checkpoints.Checkpointer.save

    def slow_save(self, *args, **kwargs):
        time.sleep(60)
        return save(self, *args, **kwargs)

    checkpoints.Checkpointer.save = slow_save


def main(argv):
    job = rj.RegressionJob(int(os.environ["STEPS"]), make_input=SlowInput)
    summary = loop.train(job, rj.make_config(every=1000), os.environ["WORKDIR"],
                         log=functools.partial(print, flush=True))
    print(f"Training {summary['status']}.", flush=True)


cli.run(main)
"""


class Command:
    """The job as a command (cli.run), its stdout read line by line as it comes."""

    def __init__(self, workdir, steps, **env):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", COMMAND], cwd=ROOT, text=True, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(os.environ, WORKDIR=str(workdir), STEPS=str(steps), **env))
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line.rstrip("\n"))
                                         for line in self.proc.stdout], daemon=True).start()
        self.seen: list[str] = []

    def wait_for(self, pattern, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                assert self.proc.poll() is None, "\n".join(self.seen) + self.proc.stderr.read()
                continue
            self.seen.append(line)
            found = re.match(pattern, line)
            if found:
                return found
        raise AssertionError(f"no line {pattern!r} in {self.seen}")

    def end(self, timeout=60):
        """(exit status, stderr, stdout lines), once it ends."""
        try:
            _, err = self.proc.communicate(timeout=timeout)
        finally:
            self.proc.kill()
        time.sleep(0.2)  # the reader thread's last lines
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return self.proc.returncode, err, self.seen


@pytest.mark.slow
def test_ctrl_c_in_the_command_saves_says_where_and_exits_130_then_resumes_bitwise(
        tmp_path, uninterrupted):
    workdir = tmp_path / "run"
    command = Command(workdir, STEPS)
    command.wait_for(r"step 2/")
    command.proc.send_signal(signal.SIGINT)
    step = int(command.wait_for(r"Ctrl-C: saving step (\d+) to ")[1])
    status, err, out = command.end()
    saved = workdir / "checkpoints" / str(step)
    print(f"Ctrl-C after step 2: saved step {step}; stdout: {out[-1]!r}; stderr: "
          f"{err.splitlines()[-1]!r}; exit {status}")
    assert status == 130, err[-3000:]
    assert out[-1] == (f"Ctrl-C: saving step {step} to {saved} (Ctrl-C again to quit without "
                       "saving)")
    assert err.splitlines()[-1] == (f"Ctrl-C: saved step {step} to {saved}; run the same "
                                    "command to resume"), err[-3000:]
    assert "Training" not in "\n".join(out)
    assert steps_on_disk(workdir) == [str(step)] and step < STEPS

    summary, lines = run(workdir, STEPS, make_config(every=1000))
    assert f"Resumed from {saved} at step {step}" in lines
    assert losses(workdir) == losses(uninterrupted)
    same_params(workdir, uninterrupted, STEPS)


@pytest.mark.slow
@pytest.mark.extended
def test_finetuning_ctrl_c_then_the_same_command_ends_as_a_straight_run(checkpoint, tmp_path):
    """`bertjax.finetune` (tests/finetune_task.py's task): Ctrl-C after step 2 saves,
    exits 130 saying where; the same command again resumes, and the losses, every evaluation,
    the best step and the test predictions equal an uninterrupted run's, bit for bit."""
    write_task(tmp_path)
    straight, workdir = tmp_path / "straight", tmp_path / "run"
    proc = run_python(finetune_args(checkpoint, tmp_path, straight, epochs=5, every=1000))
    assert proc.returncode == 0, proc.stderr[-3000:]

    args = finetune_args(checkpoint, tmp_path, workdir, epochs=5, every=1000)
    proc = start(args)
    assert wait_for(lambda: (workdir / "metrics.jsonl").exists()
                    and len(train_losses(workdir)) >= 2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    found = re.search(r"^Ctrl-C: saved step (\d+) to (.*); run the same command to resume$",
                      out, re.M)
    assert proc.returncode == 130 and found, out[-3000:]
    step = int(found[1])
    print(f"finetune: Ctrl-C after step 2: {found[0]!r}, exit {proc.returncode}")
    assert found[2] == str(workdir / "checkpoints" / str(step))
    assert os.path.exists(workdir / "checkpoints" / str(step) / "_CHECKPOINT_METADATA")
    assert out.rstrip().splitlines()[-1] == found[0] and "Traceback" not in out

    proc = run_python(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Resumed from {workdir / 'checkpoints' / str(step)} at step {step}" in proc.stdout
    assert train_losses(workdir) == train_losses(straight)
    assert outputs(workdir) == outputs(straight)  # every evaluation, best step, test predictions


@pytest.mark.slow
def test_a_second_ctrl_c_quits_at_once_without_saving(tmp_path):
    workdir = tmp_path / "run"
    command = Command(workdir, 1000, SLOW_SAVE="1")
    command.wait_for(r"step 2/")
    command.proc.send_signal(signal.SIGINT)
    command.wait_for(r"Ctrl-C: saving step \d+ to ")
    time.sleep(0.5)  # inside the (minute-long) save
    sent = time.monotonic()
    command.proc.send_signal(signal.SIGINT)
    status, err, _ = command.end()
    took = time.monotonic() - sent
    print(f"second Ctrl-C: exit {status} after {took:.1f} s: {err.splitlines()[-1]!r}")
    assert took < 10
    assert status == 130 and err.splitlines()[-1] == "error: interrupted (Ctrl-C)", err[-3000:]
    assert steps_on_disk(workdir) == []


# The regression job on 2 processes (tests/multihost.py), saving every minute: process 0's fake
# clock moves 24 s a batch, process 1's never moves. Each process prints the steps it saves.
AGREEING_COMMAND = """
import sys
import jax
import regression_job as rj
from bertjax import cli
from bertjax.train import checkpoints, loop


def main(argv):
    config = rj.make_config(every=1000)
    config.checkpoint.every_minutes = 1
    config.distributed = dict(timeout_s=60)
    cli.initialize_distributed(config)
    clock = rj.Clock(24.0 if jax.process_index() == 0 else 0.0)
    loop.clock = clock
    save = checkpoints.Checkpointer.save

    def saving(self, step, *args, **kwargs):
        print("saving step", step, flush=True)
        return save(self, step, *args, **kwargs)

    checkpoints.Checkpointer.save = saving
    rj.run(argv[1], int(argv[2]), config, make_input=rj.timed_input(clock))


cli.define_distributed_flags()
cli.run(main)
"""


@pytest.mark.slow
@pytest.mark.extended
def test_every_process_saves_when_process_0_says_time_is_up(tmp_path):
    from multihost import Process, coordinator_flags, devices_env, free_port

    port = free_port()
    processes = [Process(f"process {i}", ["-c", AGREEING_COMMAND, str(tmp_path / "run"), str(STEPS)]
                         + coordinator_flags(port, i, 2), devices_env(1)) for i in range(2)]
    for p in processes:
        p.proc.wait(timeout=600)
        while p.exited is None:  # the reader thread's last lines
            time.sleep(0.05)
    saves = [[line for _, line in p.lines if line.startswith("saving step")] for p in processes]
    print(f"2 processes, process 1's clock stopped: saves {saves}")
    for p in processes:
        assert p.proc.returncode == 0, p.output()
    assert saves[0] == saves[1] == ["saving step 3", "saving step 6", "saving step 8"]
    assert steps_on_disk(tmp_path / "run") == ["8"]

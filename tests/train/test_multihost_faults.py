"""Faults of a multi-host run, on one machine: N CPU processes (jax.distributed on localhost,
one device each) stand in for the N hosts of a pod slice (tests/multihost.py runs them).

What a slice meets and a single host never does: a host dies (SIGKILL), is preempted (SIGTERM
to one process only), or stalls on its input; the others must not wait for it without bound.
Each test prints the bound it measured (pytest -s):
- a lost process (SIGKILL, of 2 or 4, at a random step; the coordinator too): every other
  one exits non-zero with the same one `error:` line naming it by index and address, and
  nothing after it, within config.distributed.timeout_s plus two heartbeats; no half-written
  checkpoint becomes the latest;
- a restart of all processes (on the same or another process count) resumes from the last
  complete checkpoint with the same losses, bit for bit, as a run never interrupted (up to
  rounding on another count);
- a stalled input: every process names the stalled one within config.train.input_timeout_s;
- SIGTERM to one process: every process saves the same step and exits 0;
- a checkpoint save failing on one process (EIO through tests/fault_fs.c): all processes try
  it again together, or all stop with the same one line.
"""

from __future__ import annotations

import io
import os
import random
import re
import shutil
import signal
import socket
import time

import numpy as np
import pytest
from multihost import Process, coordinator_flags, devices_env, free_port, read_metrics

STEPS = 12
TIMEOUT_S = 60  # config.distributed.timeout_s of these runs
# A killed process is named within timeout_s plus two heartbeats (multihost.Watchdog), at once
# where a collective with it fails.
WATCHDOG_BOUND_S = TIMEOUT_S + 2 * min(5.0, max(0.5, TIMEOUT_S / 30)) + 5
INPUT_TIMEOUT_S = 20.0

def pretrain_args(workdir, steps: int = STEPS, *extra: str) -> list[str]:
    """A tiny pre-training run on synthetic batches: global batch 8, checkpoints every 2
    steps, every step logged."""
    return ["-m", "bertjax.pretrain", "--config=experiments/pretrain.py:tiny",
            f"--workdir={workdir}", "--config.phases.phase1.data=synthetic",
            "--config.phases.phase2.data=synthetic", "--config.model.num_layers=2",
            "--config.model.hidden_size=32", "--config.model.num_heads=4",
            "--config.model.intermediate_size=64", "--config.model.vocab_size=128",
            "--config.model.dtype=float32", f"--config.train.num_train_steps={steps}",
            f"--config.phases.phase1.steps={steps}", "--config.phases.phase1.seq_len=32",
            "--config.phases.phase1.max_predictions=5", "--config.train.batch_size=8",
            "--config.log_every_steps=1", "--config.checkpoint.every_steps=2",
            "--config.optimizer.warmup_steps=2", "--config.optimizer.learning_rate=1e-3",
            f"--config.distributed.timeout_s={TIMEOUT_S}", *extra]

def start(args: list[str], n: int) -> list[Process]:
    port = free_port()
    return [Process(f"process {i}", args + coordinator_flags(port, i, n), devices_env(1))
            for i in range(n)]

def wait(processes: list[Process], bound_s: float) -> None:
    """Waits until every process has exited; kills those still running after `bound_s`."""
    deadline = time.monotonic() + bound_s
    while any(p.exited is None for p in processes):
        if time.monotonic() > deadline:
            for p in processes:
                if p.exited is None:
                    p.kill(f"still running after {bound_s:.0f} s")
        time.sleep(0.1)

def wait_for_step(processes: list[Process], step: int, bound_s: float = 600) -> None:
    deadline = time.monotonic() + bound_s
    while not all(steps_logged(p) >= step for p in processes):
        assert time.monotonic() < deadline and all(p.exited is None for p in processes), \
            "\n\n".join(p.output() for p in processes)
        time.sleep(0.05)

def wait_for_commit(workdir, processes: list[Process], bound_s: float = 120) -> None:
    """Waits until some checkpoint is committed: saves are asynchronous, so on a loaded machine
    the step-2 save may still be in flight when step 3 is logged."""
    deadline = time.monotonic() + bound_s
    while not ((workdir / "checkpoints").is_dir() and committed_steps(workdir)):
        assert time.monotonic() < deadline and all(p.exited is None for p in processes), \
            "\n\n".join(p.output() for p in processes)
        time.sleep(0.05)

def steps_logged(p: Process) -> int:
    """The last step whose progress line the process printed."""
    from multihost import PROGRESS

    steps = [int(m.group(1)) for _, line in p.lines if (m := PROGRESS.search(line))]
    return max(steps, default=0)

def errors(p: Process) -> list[str]:
    return [line for _, line in p.lines if line.startswith("error: ")]

def losses(workdir) -> dict[int, float]:
    return {step: r["loss"] for step, r in read_metrics(workdir, "train").items()}

def committed_steps(workdir) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())

def only_committed_checkpoints(workdir) -> None:
    """Every step directory is complete (orbax's commit marker): an interrupted save stays a
    temporary directory, which is never taken as the latest."""
    for step in committed_steps(workdir):
        assert (workdir / "checkpoints" / str(step) / "_CHECKPOINT_METADATA").exists(), step

# ------------------------------------------------------------------ JAX's fatal log, replaced

# What JAX 0.10's client logs, from a C++ thread, as it ends a process whose coordination
# service has gone (its process 0 was killed) or found a task dead.
JAX_COORDINATOR_GONE = """\
E1125 15:24:02.485249   12353 coordination_service_agent.cc:289] Polled an error from \
coordination service (this can be an error from this or another task).
F1125 15:24:02.485289   12353 client.h:80] Terminating process because the JAX distributed \
service detected fatal errors. absl::Status: UNAVAILABLE: Failed to send RPC to coordination \
service. Either the leader task was preempted/died/restarted unexpectedly or this task is \
experiencing network issues.
Additional GRPC error information from remote target coordination_service while calling \
/xla.coordination.CoordinationService/PollForError:
:UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}
*** Check failure stack trace: ***
    @     0x7f94c8840634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
"""
JAX_TASK_DEAD = """\
F1125 15:22:33.014255   11319 client.h:80] Terminating process because the JAX distributed \
service detected fatal errors. absl::Status: UNAVAILABLE: The following tasks are unhealthy \
(stopped sending heartbeats):
2
The tasks have crashed.
"""


def guarded(text: str) -> str:
    """What the stderr_guard companion shows of a process's stderr `text` (a process of 4)."""
    from bertjax import stderr_guard

    read, write = os.pipe()
    os.write(write, text.encode())
    os.close(write)
    shown = io.BytesIO()
    stderr_guard.guard(read, shown, 4, "10.0.0.2:8476")
    os.close(read)
    return shown.getvalue().decode()


def test_the_stderr_guard_ends_every_output_in_one_line():
    tail = ("the host died, was preempted or its process was killed; start all 4 processes "
            "again (the same command) to resume from the last checkpoint\n")
    assert guarded("step 3/12\n" + JAX_COORDINATOR_GONE) == (
        "step 3/12\nerror: lost process 0 of 4 (the coordinator, 10.0.0.2:8476): the "
        "coordination service stopped answering; " + tail)
    assert guarded(JAX_TASK_DEAD) == (
        "error: lost process 2 of 4: it sent no heartbeat to the coordination service; " + tail)
    # Our own line first: nothing after it, JAX's log included.
    assert guarded("error: lost process 1 of 4 (vm, pid 7): x\nTraceback (most recent call "
                   "last):\n" + JAX_TASK_DEAD) == "error: lost process 1 of 4 (vm, pid 7): x\n"
    # C++ log lines without a fatal one are shown, in order.
    log = "W1125 15:22:33.014255   11319 service.cc:12] slow\n"
    assert guarded(log + "step 4/12\n" + log) == log + "step 4/12\n" + log


# ------------------------------------------------------------------------- a lost process

def finetune_args(tmp_path):
    """args_for(workdir) of a classification fine-tuning run from a tiny checkpoint: 64
    examples, global batch 8, 2 epochs (16 steps), checkpoints every 2 steps."""
    import random

    from conftest import write_jsonl
    from multihost_finetune import finetune, sentiment_rows, tiny_checkpoint

    rng = random.Random(1)
    train = write_jsonl(tmp_path / "train.jsonl", sentiment_rows(rng, 64))
    dev = write_jsonl(tmp_path / "dev.jsonl", sentiment_rows(rng, 16))
    return finetune("experiments/finetune_files.py:classification", tiny_checkpoint(tmp_path),
                    f"--config.data.train={train}", f"--config.data.validation={dev}",
                    "--config.train.num_epochs=2", "--config.max_seq_length=32",
                    "--config.min_bucket_length=32", "--config.checkpoint.every_steps=2",
                    "--config.checkpoint.max_to_keep=3",
                    f"--config.distributed.timeout_s={TIMEOUT_S}")


def seeded_choice(n: int) -> tuple[int, int, int]:
    """(seed, process to kill, step after which to kill it): random, or fixed by
    $BERTJAX_FAULT_SEED to replay a failure (the seed is printed)."""
    seed = int(os.environ.get("BERTJAX_FAULT_SEED", time.time_ns() % 10**6))
    rng = random.Random(seed)
    return seed, rng.randrange(n), rng.randint(3, STEPS - 4)


def assert_one_line_naming(p: Process, victim: Process, index: int, n: int) -> str:
    """`p` exited non-zero, its output ending in one `error:` line naming process `index` of
    `n` by its address, with no traceback or fatal log anywhere; the line."""
    assert p.proc.returncode not in (0, None), p.output()
    (line,) = errors(p)
    assert p.lines[-1][1] == line, p.output()  # nothing after it
    where = (r"the coordinator, localhost:\d+" if index == 0 else
             rf"{re.escape(socket.gethostname())}, pid {victim.proc.pid}")
    assert re.match(rf"error: lost process {index} of {n} \({where}\): ", line), line
    assert not any(text.startswith(("Traceback", "terminate called", "*** Check failure"))
                   or re.match(r"F\d{4} ", text) for _, text in p.lines), p.output()
    return line


@pytest.mark.slow
@pytest.mark.parametrize("job,n,victim", [("pretrain", 2, 0), ("finetune", 2, 1),
                                          ("pretrain", 4, None)])
@pytest.mark.extended
def test_a_killed_process_ends_the_job_and_a_restart_resumes_exactly(tmp_path, job, n, victim):
    """SIGKILL one of n processes at a random step (of 4: a random one; of 2: the coordinator
    in pre-training, the other in fine-tuning): every other one exits non-zero within
    WATCHDOG_BOUND_S with the same one line naming it. Starting all n again resumes from the
    last complete checkpoint with the losses of an uninterrupted n-process run, bit for bit; of
    2, so does a restart as 1 process, up to rounding."""
    args_for = pretrain_args if job == "pretrain" else finetune_args(tmp_path)
    seed, random_victim, at_step = seeded_choice(n)
    victim = random_victim if victim is None else victim
    reference = start(args_for(tmp_path / "reference"), n)
    wait(reference, 900)
    assert [p.proc.returncode for p in reference] == [0] * n, reference[0].output()
    expected = losses(tmp_path / "reference")

    workdir = tmp_path / "run"
    processes = start(args_for(workdir), n)
    wait_for_step(processes, at_step)
    wait_for_commit(workdir, processes)
    killed = time.monotonic()
    processes[victim].proc.kill()
    wait(processes, WATCHDOG_BOUND_S + 60)
    survivors = [p for i, p in enumerate(processes) if i != victim]
    seconds = [p.exited - killed for p in survivors]
    lines = {p.name: errors(p) for p in survivors}
    print(f"{job}: SIGKILL process {victim} of {n} after step {at_step} (seed {seed}): the "
          f"others exited {[p.proc.returncode for p in survivors]} after "
          f"{[f'{s:.1f}' for s in seconds]} s (bound {WATCHDOG_BOUND_S:g} s): {lines}",
          flush=True)
    named = {assert_one_line_naming(p, processes[victim], victim, n) for p in survivors}
    assert len(named) == 1, named  # the same line everywhere
    assert max(seconds) < WATCHDOG_BOUND_S
    only_committed_checkpoints(workdir)
    last = max(committed_steps(workdir))

    for count, name in ((n, f"{n} processes"), (1, "1 process, 2 devices"))[:3 - n // 2]:
        again = tmp_path / f"restarted_{count}"
        shutil.copytree(workdir, again)
        if count > 1:
            restarted = start(args_for(again), count)
        else:
            restarted = [Process("process 0", args_for(again), devices_env(2))]
        wait(restarted, 900)
        assert all(p.proc.returncode == 0 for p in restarted), restarted[0].output()
        assert any(f"Resumed from {again / 'checkpoints' / str(last)} at step {last}" in line
                   for _, line in restarted[0].lines), restarted[0].output()
        after = [s for s in sorted(expected) if s > last]
        got, want = [losses(again)[s] for s in after], [expected[s] for s in after]
        print(f"{job}: restart on {name} from step {last}: losses of steps {after[0]}..{after[-1]} "
              f"{'bitwise equal' if got == want else 'differ'}", flush=True)
        if count == n:
            assert got == want
        else:  # another reduction order may round differently
            np.testing.assert_allclose(got, want, rtol=1e-5)


# ------------------------------------------------------------------------- a stalled input

# The regression job of tests/regression_job.py as a multi-process command: the input of process
# `argv[2]` opens a FIFO nobody writes to for batch 3, i.e. step 4 (a file system that stopped
# answering).
STALLING_COMMAND = """
import sys
import jax
import regression_job as rj
from bertjax import cli


def main(argv):
    workdir, stalling, fifo, input_timeout, timeout = argv[1:6]
    config = rj.make_config(input_timeout_s=float(input_timeout))
    config.distributed = dict(timeout_s=int(timeout))
    cli.initialize_distributed(config)
    stall = lambda: open(fifo, "rb")
    make_input = (lambda: rj.RegressionInput(3, stall)) if jax.process_index() == int(
        stalling) else rj.RegressionInput
    summary, lines = rj.run(workdir, 6, config, make_input=make_input)
    print("\\n".join(lines), flush=True)


cli.define_distributed_flags()
cli.run(main)
"""


@pytest.mark.slow
@pytest.mark.parametrize("stalling", [1, 0])
@pytest.mark.extended
def test_a_stalled_input_is_named_on_every_process_within_the_input_timeout(tmp_path,
                                                                             stalling):
    fifo = tmp_path / "shard.tfrecord"
    os.mkfifo(fifo)
    processes = start(["-c", STALLING_COMMAND, str(tmp_path / "run"), str(stalling), str(fifo),
                       str(INPUT_TIMEOUT_S), str(TIMEOUT_S)], 2)
    deadline = time.monotonic() + 600
    while not (tmp_path / "run" / "checkpoints" / "2" / "_CHECKPOINT_METADATA").exists():
        assert time.monotonic() < deadline and all(p.exited is None for p in processes), \
            "\n\n".join(p.output() for p in processes)
        time.sleep(0.05)
    reached = time.monotonic()  # step 3 takes a moment, then the input of step 4 stalls
    wait(processes, INPUT_TIMEOUT_S + TIMEOUT_S + 120)
    seconds = [p.exited - reached for p in processes]
    print(f"input of process {stalling} stalled before step 4: exits "
          f"{[p.proc.returncode for p in processes]} after {[f'{s:.1f}' for s in seconds]} s "
          f"(input_timeout_s {INPUT_TIMEOUT_S:g}): {errors(processes[0])}", flush=True)
    expected = (f"error: the input of main on process {stalling} gave no batch for "
                f"{INPUT_TIMEOUT_S:g} s (config.train.input_timeout_s) before step 4; stopping "
                "without saving (last checkpoint: step 2)")
    for p in processes:
        assert p.proc.returncode == 1 and errors(p) == [expected], p.output()
        assert "Traceback" not in p.output()
    assert max(seconds) < INPUT_TIMEOUT_S + 30
    assert committed_steps(tmp_path / "run") == [2]


@pytest.mark.slow
@pytest.mark.extended
def test_a_process_killed_while_the_others_wait_at_a_barrier_is_named_within_the_bound(
        tmp_path):
    """Process 1 stalls on its input of step 4 (a long input_timeout_s) and is killed there:
    process 0 waits at the coordination service's barrier of the step's check-in, where no
    collective fails; the watchdog names process 1 once its heartbeats have stopped for
    config.distributed.timeout_s (before JAX's own timeout would end it with a fatal log)."""
    fifo = tmp_path / "shard.tfrecord"
    os.mkfifo(fifo)
    processes = start(["-c", STALLING_COMMAND, str(tmp_path / "run"), "1", str(fifo), "600",
                       str(TIMEOUT_S)], 2)
    deadline = time.monotonic() + 600
    while not (tmp_path / "run" / "checkpoints" / "2" / "_CHECKPOINT_METADATA").exists():
        assert time.monotonic() < deadline and all(p.exited is None for p in processes), \
            "\n\n".join(p.output() for p in processes)
        time.sleep(0.05)
    time.sleep(5)  # step 3, then both wait: process 1 for its input, process 0 at the barrier
    killed = time.monotonic()
    processes[1].proc.kill()
    wait(processes, WATCHDOG_BOUND_S + 60)
    seconds = processes[0].exited - killed
    print(f"SIGKILL process 1 of 2 while process 0 waits at a barrier: process 0 exited "
          f"{processes[0].proc.returncode} after {seconds:.1f} s (bound {WATCHDOG_BOUND_S:g} s): "
          f"{errors(processes[0])}", flush=True)
    line = assert_one_line_naming(processes[0], processes[1], 1, 2)
    assert ": it sent no heartbeat for " in line
    assert seconds < WATCHDOG_BOUND_S


# ------------------------------------------------------------ a flaky remote file system

# The regression job of tests/regression_job.py on 2 processes, its parameters sharded over them
# (fsdp) so that each writes its own part of every checkpoint.
FLAKY_SAVES_COMMAND = """
import sys
import regression_job as rj
from bertjax import cli
from bertjax.train import multihost

multihost.RETRY_DELAYS_S = (0.5, 1.0)


def main(argv):
    workdir, steps, checkpoint_timeout = argv[1], int(argv[2]), int(argv[3])
    config = rj.make_config()
    config.mesh = dict(data=1, fsdp=-1, tensor=1)
    config.checkpoint.timeout_s = checkpoint_timeout
    config.distributed = dict(timeout_s=int(argv[4]))
    cli.initialize_distributed(config)
    summary, lines = rj.run(workdir, steps, config)
    print("\\n".join(lines), flush=True)


cli.define_distributed_flags()
cli.run(main)
"""
CHECKPOINT_TIMEOUT_S = 5  # config.checkpoint.timeout_s: process 0 waits this long for process 1


def process_1_writes(step: int) -> str:
    """fault_fs's pattern for process 1's array writes into checkpoint `step`."""
    return f"/{step}.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_1/d/"


@pytest.mark.slow
@pytest.mark.extended
def test_a_save_failing_on_one_process_is_retried_or_stopped_by_all(fault_fs, tmp_path):
    """Process 1's array writes fail (EIO, tests/fault_fs.c), process 0's do not; process 0
    learns it after config.checkpoint.timeout_s at orbax's barrier. Both retry together: step 2
    fails once (step 4 stands in for it, training went on), step 6, the last, fails once and is
    saved again; every step that remains restores. Where every write of process 1 fails, both
    stop with the same one line, no step saved."""
    def flaky_run(workdir, steps, rules):
        env = dict(devices_env(1), LD_PRELOAD=str(fault_fs), FAULT_FS=rules)
        port, start_s = free_port(), time.monotonic()
        processes = [Process(f"process {i}", ["-c", FLAKY_SAVES_COMMAND, str(workdir),
                                              str(steps), str(CHECKPOINT_TIMEOUT_S),
                                              str(TIMEOUT_S)] + coordinator_flags(port, i, 2),
                             env) for i in range(2)]
        wait(processes, 300)
        return processes, time.monotonic() - start_s

    from bertjax.train import checkpoints

    workdir = tmp_path / "transient"
    processes, took = flaky_run(workdir, 6, f"{process_1_writes(2)}:5:0:1;"
                                            f"{process_1_writes(6)}:5:0:1")
    warned = [[line for _, line in p.lines if "saving checkpoint step" in line]
              for p in processes]
    print(f"EIO on process 1 at steps 2 and 6: {len(warned[0])} retries agreed, run {took:.1f} s "
          f"(checkpoint.timeout_s {CHECKPOINT_TIMEOUT_S})", flush=True)
    for p in processes:
        assert p.proc.returncode == 0 and "Traceback" not in p.output(), p.output()
    for lines in warned:
        assert len(lines) == 2, lines
        assert "step 2" in lines[0] and "step 4, saved now, stands in for it" in lines[0]
        assert "step 6" in lines[1] and "trying again in 0.5 s" in lines[1]
    assert committed_steps(workdir) == [4, 6] and sorted(
        p.name for p in (workdir / "checkpoints").iterdir()) == ["4", "6"]
    only_committed_checkpoints(workdir)
    for step in (4, 6):
        assert checkpoints.read_params(str(workdir), step)["w"].shape == (4, 2)

    workdir = tmp_path / "permanent"
    processes, took = flaky_run(workdir, 2, f"{process_1_writes(2)}:5:0:-1")
    lines = [errors(p) for p in processes]
    print(f"EIO on every write of process 1: exits {[p.proc.returncode for p in processes]} "
          f"after {took:.1f} s: {lines[0]}", flush=True)
    for p in processes:
        assert p.proc.returncode == 1 and "Traceback" not in p.output(), p.output()
    assert lines[0] == lines[1] and len(lines[0]) == 1, lines
    assert re.match(rf"error: saving checkpoint step 2 to {workdir / 'checkpoints' / '2'} failed "
                    r"\(Input/output error, errno 5: .*\); no earlier checkpoint; ", lines[0][0])
    assert committed_steps(workdir) == []


# ----------------------------------------------------------------------- preemption of one


@pytest.mark.slow
@pytest.mark.extended
def test_sigterm_to_one_process_saves_the_same_step_everywhere_and_exits_0(tmp_path):
    """A spot VM gets SIGTERM alone: JAX's preemption sync point (orbax reached_preemption)
    makes every process stop at the same step, save it and exit 0; a restart resumes there and
    ends with the losses of an uninterrupted run."""
    workdir = tmp_path / "run"
    processes = start(pretrain_args(workdir, 40), 2)
    wait_for_step(processes, 4)
    sent = time.monotonic()
    processes[1].proc.send_signal(signal.SIGTERM)
    wait(processes, 300)
    seconds = [p.exited - sent for p in processes]
    saved = [[line for _, line in p.lines if line.startswith("SIGTERM: saved step ")]
             for p in processes]
    print(f"SIGTERM to process 1 of 2: exits {[p.proc.returncode for p in processes]} after "
          f"{[f'{s:.1f}' for s in seconds]} s; {saved}", flush=True)
    for p in processes:
        assert p.proc.returncode == 0, p.output()
        assert any(line == "Training preempted." for _, line in p.lines), p.output()
    assert len(saved[0]) == 1 and saved[0] == saved[1], saved
    step = int(saved[0][0].split()[3].rstrip(";"))
    assert max(committed_steps(workdir)) == step < 40
    only_committed_checkpoints(workdir)
    assert max(seconds) < 120

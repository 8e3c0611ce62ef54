"""Running a command as 2 CPU processes (jax.distributed on localhost) beside 1 process with 2
devices, and comparing the two runs (tests/train/test_multihost.py)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

# A process of the pair must exit within this many seconds of its last step's progress line
# (or its final write): a process left waiting for a peer would take much longer.
EXIT_BOUND_S = 60.0
TIMEOUT_S = 600.0  # a whole run, before it is killed
PROGRESS = re.compile(r"\bstep (\d+)/(\d+) \(")  # bertjax.train.metrics.progress_line
FINAL_WRITE = re.compile(r"^wrote ")


def devices_env(n: int) -> dict[str, str]:
    # Unbuffered: each line is timed when it is printed, not when a buffer fills.
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "JAX_PLATFORMS": "cpu",
            "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def coordinator_flags(port: int, process_id: int, num_processes: int = 2) -> list[str]:
    return [f"--coordinator_address=localhost:{port}", f"--num_processes={num_processes}",
            f"--process_id={process_id}"]


class Process:
    """`python <args>` from the project root, its output lines timed (time.monotonic()) by a
    reader thread, which also records when the process exits."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]):
        self.name = name
        self.started = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        self.exited: float | None = None
        self.killed = False
        self.proc = subprocess.Popen([sys.executable, *args], cwd=ROOT,
                                     env=dict(os.environ, **env), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
        self.proc.wait()
        self.exited = time.monotonic()

    def has_stepped(self) -> bool:
        return any(PROGRESS.search(line) for _, line in self.lines)

    def last_step_time(self) -> float:
        """When the final step's progress line came (a line `step N/N`; the last of them for
        a command that trains several runs), else the last `wrote ...` line, else the last
        line, else the start."""
        for pattern in (PROGRESS, FINAL_WRITE):
            times = [t for t, line in self.lines if (m := pattern.search(line))
                     and (pattern is FINAL_WRITE or m.group(1) == m.group(2))]
            if times:
                return times[-1]
        return self.lines[-1][0] if self.lines else self.started

    def kill(self, why: str) -> None:
        if not self.killed:
            self.killed = True
            self.lines.append((time.monotonic(), f"[killed by the test: {why}]"))
            self.proc.kill()

    def seconds_from_last_step_to_exit(self) -> float:
        return self.exited - self.last_step_time()

    def output(self, tail: int = 4000) -> str:
        return "\n".join(line for _, line in self.lines)[-tail:]


def run_pair_and_reference(args_for: Callable[[Path], list[str]], root: Path
                           ) -> tuple[list[Process], Process]:
    """args_for(directory) is the command (after `python`) writing into `directory`; it runs
    as 2 processes x 1 device into root/pair and as 1 process x 2 devices into root/single.

    The pair starts first: its first step sets up its cross-process (gloo) context, which gives
    up after 30 s; the reference starts once the pair has stepped (or exited), so that the 2
    cores are not shared three ways before then."""
    port = free_port()
    pair_args = args_for(root / "pair")
    pair = [Process(f"process {i}", pair_args + coordinator_flags(port, i), devices_env(1))
            for i in range(2)]
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and not any(p.has_stepped() or p.proc.poll() is not None
                                                  for p in pair):
        time.sleep(0.1)
    reference = Process("reference", args_for(root / "single"), devices_env(2))
    wait_all(pair, [reference], deadline)
    return pair, reference


def wait_all(pair: list[Process], others: list[Process], deadline: float) -> None:
    """Waits for the pair and the `others`. Kills one at `deadline`; one silent for
    2 * EXIT_BOUND_S after it has stepped (a hang: its bound fails anyway); a process of the
    pair whose peer failed more than EXIT_BOUND_S ago."""
    while any(p.exited is None for p in [*pair, *others]):
        now = time.monotonic()
        for p in [*pair, *others]:
            if p.proc.poll() is not None:
                continue
            peer_failed = p in pair and any(
                q.exited is not None and q.proc.returncode != 0 and now - q.exited > EXIT_BOUND_S
                for q in pair)
            if now > deadline:
                p.kill(f"still running after {now - p.started:.0f} s")
            elif p.has_stepped() and now - p.lines[-1][0] > 2 * EXIT_BOUND_S:
                p.kill(f"no output for {now - p.lines[-1][0]:.0f} s")
            elif peer_failed:
                p.kill("the other process of the pair failed")
        time.sleep(0.2)


# ------------------------------------------------------------------------------- comparisons


def read_metrics(workdir: Path, split: str) -> dict[int, dict[str, float]]:
    """step → the record of `split` in workdir/metrics.jsonl."""
    records = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["split"] == split:
            records[record["step"]] = record
    return records


def assert_same_losses(pair_dir: Path, single_dir: Path) -> None:
    """Train losses at every logged step within rtol 1e-5."""
    pair, single = read_metrics(pair_dir, "train"), read_metrics(single_dir, "train")
    assert sorted(pair) == sorted(single) and pair, (sorted(pair), sorted(single))
    np.testing.assert_allclose([pair[s]["loss"] for s in sorted(pair)],
                               [single[s]["loss"] for s in sorted(single)], rtol=1e-5,
                               err_msg=f"train losses of {pair_dir}")


def assert_same_evals(pair_dir: Path, single_dir: Path) -> None:
    """Every evaluation record (every metric) within rtol 1e-5."""
    pair, single = read_metrics(pair_dir, "eval"), read_metrics(single_dir, "eval")
    assert sorted(pair) == sorted(single) and pair, (sorted(pair), sorted(single))
    for step in pair:
        assert pair[step].keys() == single[step].keys(), step
        for key, value in pair[step].items():
            if key != "split":
                np.testing.assert_allclose(value, single[step][key], rtol=1e-5,
                                           err_msg=f"eval {key} at step {step}")


def assert_same_files(pair_dir: Path, single_dir: Path, names: list[str]) -> None:
    """Each file byte-identical; in JSON files the two run directories' own paths (which
    they may record) are read as one."""
    assert names
    for name in names:
        pair, single = (pair_dir / name).read_bytes(), (single_dir / name).read_bytes()
        if name.endswith(".json"):
            pair = pair.replace(str(pair_dir).encode(), str(single_dir).encode())
        assert pair == single, f"{name} differs"


def assert_same_export(pair_dir: Path, single_dir: Path) -> None:
    """Two bertjax checkpoint directories: config.json byte-identical, every parameter within
    rtol 1e-5 / atol 1e-6 (read back with bertjax.load_pretrained)."""
    import flax

    from bertjax.checkpoint_dir import load_pretrained

    assert_same_files(pair_dir, single_dir, ["config.json"])
    params, expected = (flax.traverse_util.flatten_dict(load_pretrained(d)[1], sep="/")
                        for d in (pair_dir, single_dir))
    assert params.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(params[key], expected[key], rtol=1e-5, atol=1e-6,
                                   err_msg=key)


def files_under(directory: Path) -> list[str]:
    """Every file below `directory` (there must be one), relative to its parent (e.g.
    submission/test.tsv)."""
    names = sorted(str(p.relative_to(directory.parent)) for p in directory.rglob("*")
                   if p.is_file())
    assert names, f"no files in {directory}"
    return names


# ------------------------------------------------------------------------------------ report


def _outcome(check: Callable[[], None] | None) -> tuple[str, str | None]:
    """("yes" | "no" | "n/a", the failure's message)."""
    if check is None:
        return "n/a", None
    try:
        check()
    except Exception as e:  # noqa: BLE001 - an assertion, or a file the run did not write
        return "no", f"{type(e).__name__}: {e}"
    return "yes", None


def check_job(job: str, pair: list[Process], reference: Process,
              losses: Callable[[], None] | None, outputs: Callable[[], None] | None) -> None:
    """Prints (and appends to $BERTJAX_MULTIHOST_REPORT) the line
    `job | exit codes | s from last step to exit | losses equal | outputs equal`, then fails
    on every check that did not pass, with the processes' output. losses / outputs: the
    comparisons (None: nothing to compare, "n/a")."""
    codes = [p.proc.returncode for p in pair]
    seconds = max(p.seconds_from_last_step_to_exit() for p in pair)
    losses_equal, losses_error = _outcome(losses)
    outputs_equal, outputs_error = _outcome(outputs)
    line = (f"{job} | pair {','.join(map(str, codes))}, reference {reference.proc.returncode} "
            f"| {seconds:.1f} | {losses_equal} | {outputs_equal}")
    print(line, flush=True)
    if os.environ.get("BERTJAX_MULTIHOST_REPORT"):
        with open(os.environ["BERTJAX_MULTIHOST_REPORT"], "a") as f:
            f.write(line + "\n")
    failures = []
    for p in [*pair, reference]:
        if p.proc.returncode != 0:
            failures.append(f"{p.name} exited {p.proc.returncode}:\n{p.output()}")
    slow = [p for p in pair if p.seconds_from_last_step_to_exit() > EXIT_BOUND_S]
    for p in slow:
        failures.append(f"{p.name} exited {p.seconds_from_last_step_to_exit():.1f} s after its "
                        f"last step (bound {EXIT_BOUND_S:g} s):\n{p.output()}")
    failures += [e for e in (losses_error, outputs_error) if e]
    if failures:
        pytest.fail(f"{job}: " + "\n\n".join(failures), pytrace=False)

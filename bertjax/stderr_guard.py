"""The stderr of a multi-process run, passed through a small companion process, so that each
process's output ends in one `error:` line however it ends.

Why a second process: when JAX's coordination service reports an error (its leader, process 0,
is gone; a task missed its heartbeats), JAX's client ends the process from a C++ thread with a
fatal log and a stack trace (abort, exit -6), before any Python code can run; the callback
that would replace it cannot be given from Python in jax 0.10 (a Python callable aborts with
std::bad_cast). The companion outlives its process by a moment: it holds back C++ log lines
for a moment, drops a fatal log, the lines just before it and all after it, and prints instead
the one line naming the lost process. Once an `error:` line has passed, nothing after it is shown.

Standard library only: the companion loads this file alone (`_COMPANION`).
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys

# absl's log line prefix (severity, date, time, thread, file:line]), as XLA's C++ logs.
_ABSL = re.compile(rb"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w.]+:\d+\]")
HOLD_S = 2.0  # how long C++ log lines wait for a fatal log that would replace them


def lost_line(index: int | None, count: int, where: str, cause: str) -> str:
    """The one line every remaining process prints when process `index` of `count` (None:
    not known) is gone; `where` is its address, `cause` how it was noticed."""
    who = f"process {index} of {count}" if index is not None else f"a process of {count}"
    return (f"error: lost {who}{f' ({where})' if where else ''}: {cause}; the host died, was "
            f"preempted or its process was killed; start all {count} processes again (the same "
            "command) to resume from the last checkpoint")


def coordinator_gone(text: str) -> bool:
    """Whether a JAX runtime error says the coordination service (process 0) is unreachable."""
    return "Failed to send RPC to coordination service" in text or (
        "coordination service" in text and "Socket closed" in text)


def unhealthy_task(text: str) -> int | None:
    """The task that the coordination service found dead (missed heartbeats), if named."""
    found = (re.search(r"Task (\d+) heartbeat timeout", text)
             or re.search(r"stopped sending heartbeats\):\s*(\d+)", text))
    return int(found[1]) if found else None


def from_jax_fatal(text: str, count: int, coordinator: str) -> str:
    """Our line for JAX's fatal log `text` (the fatal line and the lines after it)."""
    if coordinator_gone(text):
        return lost_line(0, count, f"the coordinator, {coordinator}",
                         "the coordination service stopped answering")
    task = unhealthy_task(text)
    if task is not None:
        return lost_line(task, count, "", "it sent no heartbeat to the coordination service")
    first = text.strip().splitlines()[0] if text.strip() else "a fatal error"
    first = re.sub(r"^F\d{4} \S+ +\d+ \S+\] ", "", first)
    return f"error: JAX's distributed runtime ended this process: {first[:300]}"


# The companion: `guard` from this file, without importing bertjax (nor JAX) there.
_COMPANION = """
import importlib.util
import sys

spec = importlib.util.spec_from_file_location("stderr_guard", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.guard(sys.stdin.fileno(), sys.stdout.buffer, int(sys.argv[2]), sys.argv[3])
"""


def start(count: int, coordinator: str) -> None:
    """Routes this process's stderr (file descriptor 2) through a companion process that runs
    `guard` and writes to the original stderr."""
    original = os.dup(2)
    companion = subprocess.Popen(
        [sys.executable, "-I", "-c", _COMPANION, os.path.abspath(__file__), str(count),
         coordinator], stdin=subprocess.PIPE, stdout=original, stderr=original)
    sys.stderr.flush()
    os.dup2(companion.stdin.fileno(), 2)
    os.close(original)
    companion.stdin.close()  # fd 2 holds the pipe now


def guard(fd: int, sink, count: int, coordinator: str) -> None:
    """Copies lines from file descriptor `fd` to `sink` (a binary file) until EOF, as the
    module says."""
    held: list[bytes] = []  # C++ log lines not yet shown (a fatal log may follow)
    fatal: list[bytes] | None = None
    done = False  # an `error:` line has passed
    rest = b""  # a line not yet complete

    def show(lines):
        if lines and not done:
            sink.write(b"".join(lines))
            sink.flush()

    while True:
        ready, _, _ = select.select([fd], [], [], HOLD_S)
        if not ready:
            show(held)
            held = []
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        *lines, rest = (rest + chunk).split(b"\n")
        for line in (line + b"\n" for line in lines):
            if fatal is not None:
                fatal.append(line)
                continue
            log = _ABSL.match(line)
            if (log and log[1] == b"F") or line.startswith(b"terminate called"):
                fatal = [line]
                continue
            if log:
                held.append(line)
                continue
            show(held + [line])
            held = []
            done = done or line.startswith(b"error: ")
    if fatal is not None and not done:
        text = b"".join(fatal + [rest]).decode(errors="replace")
        show([from_jax_fatal(text, count, coordinator).encode() + b"\n"])
    else:
        show(held + ([rest] if rest else []))

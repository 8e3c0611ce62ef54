"""The one rule for side effects on a multi-host run (one process per host, docs/tpu.md):

1. Every collective is called by every process, in the same order: orbax saves and restores
   (`Checkpointer`, `save_pretrained`), `to_host` (an all-gather), `write_from_main`'s
   broadcast.
   Never put one under `if jax.process_index() == 0`: the other processes would not join it
   and the job would hang until JAX's shutdown barrier aborts it.
2. Plain file writes (JSON, text, plots, prediction files) happen once, on process 0, through
   `write_from_main`, which every process calls: it shares process 0's outcome, so the others
   go on only once the files are in place, or fail with the same `error:` line. Transient
   errors of a remote file system are retried with backoff first (`with_retries`).

On one process both are plain calls.

A process that dies (a host lost, a process killed) ends every other one with the same one
`error:` line naming it (index and host): a collective with it fails (on CPU at once: gloo's
connection closes; `lost_process`), or its heartbeat stops for `config.distributed.timeout_s`
(`Watchdog`), whichever comes first. If process 0 dies, the coordination service goes with it;
JAX then ends each process at once, and `bertjax.stderr_guard` replaces JAX's fatal log with
that line.
"""

from __future__ import annotations

import atexit
import errno
import itertools
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from bertjax import stderr_guard
from bertjax.errors import BertjaxError

# config.distributed.timeout_s when a config has none (experiments/common.py: distributed()).
DISTRIBUTED_TIMEOUT_S = 300.0


def distributed_timeout_s(config) -> float:
    """config.distributed.timeout_s: how long a process waits for the others (the watchdog's
    bound on a silent process, a finishing process's wait for the rest)."""
    return float((config or {}).get("distributed", {}).get("timeout_s", DISTRIBUTED_TIMEOUT_S))

T = TypeVar("T")
# A remote file system's passing failures (a timeout, a reset connection, an I/O error); a
# full disk, a missing permission or directory will not pass by waiting.
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ESTALE,
                              errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED,
                              errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH})
RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 16.0)  # then the error stands
_MESSAGE_BYTES = 2048  # room for an error line shared with the other processes


class WriteError(BertjaxError, OSError):
    """Process 0 failed to write an output file; every process raises it, with its message."""


class LostProcess(BertjaxError, RuntimeError):
    """Another process of the job is gone: a collective or coordination call failed. `index`:
    which one, where known."""

    def __init__(self, index: int | None, cause: str):
        super().__init__(stderr_guard.lost_line(index, jax.process_count(), "", cause)
                         .removeprefix("error: "))
        self.index, self.cause = index, cause


# How XLA's runtime reports a failure whose cause is another process gone: a collective whose
# peer closed its connection (gloo on CPU), a coordination-service call that failed (its host,
# process 0, gone; a task that missed its heartbeats). Messages, since every status comes as
# the same exception type.
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Socket closed|"
                        r"heartbeat timeout|stopped sending heartbeats|Broken pipe|"
                        r"Failed to send RPC to coordination service")


def lost_process(error: BaseException) -> LostProcess | None:
    """`error` as a LostProcess when it failed because another process of this multi-process
    run is gone, naming it where the error tells (of two, the other one; the coordinator, when
    the coordination service is unreachable; a task the service found dead); None otherwise.
    `exit_line` names it otherwise."""
    count = jax.process_count() if jax.distributed.is_initialized() else 1
    text = str(error)
    found = _PEER_GONE.search(text)
    if count == 1 or not found:
        return None
    cause = f"a collective failed ({found[0]})"
    if stderr_guard.coordinator_gone(text):
        index, cause = 0, "the coordination service stopped answering"
    else:
        index = stderr_guard.unhealthy_task(text)
        if index is None and count == 2:
            index = 1 - jax.process_index()
    return LostProcess(index, cause)


def exit_line(lost: LostProcess) -> str:
    """The one line naming the lost process. Where `lost` does not name it, the watchdog looks
    for the process whose heartbeats stopped (at most `config.distributed.timeout_s`; usually
    seconds, as a failed collective makes it look harder: `Watchdog.suspect`)."""
    if lost.index is None and _watchdog is not None:
        named = _watchdog.suspect()
        if named is not None:
            return named
    return _watchdog.line(lost.index, lost.cause) if _watchdog else stderr_guard.lost_line(
        lost.index, jax.process_count(), "", lost.cause)


# ------------------------------------------------------------------------------ the watchdog

_WATCH = "bertjax/watch/"  # coordination-service keys: host/i, beat/i, left/i, lost


class Watchdog:
    """Each process's heartbeat, and its watch over the others', through the coordination
    service: a process whose heartbeat stops for `timeout_s` (killed, its host dead) is named
    by every other process in the same one line (the first process to notice records it under
    `lost`; the others print that), which then end (`on_lost`). JAX's own heartbeat timeout is
    set longer (cli.initialize_distributed), so this comes first: JAX's ends each process with
    a fatal log, which stderr_guard turns into a line, but not always the same line everywhere.
    The heartbeat thread runs while the main thread waits or compiles (XLA releases the GIL).

    A process that ends (done, or with its own error) marks itself `left`, and is no longer
    watched."""

    def __init__(self, client, timeout_s: float, coordinator: str, on_lost: Callable[[str], Any]):
        self.client, self.timeout_s, self.coordinator = client, timeout_s, coordinator
        self.on_lost = on_lost
        self.index, self.count = jax.process_index(), jax.process_count()
        self.interval_s = min(5.0, max(0.5, timeout_s / 30))
        # After a failed collective, a process silent this long is the lost one.
        self.suspect_s = max(3 * self.interval_s, 5.0)
        self._threshold_s = timeout_s
        self._changed: dict[int, tuple[str | None, float]] = {}  # peer: (beat, when it changed)
        self._entries: dict[str, str] = {}
        self._stopped = threading.Event()
        client.key_value_set(f"{_WATCH}host/{self.index}",
                             f"{socket.gethostname()}, pid {os.getpid()}", allow_overwrite=True)
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        beat = 0
        while not self._stopped.is_set():
            beat += 1
            try:
                self.client.key_value_set(f"{_WATCH}beat/{self.index}", str(beat),
                                          allow_overwrite=True)
                self._entries = dict(self.client.key_value_dir_get(_WATCH))
            except Exception as e:  # noqa: BLE001 - the service's errors are all one type
                if self._stopped.is_set():
                    return
                if stderr_guard.coordinator_gone(str(e)):
                    self.on_lost(self.line(0, "the coordination service stopped answering"))
                    return
            else:
                line = self._verdict()
                if line is not None:
                    self.on_lost(line)
                    return
            self._stopped.wait(self.interval_s)

    def _verdict(self) -> str | None:
        """The recorded `lost` line, or a line naming a peer silent for the threshold."""
        entries, now = self._entries, time.monotonic()
        if f"{_WATCH}lost" in entries:
            return entries[f"{_WATCH}lost"]
        for peer in range(self.count):
            if peer == self.index or f"{_WATCH}left/{peer}" in entries:
                continue
            beat = entries.get(f"{_WATCH}beat/{peer}")
            last, since = self._changed.get(peer, (None, now))
            if beat != last or peer not in self._changed:
                self._changed[peer] = (beat, now)
            elif now - since > self._threshold_s:
                return self.line(peer, f"it sent no heartbeat for {now - since:.0f} s")
        return None

    def suspect(self) -> str | None:
        """After a failed collective: watches with the short threshold (`suspect_s`) for up to
        `timeout_s`; the line naming the silent process, else None."""
        self._threshold_s = self.suspect_s
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            time.sleep(self.interval_s)  # the watchdog thread may end the process meanwhile
            entries = self._entries
            line = entries.get(f"{_WATCH}lost")
            if line is not None:
                return line
            for peer in range(self.count):  # a peer that ended with its own error
                left = entries.get(f"{_WATCH}left/{peer}", "")
                if peer != self.index and left.startswith("error: "):
                    return self.line(peer, "it ended with its own error (see its log)")
        return None

    def line(self, index: int | None, cause: str) -> str:
        where = ""
        if index == 0:
            where = f"the coordinator, {self.coordinator}"
        elif index is not None:
            where = self._entries.get(f"{_WATCH}host/{index}", "")
        return stderr_guard.lost_line(index, self.count, where, cause)

    def agree(self, line: str) -> str:
        """Records `line` as the job's `lost` line, or returns the one another process
        recorded first."""
        try:
            self.client.key_value_set(f"{_WATCH}lost", line)
        except Exception:  # noqa: BLE001 - already recorded, or the service is gone
            try:
                return self.client.key_value_try_get(f"{_WATCH}lost")
            except Exception:  # noqa: BLE001
                pass
        return line

    def leave(self, line: str, wait_for_others: bool) -> None:
        """Marks this process as ended (with `line`), and stops watching. wait_for_others: on
        process 0, which hosts the coordination service, first waits (boundedly) for the other
        processes, but the one `line` names as lost, to have ended too: its exit would end
        them at once, before they print their line."""
        self._stopped.set()
        lost = re.match(r"error: lost process (\d+) of", line)
        try:
            self.client.key_value_set(f"{_WATCH}left/{self.index}", line, allow_overwrite=True)
            if not (wait_for_others and self.index == 0):
                return
            deadline = time.monotonic() + 3 * self.interval_s + 5
            others = {f"{_WATCH}left/{p}" for p in range(1, self.count)
                      if not (lost and p == int(lost[1]))}
            while time.monotonic() < deadline:
                if others <= dict(self.client.key_value_dir_get(_WATCH)).keys():
                    return
                time.sleep(0.2)
        except Exception:  # noqa: BLE001 - the service is gone: nothing to wait for
            return


_watchdog: Watchdog | None = None


def start_watchdog(timeout_s: float, on_lost: Callable[[str], Any]) -> None:
    """On a multi-process run (after jax.distributed.initialize): the Watchdog, and stderr
    through the stderr_guard companion. At a normal exit the process marks itself ended before
    JAX's own shutdown."""
    global _watchdog
    if jax.process_count() == 1 or _watchdog is not None:
        return
    from jax._src import distributed

    coordinator = distributed.global_state.coordinator_address or "?"
    stderr_guard.start(jax.process_count(), coordinator)
    _watchdog = Watchdog(distributed.global_state.client, timeout_s, coordinator, on_lost)
    atexit.register(_watchdog.leave, "done", False)  # runs before JAX's (registered earlier)


def watchdog() -> Watchdog | None:
    return _watchdog


_calls = itertools.count()  # coordination-service names used by this process, in order
_last_status_key: str | None = None


def unique(tag: str) -> str:
    """`tag` made unique within this process's life: every process takes the same names in
    the same order, so they agree, and a later job in the same process (a grid's next cell)
    never meets an earlier one's keys or barriers."""
    return f"bertjax/{next(_calls)}/{tag}"


def statuses(tag: str, status: str, timeout_s: float) -> list[str]:
    """Every process's `status` (index: process), each process giving its own under `tag`.
    Through the coordination service (a key per process, then a barrier), not a device
    collective, so a process may join up to `timeout_s` later (e.g. after its input's own
    timeout) and the others wait without running anything. The previous call's key is
    removed once every process is past this call's barrier (so has read it)."""
    global _last_status_key
    if jax.process_count() == 1:
        return [status]
    from jax._src import distributed

    client, me = distributed.global_state.client, jax.process_index()
    key = unique(tag)
    client.key_value_set(f"{key}/{me}", status)
    client.wait_at_barrier(key, int(timeout_s * 1000))
    shared = dict(client.key_value_dir_get(f"{key}/"))
    if _last_status_key is not None:
        client.key_value_delete(f"{_last_status_key}/{me}")
    _last_status_key = key
    return [shared[f"{key}/{i}"] for i in range(jax.process_count())]


def is_main() -> bool:
    return jax.process_index() == 0


def to_host(tree: Any) -> Any:
    """A pytree of (possibly sharded over hosts) arrays as NumPy arrays of their full values on
    every process. A collective on a multi-host run: every process must call it."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        tree = multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _error_text(error: BaseException) -> str:
    if isinstance(error, OSError) and not isinstance(error, BertjaxError) and error.strerror:
        return (f"{error.filename}: " if error.filename else "") + error.strerror
    return str(error) or type(error).__name__


def with_retries(write: Callable[[], T], what: str = "write") -> T:
    """`write()`, tried again after each of RETRY_DELAYS_S while it fails with a transient
    OSError (TRANSIENT_ERRNOS); any other error, or the last transient one, is raised at
    once. `write` must be safe to repeat (a file written whole, replaced, or appended to by
    a writer that cuts off a partial line first)."""
    for delay in (*RETRY_DELAYS_S, None):
        try:
            return write()
        except OSError as e:
            if delay is None or e.errno not in TRANSIENT_ERRNOS:
                raise
            logging.getLogger(__name__).warning("%s failed (%s); trying again in %g s", what,
                                                _error_text(e), delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def _share(message: str) -> str:
    """Process 0's `message` on every process (a collective)."""
    from jax.experimental import multihost_utils

    data = np.zeros(_MESSAGE_BYTES, np.uint8)
    encoded = message.encode()[:_MESSAGE_BYTES]
    data[:len(encoded)] = np.frombuffer(encoded, np.uint8)
    shared = np.asarray(multihost_utils.broadcast_one_to_all(data))
    return shared.tobytes().rstrip(b"\0").decode(errors="replace")


def write_from_main(write: Callable[[], T], what: str = "write") -> T | None:
    """Runs `write()` on process 0 only and returns its result there (None elsewhere). Every
    process must call this: it returns once process 0's write is done, and if the write failed
    every process raises (process 0 its own error, the others a WriteError with its text).
    Transient errors are retried first (`with_retries`; `what` names the write in its
    warnings)."""
    error: BaseException | None = None
    result = None
    if is_main():
        try:
            result = with_retries(write, what)
        except Exception as e:  # shared below, then raised
            error = e
    if jax.process_count() > 1:
        shared = _share("" if error is None else _error_text(error))
        if shared and error is None:
            raise WriteError(shared)
    if error is not None:
        raise error
    return result


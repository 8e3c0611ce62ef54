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

A process that dies (a host lost, a process killed) makes the others' next collective fail:
on CPU at once (gloo's connection closes), elsewhere once the coordination service misses its
heartbeats for `config.distributed.timeout_s` (cli.initialize_distributed), when JAX ends every
process. `lost_process` turns the first kind into one line naming the process.
"""

from __future__ import annotations

import errno
import logging
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from bertjax.errors import BertjaxError

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
    """Another process of the job is gone: a collective with it failed."""


# How XLA's runtime reports a collective whose peer has gone (gloo on CPU, the coordination
# service elsewhere); messages, since every status comes as the same exception type.
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Socket closed|"
                        r"heartbeat timeout|stopped sending heartbeats|Broken pipe")


def lost_process(error: BaseException) -> LostProcess | None:
    """`error` as a LostProcess when it is a collective that failed because another process of
    this multi-process run is gone (naming it where it can be told: the other one of two);
    None otherwise."""
    count = jax.process_count() if jax.distributed.is_initialized() else 1
    text = str(error)
    found = _PEER_GONE.search(text)
    if count == 1 or not found:
        return None
    peer = re.search(r"peer (\[[^\]]+\]:\d+)", text)
    who = (f"process {1 - jax.process_index()} of 2" if count == 2 else
           f"a process of {count}" + (f" (collective peer {peer[1]})" if peer else ""))
    return LostProcess(
        f"lost {who}: a collective failed ({found[0]}); the host died, was preempted or its "
        f"process was killed; start all {count} processes again (the same command) to resume "
        "from the last checkpoint")


def statuses(tag: str, status: str, timeout_s: float) -> list[str]:
    """Every process's `status` (index: process), each process giving its own under the same
    `tag`, used once. Through the coordination service (a key per process, then a barrier),
    not a device collective, so a process may join up to `timeout_s` later (e.g. after its
    input's own timeout) and the others wait without running anything."""
    if jax.process_count() == 1:
        return [status]
    from jax._src import distributed

    client, me = distributed.global_state.client, jax.process_index()
    client.key_value_set(f"bertjax/{tag}/{me}", status)
    client.wait_at_barrier(f"bertjax/{tag}", int(timeout_s * 1000))
    shared = dict(client.key_value_dir_get(f"bertjax/{tag}/"))
    return [shared[f"bertjax/{tag}/{i}"] for i in range(jax.process_count())]


def forget_status(tag: str) -> None:
    """Removes this process's `statuses` key of `tag` (once every process has read it)."""
    if jax.process_count() > 1:
        from jax._src import distributed

        distributed.global_state.client.key_value_delete(f"bertjax/{tag}/{jax.process_index()}")


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


def write_from_main(write: Callable[[], T]) -> T | None:
    """Runs `write()` on process 0 only and returns its result there (None elsewhere). Every
    process must call this: it returns once process 0's write is done, and if the write failed
    every process raises (process 0 its own error, the others a WriteError with its text).
    Transient errors are retried first (`with_retries`)."""
    error: BaseException | None = None
    result = None
    if is_main():
        try:
            result = with_retries(write)
        except Exception as e:  # shared below, then raised
            error = e
    if jax.process_count() > 1:
        shared = _share("" if error is None else _error_text(error))
        if shared and error is None:
            raise WriteError(shared)
    if error is not None:
        raise error
    return result


"""The one rule for side effects on a multi-host run (one process per host, docs/tpu.md):

1. Every collective is called by every process, in the same order: orbax saves and restores
   (`Checkpointer`, `save_pretrained`), `to_host` (an all-gather), `write_from_main`'s
   broadcast.
   Never put one under `if jax.process_index() == 0`: the other processes would not join it
   and the job would hang until JAX's shutdown barrier aborts it.
2. Plain file writes (JSON, text, plots, prediction files) happen once, on process 0, through
   `write_from_main`, which every process calls: it shares process 0's outcome, so the others
   go on only once the files are in place, or fail with the same `error:` line.

On one process both are plain calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from bertjax.errors import BertjaxError

T = TypeVar("T")
_MESSAGE_BYTES = 2048  # room for an error line shared with the other processes


class WriteError(BertjaxError, OSError):
    """Process 0 failed to write an output file; every process raises it, with its message."""


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
    every process raises (process 0 its own error, the others a WriteError with its text)."""
    error: BaseException | None = None
    result = None
    if is_main():
        try:
            result = write()
        except Exception as e:  # shared below, then raised
            error = e
    if jax.process_count() > 1:
        shared = _share("" if error is None else _error_text(error))
        if shared and error is None:
            raise WriteError(shared)
    if error is not None:
        raise error
    return result


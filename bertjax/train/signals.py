"""What asks a run to stop: SIGTERM (a preempted VM, `kill`) and, on a single process once
training runs, the first Ctrl-C. Both ask for a save and a stop at the next step; a second Ctrl-C
quits at once."""

from __future__ import annotations

import contextlib
import signal
import threading

import jax


class StopSignals:
    """Installs a SIGTERM handler on a single process (a multi-process run stops at orbax's
    preemption sync point instead); `restore` puts the previous one back."""

    def __init__(self):
        self.sigterm_received = False  # no collective call: safe at any moment
        self.ctrl_c_received = False
        self._previous = None
        if jax.process_count() == 1:
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self.sigterm_received = True

    def _on_sigint(self, signum, frame):
        if self.ctrl_c_received:  # the second: quit now, unsaved
            raise KeyboardInterrupt
        self.ctrl_c_received = True

    def requested(self) -> bool:
        return self.sigterm_received or self.ctrl_c_received

    @contextlib.contextmanager
    def ctrl_c_saves(self):
        """Within: the first Ctrl-C (SIGINT) asks for a save and a stop at the next step, as
        SIGTERM does; a second raises KeyboardInterrupt at once. The previous handler comes
        back after (the library runs in notebooks, whose interrupt is SIGINT). Only on a single
        process, from the main thread: SIGINT reaches only the process it is sent to, and the
        others would wait for it in the step's collectives (a multi-process run stops on
        SIGTERM; Ctrl-C there stays Python's KeyboardInterrupt)."""
        if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield
        finally:
            # None: a handler not set from Python; Python's own is the nearest to it.
            signal.signal(signal.SIGINT, signal.default_int_handler if previous is None
                          else previous)

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

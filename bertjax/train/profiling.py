"""`config.profile.steps=START,END`: a `jax.profiler` trace of training steps START..END.

Steps are numbered as the logs number them (step k is the k-th optimizer step of the run).
The trace goes to `workdir/profile` in the layout of TensorBoard's profile plugin (xprof):
`workdir/profile/plugins/profile/<run>/<host>.xplane.pb`, one file per process.
"""

from __future__ import annotations

from typing import Any

import jax
from etils import epath

from bertjax.errors import ConfigError

FIELD = "config.profile.steps"
PROFILE_DIR = "profile"


def parse_steps(value: Any) -> tuple[int, int] | None:
    """"START,END" (1 <= START <= END) → (START, END); "" or None → None (no profile)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    parts = str(value).split(",")
    try:
        start, end = (int(p) for p in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        start = end = None
    if start is None or not 1 <= start <= end:
        raise ConfigError(f"{FIELD}={value!r} must be START,END: two step numbers with "
                          "1 <= START <= END (e.g. 10,20)")
    return start, end


def steps_of(config) -> tuple[int, int] | None:
    """The (START, END) of a job's config; None where it profiles nothing (or has no field)."""
    return parse_steps((config.get("profile") or {}).get("steps", ""))


class StepProfiler:
    """Starts the trace before step START runs and stops it once step END has finished (its
    outputs ready, so the trace holds the whole step, not just its dispatch)."""

    def __init__(self, steps: tuple[int, int] | None, workdir: str | epath.Path, log=print):
        self.steps, self.log = steps, log
        self.directory = epath.Path(workdir) / PROFILE_DIR
        self.active = self.done = False

    def before(self, step: int) -> None:
        """Call before running step `step` (1-based). A run resumed inside START..END traces
        from its first step on."""
        if self.steps and not (self.active or self.done) and (
                self.steps[0] <= step <= self.steps[1]):
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, outputs: Any) -> None:
        """Call once step `step` has been dispatched, with its outputs."""
        if self.active and step >= self.steps[1]:
            jax.block_until_ready(outputs)
            self.stop()

    def stop(self) -> None:
        """Ends an active trace (also where a run stops before END) and says where it is."""
        if not self.active:
            return
        jax.profiler.stop_trace()
        self.active, self.done = False, True
        start, end = self.steps
        self.log(f"Profile of steps {start}..{end} written to {self.directory} (tensorboard "
                 f"--logdir {self.directory}, Profile tab)")

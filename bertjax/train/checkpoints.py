"""Training checkpoints for every job: one orbax CheckpointManager under `workdir/checkpoints`.

Each step directory `checkpoints/<step>/` holds three items, committed together:
  state  TrainState (step, params, optimizer state, RNG): sharded arrays, restorable onto any
         mesh;
  meta   JSON: the stage being trained and the evaluation history so far;
  data   the input's position (`position*`), written by the iterator's own `save(prefix)`
         (tf.data: shuffle buffers included). Every job's input is one global order of
         batches, of which each process takes its rows, so the position is the same on every
         process: process 0 writes it and every process restores it, on a slice of any size.
orbax writes a step into a temporary directory and renames it when complete, so a run killed
mid-save leaves the previous checkpoint intact. Kept: the last `max_to_keep` steps, plus the
step with the best `best_metric` (evaluated steps carry their metrics).

Faults: a save that fails (a full disk, a write error; with async saves found at the next save
or `wait`) raises one CheckpointError naming the path, the earlier steps untouched. A transient
failure (multihost.TRANSIENT_ERRNOS: EIO, a timeout, a reset connection) is first tried again,
synchronously, after each of multihost.RETRY_DELAYS_S (`multihost.with_retries`): the same step
where its state is still at hand (a save that failed at once, the save `wait` finishes at the end
of a run or at a preemption); else (training went on) the next save stands in for it, made at
once. A save is collective: after each attempt every process shares its outcome
(`multihost.statuses`), so all try again together or all stop with the same line. A failed
attempt never becomes a step: orbax writes into a temporary directory (removed when the step is
saved again) and renames it only once every write is done. On resume,
`restore_newest` skips a step that fails to restore (a truncated or missing file), says so and
moves it to `workdir/unreadable_checkpoints/<step>` (kept for inspection, never deleted) so the
run can save that step again. A checkpoint from before config.rng_impl (a raw dropout key)
resumes exactly with the default threefry keys, and is refused in one line with others
(`typed_key`).

Preemption: on a multi-process run the JAX distributed runtime turns SIGTERM (how TPU VMs
announce preemption) into a sync point that every process reaches at the same step
(`reached_preemption`). A single process has no runtime to do that, so SIGTERM sets a flag;
so does Ctrl-C (SIGINT) while the loop trains (`ctrl_c_saves`): the loop saves and stops.

Stop-gaps: a checkpoint saved because time passed (config.checkpoint.every_minutes) is kept
only while it is the newest (`_LatestN`), so it never takes the place of one kept by steps
(a grid exports those).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers

from bertjax.errors import CheckpointError
from bertjax.train import multihost
from bertjax.train import step as step_lib

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 1200  # config.checkpoint.timeout_s: orbax's own default
TMP_SUFFIX = ocp.path.atomicity_types.TMP_DIR_SUFFIX  # of a step directory being written
UNREADABLE_DIR = "unreadable_checkpoints"


def short_reason(error: BaseException) -> str:
    """An exception as one short line: the OS error and its file where there is one (tensorstore
    buries them in a long message, and appends its whole spec)."""
    text = str(error).strip()
    os_error = re.search(r"([^:\]]+) \[os_error_code='(\d+)'\]", text)
    if isinstance(error, OSError) and error.strerror:
        text = error.strerror + (f": {error.filename}" if error.filename else "")
    elif os_error:
        failed = re.search(r'Failed (?:writing|reading): "([^"]+)"', text)
        text = f"{os_error[1].strip()}, errno {os_error[2]}" + (f": {failed[1]}" if failed else "")
    else:
        text = text.split("\n")[0].split(" [tensorstore_spec")[0]
        text = text.split(" See full TensorStore details")[0]  # then its whole spec
        files = re.findall(r'local file "([^"]+)"', text)
        if files:  # tensorstore's chain "opening ...: reading ...: <cause>": cause and file
            text = f"{text.rsplit(chr(34) + ': ', 1)[-1]}: {files[-1]}"
    text = text or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class UnreadableCheckpoint(CheckpointError):
    """A step that fails to restore; `reason` says why in a few words."""

    RESUME_HINT = ("does not fit this run's model and optimizer", "resume with the config it was "
                   "saved with or use a new --workdir")

    def __init__(self, path: epath.Path, reason: str, hint: tuple[str, str] = RESUME_HINT):
        super().__init__(f"{path} is unreadable or {hint[0]} ({reason}); {hint[1]}")
        self.reason = reason


class _DropReraised(logging.Filter):
    """Drops orbax's error logs (a failed async save logs its traceback from several threads):
    every such error is also raised to the Checkpointer, which reports it in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not ("orbax" in record.pathname and record.levelno >= logging.ERROR)


class _DropTaskErrors(logging.Filter):
    """Drops asyncio's reports of exceptions in orbax's tasks and futures (bertjax runs no
    asyncio code of its own): a failed save or restore raises its first error to its caller,
    which reports it in one line; the others are logged, with a traceback, whenever their
    abandoned tasks are garbage-collected, often only at the interpreter's exit, after the
    command's error line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.exc_info is None


_DROP_TASK_ERRORS = _DropTaskErrors()


def ignore_late_callbacks() -> None:
    """When an orbax save or restore fails, tensorstore's other reads and writes of it still
    complete, into the event loop that orbax closes on the failure; Python reports each as an
    unraisable "Event loop is closed" RuntimeError (a traceback apiece, before and after the
    command's error line). Those, and asyncio's reports of the failed tasks
    (`_DropTaskErrors`), are dropped from the first orbax use on."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_late_reads", False):
        return

    def hook(unraisable):
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
            previous(unraisable)

    hook.drops_late_reads = True
    sys.unraisablehook = hook
    # A failed save's writes that never started: collected at exit, each with a warning.
    warnings.filterwarnings("ignore", r"coroutine 'async_serialize_from_host\.", RuntimeWarning)
    logging.getLogger("asyncio").addFilter(_DROP_TASK_ERRORS)


def read_checkpoint(path: epath.Path, read: Callable[[], T], what: str = "",
                    hint: tuple[str, str] = UnreadableCheckpoint.RESUME_HINT) -> T:
    """`read()` (an orbax restore of `path`): the one error path of every checkpoint reader
    (resume, export, bertjax checkpoint directories). Any failure (a truncated or missing file,
    which tensorstore reports as OUT_OF_RANGE or NOT_FOUND, a shape that does not fit) is an
    UnreadableCheckpoint naming `path`; `what` says which part was read, `hint` (what else it
    may be, what to do) completes the line."""
    ignore_late_callbacks()
    try:
        return read()
    except Exception as e:  # orbax / tensorstore raise ValueError, OSError, KeyError...
        raise UnreadableCheckpoint(path, what + short_reason(e), hint) from None


# The key data of a checkpoint saved before config.rng_impl existed: a raw threefry key.
_RAW_KEY_IMPL = "threefry2x32"


def typed_key(path: epath.Path, value: Any, target: jax.ShapeDtypeStruct) -> Any:
    """`value` restored for `target`, with raw key data where a typed PRNG key is expected (the
    dropout key of a checkpoint saved before config.rng_impl: a raw uint32[2] threefry key)
    made the typed threefry key of the same bits, so the run goes on exactly as it would have.
    Any other key type cannot continue that run: a CheckpointError in one line."""
    wanted = jax.dtypes.issubdtype(target.dtype, jax.dtypes.prng_key)
    if not wanted or jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        return value
    raw = jax.random.key(0, impl=_RAW_KEY_IMPL)
    if target.dtype != raw.dtype or value.shape != jax.random.key_data(raw).shape:
        impl = next((name for name in step_lib.RNG_IMPLS
                     if jax.random.key(0, impl=name).dtype == target.dtype), str(target.dtype))
        raise CheckpointError(
            f"{path} was saved before config.rng_impl existed: its dropout key is a raw "
            f"{_RAW_KEY_IMPL} key, which config.rng_impl={impl!r} cannot continue; resume with "
            f"config.rng_impl={_RAW_KEY_IMPL!r} (its default), or use a new --workdir")
    wrap = functools.partial(jax.random.wrap_key_data, impl=_RAW_KEY_IMPL)
    return jax.jit(wrap, out_shardings=target.sharding)(value)


POSITION_PREFIX = "position"


class DataIteratorHandler(ocp.CheckpointHandler):
    """Saves / restores an input iterator through its `save(prefix)` / `restore(prefix)`: the
    global position, written by process 0, read by every process."""

    def save(self, directory: epath.Path, args: DataIteratorSave) -> None:
        def write():
            directory.mkdir(parents=True, exist_ok=True)
            args.iterator.save(str(directory / POSITION_PREFIX))

        multihost.write_from_main(write, f"writing the input position to {directory}")

    def restore(self, directory: epath.Path, args: DataIteratorRestore) -> Any:
        args.iterator.restore(str(directory / POSITION_PREFIX))
        return args.iterator


@ocp.args.register_with_handler(DataIteratorHandler, for_save=True)
@dataclasses.dataclass
class DataIteratorSave(ocp.args.CheckpointArgs):
    iterator: Any


@ocp.args.register_with_handler(DataIteratorHandler, for_restore=True)
@dataclasses.dataclass
class DataIteratorRestore(ocp.args.CheckpointArgs):
    iterator: Any


def checkpoints_dir(workdir: str) -> epath.Path:
    """workdir/checkpoints, absolute: orbax wants absolute paths (gs:// URLs already are)."""
    root = workdir if "://" in str(workdir) else os.path.abspath(workdir)
    return epath.Path(root) / "checkpoints"


def _os_error(error: BaseException) -> tuple[int, BaseException]:
    """(errno, the error stating it) of the OS error behind `error` (tensorstore states it in
    its message), searched along the chain of errors it was raised during (on a multi-process
    run orbax's closing barrier times out, raised over the write's error); (0, error): none."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return seen.errno, seen
        found = re.search(r"\[os_error_code='(\d+)'\]", str(seen))
        if found:
            return int(found[1]), seen
        seen = seen.__cause__ or seen.__context__
    return 0, error


@dataclasses.dataclass
class _Pending:
    """An async save not yet known to be done, with what it takes to make it again; the state
    by weak reference (keeping it would hold a second copy of it in device memory)."""

    step: int
    state: weakref.ref | None
    meta: dict[str, Any]
    iterator: Any
    metrics: dict[str, float] | None

    def live_state(self) -> Any | None:
        """The saved state while someone else still holds it and a donating step has not
        taken its buffers; else None."""
        state = self.state() if self.state is not None else None
        leaves = jax.tree.leaves(state)
        if state is None or any(isinstance(a, jax.Array) and a.is_deleted() for a in leaves):
            return None
        return state


@dataclasses.dataclass
class _LatestN:
    """orbax's LatestN over the checkpoints that are not `stopgaps`; a stop-gap is kept while
    it is the newest (the run resumes from it), and deleted by the next save."""

    n: int
    stopgaps: set[int]

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        regular = [c.step for c in checkpoints if c.step not in self.stopgaps]
        kept = set(regular[-self.n:] if self.n > 0 else [])
        if checkpoints:
            kept.add(checkpoints[-1].step)
        return [c.step in kept for c in checkpoints]


class Checkpointer:
    def __init__(self, workdir: str, max_to_keep: int = 3, async_save: bool = True,
                 best_metric: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 distributed_timeout_s: float = multihost.DISTRIBUTED_TIMEOUT_S):
        self.directory = checkpoints_dir(workdir)
        # A process whose writes failed never reaches orbax's barrier after them: the others
        # wait there for `timeout_s`, then all share their outcome (`_agreed`).
        self.agree_timeout_s = timeout_s + distributed_timeout_s
        ignore_late_callbacks()
        self._stopgaps: set[int] = set()  # steps saved by time (`save(stopgap=True)`)
        policies = [_LatestN(max_to_keep, self._stopgaps)]
        if best_metric:
            policies.append(checkpoint_managers.BestN(
                get_metric_fn=lambda m: m[best_metric], n=1,
                keep_checkpoints_without_metrics=False))
        self._options = functools.partial(
            ocp.CheckpointManagerOptions,
            # A failed attempt's (or a killed run's) temporary directory goes at start.
            enable_async_checkpointing=async_save, create=True, cleanup_tmp_directories=True,
            async_options=ocp.AsyncOptions(timeout_secs=int(timeout_s)),
            preservation_policy=checkpoint_managers.AnyPreservationPolicy(policies))
        self.manager = ocp.CheckpointManager(self.directory, options=self._options())
        self._log_filter = _DropReraised()
        logging.getLogger("absl").addFilter(self._log_filter)
        self._pending: _Pending | None = None
        self._failed = False
        self._abandoned = False

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def reached_preemption(self, step: int) -> bool:
        """orbax's preemption sync point (a multi-process run's SIGTERM; a collective)."""
        return self.manager.reached_preemption(step)

    def _save_error(self, step: int | None, error: BaseException) -> CheckpointError:
        self._failed = True
        done = [s for s in self.manager.all_steps() if s != step]
        kept = f"step {max(done)} is intact" if done else "no earlier checkpoint"
        where = self._path(step) if step is not None else self.directory
        return CheckpointError(
            f"saving checkpoint step {step} to {where} failed "
            f"({short_reason(error)}); {kept}; free space or fix the directory, then run "
            "again to resume")

    def save(self, step: int, state: Any, meta: dict[str, Any], iterator: Any,
             metrics: dict[str, float] | None = None, stopgap: bool = False) -> None:
        """Starts saving `step` (async: finished in the background). An earlier async save's
        lasting error surfaces here or at `wait`, as a CheckpointError; where it failed
        transiently, this save is made at once and stands in for it. stopgap: kept only while
        the newest (a save by time); every process must say the same."""
        if stopgap:  # recorded in its meta too: a run resumed from it still deletes it
            self._stopgaps.add(step)
            meta = {**meta, "stopgap": True}
        earlier = self._outcome()
        attempt = self._attempt(step, state, meta, iterator, metrics)
        if earlier is not None:
            pending, error = earlier
            logging.getLogger(__name__).warning(
                "saving checkpoint step %d to %s failed (%s); training went on, so step %d, "
                "saved now, stands in for it", pending.step, self._path(pending.step),
                error.strerror, step)
            self._retry(step, attempt, None)
            multihost.write_from_main(functools.partial(self._remove_attempts, pending.step))
            return
        try:
            self._agreed(attempt)
        except OSError as e:
            self._retry(step, attempt, e)
            return
        try:
            ref = weakref.ref(state)
        except TypeError:  # not weakly referable: `wait` cannot make this save again
            ref = None
        self._pending = _Pending(step, ref, meta, iterator, metrics)

    def _attempt(self, step: int, state: Any, meta: dict[str, Any], iterator: Any,
                 metrics: dict[str, float] | None) -> Callable[[], Any]:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  meta=ocp.args.JsonSave(meta), data=DataIteratorSave(iterator))
        # self.manager when called: a failed attempt renews it (`_renew_manager`)
        return lambda: self.manager.save(step, args=args, metrics=metrics, force=True)

    def _agreed(self, attempt: Callable[[], Any], can_redo: bool = True) -> None:
        """attempt() on every process, then every process's outcome shared: if any failed, each
        raises the same OSError: the first OS error's errno and reason (others' timeouts at
        orbax's barrier follow from it), else the first failure's, errno 0 (never transient);
        errno 0 too where a process cannot make the save again (`can_redo` False)."""
        status = "ok"
        try:
            attempt()
        except Exception as e:  # OSError, or orbax / tensorstore wrapping one
            if multihost.lost_process(e) is not None:
                raise  # no outcome to share with a process that is gone
            code, cause = _os_error(e)
            status = f"{code} {short_reason(cause)}"
        shared = multihost.statuses("checkpoint", f"{int(can_redo)} {status}",
                                    self.agree_timeout_s)
        outcomes = [s.split(" ", 1) for s in shared]  # [can_redo, "ok" | "errno reason"]
        failed = sorted((outcome.split(" ", 1) for _, outcome in outcomes if outcome != "ok"),
                        key=lambda failure: failure[0] == "0")  # OS errors first
        if failed:
            if len(shared) > 1:
                self._renew_manager()
            redo = all(flag == "1" for flag, _ in outcomes)
            raise OSError(int(failed[0][0]) if redo else 0, failed[0][1])

    def _renew_manager(self) -> None:
        """A new manager, with barriers of its own: after a failed save the old one's are out
        of step (the failing process skipped some, the others timed out at them), and every
        later save through it would time out. Every process renews at the same point. The old
        one is dropped unclosed: closing it would wait at its barriers once more."""
        prefix = multihost.unique("orbax").replace("/", "_")
        self.manager = ocp.CheckpointManager(self.directory, options=self._options(
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                barrier_sync_key_prefix=prefix)))

    def _retry(self, step: int, attempt: Callable[[], Any], error: OSError | None) -> None:
        """Saves `step` synchronously, tried again after each of multihost.RETRY_DELAYS_S while
        it fails transiently; `error`: its first attempt's, None to start with an attempt."""
        errors = [error] if error is not None else []

        def again():
            if errors:
                raise errors.pop()
            self._agreed(lambda: (attempt(), self.manager.wait_until_finished()))

        try:
            multihost.with_retries(again, f"saving checkpoint step {step} to {self._path(step)}")
        except OSError as e:
            raise self._save_error(step, e) from None

    def _outcome(self, can_redo: bool = True) -> tuple[_Pending, OSError] | None:
        """Waits for the pending async save; (it, its error) where it failed transiently, None
        where it is done (or none is pending). A lasting error raises a CheckpointError."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            self._agreed(self.manager.wait_until_finished, can_redo)
        except OSError as e:
            if e.errno not in multihost.TRANSIENT_ERRNOS:
                raise self._save_error(pending.step, e) from None
            return pending, e
        return None

    def _remove_attempts(self, step: int) -> None:
        """Removes the temporary directories of `step`'s failed attempts."""
        for path in self.directory.glob(f"{step}{TMP_SUFFIX}*"):
            path.rmtree()

    def _path(self, step: int) -> epath.Path:
        return self.directory / str(step)

    def restore(self, step: int, abstract_state: Any, shardings: Any) -> tuple[Any, dict]:
        """State and meta of `step`, onto `shardings` (which may differ from the saving mesh)."""
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract_state, shardings)
        restored = read_checkpoint(self._path(step), lambda: self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                          meta=ocp.args.JsonRestore())))
        state = jax.tree.map(functools.partial(typed_key, self._path(step)), restored["state"],
                             target)
        if restored["meta"].get("stopgap"):
            self._stopgaps.add(step)
        return state, dict(restored["meta"])

    def restore_data(self, step: int, iterator: Any) -> None:
        """Moves `iterator` to where it was when `step` was saved."""
        read_checkpoint(self._path(step), lambda: self.manager.restore(
            step, args=ocp.args.Composite(data=DataIteratorRestore(iterator))),
            what="input position: ")

    def restore_newest(self, restore: Callable[[int], T], log) -> tuple[int, T] | None:
        """(step, restore(step)) for the newest step that restores; None without checkpoints.

        A newer step whose restore fails is reported and, once an older one has restored,
        moved to workdir/unreadable_checkpoints/<step>: kept, but out of the way of the step
        being saved again. When no step restores, nothing is moved and a CheckpointError
        names the directory.
        """
        failed: list[tuple[int, str]] = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                restored = restore(step)
            except UnreadableCheckpoint as e:
                failed.append((step, e.reason))
                continue
            for bad, reason in failed:
                kept = self._set_aside(bad)
                log(f"checkpoint step {bad} in {self.directory} is unreadable ({reason}); "
                    f"moved to {kept}; resuming from step {step}")
            if failed:
                self.manager.reload()
            return step, restored
        if failed:
            steps = ", ".join(str(s) for s, _ in failed)
            raise CheckpointError(
                f"no checkpoint in {self.directory} restores (steps {steps}; step "
                f"{failed[0][0]}: {failed[0][1]}); if the model or optimizer changed, resume "
                "with the config the run was saved with, or use a new --workdir")
        return None

    def _set_aside(self, step: int) -> epath.Path:
        root = self.directory.parent / UNREADABLE_DIR
        target, n = root / str(step), 1
        while target.exists():
            target, n = root / f"{step}.{n}", n + 1
        def move():
            root.mkdir(parents=True, exist_ok=True)
            self._path(step).rename(target)

        multihost.write_from_main(move)
        return target

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def wait(self) -> None:
        """Waits for the async save; a transient failure is tried again (the caller has stopped
        training: its state and input are where the save left them), a lasting one raises a
        CheckpointError."""
        pending = self._pending
        state = pending.live_state() if pending is not None else None
        failed = self._outcome(can_redo=state is not None)
        if failed is not None:
            pending, error = failed
            self._retry(pending.step, self._attempt(pending.step, state, pending.meta,
                                                    pending.iterator, pending.metrics), error)

    def abandon(self) -> None:
        """Makes `close` leave a pending save unfinished (another process of the job is gone,
        and the save would wait for it): orbax never marks it complete."""
        self._abandoned = True

    def close(self) -> None:
        """Finishes the pending save and releases the manager; a save error already raised is
        not raised again (it would hide the first report)."""
        if self._abandoned:
            logging.getLogger("absl").removeFilter(self._log_filter)
            return
        try:
            if not self._failed:
                self.wait()
        finally:
            try:
                self.manager.close()
            except Exception:
                if not self._failed:
                    raise
            logging.getLogger("absl").removeFilter(self._log_filter)


def read_params(workdir: str, step: int) -> Any:
    """The params of checkpoint `step` in `workdir` as host NumPy arrays, on any machine (the
    mesh it was saved from does not matter): for exporting a trained model."""
    import numpy as np

    path = checkpoints_dir(workdir) / str(step) / "state"
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    checkpointer = ocp.PyTreeCheckpointer()
    host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)  # "no _CHECKPOINT_METADATA": it is the step's, above

    def read():
        saved = checkpointer.metadata(path).item_metadata.tree["params"]
        target = {"params": jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=host), saved)}
        # The params alone: the optimizer's moments (2x the params) are never read.
        return checkpointer.restore(path, args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True))

    try:
        state = read_checkpoint(path, read)
    finally:
        absl_logger.setLevel(level)
    return jax.tree.map(np.asarray, state["params"])

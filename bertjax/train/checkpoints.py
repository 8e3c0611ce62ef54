"""Training checkpoints for every job: one orbax CheckpointManager under `workdir/checkpoints`.

Each step directory `checkpoints/<step>/` holds three items, committed together:
  state  TrainState (step, params, optimizer state, RNG): sharded arrays, restorable onto any
         mesh;
  meta   JSON: the stage being trained and the evaluation history so far;
  data   each process's input-iterator position (`process_<i>*`), written by the iterator's
         own `save(prefix)` (tf.data: shuffle buffers included).
orbax writes a step into a temporary directory and renames it when complete, so a run killed
mid-save leaves the previous checkpoint intact. Kept: the last `max_to_keep` steps, plus the
step with the best `best_metric` (evaluated steps carry their metrics).

Preemption: on a multi-process run the JAX distributed runtime turns SIGTERM (how TPU VMs
announce preemption) into a sync point that every process reaches at the same step
(`reached_preemption`). A single process has no runtime to do that, so SIGTERM sets a flag.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers

from bertjax.errors import CheckpointError


class DataIteratorHandler(ocp.CheckpointHandler):
    """Saves / restores an input iterator through its `save(prefix)` / `restore(prefix)`."""

    def save(self, directory: epath.Path, args: DataIteratorSave) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        args.iterator.save(str(directory / f"process_{jax.process_index()}"))

    def restore(self, directory: epath.Path, args: DataIteratorRestore) -> Any:
        prefix = str(directory / f"process_{jax.process_index()}")
        args.iterator.restore(prefix)
        return args.iterator


@ocp.args.register_with_handler(DataIteratorHandler, for_save=True)
@dataclasses.dataclass
class DataIteratorSave(ocp.args.CheckpointArgs):
    iterator: Any


@ocp.args.register_with_handler(DataIteratorHandler, for_restore=True)
@dataclasses.dataclass
class DataIteratorRestore(ocp.args.CheckpointArgs):
    iterator: Any


class Checkpointer:
    def __init__(self, workdir: str, max_to_keep: int = 3, async_save: bool = True,
                 best_metric: str | None = None):
        # orbax wants absolute paths; gs:// and other URLs already are.
        self.directory = epath.Path(
            workdir if "://" in str(workdir) else os.path.abspath(workdir)) / "checkpoints"
        policies = [checkpoint_managers.LatestN(max_to_keep)]
        if best_metric:
            policies.append(checkpoint_managers.BestN(
                get_metric_fn=lambda m: m[best_metric], n=1,
                keep_checkpoints_without_metrics=False))
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                enable_async_checkpointing=async_save, create=True,
                preservation_policy=checkpoint_managers.AnyPreservationPolicy(policies)),
        )
        self._sigterm = False
        self._previous_handler = None
        if jax.process_count() == 1:
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self._sigterm = True

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def reached_preemption(self, step: int) -> bool:
        return self._sigterm or self.manager.reached_preemption(step)

    def save(self, step: int, state: Any, meta: dict[str, Any], iterator: Any,
             metrics: dict[str, float] | None = None) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
                data=DataIteratorSave(iterator)),
            metrics=metrics,
            force=True,
        )

    def _path(self, step: int) -> epath.Path:
        return self.directory / str(step)

    def restore(self, step: int, abstract_state: Any, shardings: Any) -> tuple[Any, dict]:
        """State and meta of `step`, onto `shardings` (which may differ from the saving mesh)."""
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract_state, shardings)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{self._path(step)} does not fit this run's model and optimizer ({e}); "
                "resume with the config it was saved with or use a new --workdir") from None
        return restored["state"], dict(restored["meta"])

    def restore_data(self, step: int, iterator: Any) -> None:
        """Moves `iterator` to where it was when `step` was saved."""
        self.manager.restore(step, args=ocp.args.Composite(data=DataIteratorRestore(iterator)))

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)

"""Preemption-safe training checkpoints with orbax.

Layout under `workdir/checkpoints/<step>/`: `state` (TrainState: step, params, optimizer state,
RNG — sharded arrays, restorable onto any mesh) and `meta` (JSON: phase, data positions).
orbax writes each step to a temporary directory and renames it when complete, so a run killed
mid-save leaves the previous checkpoint intact. Input-pipeline positions are written by each
process under `workdir/data_state/<step>/` *before* the state is committed, so every committed
step has them.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath


class Checkpointer:
    def __init__(self, workdir: str, max_to_keep: int = 3, async_save: bool = True):
        # orbax wants absolute paths; gs:// and other URLs already are.
        self.workdir = epath.Path(workdir if "://" in str(workdir) else os.path.abspath(workdir))
        self.manager = ocp.CheckpointManager(
            self.workdir / "checkpoints",
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def data_state_prefix(self, step: int, phase: str) -> str:
        """Where this process keeps its input-iterator position for `step`."""
        directory = self.workdir / "data_state" / str(step)
        directory.mkdir(parents=True, exist_ok=True)
        return str(directory / f"{phase}-process{jax.process_index()}")

    def save(self, step: int, state: Any, meta: dict[str, Any], input_iterator=None,
             phase: str = "") -> None:
        if input_iterator is not None:
            input_iterator.save(self.data_state_prefix(step, phase))
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        self._drop_stale_data_states()

    def restore(self, step: int, abstract_state: Any, shardings: Any) -> tuple[Any, dict]:
        """Restores `step` into `shardings` (which may differ from the mesh it was saved on)."""
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract_state,
            shardings,
        )
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
            ),
        )
        return restored["state"], dict(restored["meta"])

    def _drop_stale_data_states(self) -> None:
        root = self.workdir / "data_state"
        if jax.process_index() != 0 or not root.exists():
            return
        keep = {str(s) for s in self.manager.all_steps()}
        # A step being saved asynchronously is not listed yet: keep anything newer than the latest.
        latest = max((int(s) for s in keep), default=-1)
        for path in root.iterdir():
            if path.name not in keep and path.name.isdigit() and int(path.name) < latest:
                path.rmtree()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

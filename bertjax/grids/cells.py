"""The cell protocol of the grids: a cell is one resumable run in its own directory.

  <cell>/results.json    the run finished (bertjax.train.workdir.RESULTS_FILE)
  <cell>/diverged.json   a fine-tuning run whose loss diverged (bertjax.errors.TrainingError),
                         {"error": its message}: finished too, a normal outcome of a grid
  <cell>/run_config.json the run's config (written by the training loop)

A cell with neither file is started (its directory exists: a rerun resumes it from its last
checkpoint) or still to do. A finished cell is reused only with the config it ran with."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from etils import epath

from bertjax.errors import ConfigError, TrainingError
from bertjax.train import multihost
from bertjax.train.workdir import DIVERGED_FILE, RESULTS_FILE, flatten, run_config_path

DONE, DIVERGED, STARTED, TO_DO = "done", "diverged", "started", "to do"


def state(directory: epath.Path) -> str:
    """done, diverged, started (an unfinished run to resume) or to do."""
    for name, text in ((RESULTS_FILE, DONE), (DIVERGED_FILE, DIVERGED)):
        if (directory / name).exists():
            return text
    return STARTED if directory.exists() else TO_DO


def is_finished(directory: epath.Path) -> bool:
    """Whether the cell in `directory` is done or diverged (a rerun skips it)."""
    return state(directory) in (DONE, DIVERGED)


def log_start(log: Callable[[str], Any], tag: str, directory: epath.Path) -> None:
    log(f"{tag} {'resuming' if directory.exists() else 'starting'} in {directory}")


def finetune_cell(config, workdir: str, log: Callable[[str], Any],
                  train_fn: Callable | None = None) -> dict[str, Any]:
    """Fine-tunes (or resumes) in `workdir` with `train_fn(config, workdir, log)` (default
    bertjax.tasks.train_and_evaluate, which writes results.json). Returns its summary, status
    "done" or "preempted"; a diverged run is recorded in diverged.json and returns
    {"status": "diverged", "error"}. Every process calls this."""
    if train_fn is None:
        from bertjax.tasks import train_and_evaluate as train_fn
    try:
        return train_fn(config, workdir, log=log)
    except TrainingError as e:
        log(f"diverged: {e}")
        multihost.write_from_main(functools.partial(
            (epath.Path(workdir) / DIVERGED_FILE).write_text,
            json.dumps({"error": str(e)}) + "\n"))
        return {"status": "diverged", "error": str(e)}


def check_same_config(run_dir: epath.Path, config) -> None:
    """A finished run may be reused only if it ran with exactly this config: otherwise a
    ConfigError naming (up to five of) the differing fields."""
    stored = run_config_path(run_dir)
    if not stored.exists():
        return
    old, new = json.loads(stored.read_text()), json.loads(config.to_json_best_effort())
    if old != new:
        flat_old, flat_new = flatten(old), flatten(new)
        differ = sorted(k for k in flat_old.keys() | flat_new.keys()
                        if flat_old.get(k) != flat_new.get(k))
        raise ConfigError(f"{run_dir} finished with a different config (differs in "
                          f"{', '.join(differ[:5])}); use a new --workdir or delete that run")


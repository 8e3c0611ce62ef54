"""The run directory's format, shared by the loop, the grids and `bertjax.convert to_hf`:
its file names, JSON records written whole (from process 0, see multihost.py), and the check
that a config may resume the run recorded there.

  workdir/run_config.json  the run's config (written at every start; checked on resume); runs
                           from before 2026-11 have it as config.json, still read
                           (a checkpoint directory's config.json is the model's: BertConfig)
  workdir/results.json     a fine-tuning run's evaluations and best step
  workdir/export.json      a fine-tuning run's record for `bertjax.convert to_hf`
  workdir/diverged.json    a grid cell whose run diverged (a normal outcome of a grid)
  workdir/checkpoints/     orbax checkpoints (bertjax/train/checkpoints.py)
  workdir/metrics.jsonl, tensorboard/   bertjax/train/metrics.py
"""

from __future__ import annotations

import fnmatch
import json
from typing import Any

from etils import epath

from bertjax.errors import ConfigError
from bertjax.train import multihost

RESULTS_FILE = "results.json"
EXPORT_FILE = "export.json"
DIVERGED_FILE = "diverged.json"
CONFIG_FILE = "run_config.json"
LEGACY_CONFIG_FILE = "config.json"
# Config fields a resumed run must share with the run recorded in its workdir: they fix the
# checkpoint's shapes, the optimizer state, and what a saved input position means. (The
# compute dtype and the mesh may change: checkpoints restore onto any mesh.) fnmatch patterns:
# "phases.*.batch_size" is each pre-training phase's own batch.
RESUME_FIELDS = ("model.*", "optimizer.name", "train.batch_size", "phases.*.batch_size",
                 "task.name", "rng_impl", "data.pack")
RESUME_FIELDS_FREE = ("model.dtype",)


def run_config_path(workdir: str | epath.Path) -> epath.Path:
    """The run's config record in `workdir`: CONFIG_FILE, or LEGACY_CONFIG_FILE where only that
    one exists (a run written before the rename)."""
    workdir = epath.Path(workdir)
    path = workdir / CONFIG_FILE
    legacy = workdir / LEGACY_CONFIG_FILE
    return legacy if not path.exists() and legacy.exists() else path


def write_json(path: epath.Path, value: Any) -> None:
    """Writes `path` whole or not at all (a temporary file renamed over it), from process 0;
    every process calls it (multihost.write_from_main)."""
    def write():
        tmp = path.parent / (path.name + ".tmp")
        tmp.write_text(json.dumps(value, indent=2) + "\n")
        tmp.replace(path)

    multihost.write_from_main(write)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested record as {"a.b.c": leaf}."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def check_resumable(workdir: epath.Path, config_record: dict) -> None:
    """Refuses to resume the run recorded in `workdir` (run_config_path) with a config that
    differs on `RESUME_FIELDS` (fields present in both records), in one line naming each
    field."""
    path = run_config_path(workdir)
    if not path.exists():
        return
    try:
        previous = flatten(json.loads(path.read_text()))
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); it records the run being resumed: "
                          "restore it, or use a new --workdir") from None
    current = flatten(config_record)
    differing = [
        f"config.{key}: {previous[key]!r} in the run at {workdir}, {current[key]!r} now"
        for key in sorted(previous.keys() & current.keys())
        if any(fnmatch.fnmatchcase(key, field) for field in RESUME_FIELDS)
        and key not in RESUME_FIELDS_FREE
        and previous[key] != current[key]]
    if differing:
        raise ConfigError("; ".join(differing) + "; the checkpoints there were saved with the "
                          "run's values: resume with them or use a new --workdir")



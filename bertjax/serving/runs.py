"""A finished fine-tuning run, from its workdir or its transformers export: the task with its
learnt state, the model config, the best checkpoint's params and the tokenizer (`TrainedModel`).

A finished workdir holds `run_config.json` (the run's config: task family, field names,
max_seq_length, batch sizes, mesh), `results.json` (the best step), `export.json` (model
config, vocabulary, casing, and the task's `state()`: labels, kind, the v2.0 null threshold)
and the best checkpoint; `python -m bertjax.convert to_hf --input=WORKDIR` reads them the same
way (`read_finished_run`, `task_record`). An export is transformers' config.json and weights,
the vocabulary, and TASK_FILE.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections
from etils import epath

from bertjax import models, paths
from bertjax.errors import CheckpointError, ConfigError
from bertjax.models import ModelConfig, architecture
from bertjax.tasks.base import Task
from bertjax.train import configs
from bertjax.train.workdir import EXPORT_FILE, RESULTS_FILE, run_config_path


def read_finished_run(workdir: str | epath.Path, error: type[Exception] = CheckpointError,
                      flag: str = "--workdir") -> tuple[dict, int]:
    """(export.json record, best step) of a finished fine-tuning workdir; `error` with one
    line otherwise (not a directory, a pre-training run, an unfinished run)."""
    workdir = epath.Path(workdir)
    if not workdir.is_dir():
        raise error(f"{flag} {workdir}: no such directory")
    if (workdir / TASK_FILE).exists():
        raise error(f"{flag} {workdir} is a fine-tuning run's transformers export; pass it as "
                    "--export (Predictor.from_export)")
    config_file = run_config_path(workdir)
    if config_file.exists():
        recorded = paths.read_json_object(config_file, error)
        if "phases" in recorded or "task" not in recorded:
            export = workdir / "export"
            use = (f"python -m bertjax.convert to_hf --input {export}" if flag == "--input"
                   else f"python -m bertjax.predict fill_mask --checkpoint={export}")
            raise error(f"{flag} {workdir} is a pre-training run, not a fine-tuning one; its "
                        f"model is the checkpoint directory {export} ({use})")
    unfinished = (f"{flag} {workdir}: no {{}}: the fine-tuning run has not finished or predates "
                  "export.json; run its command again (a finished run only rewrites its "
                  "outputs)")
    for name in (RESULTS_FILE, EXPORT_FILE):
        if not (workdir / name).exists():
            raise error(unfinished.format(name))
    record = paths.read_json_object(workdir / EXPORT_FILE, error)
    step = paths.read_json_object(workdir / RESULTS_FILE, error).get("best_step")
    if step is None:
        raise error(unfinished.format(f"best_step in {RESULTS_FILE}"))
    return record, int(step)


@dataclasses.dataclass
class TrainedModel:
    """What a finished fine-tuning run left: its config, the task with its learnt state, the
    model config, the best checkpoint's params (host arrays) and the tokenizer."""

    workdir: str
    config: ml_collections.ConfigDict
    task: Task
    model_config: ModelConfig  # BertConfig or ModernConfig
    params: dict[str, Any]
    tokenizer: Any
    step: int


def load_workdir(workdir: str, dtype: str | None = None) -> TrainedModel:
    """The best checkpoint of a finished fine-tuning workdir, its task restored.

    dtype: compute dtype override (default: the run's, e.g. float32 on CPU)."""
    from bertjax.models import layout
    from bertjax.tasks import get_task
    from bertjax.tokenization import load_tokenizer
    from bertjax.train.checkpoints import read_params

    record, step = read_finished_run(workdir)
    config = ml_collections.ConfigDict(
        paths.read_json_object(run_config_path(workdir), CheckpointError))
    if config.task.family == "feature_based":
        raise ConfigError(f"--workdir {workdir}: a feature-based tagger (frozen encoder + "
                          "BiLSTM) has no prediction command yet")
    task = get_task(config)
    task.restore(record.get("task") or task.legacy_state(record, config))
    fields = dict(record["model"])
    if dtype:
        fields["dtype"] = configs.compute_dtype(dtype)
    model_config = models.model_config(fields)
    params = read_params(str(workdir), step)
    if architecture(model_config).scans_layers:  # else always unrolled
        params = layout.to_layout(params, model_config.scan_layers)
    tokenizer = load_tokenizer(str(run_vocab(workdir, record)),
                               do_lower_case=record["do_lower_case"])
    return TrainedModel(str(workdir), config, task, model_config, params, tokenizer, step)


def run_vocab(workdir: str | epath.Path, record: dict) -> epath.Path:
    """The vocabulary of a finished run: export.json names it relative to the workdir (runs
    before that: an absolute path)."""
    vocab = record["vocab"]
    return epath.Path(vocab) if "://" in vocab else epath.Path(workdir) / vocab


# ---------------------------------------------------------------------------------------------
# A fine-tuning run's transformers export (`python -m bertjax.convert to_hf --input=WORKDIR`)

# Written beside the export's config.json: what transformers' config cannot say (the run's
# config: task family, field names, max_seq_length, mesh; the task's learnt state).
TASK_FILE = "bertjax_task.json"


def task_record(workdir: str | epath.Path, error: type[Exception] = CheckpointError,
                flag: str = "--workdir") -> dict[str, Any]:
    """The TASK_FILE record of a finished fine-tuning workdir."""
    record, step = read_finished_run(workdir, error, flag)
    from bertjax.tasks import get_task

    config = paths.read_json_object(run_config_path(workdir), error)
    state = record.get("task")
    if not state:
        recorded = ml_collections.ConfigDict(config)
        state = get_task(recorded).legacy_state(record, recorded)
    return {"config": config, "task": state, "model": record["model"],
            "do_lower_case": record["do_lower_case"], "best_step": step,
            "architecture": record.get("architecture"), "workdir": str(workdir)}


def load_export(directory: str, dtype: str | None = None) -> TrainedModel:
    """A fine-tuning run as `bertjax.convert to_hf` exported it: transformers' config.json and
    weights, the vocabulary, and TASK_FILE (the run's config and task state)."""
    import importlib

    from bertjax.convert.mapping import ConversionError
    from bertjax.tasks import get_task
    from bertjax.tokenization import load_tokenizer

    path = epath.Path(directory)
    if not (path / TASK_FILE).exists():
        raise CheckpointError(_no_task_file(path))
    record = paths.read_json_object(path / TASK_FILE, CheckpointError)
    config = ml_collections.ConfigDict(record["config"])
    task = get_task(config)
    task.restore(record["task"])
    fields = dict(record["model"])
    if dtype:
        fields["dtype"] = configs.compute_dtype(dtype)
    kind = architecture(fields)
    if kind.conversion is None:
        raise CheckpointError(f"--export {path}: {kind.title} has no transformers export")
    # Its conversion module reads the weights and checks them against the run's model.
    conversion = importlib.import_module(kind.conversion)
    try:
        model_config, params = conversion.read_export(path, fields, record.get("architecture"),
                                                      task.model, task.init_inputs())
    except ConversionError as e:
        raise CheckpointError(str(e).replace("--input", "--export")) from None
    tokenizer = load_tokenizer(str(_vocab(path)), do_lower_case=record["do_lower_case"])
    return TrainedModel(str(directory), config, task, model_config, params, tokenizer,
                        int(record.get("best_step", 0)))


def _vocab(path: epath.Path) -> epath.Path:
    from bertjax.checkpoint_dir import vocab_path

    return vocab_path(path)


def _no_task_file(path: epath.Path) -> str:
    """Why a directory cannot be predicted with as an export, and what to pass instead."""
    if (path / "params").is_dir():
        return (f"--export {path} is a pre-trained bertjax checkpoint directory (no task "
                "head): pass a finished fine-tuning workdir (--workdir), or ask it with "
                "fill_mask --checkpoint")
    if (path / "config.json").exists():
        return (f"--export {path}: no {TASK_FILE} (transformers' config.json does not record "
                "the task's fields, max length or thresholds): pass the fine-tuning workdir "
                "(--workdir), or export it again with python -m bertjax.convert to_hf "
                "--input=WORKDIR")
    return (f"--export {path}: not an export of a fine-tuning run (no config.json, no "
            f"{TASK_FILE})")


# ---------------------------------------------------------------------------------------------

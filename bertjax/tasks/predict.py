"""Predictions of a trained model on new rows (`python -m bertjax.predict`, `bertjax.Predictor`),
and masked-word predictions of a pre-trained checkpoint (`FillMask`).

A finished fine-tuning workdir holds everything a prediction needs: `config.json` (the run's
config: task family, field names, max_seq_length, batch sizes, mesh), `results.json` (the best
step), `export.json` (model config, vocabulary, casing, and the task's `state()`: labels, kind,
the v2.0 null threshold) and the best checkpoint. `load_workdir` reads them (the same reading
as `bertjax.convert to_hf`: `read_finished_run`); `Engine` then runs the task's own code:

    task.encode (length buckets of the run) → task.batches (fixed shapes per bucket)
      → jitted task.outputs + task.predict, batches sharded over the mesh's data axes
      → task.records (one plain record per example, in input order)

so predictions on a split equal those the run wrote for it at the end of training (same
batches, same compiled function, same params). Every process computes every batch (its share
of the rows, then gathered); callers write from process 0 (multihost.write_from_main). Given
`devices` (`python -m bertjax.predict` on a CPU split into one device per core), whole batches
run on those devices in turn instead (`DeviceTurns`): the same bits, the cores kept busier.

Nothing here imports TensorFlow.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from etils import epath

from bertjax import paths
from bertjax.errors import CheckpointError, ConfigError, DataError
from bertjax.models import BertConfig
from bertjax.tasks.base import Task, _predict, predict_rows
from bertjax.train import configs
from bertjax.train import sharding as sharding_lib
from bertjax.train.loop import Runner, batch_signature, compiled_ahead
from bertjax.train.workdir import CONFIG_FILE, EXPORT_FILE, RESULTS_FILE

# Meshes for a checkpoint directory without a run config (fill-mask): data-parallel only.
DATA_PARALLEL_MESH = {"data": -1, "fsdp": 1, "tensor": 1}
DATA_PARALLEL_RULES = (("batch", ("data", "fsdp")),)


# ---------------------------------------------------------------------------------------------
# A finished fine-tuning run


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
    config_file = workdir / CONFIG_FILE
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


def _legacy_state(record: dict, config) -> dict[str, Any]:
    """The task state of an export.json written before it recorded one (from its transformers
    head fields and the run's config)."""
    family = config.task.family
    labels = list(record.get("labels") or ())
    if family in ("glue", "swag", "files"):
        kind = {"BertForMultipleChoice": "multiple_choice"}.get(
            record.get("architecture"), "regression" if record.get("problem_type") ==
            "regression" else "classification")
        if kind == "multiple_choice":
            labels = [str(i) for i in range(len(config.data.choices.split(",")) if
                                            family == "files" else 4)]
        metrics = {"regression": ["pearson", "spearman"]}.get(kind, ["accuracy"])
        if family == "glue":
            from bertjax.tasks.classification.readers import glue_task

            metrics = list(glue_task(config.task.name).metrics)
        elif kind == "classification" and len(labels) == 2:
            metrics = ["accuracy", "f1", "matthews_corrcoef"]
        return {"kind": kind, "labels": labels, "metric_names": metrics}
    if family == "token_classification":
        return {"labels": labels, "scheme": config.task.label_scheme}
    if family == "squad":
        extra = record.get("extra_config") or {}
        return {"version_2": bool(config.task.version_2),
                "threshold": float(extra.get("null_score_diff_threshold", 0.0))}
    raise ConfigError(f"config.task.family={family!r} has no predictions from a finished run")


@dataclasses.dataclass
class TrainedModel:
    """What a finished fine-tuning run left: its config, the task with its learnt state, the
    model config, the best checkpoint's params (host arrays) and the tokenizer."""

    workdir: str
    config: ml_collections.ConfigDict
    task: Task
    model_config: BertConfig
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
        paths.read_json_object(epath.Path(workdir) / CONFIG_FILE, CheckpointError))
    if config.task.family == "feature_based":
        raise ConfigError(f"--workdir {workdir}: a feature-based tagger (frozen encoder + "
                          "BiLSTM) has no prediction command yet")
    task = get_task(config)
    task.restore(record.get("task") or _legacy_state(record, config))
    fields = dict(record["model"])
    if dtype:
        fields["dtype"] = configs.compute_dtype(dtype)
    model_config = BertConfig.from_dict(fields)
    params = layout.to_layout(read_params(str(workdir), step), model_config.scan_layers)
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
    config = paths.read_json_object(epath.Path(workdir) / CONFIG_FILE, error)
    state = record.get("task") or _legacy_state(record, ml_collections.ConfigDict(config))
    return {"config": config, "task": state, "model": record["model"],
            "do_lower_case": record["do_lower_case"], "best_step": step,
            "architecture": record.get("architecture"), "workdir": str(workdir)}


def _fill_absent_pooler(params: dict, abstract: dict, directory) -> dict:
    """`params` completed with zeros for the pooler (transformers' token-classification and
    QA classes have none; the encoder computes it, these heads never read it); any other
    missing or extra parameter is an error."""
    def merge(have, want, path):
        if not isinstance(want, dict):
            return have
        missing = sorted(set(want) - set(have or {}))
        if missing and path != ("bert",) or set(have or {}) - set(want):
            raise CheckpointError(f"--export {directory}: its weights do not fit the run's "
                                  f"model at {'/'.join(path) or 'the top level'} (missing "
                                  f"{missing}, extra {sorted(set(have or {}) - set(want))})")
        out = {k: merge(have[k], want[k], path + (k,)) for k in want if k in have}
        for k in missing:
            if k != "pooler":
                raise CheckpointError(f"--export {directory}: no bert/{k} weights")
            out[k] = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), want[k])
        return out

    return merge(params, abstract, ())


def load_export(directory: str, dtype: str | None = None) -> TrainedModel:
    """A fine-tuning run as `bertjax.convert to_hf` exported it: transformers' config.json and
    weights, the vocabulary, and TASK_FILE (the run's config and task state)."""
    from bertjax.convert import huggingface
    from bertjax.convert.mapping import ConversionError
    from bertjax.models import layout
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
    model_config = BertConfig.from_dict(fields)
    unrolled = BertConfig.from_dict({**fields, "scan_layers": False})
    heads = huggingface.ARCHITECTURES.get(record.get("architecture"), ("classifier",
                                                                       "qa_outputs"))
    try:
        params = huggingface.read_hf_checkpoint(path, unrolled, heads)[0]
    except ConversionError as e:
        raise CheckpointError(str(e).replace("--input", "--export")) from None
    model = task.model(unrolled)
    abstract = nn.unbox(jax.eval_shape(
        lambda: model.init(jax.random.key(0), *task.init_inputs()))["params"])
    params = _fill_absent_pooler(params, abstract, path)
    params = layout.to_layout(params, model_config.scan_layers)
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
# The engine


def place_params(model, init_inputs: tuple, params, mesh, rules) -> Any:
    """Host params placed with the model's logical-axis shardings on `mesh`."""
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *init_inputs))["params"]
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh,
                                            sharding_lib.as_rules(rules))
    return jax.device_put(params, shardings)


class DeviceTurns:
    """Runs a jitted function over whole batches on devices in turn, a few batches in flight on
    each; the interface of train.loop.Runner (one process only).

    For a CPU split into devices (one per core): XLA:CPU spreads each op of one device's step
    over the cores, and its small ops (the attention's batched products, softmax, layer norms)
    leave cores idle; two devices stepping at once fill them. A batch runs whole, with the
    program and shapes it has on one device, so its predictions are bitwise those of one device
    (and of the run's files), unlike a batch split over the devices (fewer rows each).

    Each device compiles each batch shape it runs, and a compile costs as much as many batches:
    a run of fewer than SPREAD_BATCHES batches of one shape stays on one device (the runs taking
    the devices in turn, so different shapes step at once), a longer run takes them batch by
    batch."""

    SPREAD_BATCHES = 16
    IN_FLIGHT = 2  # batches dispatched and not yet fetched, per device

    def __init__(self, devices: Sequence[jax.Device]):
        if jax.process_count() > 1:
            raise ConfigError("whole batches on devices in turn are for one process; on a pod "
                              "slice the batches are sharded over the run's mesh")
        self.devices = list(devices)

    def place(self, params) -> list:
        """A copy of the host `params` on each device."""
        return [jax.device_put(params, device) for device in self.devices]

    def assign(self, batches: Iterable[dict[str, np.ndarray]]
               ) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """(device index, batch) for each of `batches`, in order (see the class docstring)."""
        n, turn = len(self.devices), 0
        run: list = []  # the current run's batches while it may still be short
        signature, spread = None, False
        for batch in batches:
            if batch_signature(batch) != signature:
                yield from ((turn, b) for b in run)  # a short run: one device
                turn = (turn + bool(run)) % n
                run, signature, spread = [], batch_signature(batch), False
            run.append(batch)
            if spread or len(run) == self.SPREAD_BATCHES:
                spread = True
                for b in run:
                    yield turn, b
                    turn = (turn + 1) % n
                run = []
        yield from ((turn, b) for b in run)

    def run(self, fn, params: list, batches: Iterable[dict[str, np.ndarray]]
            ) -> Iterator[tuple[dict[str, np.ndarray], Any]]:
        """(batch, fn(params, batch) on the host) for every batch, in order. Each device takes
        its next batch among the next 2 * SPREAD_BATCHES as soon as it has a free slot (so the
        next run steps while this one does); a jitted `fn` is compiled for each batch shape
        and device ahead (train.loop.compiled_ahead)."""
        source = self.assign(batches)
        if hasattr(fn, "lower"):
            def compile_for(i, item):
                device, batch = item
                fn.lower(params[device], jax.device_put(batch, self.devices[device])).compile()

            source = compiled_ahead(source, compile_for,
                                    lambda i, item: (item[0], batch_signature(item[1])))
        window: collections.deque = collections.deque()  # [device, batch, outputs | None]
        exhausted = False
        while window or not exhausted:
            while not exhausted and len(window) < 2 * self.SPREAD_BATCHES:
                item = next(source, None)
                exhausted = item is None
                if item is not None:
                    window.append([*item, None])
            running = collections.Counter(d for d, _, o in window
                                          if o is not None and not _ready(o))
            dispatched = False
            for entry in window:
                device, batch, outputs = entry
                if outputs is None and running[device] < self.IN_FLIGHT:
                    entry[2] = fn(params[device], jax.device_put(batch, self.devices[device]))
                    running[device] += 1
                    dispatched = True
            # The first entry is dispatched by now: the scan reaches it before any later entry
            # of its device. Fetching it waits, unless a dispatch is still to be made.
            _, batch, outputs = window[0]
            if not dispatched or _ready(outputs):
                window.popleft()
                yield batch, jax.device_get(outputs)


def _ready(outputs) -> bool:
    return all(leaf.is_ready() for leaf in jax.tree.leaves(outputs))


def runner_and_params(model, init_inputs: tuple, params, mesh_sizes, rules, batch_size: int,
                      devices: Sequence[jax.Device] | None = None) -> tuple[Any, Any]:
    """(runner, the host `params` placed for it): whole batches on each of `devices` in turn
    (`DeviceTurns`), or without devices, batches sharded over a mesh of `mesh_sizes` on every
    device (`rules`: the logical-axis rules; `batch_size` must divide over its data axes)."""
    if devices:
        runner = DeviceTurns(devices)
        return runner, runner.place(params)
    mesh = sharding_lib.make_mesh(mesh_sizes)
    configs.check_batch_size(batch_size, mesh, field="--batch_size")
    return (Runner(sharding_lib.batch_sharding(mesh, rules), rules),
            place_params(model, init_inputs, params, mesh, rules))


class Engine:
    """A trained model's jitted task forward over the run's mesh (see the module docstring).

    batch_size: rows per global batch (default: what the run's evaluations used,
    config.eval.batch_size, on a CPU at most 8: train.configs.prediction_batch_size; this makes
    predictions bitwise those of the run); it must divide over the data-parallel devices.
    devices: instead of the mesh, whole batches on each of these in turn (`DeviceTurns`)."""

    def __init__(self, trained: TrainedModel, batch_size: int | None = None,
                 devices: Sequence[jax.Device] | None = None):
        config, task = trained.config, trained.task
        self.trained, self.task = trained, task
        self.max_seq_length = int(config.max_seq_length)
        if not batch_size:  # the rows the run's evaluations used on this kind of device
            platform = (devices[0] if devices else jax.devices()[0]).platform
            parallel = 1 if devices else configs.data_parallel_size(
                sharding_lib.make_mesh(config.mesh))
            batch_size = configs.prediction_batch_size(config.eval.batch_size, platform,
                                                       parallel)
        self.batch_size = int(batch_size)
        self.model = model = task.model(trained.model_config)
        self.runner, self.params = runner_and_params(
            model, task.init_inputs(), trained.params, config.mesh, config.logical_axis_rules,
            self.batch_size, devices)
        self._predict = jax.jit(functools.partial(_predict, task=task, model=model))

    def run(self, examples: list) -> tuple[Any, dict[str, Any], dict[str, int]]:
        """(features, per-row predictions, {"real": tokens, "computed": token positions run})
        of `examples`."""
        features = self.task.encode(self.trained.tokenizer, examples, self.max_seq_length)
        tokens = {"real": 0, "computed": 0}
        predictions = predict_rows(self.task, self._predict, self.params, features,
                                   self.batch_size, self.runner, tokens)
        return features, predictions, tokens


def padding_line(tokens: dict[str, int]) -> str:
    waste = 1.0 - tokens["real"] / max(tokens["computed"], 1)
    return (f"padding is {100 * waste:.1f}% of the {tokens['computed']:,} token positions "
            "computed")


class Predictor:
    """Predictions of a finished fine-tuning run, as plain Python records.

        predictor = bertjax.Predictor.from_workdir("runs/mrpc")
        predictor = bertjax.Predictor.from_export("hf/mrpc")  # convert to_hf of runs/mrpc
        predictor(["a sentence", ...])           # classification / regression
        predictor([("sentence a", "sentence b")])  # pairs
        predictor([("context", ["ending 1", ...])])  # multiple choice
        predictor([("question", "context")])     # SQuAD
        predictor([["EU", "rejects", "German", "call"]])  # tagging (or "EU rejects ...")

    Records: see each task's `records` (classification: {id, label, probabilities}).

    devices (optional): whole batches on each of these in turn (`DeviceTurns`), as the command
    runs on a machine with no accelerator: `jax.config.update("jax_num_cpu_devices", 2)` before
    JAX starts, then `devices=jax.devices()`; the same predictions, faster.
    """

    def __init__(self, trained: TrainedModel, batch_size: int | None = None,
                 devices: Sequence[jax.Device] | None = None):
        self.trained = trained
        self.engine = Engine(trained, batch_size, devices)
        self.task = trained.task
        self.last_padding = ""  # padding_line of the last call

    @classmethod
    def from_workdir(cls, workdir: str, batch_size: int | None = None,
                     dtype: str | None = None, devices: Sequence[jax.Device] | None = None
                     ) -> Predictor:
        return cls(load_workdir(workdir, dtype), batch_size, devices)

    @classmethod
    def from_export(cls, directory: str, batch_size: int | None = None,
                    dtype: str | None = None, devices: Sequence[jax.Device] | None = None
                    ) -> Predictor:
        """From `python -m bertjax.convert to_hf --input=WORKDIR --output=DIR`'s DIR."""
        return cls(load_export(directory, dtype), batch_size, devices)

    def _records(self, examples) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
        features, predictions, tokens = self.engine.run(examples)
        self.last_padding = padding_line(tokens)
        try:
            return features, predictions, self.task.records(predictions, features, examples)
        finally:
            self.task.release(examples)

    def __call__(self, items: list) -> list[dict[str, Any]]:
        return self._records(self.task.examples(list(items)))[2]

    def predict_file(self, path: str, fields: dict[str, Any] | None = None
                     ) -> tuple[list, list[dict[str, Any]], dict[str, float] | None]:
        """(examples, records, the task's metrics or None when the file has no gold labels)
        of a file of new rows; `fields` override the run's users'-files field names."""
        if not paths.exists(path):
            raise DataError(f"{path}: no such file")
        merged = {**dict(self.trained.config.get("data", {})),
                  **{k: v for k, v in (fields or {}).items() if v is not None}}
        paths.check_encoding(merged.get("encoding") or paths.DEFAULT_ENCODING, "--encoding")
        examples, labelled = self.task.read_inputs(path, merged)
        features, predictions, records = self._records(examples)
        metrics = self.task.metrics(predictions, features, "input") if labelled else None
        return examples, records, metrics

    def predict_stream(self, path: str, write, fields: dict[str, Any] | None = None,
                       chunk_rows: int = 10_000) -> int:
        """Predicts a file `chunk_rows` rows at a time (memory independent of its size) and
        calls `write(examples, records, labelled)` per chunk, in input order, with the
        records the one-shot `predict_file` gives those rows (ids numbered in the whole
        file). Every process must call this (the batches are collective); `write` runs on
        process 0 only. No metrics: they need every row at once. Returns the rows predicted."""
        import os
        import tempfile

        from bertjax.train import multihost

        if chunk_rows < 1:
            raise ConfigError(f"--chunk_rows={chunk_rows} must be positive")
        if not paths.exists(path):
            raise DataError(f"{path}: no such file")
        merged = {**dict(self.trained.config.get("data", {})),
                  **{k: v for k, v in (fields or {}).items() if v is not None}}
        paths.check_encoding(merged.get("encoding") or paths.DEFAULT_ENCODING, "--encoding")
        total, real, computed = 0, 0, 0
        with tempfile.TemporaryDirectory() as directory:
            for chunk, start in input_chunks(self.task, path, chunk_rows, merged, directory):
                # The chunks are written in UTF-8, whatever the input's encoding.
                examples, labelled = self.task.read_inputs(chunk, {**merged,
                                                                   "encoding": "utf-8"})
                features, predictions, tokens = self.engine.run(examples)
                try:
                    records = self.task.records(predictions, features, examples)
                finally:
                    self.task.release(examples)
                if hasattr(self.task, "conll_text"):  # tagging ids: sentence numbers
                    records = [{**r, "id": str(start + i)} for i, r in enumerate(records)]
                multihost.write_from_main(functools.partial(write, examples, records,
                                                            labelled))
                total += len(records)
                real, computed = real + tokens["real"], computed + tokens["computed"]
                os.remove(chunk)  # the next chunk is written only once this one is done
        self.last_padding = padding_line({"real": real, "computed": computed})
        return total


# ---------------------------------------------------------------------------------------------
# Dry run of the inference step (`python -m bertjax.predict --dry_run [--topology=v5e-8]`)


@dataclasses.dataclass
class InferenceCost:
    """The jitted predict step of one batch shape, compiled for the mesh's devices; bytes,
    FLOPs and time per device (chip)."""

    seq_len: int
    batch_size: int  # global
    total_bytes: float
    hbm_bytes: float | None  # the chip's HBM (None: the local machine's devices)
    flops: float | None
    step_seconds: float | None  # the compiler's estimate, else the roofline (TPU only)

    @property
    def fits(self) -> bool:
        return self.hbm_bytes is None or self.total_bytes <= self.hbm_bytes

    def sequences_per_second_per_chip(self, chips: int) -> float | None:
        return self.batch_size / self.step_seconds / chips if self.step_seconds else None


def batch_shapes(task: Task, max_seq_length: int, batch_size: int
                 ) -> list[tuple[int, int]]:
    """[(global rows, length)]: the batch shapes of the task's unshuffled (prediction) batches
    (data_pipeline.finetune_data's prediction plan, SQuAD windows included)."""
    from data_pipeline import finetune_data

    grid = finetune_data.prediction_buckets(finetune_data.bucket_lengths(
        max_seq_length, min(task.min_bucket_length, max_seq_length)))
    return [(finetune_data.prediction_rows(batch_size, n, max_seq_length), n) for n in grid]


def inference_costs(workdir: str, topology: str | None = None, batch_size: int | None = None,
                    dtype: str | None = None) -> tuple[list[InferenceCost], int, str]:
    """([cost per batch shape], chips, a header line) of a finished run's predict step:
    compiled by the TPU compiler for `topology`'s slice (any machine; dtype bfloat16 unless
    given), or for this machine's devices, the layers unrolled and measured as the training
    dry run does (bertjax.train.dry_run.calibrated). Abstract shapes only: no checkpoint is
    read."""
    from bertjax.tasks import get_task
    from bertjax.train import dry_run
    from bertjax.train import topology as topology_lib

    record, _ = read_finished_run(workdir)
    config = ml_collections.ConfigDict(
        paths.read_json_object(epath.Path(workdir) / CONFIG_FILE, CheckpointError))
    task = get_task(config)
    task.restore(record.get("task") or _legacy_state(record, config))
    fields = dict(record["model"])
    slice_ = topology_lib.parse(topology) if topology else None
    devices = topology_lib.devices(slice_) if slice_ else jax.devices()
    if dtype or slice_:
        fields["dtype"] = configs.compute_dtype(dtype or "bfloat16")
    model_config = BertConfig.from_dict(fields)
    mesh = sharding_lib.make_mesh(config.mesh, devices)
    batch_size = int(batch_size or config.eval.batch_size)
    configs.check_batch_size(batch_size, mesh, field="--batch_size")
    rules = sharding_lib.as_rules(config.logical_axis_rules)
    batch_sharding = sharding_lib.batch_sharding(mesh, config.logical_axis_rules)
    chips = len(devices)

    def compile_layers(layers: int, rows: int, length: int):
        model = task.model(dataclasses.replace(model_config, num_layers=layers,
                                               scan_layers=False))
        boxed = jax.eval_shape(
            lambda: model.init(jax.random.key(0), *task.init_inputs()))["params"]
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                nn.unbox(boxed), shardings)
        spec = task.batch_spec(rows, length)
        step = jax.jit(functools.partial(_predict, task=task, model=model),
                       in_shardings=(shardings, jax.tree.map(lambda _: batch_sharding, spec)))
        return dry_run.compile_and_measure(step, (abstract, spec), slice_)

    costs, method = [], ""
    for rows, length in batch_shapes(task, int(config.max_seq_length), batch_size):
        m, method = dry_run.calibrated(functools.partial(compile_layers, rows=rows,
                                                         length=length),
                                       model_config.num_layers)
        if isinstance(m, str):  # out of memory: a row that does not fit
            needed = dry_run.oom_sizes(m)[0]
            costs.append(InferenceCost(length, rows, needed or float("inf"),
                                       slice_.hbm_bytes if slice_ else 0.0, None, None))
            continue
        seconds = m.op_seconds or m.seconds  # the compiler's per-op estimates (dry_run)
        if slice_ and not seconds:  # no estimate at all: the roofline
            seconds = max(m.flops / slice_.peak_flops,
                          (m.hlo_bytes or m.bytes_accessed) / (slice_.chip.hbm_gbps * 1e9))
        costs.append(InferenceCost(length, rows, m.argument_bytes + m.output_bytes
                                   + m.temp_bytes, slice_.hbm_bytes if slice_ else None,
                                   m.flops or None, seconds if slice_ else None))
    where = (f"{slice_.accelerator_type} ({slice_.topology_name}, TPU compiler): {chips} chips "
             f"of {slice_.chip.hbm_gib:g} GiB HBM" if slice_ else
             f"this machine: {chips} {devices[0].platform} device(s)")
    header = (f"Predict step of {workdir} ({type(task.model(model_config)).__name__}, "
              f"{model_config.dtype}) on {where}; mesh {dict(mesh.shape)}; global batch "
              f"{batch_size} rows at full length, more when shorter; {method}")
    return costs, chips, header


def inference_table(costs: list[InferenceCost], chips: int) -> list[str]:
    """One line per batch shape: memory, FLOPs, step time and sequences/s per chip."""
    gib = 1024.0**3
    lines = [f"{'length':>6} {'rows':>5} {'memory/chip':>12} {'fits':>4} {'GFLOP/chip':>11} "
             f"{'step ms':>8} {'seq/s/chip':>11}"]
    for c in costs:
        rate = c.sequences_per_second_per_chip(chips)
        fits = "yes" if c.fits else "NO"
        memory = (f"{c.total_bytes / gib:.2f} GiB" if c.total_bytes >= gib / 10 else
                  f"{c.total_bytes / 1024**2:.1f} MiB")
        lines.append(f"{c.seq_len:>6} {c.batch_size:>5} {memory:>12} {fits:>4} "
                     f"{(c.flops or 0) / 1e9:>11.2f} "
                     f"{'n/a' if c.step_seconds is None else f'{c.step_seconds * 1e3:.3f}':>8} "
                     f"{'n/a' if rate is None else f'{rate:,.0f}':>11}")
    return lines


# ---------------------------------------------------------------------------------------------
# Streaming: a corpus larger than memory, a chunk of rows at a time

def _write_chunk(directory: str, number: int, suffix: str, write) -> str:
    import os

    chunk = os.path.join(directory, f"chunk{number}{suffix}")
    with open(chunk, "w", encoding="utf-8", newline="") as f:
        write(f)
    return chunk


def _csv_chunks(path: str, rows: int, id_field: str, directory: str, fill_empty: bool = True,
                encoding: str = paths.DEFAULT_ENCODING) -> Iterator[tuple[str, int]]:
    """CSV / TSV chunks, the header repeated; a row without an id (the column absent, or with
    `fill_empty` its cell empty) gets its 0-based row number in the whole file (what the
    one-shot reader gives it)."""
    import csv

    delimiter = "\t" if path.lower().endswith(".tsv") else ","
    with paths.open_text(path, encoding, newline="") as f:
        reader = csv.reader(f, delimiter=delimiter)
        header = next((h for h in reader if h and any(x.strip() for x in h)), None)
        if header is None:
            raise DataError(f"{path}: empty file (expected a header row)")
        names = [h.strip() for h in header]
        add_id = id_field not in names
        column = len(header) if add_id else names.index(id_field)
        start, buffer, number = 0, [], 0

        def flush():
            def write(out):
                writer = csv.writer(out, delimiter=delimiter)
                writer.writerow(header + ([id_field] if add_id else []))
                writer.writerows(buffer)
            return _write_chunk(directory, number, path[-4:], write)

        for row in reader:
            if not row or not any(x.strip() for x in row):
                continue
            index = start + len(buffer)
            if add_id:
                row = row + [""] * max(len(header) - len(row), 0) + [str(index)]
            elif fill_empty and column < len(row) and row[column] == "":
                row = row[:column] + [str(index)] + row[column + 1:]
            buffer.append(row)
            if len(buffer) == rows:
                yield flush(), start
                start, buffer, number = start + rows, [], number + 1
        if buffer or start == 0:
            yield flush(), start


def _jsonl_chunks(path: str, rows: int, id_field: str | None, directory: str,
                  encoding: str = paths.DEFAULT_ENCODING) -> Iterator[tuple[str, int]]:
    """JSONL chunks; an object without `id_field` gets its 0-based number in the whole file."""
    start, buffer, number = 0, [], 0

    def flush():
        return _write_chunk(directory, number, ".jsonl",
                            lambda out: out.writelines(dump(r) + "\n" for r in buffer))

    for _, record in paths.jsonl_records(path, DataError, encoding):
        if id_field and id_field not in record:
            record = {**record, id_field: start + len(buffer)}
        buffer.append(record)
        if len(buffer) == rows:
            yield flush(), start
            start, buffer, number = start + rows, [], number + 1
    if buffer or start == 0:
        yield flush(), start


def _conll_chunks(path: str, rows: int, directory: str, encoding: str = paths.DEFAULT_ENCODING
                  ) -> Iterator[tuple[str, int]]:
    """CoNLL chunks of at least `rows` sentences, cut only where a document starts
    (-DOCSTART-): a sentence's document context stays what the whole file gives it."""
    start, lines, sentences, number, in_sentence = 0, [], 0, 0, False

    def flush():
        return _write_chunk(directory, number, ".conll", lambda out: out.writelines(lines))

    with paths.open_text(path, encoding) as f:
        for raw in f:
            fields = raw.split()
            if fields and fields[0] == "-DOCSTART-" and sentences >= rows:
                yield flush(), start
                start, lines, sentences, number = start + sentences, [], 0, number + 1
            if fields and fields[0] != "-DOCSTART-":
                sentences += not in_sentence
                in_sentence = True
            else:
                in_sentence = False
            lines.append(raw if raw.endswith("\n") else raw + "\n")
    if lines or start == 0:
        yield flush(), start


def _tagging_jsonl_chunks(path: str, rows: int, directory: str,
                          encoding: str = paths.DEFAULT_ENCODING) -> Iterator[tuple[str, int]]:
    """JSONL tagging chunks of at least `rows` sentences, cut only where a document starts (a
    line without a "document" field, or with another value than the line before)."""
    start, buffer, number, previous = 0, [], 0, None

    def flush():
        return _write_chunk(directory, number, ".jsonl",
                            lambda out: out.writelines(dump(r) + "\n" for r in buffer))

    for _, record in paths.jsonl_records(path, DataError, encoding):
        document = record["document"] if "document" in record else object()  # alone
        if len(buffer) >= rows and document != previous:
            yield flush(), start
            start, buffer, number = start + len(buffer), [], number + 1
        previous = document
        buffer.append(record)
    if buffer or start == 0:
        yield flush(), start


def json_array_items(path: str, key: str, block: int = 1 << 20,
                     encoding: str = paths.DEFAULT_ENCODING) -> Iterator[Any]:
    """The items of the array `key` of the JSON object in `path`, one at a time, reading
    `block` characters at a time (a file larger than memory, e.g. SQuAD's {"data": [...]});
    the object's other values are read and dropped."""
    decoder = json.JSONDecoder()
    state = {"buffer": "", "pos": 0, "eof": False, "block": block}
    handle = paths.open_text(path, encoding)

    def more() -> bool:
        text = handle.read(state["block"])
        state["eof"] = not text
        state["buffer"] = state["buffer"][state["pos"]:] + text
        state["pos"] = 0
        return bool(text)

    def peek() -> str:
        while True:
            buffer, pos = state["buffer"], state["pos"]
            while pos < len(buffer) and buffer[pos] in " \t\r\n":
                pos += 1
            state["pos"] = pos
            if pos < len(buffer):
                return buffer[pos]
            if not more():
                raise DataError(f"{path}: the JSON ends early")

    def take(expected: str) -> None:
        if peek() not in expected:
            raise DataError(f"{path}: not a JSON object with a {key!r} list (expected "
                            f"{' or '.join(expected)} at {state['buffer'][state['pos']:][:20]!r})")
        state["pos"] += 1

    def value():
        while True:
            peek()
            try:
                item, end = decoder.raw_decode(state["buffer"], state["pos"])
                if end < len(state["buffer"]) or state["eof"]:  # a number may continue
                    state["pos"] = end
                    return item
            except json.JSONDecodeError as e:
                if state["eof"]:
                    raise DataError(f"{path}: not valid JSON ({e.msg})") from None
            state["block"] *= 2  # an item longer than the buffer: read more at a time
            more()

    with handle:
        take("{")
        while peek() != "}":
            name = value()
            take(":")
            if name != key:
                value()
            else:
                take("[")
                while peek() != "]":
                    yield value()
                    if peek() != "]":
                        take(",")
                take("]")
            if peek() != "}":
                take(",")
        take("}")


def _squad_json_chunks(path: str, rows: int, directory: str,
                       encoding: str = paths.DEFAULT_ENCODING) -> Iterator[tuple[str, int]]:
    """SQuAD-layout .json chunks of whole paragraphs holding at least `rows` questions (an
    article's paragraphs may fall in two chunks: each question is predicted by itself)."""
    start, buffer, questions, number = 0, [], 0, 0

    def flush():
        return _write_chunk(directory, number, ".json",
                            lambda out: out.write(dump({"data": buffer})))

    for article in json_array_items(path, "data", encoding=encoding):
        if not isinstance(article, dict):
            raise DataError(f"{path}: data[] holds {type(article).__name__}, not articles")
        for paragraph in article.get("paragraphs") or ():
            buffer.append({"title": article.get("title", ""), "paragraphs": [paragraph]})
            questions += len(paragraph.get("qas") or ()) if isinstance(paragraph, dict) else 0
            if questions >= rows:
                yield flush(), start
                start, buffer, questions, number = start + questions, [], 0, number + 1
    if buffer or start == 0:
        yield flush(), start


def input_chunks(task: Task, path: str, rows: int, fields: dict[str, Any], directory: str
                 ) -> Iterator[tuple[str, int]]:
    """(chunk file of about `rows` rows, its first row's 0-based number in `path`), in order;
    each chunk is written to `directory` and can be read by `task.read_inputs`. Chunks end
    where the one-shot reading would give each row the same input (a tagging document's
    context, a SQuAD paragraph). `path` is read in fields["encoding"] (default UTF-8); the
    chunks are UTF-8."""
    lower = path.lower()
    encoding = fields.get("encoding") or paths.DEFAULT_ENCODING
    if hasattr(task, "conll_text"):  # tagging
        fmt = fields.get("format") or "auto"
        if fmt == "jsonl" or (fmt == "auto" and lower.endswith((".jsonl", ".json"))):
            return _tagging_jsonl_chunks(path, rows, directory, encoding)
        return _conll_chunks(path, rows, directory, encoding)
    if lower.endswith(".json") and hasattr(task, "doc_stride"):  # SQuAD layout
        return _squad_json_chunks(path, rows, directory, encoding)
    if lower.endswith(".csv") and getattr(task, "family", "") == "swag":  # SWAG's ids
        return _csv_chunks(path, rows, "fold-ind", directory, fill_empty=False,
                           encoding=encoding)
    if lower.endswith((".csv", ".tsv")):
        return _csv_chunks(path, rows, fields.get("id") or "id", directory, encoding=encoding)
    if lower.endswith(".jsonl"):
        return _jsonl_chunks(path, rows, fields.get("id") or "id", directory, encoding)
    raise DataError(f"--input={path}: streaming (--chunk_rows) reads .csv, .tsv, .jsonl, "
                    "SQuAD-layout .json, CoNLL or JSONL tagging files")


# ---------------------------------------------------------------------------------------------
# Fill-mask: the masked-LM head of a pre-trained checkpoint


class FillMask:
    """Top-k fillers of each [MASK] of a text, from a bertjax checkpoint directory's MLM head.

        fill = bertjax.FillMask.from_checkpoint("runs/demo/export")
        fill("the capital of france is [MASK].", top_k=5)
        → [{"position": 6, "candidates": [{"token", "word", "probability", "sequence"}]}]

    Probabilities are the softmax over the whole vocabulary; the candidates skip special
    tokens. A WordPiece continuation (`##s`) is shown as the whole word it completes (`word`).
    Texts run in fixed-shape batches of length buckets (16, 32, ..., max_seq_length), sharded
    over the data-parallel devices.
    """

    def __init__(self, model_config: BertConfig, params, tokenizer, max_seq_length: int = 128,
                 batch_size: int = 8):
        from bertjax.models import BertForPreTraining

        self.tokenizer, self.batch_size = tokenizer, batch_size
        self.max_seq_length = min(max_seq_length, model_config.max_position_embeddings)
        model = BertForPreTraining(model_config)
        ids = jnp.zeros((1, 2), jnp.int32)
        self.runner, self.params = runner_and_params(
            model, (ids, ids, ids, jnp.zeros((1, 1), jnp.int32)), params, DATA_PARALLEL_MESH,
            DATA_PARALLEL_RULES, batch_size)

        def probabilities(params, batch):  # [batch, masks, vocab] float32
            out = model.apply({"params": params}, batch["input_ids"], batch["segment_ids"],
                              batch["input_mask"], batch["positions"])
            return jax.nn.softmax(out["mlm_logits"].astype(jnp.float32), axis=-1)

        self._probabilities = jax.jit(probabilities)

    @classmethod
    def from_checkpoint(cls, directory: str, max_seq_length: int = 128, batch_size: int = 8,
                        dtype: str | None = None) -> FillMask:
        from bertjax.checkpoint_dir import load_pretrained

        overrides = {"dtype": configs.compute_dtype(dtype or "auto")}
        config, params, tokenizer = load_pretrained(directory, **overrides)
        return cls(config, params, tokenizer, max_seq_length, batch_size)

    def probabilities(self, texts: list[str]) -> list[tuple[Any, np.ndarray]]:
        """(encoding, [masks, vocab] probabilities at its [MASK] positions) per text."""
        from data_pipeline.finetune_data import bucket_lengths
        from data_pipeline.hosts import host_rows

        encodings = [self.tokenizer.encode(t, max_seq_length=self.max_seq_length)
                     for t in texts]
        masks = []
        for i, enc in enumerate(encodings):
            found = [p for p, t in enumerate(enc.input_ids) if t == self.tokenizer.mask_id]
            if not found:
                raise DataError(f"text {i + 1} ({texts[i][:40]!r}) has no [MASK] within "
                                f"{self.max_seq_length} tokens")
            masks.append(found)
        buckets = bucket_lengths(self.max_seq_length, min(16, self.max_seq_length))
        width = max(len(m) for m in masks)
        out: list = [None] * len(texts)
        order = sorted(range(len(texts)), key=lambda i: sum(encodings[i].input_mask))
        for first in range(0, len(order), self.batch_size):
            rows = order[first:first + self.batch_size]
            longest = max(sum(encodings[i].input_mask) for i in rows)
            length = next(b for b in buckets if b >= longest)
            batch = {k: np.zeros((self.batch_size, length), np.int32)
                     for k in ("input_ids", "segment_ids", "input_mask")}
            batch["positions"] = np.zeros((self.batch_size, width), np.int32)
            for r, i in enumerate(rows):
                enc = encodings[i]
                batch["input_ids"][r] = enc.input_ids[:length]
                batch["segment_ids"][r] = enc.segment_ids[:length]
                batch["input_mask"][r] = enc.input_mask[:length]
                batch["positions"][r, :len(masks[i])] = masks[i]
            mine = host_rows(self.batch_size, jax.process_index(), jax.process_count())
            _, probs = next(self.runner.run(self._probabilities, self.params,
                                            [{k: v[mine] for k, v in batch.items()}]))
            for r, i in enumerate(rows):
                out[i] = (encodings[i], masks[i], np.asarray(probs[r, :len(masks[i])]))
        return out

    def __call__(self, text: str | list[str], top_k: int = 5):
        """Per text (a list for a list of texts): [{position, candidates}] per [MASK]."""
        texts = [text] if isinstance(text, str) else list(text)
        if not texts:
            raise DataError("no texts")
        results = [self._candidates(*row, top_k) for row in self.probabilities(texts)]
        return results[0] if isinstance(text, str) else results

    def _candidates(self, enc, masks: list[int], probs: np.ndarray, top_k: int) -> list[dict]:
        tokenizer = self.tokenizer
        special = np.zeros(probs.shape[-1], bool)
        special[list(tokenizer.special_ids)] = True
        n = int(sum(enc.input_mask))
        out = []
        for m, position in enumerate(masks):
            p = np.where(special, -1.0, probs[m])
            best = np.argsort(-p, kind="stable")[:top_k]
            candidates = []
            for token_id in best:
                token = tokenizer.convert_ids_to_tokens([int(token_id)])[0]
                ids = list(enc.input_ids[1:n - 1])  # without [CLS] / [SEP]
                ids[position - 1] = int(token_id)
                candidates.append({"token": token, "word": whole_word(enc.tokens, position,
                                                                      token),
                                   "probability": float(probs[m, token_id]),
                                   "sequence": tokenizer.decode(ids)})
            out.append({"position": position, "candidates": candidates})
        return out


def whole_word(tokens: list[str], position: int, token: str) -> str:
    """The word a candidate at `position` makes: a `##` continuation joined to the pieces
    before it (and any continuations after it), otherwise the token and its continuations."""
    def piece(t: str) -> str:
        return t[2:] if t.startswith("##") else t

    start = position
    if token.startswith("##"):
        while start > 1 and tokens[start - 1].startswith("##"):
            start -= 1
        start -= start > 1  # the word's first piece (not [CLS])
    end = position + 1
    while end < len(tokens) and tokens[end].startswith("##"):
        end += 1
    pieces = [token if i == position else tokens[i] for i in range(start, end)]
    return pieces[0].removeprefix("##") + "".join(piece(t) for t in pieces[1:])


def dump(record: dict[str, Any]) -> str:
    """One JSONL line (non-ASCII kept as written)."""
    return json.dumps(record, ensure_ascii=False)

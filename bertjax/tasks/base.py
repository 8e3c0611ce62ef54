"""The fine-tuning plug-in interface, and the job that runs any task on the shared loop.

A task family (classification/, squad/, tagging/) subclasses `Task` and declares only what is
its own. For training (`TrainingTask`):

  read(config)                  -> Splits: examples of train, dev {name: [...]}, test {name: [...]}
  encode(tokenizer, examples)   -> features of a split (any object; `batches` knows it)
  batches(features, batch_size, shuffle, seed) -> per-host NumPy batches of one epoch, each
                                   with `example_index` [batch] (-1 for filler rows)
  batch_spec(batch_size, max_seq_length) -> shapes of the largest global batch (dry runs)
  train_rows / train_batch_spec(features, ...) -> a training batch's rows and shapes (other
                                   than batch_size and batch_spec where the task packs examples)
  model(model_config)           -> the Flax module (BertModel "bert" + head; for a ModernBERT
                                   ModernBertModel "model" + transformers' head, models/heads.py)
  init_inputs()                 -> dummy inputs for model.init
  outputs(model, params, batch, **apply_kwargs) -> the head's outputs for a batch
  loss(outputs, batch, denominators=None) -> (loss, metrics) in float32
  denominators(batch)           -> {term: [] float32}: the normalisers of `loss`'s weighted
                                   means over a batch (sum of example / label weights), which
                                   `loss` divides by when given them, else computes itself;
                                   with them accumulated micro-batches sum to one batch
                                   (bertjax/train/step.py). None: the task has none.
  predict(outputs, batch)       -> {name: [batch, ...]} per-example predictions (jitted)
  metrics(predictions, features, split) -> {metric: float}
  write_outputs(predictions, examples, split, workdir, log)   (test predictions, files)
  metric_names, primary_metric  (the primary one selects the best checkpoint)
for the export (`ExportTask`):
  hf_head()                     -> how `bertjax.convert to_hf` exports the model (hf_head)
  state() / restore(state)      what `read` learnt that the model needs (labels, kind, the
                                v2.0 null threshold), kept in export.json as "task"
  legacy_state(record, config)  the state of a run whose export.json predates `state()`
and for predictions from a finished run (`ServingTask`: bertjax/serving, `python -m
bertjax.predict`):
  read_inputs(path, fields)     -> (examples, labelled) of a user's file of new rows
  examples(items)               -> examples of Python values (strings, pairs, dicts)
  records(predictions, features, examples) -> one plain record per example, in input order
  input_chunks / stream_records  a file larger than memory, a chunk of rows at a time

`FineTuningJob` turns a task into a job for bertjax.train.loop.train: it loads the pre-trained
encoder (params only, no optimizer state; a ModernBERT's MLM prediction head too where the
task's head has one, as transformers' ModernBertFor*.from_pretrained loads it by name),
counts steps from epochs, applies the paper's warmup proportion, feeds epochs with a saveable
position (so a resumed run sees the same batches), and evaluates every dev split; the loop
does the rest. At the end it writes `workdir/export.json`
(EXPORT_FILE): the model config, vocabulary and head that `python -m bertjax.convert to_hf
--input=WORKDIR` needs to write the best checkpoint as a Hugging Face model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
from etils import epath

from bertjax import checkpoint_dir
from bertjax.errors import CheckpointError, ConfigError
from bertjax.models import ModelConfig, architecture, heads
from bertjax.tasks import chunks
from bertjax.train import configs, multihost
from bertjax.train.loop import Job, Stage
from bertjax.train.optimizer import make_optimizer
from bertjax.train.workdir import EXPORT_FILE, write_json
from data_pipeline import finetune_data


def hf_head(architecture: str, labels=(), problem_type: str | None = None,
            bilstm_units: int = 0, extra_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """A task's export record for `to_hf`: the transformers class, the label names (config
    id2label), problem_type and extra config.json fields the task's predictions need; a
    "+ BiLSTM" head has no transformers class."""
    if bilstm_units:
        return unexportable("the + BiLSTM head (config.task.bilstm_units) has no Hugging Face "
                            "BERT class")
    return {"architecture": architecture, "labels": list(labels), "problem_type": problem_type,
            "extra_config": dict(extra_config or {})}


def unexportable(why: str) -> dict[str, Any]:
    return {"architecture": None, "why": why}


@dataclasses.dataclass
class Splits:
    train: list
    dev: dict[str, list]  # eval name → examples (several: MNLI matched / mismatched)
    test: dict[str, list]  # output name (e.g. a leaderboard file stem) → examples


class TrainingTask:
    """What the loop and FineTuningJob read: data, features, head, loss, predictions, metrics,
    test outputs (the module docstring lists each member)."""

    metric_names: tuple[str, ...] = ()
    primary_metric: str = ""
    pooled_only: bool = False  # the head reads the pooled token alone (model FLOPs)
    # config.task.kind values whose training batches can be packed (config.data.pack); whether
    # the head pools one token of each example (a causal BERT's is its last, which packed rows
    # do not mark).
    packed_kinds: tuple[str, ...] = ()
    pools_one_token: bool = False

    @classmethod
    def packing_refusal(cls, config, model) -> str | None:
        """What else of `config` (and its `model` config) the task's packing cannot take, for
        config.data.pack's one-line refusal (bertjax/tasks/checks.py); None: nothing."""
        return None

    # Whether the task's head starts from a ModernBERT checkpoint's MLM prediction head
    # ("head": dense, activation, norm), as transformers' ModernBertFor* classes do.
    pretrained_head: bool = True

    def __init__(self, config):
        self.min_bucket_length = config.min_bucket_length  # the shortest length bucket
        task = config.get("task") or {}
        # The head options of bertjax/models/heads.py (checked by tasks/checks.py):
        # ModernBERT's pooling of sequence heads, and the dropout before the output layer
        # (None: the encoder's hidden dropout).
        self.classifier_pooling = task.get("classifier_pooling") or "cls"
        self.classifier_dropout = task.get("classifier_dropout")

    def read(self, config) -> Splits:
        raise NotImplementedError

    def encode(self, tokenizer, examples, max_seq_length: int):
        raise NotImplementedError

    def batches(self, features, batch_size: int, *, shuffle: bool, seed: int = 0
                ) -> Iterator[dict[str, np.ndarray]]:
        raise NotImplementedError

    def bucket_lengths(self, max_seq_length: int) -> tuple[int, ...]:
        """The run's length buckets: powers of two from `min_bucket_length`
        (config.min_bucket_length) up to `max_seq_length` (data_pipeline.finetune_data)."""
        return finetune_data.bucket_lengths(max_seq_length,
                                            min(self.min_bucket_length, max_seq_length))

    def num_batches(self, features, batch_size: int) -> int:
        """Batches in one training epoch of `batches`; a task whose batches are costly to build
        (the feature-based tagger reads its cache) counts them from its plan instead."""
        return sum(1 for _ in self.batches(features, batch_size, shuffle=True))

    def batch_spec(self, batch_size: int, max_seq_length: int
                   ) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes of the largest global batch (for dry runs)."""
        raise NotImplementedError

    def train_rows(self, features, batch_size: int) -> int:
        """Rows of a global training batch: batch_size examples one a row, unless the task
        packs several examples into a row (config.data.pack)."""
        return batch_size

    def train_batch_spec(self, features, batch_size: int, max_seq_length: int
                         ) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes of the largest global training batch of `features` (for dry runs)."""
        return self.batch_spec(batch_size, max_seq_length)

    def model(self, model_config):
        raise NotImplementedError

    def init_inputs(self) -> tuple:
        raise NotImplementedError

    def outputs(self, model, params, batch, **kwargs):
        return model.apply({"params": params}, batch["input_ids"], batch["segment_ids"],
                           batch["input_mask"], **kwargs)

    def loss(self, outputs, batch, denominators=None):
        raise NotImplementedError

    # A method `denominators(batch) -> {term: []}` in the families that normalise by weights;
    # None: accumulated micro-batches average (bertjax.train.step).
    denominators = None

    def predict(self, outputs, batch) -> dict[str, jax.Array]:
        raise NotImplementedError

    def metrics(self, predictions: dict[str, np.ndarray], features, split: str
                ) -> dict[str, float]:
        raise NotImplementedError

    def write_outputs(self, predictions: dict[str, np.ndarray], examples: list, split: str,
                      workdir: epath.Path, log) -> None:
        pass

    def describe(self, features) -> str:
        return ""

    def initial_params(self, model_config, pretrained: dict[str, Any]) -> dict[str, Any]:
        """Param groups loaded from the pre-trained checkpoint's params `pretrained` (called
        before `encode`): the encoder ("bert", a ModernBERT's "model") and a ModernBERT's
        prediction head "head" where `pretrained_head`. A task whose model has no encoder (the
        feature-based tagger) keeps the encoder to compute its inputs and returns {}."""
        record = architecture(model_config)
        groups = [record.encoder_group]
        if self.pretrained_head:
            groups += record.pretrained_head_groups
        return {group: pretrained[group] for group in groups}


class ExportTask:
    """What a finished run keeps of its task (export.json) and gives back to serving and the
    converter."""

    def hf_head(self) -> dict[str, Any]:
        """The export record of the trained model (called after the best checkpoint's outputs
        are written): hf_head(...) or unexportable(why)."""
        return unexportable(f"{type(self).__name__} has no Hugging Face BERT class")

    def state(self) -> dict[str, Any]:
        """What `read` learnt that predictions need (JSON values), kept in export.json."""
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        """Sets what `read` would have set, from `state()` of the finished run."""

    def legacy_state(self, record: dict[str, Any], config) -> dict[str, Any]:
        """The `state()` of a finished run whose export.json predates recording it, from its
        transformers head fields (`record`) and the run's config."""
        raise ConfigError(f"config.task.family={config.task.family!r} has no predictions from "
                          "a finished run")


class ServingTask:
    """What bertjax/serving reads beside the training members: new rows from files or Python
    values, plain records out, files larger than memory a chunk at a time."""

    def read_inputs(self, path: str, fields: dict[str, Any]) -> tuple[list, bool]:
        """(examples, whether they all carry gold labels) of a file of new rows; `fields`
        are the users'-files field names (text_a, text_b, label, choices, ...)."""
        raise ConfigError(f"{type(self).__name__} cannot read new rows")

    def examples(self, items: list) -> list:
        """Unlabelled examples of Python values (`bertjax.Predictor`)."""
        raise ConfigError(f"{type(self).__name__} cannot take Python values")

    def records(self, predictions: dict[str, Any], features, examples: list
                ) -> list[dict[str, Any]]:
        """One plain record per example, in the examples' order."""
        raise NotImplementedError

    def release(self, examples: list) -> None:
        """Forgets what `encode` kept about `examples` (a predictor's inputs come and go)."""

    def input_chunks(self, path: str, rows: int, fields: dict[str, Any], directory: str
                     ) -> Iterator[tuple[str, int]]:
        """(chunk file of about `rows` rows, its first row's 0-based number in `path`), in
        order, each written to `directory` and readable by `read_inputs` (bertjax.tasks.chunks):
        a file larger than memory, a chunk at a time. A family whose rows read context from
        their neighbours cuts only where the one-shot reading would give each row the same
        input. Default: CSV / TSV / JSONL rows, ids from fields["id"]."""
        return chunks.by_extension(path, rows, fields, directory)

    def stream_records(self, records: list[dict[str, Any]], start: int
                       ) -> list[dict[str, Any]]:
        """The records of a chunk whose first row is row `start` of the whole file, with the
        ids the one-shot reading gives them."""
        return records


class Task(TrainingTask, ExportTask, ServingTask):
    """Base of the task families: training, export and serving in one plug-in."""


class EpochInput:
    """Batches of epoch after epoch (`make_epoch(epoch)` builds one epoch), with a saveable
    position: (epoch, batches taken from it)."""

    def __init__(self, make_epoch: Callable[[int], Iterator[dict[str, np.ndarray]]]):
        self.make_epoch = make_epoch
        self.epoch, self.index = 0, 0
        self._batches = make_epoch(0)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        for batch in self._batches:
            self.index += 1
            return batch
        self.epoch, self.index = self.epoch + 1, 0
        self._batches = self.make_epoch(self.epoch)
        return next(self)

    def save(self, prefix: str) -> None:
        epath.Path(prefix + ".json").write_text(json.dumps({"epoch": self.epoch,
                                                            "index": self.index}))

    def restore(self, prefix: str) -> None:
        position = json.loads(epath.Path(prefix + ".json").read_text())
        self.epoch, self.index = position["epoch"], 0
        self._batches = self.make_epoch(self.epoch)
        for _ in range(position["index"]):
            next(self)


def model_overrides(fields, stored) -> dict[str, Any]:
    """config.model's overrides of the init checkpoint's config (`stored`), as its
    architecture takes them (`Architecture.model_overrides`: BERT's dropout fields translated
    for a ModernBERT)."""
    return architecture(stored).model_overrides(dict(fields or {}))


class InitCheckpoint(NamedTuple):
    """config.init_checkpoint's model config (its config.json) and tokenizer as the checks
    read them (bertjax.tasks.checks.check), handed to the job: each file is read once."""
    config: ModelConfig
    tokenizer: Any | None  # None: the checkpoint has no single vocabulary (load names it)


def load_pretrained_model(config, init: InitCheckpoint | None = None):
    """(model config with config.model overrides and the dtype policy, host params, tokenizer)
    of config.init_checkpoint; `init`: its config and tokenizer, already read."""
    stored = init.config if init else checkpoint_dir.load_config(config.init_checkpoint)
    overrides = model_overrides(config.model, stored)
    overrides["dtype"] = configs.compute_dtype(overrides.get("dtype", "auto"))
    try:
        return checkpoint_dir.load_pretrained(config.init_checkpoint, stored=stored,
                                              tokenizer=init and init.tokenizer, **overrides)
    except CheckpointError as e:
        raise CheckpointError(f"config.init_checkpoint: {e}") from None


class FineTuningJob(Job):
    """A task on the shared loop (bertjax.train.loop.train), of a config that passed
    bertjax.tasks.checks.check."""

    def __init__(self, task: Task, config, log=print, init: InitCheckpoint | None = None):
        self.task, self.config = task, config
        self.splits = task.read(config)
        self.model_config, pretrained, tokenizer = load_pretrained_model(config, init)
        self.do_lower_case = tokenizer.do_lower_case
        self._pretrained = task.initial_params(self.model_config, pretrained)
        max_len = config.max_seq_length
        encode = functools.partial(task.encode, tokenizer, max_seq_length=max_len)
        self.train_features = encode(self.splits.train)
        self.dev_features = {k: encode(v) for k, v in self.splits.dev.items()}
        self.test_features = {k: encode(v) for k, v in self.splits.test.items()}
        self.model = task.model(self.model_config)
        self.batch_size = config.train.batch_size
        self.eval_batch_size = config.eval.batch_size
        self.grad_accum_steps = config.train.get("grad_accum_steps", 1)
        self.grad_reduce_dtype = configs.grad_reduce_dtype(config)
        self.best_metric = task.primary_metric
        self.evaluate_at_start = bool(config.eval.get("at_start", False))
        self.steps_per_epoch = task.num_batches(self.train_features, self.batch_size)
        self.total_steps = max(1, int(round(self.steps_per_epoch * config.train.num_epochs)))
        log(f"Task {config.task.name}: {len(self.splits.train)} train, "
            + ", ".join(f"{len(v)} {k}" for k, v in self.splits.dev.items())
            + " examples" + task.describe(self.train_features))
        self.loss = functools.partial(_loss, task=task, model=self.model)
        self.denominators = task.denominators
        self._predict = jax.jit(functools.partial(_predict, task=task, model=self.model))
        spec = task.train_batch_spec(self.train_features, self.batch_size, max_len)
        tokens = spec.get("input_ids")
        self.stages = [Stage(
            name="finetune", start=0, end=self.total_steps, make_input=self._train_input,
            batch_spec=spec,
            # Rows a step computes: batch_size examples, packed into fewer rows where the
            # task packs (config.data.pack); the rows must split over the devices.
            batch_size=task.train_rows(self.train_features, self.batch_size),
            # A row's tokens: max_len, or the packed rows' own length (shorter where the
            # longest texts are); 0 FLOPs: MFU not reported.
            flops_per_example=0.0,
            tokens_per_example=max_len if tokens is None else int(tokens.shape[-1]),
            description=f"Fine-tuning for {self.total_steps} steps "
                        f"({config.train.num_epochs} epochs of {self.steps_per_epoch})",
            eval_every=config.eval.every_steps or self.steps_per_epoch)]

    def _plan(self, features, shuffle: bool, seed: int = 0):
        return self.task.batches(features, self.batch_size, shuffle=shuffle, seed=seed)

    def _train_input(self) -> EpochInput:
        return EpochInput(lambda epoch: self._plan(self.train_features, shuffle=True,
                                                   seed=self.config.seed * 1000 + epoch))

    def init_params(self, rng):
        return self.model.init(rng, *self.task.init_inputs())["params"]

    def optimizer(self):
        opt = ml_collections.ConfigDict(self.config.optimizer.to_dict())
        opt.warmup_steps = int(self.config.optimizer.warmup_proportion * self.total_steps)
        return make_optimizer(opt, self.total_steps)

    def pretrained_params(self) -> dict[str, Any]:
        loaded, self._pretrained = self._pretrained, None  # host memory back once placed
        return loaded

    def predictions(self, params, features, runner) -> dict[str, Any]:
        mesh = runner.batch_sharding.mesh
        rows = configs.prediction_batch_size(self.eval_batch_size,
                                             mesh.devices.flat[0].platform,
                                             configs.data_parallel_size(mesh))
        return predict_rows(self.task, self._predict, params, features, rows, runner)

    def evaluate(self, params, stage: Stage, step: int, runner) -> dict[str, float]:
        results = {}
        for name, features in self.dev_features.items():
            prefix = f"{name}_" if len(self.dev_features) > 1 else ""
            metrics = self.task.metrics(self.predictions(params, features, runner), features,
                                        name)
            results.update({prefix + k: v for k, v in metrics.items()})
        results["epoch"] = step / self.steps_per_epoch
        return results

    def finish(self, params, runner, workdir: epath.Path, log) -> None:
        """Test predictions from the best checkpoint's params, written by the task; the
        export record (EXPORT_FILE)."""
        for name, features in self.test_features.items():
            predicted = self.predictions(params, features, runner)
            multihost.write_from_main(functools.partial(
                self.task.write_outputs, predicted, self.splits.test[name], name, workdir, log))
        self.write_export(workdir)

    def write_export(self, workdir: epath.Path) -> None:
        """export.json, and the vocabulary beside it: the record names it relative to the
        workdir, so a moved or copied run still predicts and converts."""
        vocab = checkpoint_dir.vocab_path(self.config.init_checkpoint)
        multihost.write_from_main(lambda: (workdir / vocab.name).write_bytes(vocab.read_bytes()))
        write_json(workdir / EXPORT_FILE, self.export_record(vocab.name))

    def export_record(self, vocab: str) -> dict[str, Any]:
        checkpoint = self.config.init_checkpoint
        if "://" not in checkpoint:
            checkpoint = os.path.abspath(checkpoint)
        head = architecture_head(self.task.hf_head(), self.model, self.model_config)
        return {**head, "model": self.model_config.to_dict(), "vocab": vocab,
                "do_lower_case": self.do_lower_case, "init_checkpoint": checkpoint,
                "task": self.task.state()}


def architecture_head(head: dict[str, Any], model, model_config) -> dict[str, Any]:
    """A task's export record (`hf_head`, written with BERT's class names) for its `model` of
    `model_config`'s architecture: a BERT's as it is, none for an architecture without a
    conversion module; another's transformers class (`Architecture.hf_class`) and the head's
    config.json fields (classifier_pooling, classifier_dropout: what ModernBertConfig calls
    them)."""
    if head.get("architecture") is None:
        return head
    record = architecture(model_config)
    if record.conversion is None:
        return unexportable(f"{record.title} has no transformers class")
    if not record.hf_classes:  # BERT's own names
        return head
    extra = {"classifier_pooling": getattr(model, "classifier_pooling", "cls"),
             "classifier_dropout": heads.head_dropout(
                 model_config, getattr(model, "classifier_dropout", None)),
             **head.get("extra_config", {})}
    return {**head, "architecture": record.hf_class(head["architecture"]),
            "extra_config": extra}


def predict_rows(task: Task, predict_fn, params, features, batch_size: int, runner,
                 tokens: dict[str, int] | None = None) -> dict[str, Any]:
    """Every row's predictions (`predict_fn(params, batch)` over the task's unshuffled
    batches), in `example_index` order: an array [len(features)] for per-row scalars, a list of
    len(features) arrays otherwise (batches of different lengths give rows of different
    shapes, e.g. start logits [seq]). tokens: if given, counts "real" (input_mask) and
    "computed" token positions of the global batches (padding waste)."""
    scalars: dict[str, np.ndarray] = {}  # per-row scalars, filled a batch at a time
    rows: dict[str, list] = {}
    batches = task.batches(features, batch_size, shuffle=False)
    for batch, predicted in runner.run(predict_fn, params, batches):
        if tokens is not None:
            tokens["real"] += int(np.sum(batch["input_mask"]))
            tokens["computed"] += int(np.size(batch["input_mask"]))
        index = np.asarray(batch["example_index"])
        real = index >= 0  # not a filler row
        for name, values in predicted.items():
            values = np.asarray(values)
            if values.ndim == 1:
                scalars.setdefault(name, np.zeros(len(features), values.dtype))[
                    index[real]] = values[real]
                continue
            out = rows.setdefault(name, [None] * len(features))
            for row in np.flatnonzero(real):
                out[index[row]] = values[row]
    return {**scalars, **rows}


def _loss(params, batch, rng, denominators=None, *, task: Task, model):
    kwargs = {} if rng is None else {"deterministic": False, "rngs": {"dropout": rng}}
    outputs = task.outputs(model, params, batch, **kwargs)
    if denominators is None:
        return task.loss(outputs, batch)
    return task.loss(outputs, batch, denominators)


def _predict(params, batch, *, task: Task, model):
    return task.predict(task.outputs(model, params, batch), batch)

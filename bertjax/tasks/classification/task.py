"""SequenceTask: classification, regression and multiple choice (GLUE, SWAG, users' own CSV /
TSV / JSONL files), one task family of the fine-tuning plug-in (tasks/base.py).

The heads are bertjax/models/classification.py's (logits [batch, num_labels], or
[batch, choices] for multiple choice; over a ModernBERT, transformers' ModernBertFor* heads with
config.task.classifier_pooling "cls" | "mean" and config.task.classifier_dropout). Losses in
float32: softmax cross-entropy for classification and across the choices of multiple choice,
mean squared error for regression (num_labels = 1, e.g. STS-B). config.data.pack: training
batches of packed rows (data_pipeline/packed_finetune.py; classification and regression), the
logits [rows, slots, labels] and the same losses over the real examples. Examples come from
readers.py, dev metrics are the official ones (metrics.py), GLUE test predictions become
leaderboard files (submission.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from etils import epath

from bertjax import paths
from bertjax.errors import ConfigError, DataError
from bertjax.models.classification import BertForMultipleChoice, BertForSequenceClassification
from bertjax.tasks import chunks
from bertjax.tasks.base import Splits, Task, hf_head
from bertjax.tasks.classification import metrics as metrics_lib
from bertjax.tasks.classification.submission import write_submission
from bertjax.tasks.packing import PackedTraining
from data_pipeline import packed_finetune
from data_pipeline.finetune_data import ChoiceExample, Example

Array = jax.Array


def example_denominators(weights: Array) -> dict[str, Array]:
    """{"examples": [] float32}: the normaliser of the weighted means over a batch, the sum of
    the example weights [batch] (at least 1e-6: a batch of filler rows gives 0, not NaN)."""
    return {"examples": jnp.maximum(jnp.sum(weights.astype(jnp.float32)), 1e-6)}


def _weighted_mean(values: Array, weights: Array | None,
                   denominators: dict[str, Array] | None) -> Array:
    """values [batch] weighted by `weights`, over `denominators` (None: of these weights;
    without weights, the plain mean)."""
    if weights is None and denominators is None:
        return jnp.mean(values)
    if weights is None:
        weights = jnp.ones_like(values)
    weights = weights.astype(jnp.float32)
    if denominators is None:
        denominators = example_denominators(weights)
    return jnp.sum(values * weights) / denominators["examples"]


def classification_loss(
    logits: Array, labels: Array, weights: Array | None = None,
    denominators: dict[str, Array] | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Softmax cross-entropy. logits [batch, K]; labels [batch] int; weights [batch] (0 = pad);
    denominators: `example_denominators` of the batch the means run over (None: this one)."""
    logits = logits.astype(jnp.float32)
    labels = labels.reshape(-1).astype(jnp.int32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, labels[:, None], axis=-1)[:, 0]
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    loss = _weighted_mean(nll, weights, denominators)
    return loss, {"loss": loss, "accuracy": _weighted_mean(correct, weights, denominators)}


def regression_loss(
    logits: Array, labels: Array, weights: Array | None = None,
    denominators: dict[str, Array] | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Mean squared error. logits [batch, 1]; labels [batch] float; weights [batch] (0 = pad);
    denominators: as in `classification_loss`."""
    predictions = logits.astype(jnp.float32).reshape(-1)
    loss = _weighted_mean(jnp.square(predictions - labels.reshape(-1).astype(jnp.float32)),
                          weights, denominators)
    return loss, {"loss": loss}


def readers_module():
    # Imported when used: the GLUE / SWAG / files readers are not needed to train on TFDS.
    from bertjax.tasks.classification import readers

    return readers


# ---------------------------------------------------------------------------------------------
# The task family


class SequenceTask(PackedTraining, Task):
    """config.task.family: glue (config.task.name: cola ... wnli) | swag | files
    (config.task.kind: classification | regression | multiple_choice)."""

    packed_kinds = ("classification", "regression")
    pools_one_token = True

    def __init__(self, config):
        super().__init__(config)
        self.family, self.name = config.task.family, config.task.name
        self.train_batch_size = config.train.batch_size
        self.group_by_length = bool(config.train.get("group_by_length", False))
        self.bilstm_units = int(config.task.get("bilstm_units", 0))  # 0: the paper's head
        # config.data.pack: training batches of packed rows (data_pipeline/packed_finetune.py;
        # classification and regression, checked by tasks/checks.py); evaluation is unpacked.
        self.pack = bool((config.get("data") or {}).get("pack", False))
        self.grad_accum_steps = int(config.train.get("grad_accum_steps", 1))

    def read(self, config) -> Splits:
        """Examples of every split, from config.task / config.data (TensorFlow only for TFDS)."""
        from bertjax.tasks.classification import readers

        family, data = config.task.family, config.data
        encoding = data.get("encoding") or paths.DEFAULT_ENCODING
        self.glue = family == "glue"
        if family == "glue":
            task = readers.glue_task(config.task.name)
            if data.tfds:
                splits = readers.read_glue_tfds(task, data.tfds_data_dir or None)
            elif data.dir:
                splits = readers.read_glue(data.dir, task, encoding)
            else:
                raise ConfigError("config.data.dir is empty; give the GLUE data directory "
                                  "(official layout) or set config.data.tfds=true")
            self._declare("regression" if task.regression else "classification", task.labels,
                          task.metrics)
            return Splits(splits["train"], {s.name: splits[s.name] for s in task.dev},
                          {s.name: splits[s.name] for s in task.test if s.name in splits})
        if family == "swag":
            if not data.dir:
                raise ConfigError("config.data.dir is empty; give the directory holding SWAG's "
                                  "train.csv, val.csv (and test.csv)")
            splits = readers.read_swag(data.dir, encoding)
            self._declare("multiple_choice", ("0", "1", "2", "3"), ("accuracy",))
            return Splits(splits["train"], {"dev": splits["dev"]},
                          {"test": splits["test"]} if "test" in splits else {})
        if family != "files":
            raise ConfigError(f"config.task.family={family!r} is not one of glue | swag | files")
        kind = config.task.kind
        for field in ("train", "validation", "text_a"):
            if not data[field]:
                raise ConfigError(f"config.data.{field} is empty")
        for field in ("train", "validation", "test"):
            if data[field] and not epath.Path(data[field]).exists():
                raise ConfigError(f"config.data.{field}: {data[field]} does not exist")
        choices = tuple(c for c in data.choices.split(",") if c)
        if kind == "multiple_choice" and len(choices) < 2:
            raise ConfigError("config.data.choices must name at least two columns, e.g. a,b,c,d")
        labels = None
        train_rows = list(readers.records(data.train, encoding))  # for the labels too: read once
        if kind == "classification":
            labels = (tuple(x for x in data.labels.split(",") if x) if data.labels
                      else readers.infer_labels(data.train, data.label, rows=train_rows))
        read = functools.partial(readers.read_file, kind=kind, text_a=data.text_a,
                                 text_b=data.text_b, label=data.label, choices=choices,
                                 labels=labels, encoding=encoding)
        label_names = {"classification": labels, "regression": (),
                       "multiple_choice": tuple(str(i) for i in range(len(choices)))}[kind]
        metric_names = ("pearson", "spearman") if kind == "regression" else ("accuracy",)
        if kind == "classification" and len(labels) == 2:
            metric_names = ("accuracy", "f1", "matthews_corrcoef")
        self._declare(kind, tuple(label_names), metric_names)
        return Splits(read(data.train, rows=train_rows), {"dev": read(data.validation)},
                      {"test": read(data.test, labelled=False)} if data.test else {})

    def _declare(self, kind: str, label_names, metric_names) -> None:
        self.kind, self.label_names = kind, tuple(label_names)
        self.metric_names, self.primary_metric = tuple(metric_names), metric_names[0]

    def encode(self, tokenizer, examples, max_seq_length: int):
        from data_pipeline import finetune_data

        self.buckets = self.bucket_lengths(max_seq_length)
        self.max_seq_length = max_seq_length
        return finetune_data.encode(tokenizer, examples, max_seq_length=max_seq_length,
                                    regression=self.kind == "regression")

    def batches(self, features, batch_size: int, *, shuffle: bool, seed: int = 0):
        from data_pipeline import finetune_data

        if shuffle and self.pack:
            return self.packed_batches(features, batch_size, seed)
        return finetune_data.batches(features, batch_size, self.buckets, shuffle=shuffle,
                                     seed=seed, process_index=jax.process_index(),
                                     process_count=jax.process_count(),
                                     group_by_length=self.group_by_length)

    def num_batches(self, features, batch_size: int) -> int:
        if self.pack:
            return self.num_packed_batches(features, batch_size)
        return super().num_batches(features, batch_size)

    # config.data.pack (bertjax/tasks/packing.py): one label and weight a slot.
    packed_batch = staticmethod(packed_finetune.make_packed_batch)

    def packed_label_spec(self, shape):
        slots = (shape.rows, shape.slots)
        label = jnp.float32 if self.kind == "regression" else jnp.int32
        return {"labels": jax.ShapeDtypeStruct(slots, label),
                "weights": jax.ShapeDtypeStruct(slots, jnp.float32)}

    def batch_spec(self, batch_size: int, max_seq_length: int):
        tokens = (batch_size, max_seq_length)
        if self.kind == "multiple_choice":
            tokens = (batch_size, len(self.label_names), max_seq_length)
        i32, f32 = jnp.int32, jnp.float32
        label = f32 if self.kind == "regression" else i32
        return {"input_ids": jax.ShapeDtypeStruct(tokens, i32),
                "segment_ids": jax.ShapeDtypeStruct(tokens, i32),
                "input_mask": jax.ShapeDtypeStruct(tokens, i32),
                "labels": jax.ShapeDtypeStruct((batch_size,), label),
                "weights": jax.ShapeDtypeStruct((batch_size,), f32),
                "example_index": jax.ShapeDtypeStruct((batch_size,), i32)}

    def describe(self, features) -> str:
        from data_pipeline import finetune_data

        padding, lengths = finetune_data.padding_fraction(
            features, self.train_batch_size, self.buckets, self.group_by_length)
        if self.pack:
            return "; " + self.describe_packing(features, padding)
        return (f"; padding is {100 * padding:.1f}% of the train tokens computed (batch "
                f"lengths {', '.join(map(str, lengths))})")

    def hf_head(self):
        if self.kind == "multiple_choice":
            return hf_head("BertForMultipleChoice")
        if self.kind == "regression":
            return hf_head("BertForSequenceClassification", (), "regression", self.bilstm_units)
        return hf_head("BertForSequenceClassification", self.label_names,
                       "single_label_classification", self.bilstm_units)

    @property
    def pooled_only(self) -> bool:
        """Whether model()'s head reads the pooled token alone (BertModel's `pooled_only`):
        all but the "+ BiLSTM" head, and not in packed training (config.data.pack), whose rows
        pool several tokens each (the model FLOPs of a dry run)."""
        if self.pack:
            return False
        return self.kind == "multiple_choice" or not self.bilstm_units

    def model(self, model_config):
        options = dict(classifier_pooling=self.classifier_pooling,
                       classifier_dropout=self.classifier_dropout)
        if self.kind == "multiple_choice":
            return BertForMultipleChoice(model_config, **options)
        num_labels = 1 if self.kind == "regression" else len(self.label_names)
        return BertForSequenceClassification(model_config, num_labels, self.bilstm_units,
                                             **options)

    def init_inputs(self) -> tuple:
        ids = jnp.zeros((1, 2, 8) if self.kind == "multiple_choice" else (1, 8), jnp.int32)
        return ids, ids, ids

    def outputs(self, model, params, batch, **kwargs):
        if "packing_ids" in batch:  # packed rows: logits [rows, slots, labels]
            kwargs.update(packing_ids=batch["packing_ids"],
                          example_starts=batch["example_starts"])
        return super().outputs(model, params, batch, **kwargs)

    def loss(self, logits, batch, denominators=None):
        # Multiple choice: a softmax cross-entropy across the choices' logits [batch, choices].
        # Packed rows: logits [rows, slots, K], labels and weights [rows, slots], one example
        # a slot; the empty slots weigh 0, so the means are over the real examples.
        loss_fn = regression_loss if self.kind == "regression" else classification_loss
        return loss_fn(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                       batch["weights"].reshape(-1), denominators)

    def denominators(self, batch):
        return example_denominators(batch["weights"])

    def predict(self, logits, batch) -> dict[str, Array]:
        logits = logits.astype(jnp.float32)
        if self.kind == "regression":
            return {"prediction": logits.reshape(-1)}
        # [batch, K] classes or [batch, choices]
        return {"prediction": jnp.argmax(logits, axis=-1),
                "probabilities": jax.nn.softmax(logits, axis=-1)}

    def metrics(self, predictions, features, split: str) -> dict[str, float]:
        predicted = np.asarray(predictions["prediction"])
        if self.kind != "regression" and len(set(predicted.tolist())) == 1 < len(
                set(np.asarray(features.labels).tolist())):
            name = (self.label_names[int(predicted[0])] if self.kind == "classification"
                    else f"choice {int(predicted[0])}")
            logging.warning("%s: every example is predicted %s (its labels hold several): the "
                            "model does not tell the classes apart yet; more steps, another "
                            "learning rate or more data may help", split, name)
        return metrics_lib.compute(self.metric_names, features.labels, predicted)

    # ---- predictions from a finished run (bertjax/serving)

    def state(self):
        return {"kind": self.kind, "labels": list(self.label_names),
                "metric_names": list(self.metric_names)}

    def legacy_state(self, record, config):
        labels = list(record.get("labels") or ())
        kind = {"BertForMultipleChoice": "multiple_choice"}.get(
            record.get("architecture"), "regression" if record.get("problem_type") ==
            "regression" else "classification")
        if kind == "multiple_choice":
            labels = [str(i) for i in range(len(config.data.choices.split(",")) if
                                            self.family == "files" else 4)]
        metrics = {"regression": ["pearson", "spearman"]}.get(kind, ["accuracy"])
        if self.family == "glue":
            metrics = list(readers_module().glue_task(config.task.name).metrics)
        elif kind == "classification" and len(labels) == 2:
            metrics = ["accuracy", "f1", "matthews_corrcoef"]
        return {"kind": kind, "labels": labels, "metric_names": metrics}

    def input_chunks(self, path, rows, fields, directory):
        if self.family == "swag" and path.lower().endswith(".csv"):  # SWAG's ids: fold-ind
            return chunks.csv_chunks(path, rows, "fold-ind", directory, fill_empty=False,
                                     encoding=fields.get("encoding") or paths.DEFAULT_ENCODING)
        return super().input_chunks(path, rows, fields, directory)

    def restore(self, state):
        self._declare(state["kind"], state["labels"], state["metric_names"])

    def default_fields(self) -> dict[str, str]:
        """Column names of new rows when the run's config names none (GLUE: the task's
        columns where its files have a header, else text_a / text_b)."""
        if self.family == "swag":
            return {"text_a": "sent1", "choices": ",".join(readers_module().SWAG_ENDINGS)}
        if self.family != "glue":
            return {}
        task = readers_module().glue_task(self.name)
        named = lambda c, default: c if isinstance(c, str) else default  # noqa: E731
        return {"text_a": named(task.text_a, "text_a"),
                "text_b": "" if task.text_b is None else named(task.text_b, "text_b"),
                "label": named(task.label, "label")}

    def read_inputs(self, path, fields):
        """Rows of a .csv / .tsv / .jsonl file with the users'-files columns (`fields`:
        text_a, text_b, label, choices, id); labelled when the first row has the label
        column. SWAG runs read the SWAG CSV layout (sent1, sent2, ending0-3)."""
        readers = readers_module()
        fields = {**fields, **{k: v for k, v in self.default_fields().items()
                               if not fields.get(k)}}
        encoding = fields.get("encoding") or paths.DEFAULT_ENCODING
        labelled = fields["label"] in readers.first_record(path, encoding)
        if self.family == "swag" and path.lower().endswith(".csv"):
            return readers.read_swag_file(path, labelled, encoding), labelled
        if not fields.get("text_a"):
            raise ConfigError("--text_a: name the column holding the text")
        choices = tuple(c for c in fields.get("choices", "").split(",") if c)
        if self.kind == "multiple_choice" and len(choices) != len(self.label_names):
            raise ConfigError(f"--choices={','.join(choices)}: the model was trained on "
                              f"{len(self.label_names)} choices")
        examples = readers.read_file(
            path, self.kind, text_a=fields["text_a"], text_b=fields.get("text_b", ""),
            label=fields["label"], choices=choices, labels=self.label_names,
            labelled=labelled, id_column=fields.get("id") or "id", encoding=encoding)
        return examples, labelled

    def examples(self, items):
        """str → a text; (a, b) → a pair; multiple choice: (context, [endings])."""
        examples = []
        for i, item in enumerate(items):
            where = f"input[{i}]"
            if self.kind == "multiple_choice":
                if (not isinstance(item, tuple | list) or len(item) != 2
                        or len(item[1]) != len(self.label_names)):
                    raise DataError(f"{where}: give (context, [{len(self.label_names)} "
                                    "endings]) for this multiple-choice model")
                examples.append(ChoiceExample(where, str(item[0]), tuple(map(str, item[1])),
                                              None, str(i)))
            elif isinstance(item, str):
                examples.append(Example(where, item, None, None, str(i)))
            elif isinstance(item, tuple | list) and len(item) == 2:
                examples.append(Example(where, str(item[0]), str(item[1]), None, str(i)))
            else:
                raise DataError(f"{where}: give a text or a (text_a, text_b) pair")
        if not examples:
            raise DataError("no inputs")
        return examples

    def records(self, predictions, features, examples):
        """classification: {id, label, probabilities {name: p}}; regression: {id, score};
        multiple choice: {id, choice, scores [choices]} (softmax over the choices)."""
        out = []
        for i, example in enumerate(examples):
            if self.kind == "regression":
                out.append({"id": example.index, "score": float(predictions["prediction"][i])})
                continue
            probabilities = [float(p) for p in predictions["probabilities"][i]]
            choice = int(predictions["prediction"][i])
            if self.kind == "multiple_choice":
                out.append({"id": example.index, "choice": choice, "scores": probabilities})
            else:
                out.append({"id": example.index, "label": self.label_names[choice],
                            "probabilities": dict(zip(self.label_names, probabilities))})
        return out

    def write_outputs(self, predictions, examples, split: str, workdir, log) -> None:
        """GLUE leaderboard files (or test.tsv): `workdir/submission/<split>.tsv`."""
        path = write_submission(str(workdir / "submission"), split, [e.index for e in examples],
                                predictions["prediction"], self.label_names)
        log(f"wrote {len(examples)} test predictions to {path}")

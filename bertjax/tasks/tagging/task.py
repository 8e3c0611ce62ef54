"""Token classification (CoNLL-2003 NER, POS tagging, chunking, users' tagged files) as a task
family of the fine-tuning plug-in (tasks/base.py).

The paper's setting (Sec. 5.3): each word's label sits on its first sub-token (a WordPiece,
or a tokenizer.json's BPE piece); a dense layer over the final hidden vectors scores every
position (bertjax/models/tagging.py), and only first sub-tokens enter the float32
cross-entropy and the metric (no CRF). Sentences are encoded with their document's
neighbouring sentences as context (config.data.document_context), documents as the data marks
them (readers.py: a file without marks holds independent sentences); long sentences are split
into windows and each word is predicted once (features.py).

Metrics: conlleval's entity-level precision / recall / F1 (micro, and F1 per type as
"<TYPE>_f1") and token accuracy; with plain tags (scheme "none", e.g. POS) token accuracy only.
Outputs from the best checkpoint, for the dev and test splits: `workdir/predictions/<split>.conll`
(word, gold, predicted; IOB2, readable by conlleval) and a per-type table in the log.

config.data.pack: training batches of packed rows (several sentence rows back to back in each
max_seq_length row, bertjax/tasks/packing.py; the model's packing_ids keep attention inside
each); the per-token losses are the unpacked rows', evaluation and predictions stay unpacked,
so every word is read back from its own row as above.

The feature-based variant (frozen encoder, cached features, BiLSTM) is its own family,
`feature_based` (feature_based.py), reusing this task's data and features.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import logging
from etils import epath

from bertjax.errors import ConfigError, DataError
from bertjax.models.tagging import BertForTokenClassification
from bertjax.paths import DEFAULT_ENCODING, read_text
from bertjax.tasks.base import Splits, Task, hf_head
from bertjax.tasks.packing import PackedTraining
from bertjax.tasks.tagging import features as token_features
from bertjax.tasks.tagging import readers
from bertjax.tasks.tagging.metrics import entity_scores, table, token_accuracy
from bertjax.tasks.tagging.schemes import SCHEMES, convert, split_tag
from data_pipeline import finetune_data

Array = jax.Array

# CoNLL-2003 file names in a data directory: the original release, then the common renaming.
CONLL2003_FILES = {"train": ("eng.train", "train.txt"), "dev": ("eng.testa", "valid.txt"),
                   "test": ("eng.testb", "test.txt")}


def label_denominators(weights: Array) -> dict[str, Array]:
    """{"labels": [] float32}: the normaliser of `token_loss`'s means over a batch, the number
    of scored positions (label weights [batch, seq] summed, at least 1)."""
    return {"labels": jnp.maximum(jnp.sum(weights.astype(jnp.float32)), 1.0)}


def token_loss(logits: Array, labels: Array, weights: Array,
               denominators: dict[str, Array] | None = None) -> tuple[Array, dict[str, Array]]:
    """Masked softmax cross-entropy in float32, averaged over the scored positions.

    logits [batch, seq, K]; labels [batch, seq] int; weights [batch, seq] (1 = a word's first
    sub-token, 0 = anything else: other sub-tokens, context, specials, padding);
    denominators: `label_denominators` of the batch the means run over (None: this one).
    """
    logits = logits.astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    weights = weights.astype(jnp.float32)
    if denominators is None:
        denominators = label_denominators(weights)
    count = denominators["labels"]
    loss = jnp.sum(nll * weights) / count
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return loss, {"loss": loss, "accuracy": jnp.sum(correct * weights) / count}


# ---------------------------------------------------------------------------------------------
# The task family


class TokenClassificationTask(PackedTraining, Task):
    """config.task.family = token_classification; config.task.name: conll2003 | files."""

    packed_kinds = ("tagging",)

    def __init__(self, config):
        super().__init__(config)
        self.config = config
        self.train_batch_size = config.train.batch_size
        self.group_by_length = bool(config.train.get("group_by_length", False))
        self.scheme = config.task.label_scheme
        self.bilstm_units = int(config.task.get("bilstm_units", 0))  # 0: the paper's head
        self._features: dict[int, object] = {}  # id(examples) → features (write_outputs)
        # config.data.pack: packed training rows (tasks/packing.py, checked by tasks/checks.py).
        self.pack = bool((config.get("data") or {}).get("pack", False))
        self.grad_accum_steps = int(config.train.get("grad_accum_steps", 1))

    # ---- data

    def read(self, config) -> Splits:
        data = config.data
        encoding = data.get("encoding") or DEFAULT_ENCODING
        if self.scheme not in SCHEMES:
            raise ConfigError(f"config.task.label_scheme={self.scheme!r} is not one of "
                              f"{' | '.join(SCHEMES)}")
        if config.task.name == "conll2003" and data.tfds:
            # TFDS conll2003's class names are IOB2 (B-PER, I-PER, ...), whatever data.scheme
            # says about the original files.
            read = lambda split: readers.read_tfds(  # noqa: E731
                split, data_dir=data.tfds_data_dir or None, scheme="iob2", target=self.scheme)
            splits = {name: read(name) for name in ("train", "dev", "test")}
        else:
            paths = self._paths(config)
            splits = {}
            first_document = 0
            for name, path in paths.items():
                splits[name] = readers.read_file(
                    path, fmt=data.format, token_column=data.token_column,
                    tag_column=data.tag_column, tokens_key=data.tokens_key,
                    tags_key=data.tags_key, scheme=data.scheme, target=self.scheme,
                    labelled=name != "test" or data.test_labelled,
                    first_document=first_document, encoding=encoding)
                first_document = splits[name][-1].document + 1
        labels = readers.infer_labels(splits["train"], self.scheme)
        if data.labels and epath.Path(data.labels).is_file():  # one label a line (POS: ",")
            labels = tuple(x for x in read_text(data.labels, encoding).split("\n") if x)
        elif data.labels:
            labels = tuple(x for x in data.labels.split(",") if x)
        if not labels:
            raise ConfigError("no labels: config.data.labels is empty and the training data "
                              "has no tags")
        for split in splits.values():
            readers.check_labels(split, labels)
        self._declare(labels)
        outputs = {"dev": splits["dev"]}
        if "test" in splits:
            outputs["test"] = splits["test"]
        return Splits(splits["train"], {"dev": splits["dev"]}, outputs)

    def _declare(self, labels) -> None:
        self.labels = tuple(labels)
        self.label_ids = {t: i for i, t in enumerate(self.labels)}
        self.types = sorted({split_tag(t)[1] for t in self.labels} - {""}) \
            if self.scheme != "none" else []
        if self.scheme == "none":
            self.metric_names, self.primary_metric = ("accuracy",), "accuracy"
        else:
            self.metric_names = ("f1", "precision", "recall", "accuracy",
                                 *(f"{t}_f1" for t in self.types))
            self.primary_metric = "f1"

    @staticmethod
    def _paths(config) -> dict[str, str]:
        data = config.data
        if config.task.name == "conll2003" and data.dir:
            paths = {}
            for split, names in CONLL2003_FILES.items():
                found = [epath.Path(data.dir) / n for n in names
                         if (epath.Path(data.dir) / n).exists()]
                if not found:
                    raise ConfigError(f"config.data.dir={data.dir} holds neither "
                                      f"{' nor '.join(names)}")
                paths[split] = str(found[0])
            return paths
        if config.task.name == "conll2003" and not (data.train or data.tfds):
            raise ConfigError("config.data.dir is empty; give the CoNLL-2003 directory "
                              "(eng.train, eng.testa, eng.testb) or set config.data.tfds=true")
        paths = {}
        for field, split in (("train", "train"), ("validation", "dev"), ("test", "test")):
            if not data[field]:
                if field == "test":
                    continue
                raise ConfigError(f"config.data.{field} is empty")
            if not epath.Path(data[field]).exists():
                raise ConfigError(f"config.data.{field}: {data[field]} does not exist")
            paths[split] = data[field]
        return paths

    def encode(self, tokenizer, examples, max_seq_length: int):
        self.buckets = self.bucket_lengths(max_seq_length)
        self.max_seq_length = max_seq_length
        features = token_features.encode(
            tokenizer, examples, self.label_ids, max_seq_length, self.config.data.stride,
            self.config.data.document_context)
        # write_outputs receives the examples, not the features: remember which is which.
        self._features[id(examples)] = features
        return features

    def batches(self, features, batch_size: int, *, shuffle: bool, seed: int = 0):
        if shuffle and self.pack:
            return self.packed_batches(features, batch_size, seed)
        return token_features.batches(features, batch_size, self.buckets, shuffle=shuffle,
                                      seed=seed, process_index=jax.process_index(),
                                      process_count=jax.process_count(),
                                      group_by_length=self.group_by_length)

    def num_batches(self, features, batch_size: int) -> int:
        if self.pack:
            return self.num_packed_batches(features, batch_size)
        return len(finetune_data.plan_batches(features, batch_size, self.buckets, shuffle=False))

    # config.data.pack (tasks/packing.py): a label and a weight per token, as unpacked.
    packed_batch = staticmethod(token_features.make_packed_batch)

    def packed_label_spec(self, shape):
        tokens = (shape.rows, shape.length)
        return {"label_ids": jax.ShapeDtypeStruct(tokens, jnp.int32),
                "label_weights": jax.ShapeDtypeStruct(tokens, jnp.float32)}

    def batch_spec(self, batch_size: int, max_seq_length: int):
        shape, i32 = (batch_size, max_seq_length), jnp.int32
        spec = {k: jax.ShapeDtypeStruct(shape, i32)
                for k in ("input_ids", "segment_ids", "input_mask", "label_ids")}
        spec["label_weights"] = jax.ShapeDtypeStruct(shape, jnp.float32)
        spec["example_index"] = jax.ShapeDtypeStruct((batch_size,), i32)
        return spec

    def describe(self, features) -> str:
        plan = finetune_data.plan_batches(features, self.train_batch_size, self.buckets,
                                          shuffle=True, group_by_length=self.group_by_length)
        computed = sum(length * self.train_batch_size for length, _ in plan)
        padding = 1.0 - float(features.lengths.sum()) / max(computed, 1)
        if self.pack:
            return f"; {len(self.labels)} labels; " + self.describe_packing(features, padding)
        return (f"; {len(self.labels)} labels; {len(features)} train rows, padding "
                f"{100 * padding:.1f}% of the tokens computed")

    # ---- model

    def hf_head(self):
        return hf_head("BertForTokenClassification", self.labels,
                       "single_label_classification", self.bilstm_units)

    def model(self, model_config):
        return BertForTokenClassification(model_config, len(self.labels), self.bilstm_units,
                                          self.classifier_dropout)

    def init_inputs(self) -> tuple:
        ids = jnp.zeros((1, 8), jnp.int32)
        return ids, ids, ids

    def outputs(self, model, params, batch, **kwargs):
        if "packing_ids" in batch:  # packed rows: logits [rows, seq, labels]
            kwargs["packing_ids"] = batch["packing_ids"]
        return super().outputs(model, params, batch, **kwargs)

    def loss(self, logits, batch, denominators=None):
        # Packed rows too: each token's label and weight are its example's own, and the
        # denominators count the scored tokens, so the loss is the unpacked rows'.
        return token_loss(logits, batch["label_ids"], batch["label_weights"], denominators)

    def denominators(self, batch):
        return label_denominators(batch["label_weights"])

    def predict(self, logits, batch) -> dict[str, Array]:
        return {"tags": jnp.argmax(logits, axis=-1).astype(jnp.int32)}

    # ---- metrics and outputs

    def sentence_tags(self, predictions, features) -> tuple[list[list[str]], list[list[str]]]:
        """(gold, predicted) tag strings of every sentence, each word read once."""
        predicted = token_features.sentence_predictions(features, predictions["tags"])
        gold = token_features.sentence_predictions(features, features.label_ids)
        names = self.labels
        return ([[names[i] if i >= 0 else "O" for i in s] for s in gold],
                [[names[i] for i in s] for s in predicted])

    def metrics(self, predictions, features, split: str) -> dict[str, float]:
        gold, predicted = self.sentence_tags(predictions, features)
        out = {"accuracy": token_accuracy(gold, predicted)}
        if self.scheme != "none":
            scores = entity_scores(gold, predicted)
            if scores["overall"]["predicted"] == 0 < scores["overall"]["gold"]:
                logging.warning("%s: no entity is predicted (its tags hold %d): the model does "
                                "not find the entities yet; more steps, another learning rate "
                                "or more data may help", split, scores["overall"]["gold"])
            out.update({k: scores["overall"][k] for k in ("f1", "precision", "recall")})
            out.update({f"{t}_f1": scores[t]["f1"] if t in scores else 0.0
                        for t in self.types})
        return out

    # ---- predictions from a finished run (bertjax/serving)

    def state(self):
        return {"labels": list(self.labels), "scheme": self.scheme}

    def restore(self, state):
        self.scheme = state["scheme"]
        self._declare(state["labels"])

    def legacy_state(self, record, config):
        return {"labels": list(record.get("labels") or ()), "scheme": config.task.label_scheme}

    def input_chunks(self, path, rows, fields, directory):
        """Chunks of whole documents (readers.conll_chunks / tagging_jsonl_chunks)."""
        fmt = fields.get("format") or "auto"
        encoding = fields.get("encoding") or DEFAULT_ENCODING
        if fmt == "jsonl" or (fmt == "auto" and path.lower().endswith((".jsonl", ".json"))):
            return readers.tagging_jsonl_chunks(path, rows, directory, encoding)
        return readers.conll_chunks(path, rows, directory, encoding)

    def stream_records(self, records, start):
        return [{**r, "id": str(start + i)} for i, r in enumerate(records)]  # sentence numbers

    def read_inputs(self, path, fields):
        """Sentences of a CoNLL column file or JSONL {"tokens", "tags"} (`fields`: format,
        token_column, tag_column, tokens_key, tags_key, scheme); labelled when the first
        sentence has tags (a JSONL tags field, a CoNLL line with a tag column)."""
        fmt = fields.get("format", "auto")
        if fmt == "auto":
            fmt = "jsonl" if path.endswith((".jsonl", ".json")) else "conll"
        encoding = fields.get("encoding") or DEFAULT_ENCODING
        labelled = readers.has_tags(path, fmt, fields.get("tokens_key", "tokens"),
                                    fields.get("tags_key", "tags"), encoding)
        sentences = readers.read_file(
            path, fmt=fmt, token_column=fields.get("token_column", 0),
            tag_column=fields.get("tag_column", -1), tokens_key=fields.get("tokens_key",
                                                                           "tokens"),
            tags_key=fields.get("tags_key", "tags"), scheme=fields.get("scheme", self.scheme),
            target=self.scheme, labelled=labelled, encoding=encoding)
        if labelled:
            readers.check_labels(sentences, self.labels)
        return sentences, labelled

    def examples(self, items):
        """A list of words per sentence, or a string (split at whitespace); one document."""
        sentences = []
        for i, item in enumerate(items):
            words = item.split() if isinstance(item, str) else [str(w) for w in item]
            if not words or not all(words):
                raise DataError(f"input[{i}]: give a sentence as a string or a list of words")
            sentences.append(readers.Sentence(tuple(words), None, f"input:{i}", 0))
        if not sentences:
            raise DataError("no inputs")
        return sentences

    def records(self, predictions, features, examples):
        """{id: the sentence's 0-based number, tokens, tags} (the run's tag scheme)."""
        predicted = token_features.sentence_predictions(features, predictions["tags"])
        return [{"id": str(i), "tokens": list(sentence.words),
                 "tags": [self.labels[t] for t in tags]}
                for i, (sentence, tags) in enumerate(zip(examples, predicted))]

    def release(self, examples):
        self._features.pop(id(examples), None)

    def conll_text(self, examples, gold, predicted) -> str:
        """`word gold predicted` lines (`word predicted` without gold), IOB2 tags so that
        conlleval reads them, a blank line after each sentence."""
        if self.scheme not in ("none", "iob2"):
            gold = gold and [convert(g, self.scheme, "iob2") for g in gold]
            predicted = [convert(p, self.scheme, "iob2") for p in predicted]
        lines = []
        for i, (sentence, tags) in enumerate(zip(examples, predicted)):
            for w, (word, tag) in enumerate(zip(sentence.words, tags)):
                lines.append(f"{word} {gold[i][w]} {tag}" if gold else f"{word} {tag}")
            lines.append("")
        return "\n".join(lines) + "\n"

    def write_outputs(self, predictions, examples, split: str, workdir, log) -> None:
        """`workdir/predictions/<split>.conll` (conll_text: word, gold, predicted; `word
        predicted` for unlabelled data); the per-type table in the log."""
        features = self._features[id(examples)]
        gold, predicted = self.sentence_tags(predictions, features)
        labelled = all(s.tags is not None for s in examples)
        directory = epath.Path(workdir) / "predictions"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{split}.conll"
        path.write_text(self.conll_text(examples, gold if labelled else None, predicted))
        log(f"wrote {len(examples)} {split} sentences to {path}")
        if labelled:
            if self.scheme not in ("none", "iob2"):
                gold = [convert(g, self.scheme, "iob2") for g in gold]
                predicted = [convert(p, self.scheme, "iob2") for p in predicted]
            accuracy = token_accuracy(gold, predicted)
            if self.scheme == "none":
                log(f"{split}: token accuracy {100 * accuracy:.2f}%")
            else:
                log(f"{split} (token accuracy {100 * accuracy:.2f}%):\n"
                    + table(entity_scores(gold, predicted)))

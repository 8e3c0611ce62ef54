"""RerankingTask: cross-encoder rerankers, one task family of the fine-tuning plug-in
(tasks/base.py).

A cross-encoder reads a (query, passage) pair as `[CLS] query [SEP] passage [SEP]` and scores
it with one logit: bertjax/models/classification.py's BertForSequenceClassification with one
label (transformers' class, sentence-transformers' CrossEncoder). config.task.kind:

  labelled  (query, passage, label) rows: binary cross-entropy with logits
  listwise  (query, positive, negative_1 .. negative_n) rows: softmax cross-entropy of the
            positive among its own negatives
  distill   (query, passage, score) rows: the logit's squared error to a teacher's score
  margin    (query, positive, negative, margin) rows: Margin MSE

(readers.py: the files; losses.py: the losses.) A training row of several passages is one
example of [1 + negatives] sequences, scored as a group of logits [batch, 1 + negatives].
The dev set is a file of candidate lists: its metrics are nDCG@10 and MRR@10 of each query's
candidates ordered by score (metrics.py). Scores are the raw logits; config.task.activation
(auto: a converted CrossEncoder's own, else sigmoid, CrossEncoder's default for one label) is
applied only to what predictions return, as CrossEncoder.predict applies it. An init
checkpoint converted from a CrossEncoder (checkpoint_dir.CLASSIFIER_FILE) starts from its
classifier too; the export is a BertForSequenceClassification that CrossEncoder(DIR) loads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bertjax import checkpoint_dir, paths
from bertjax.errors import ConfigError, DataError
from bertjax.models.classification import BertForSequenceClassification
from bertjax.models.layers import sequence_rows
from bertjax.tasks.base import Splits, Task, hf_head
from bertjax.tasks.reranking import losses
from bertjax.tasks.reranking.metrics import RERANKING_METRICS, reranking_metrics
from bertjax.tasks.reranking.readers import (
    CandidateList,
    RerankExample,
    pair_examples,
    read_candidates,
    read_rows,
)
from data_pipeline import finetune_data
from data_pipeline.finetune_data import ChoiceExample, Example

Array = jax.Array

KINDS = ("labelled", "listwise", "distill", "margin")
ACTIVATIONS = ("sigmoid", "identity")


class CandidatePairs(list):
    """The (query, candidate) pairs of candidate lists (readers.pair_examples), with the lists
    (`lists`) the metrics regroup them by."""

    def __init__(self, lists: list[CandidateList]):
        super().__init__(pair_examples(lists))
        self.lists = lists


class RerankingFeatures(finetune_data.Features):
    """Features of pairs ([1, 3, length] each) or of training groups ([1 + negatives, 3,
    length]); labels: each row's target; `lists`: a dev set's candidate lists."""

    lists: list[CandidateList] | None = None


def activate(logits, activation: str) -> np.ndarray:
    """What CrossEncoder.predict returns of logits [n]: sigmoid (computed without overflow) or
    the logits themselves, float32."""
    logits = np.asarray(logits, np.float64)
    if activation == "sigmoid":
        logits = np.exp(-np.logaddexp(0.0, -logits))
    return logits.astype(np.float32)


def activation_of(config) -> str:
    """config.task.activation: auto (the init checkpoint's, a converted CrossEncoder's, else
    sigmoid) | sigmoid | identity."""
    value = str(config.task.get("activation", "auto"))
    if value == "auto":
        own = config.get("init_checkpoint") and checkpoint_dir.own_activation(
            config.init_checkpoint)
        return own or "sigmoid"
    if value not in ACTIVATIONS:
        raise ConfigError(f"config.task.activation={value!r} is not one of auto | "
                          f"{' | '.join(ACTIVATIONS)}")
    return value


def columns_of(kind: str, text: str) -> tuple[str, ...]:
    """config.data.columns "query,passage" → its names, as many as `kind` reads."""
    columns = tuple(c.strip() for c in str(text).split(",") if c.strip())
    wanted = {"labelled": (2, "query,passage"), "distill": (2, "query,passage"),
              "margin": (3, "query,positive,negative")}.get(kind)
    if wanted and len(columns) != wanted[0]:
        raise ConfigError(f"config.data.columns={text!r}: a {kind} task reads {wanted[0]} "
                          f"text columns, e.g. {wanted[1]}")
    if kind == "listwise" and len(columns) < 3:
        raise ConfigError(f"config.data.columns={text!r}: name the query, positive and "
                          "negative columns, e.g. query,positive,negative_1,negative_2")
    return columns


class RerankingTask(Task):
    """config.task.family: reranking (config.task.kind: labelled | listwise | distill |
    margin)."""

    metric_names = RERANKING_METRICS
    primary_metric = "ndcg@10"
    pooled_only = True  # the classifier reads the pooled [CLS] vector alone

    def __init__(self, config):
        super().__init__(config)
        self.kind = config.task.kind
        if self.kind not in KINDS:
            raise ConfigError(f"config.task.kind={self.kind!r} is not one of "
                              f"{' | '.join(KINDS)}")
        self.init_checkpoint = config.get("init_checkpoint") or ""
        self.activation = activation_of(config)
        self.group_by_length = bool(config.train.get("group_by_length", False))
        self.passages = 1  # passages of a training row (1 + negatives for the group kinds)
        self.own_classifier = False  # the init checkpoint's classifier is the start

    # ---- data

    def read(self, config) -> Splits:
        data = config.data
        encoding = data.get("encoding") or paths.DEFAULT_ENCODING
        for field in ("train", "validation"):
            if not data[field]:
                raise ConfigError(f"config.data.{field} is empty" + (
                    "; give a dev file of candidate lists (.jsonl: query, candidates with "
                    "text and relevant)" if field == "validation" else ""))
        columns = columns_of(self.kind, data.columns)
        label = "" if self.kind == "listwise" else data.label
        if self.kind != "listwise" and not label:
            raise ConfigError(f"config.data.label is empty; name the column of a {self.kind} "
                              "row's " + {"labelled": "label", "distill": "teacher score",
                                          "margin": "teacher margin"}[self.kind])
        train = read_rows(data.train, columns, label, probability=self.kind == "labelled",
                          encoding=encoding)
        self.passages = len(columns) - 1
        lists = read_candidates(data.validation, encoding)
        if not any(r > 0 for c in lists if c.relevance for r in c.relevance):
            raise DataError(f"{data.validation}: no relevant candidate (\"relevant\" > 0): the "
                            "dev metrics need one")
        return Splits(train, {"dev": CandidatePairs(lists)}, {})

    def encode(self, tokenizer, examples, max_seq_length: int) -> RerankingFeatures:
        """Each (query, passage) as `[CLS] query [SEP] passage [SEP]` (the longer side cut
        first); a training group's passages padded to its longest."""
        if not examples:
            raise DataError("no examples to encode")
        self.buckets = self.bucket_lengths(max_seq_length)
        pairs = [Example(e.guid, e.query, e.passages[0], None, e.index) if len(e.passages) == 1
                 else ChoiceExample(e.guid, e.query, e.passages, None, e.index)
                 for e in examples]
        encoded = finetune_data.encode(tokenizer, pairs, max_seq_length)
        features = RerankingFeatures(encoded.sequences,
                                     np.array([e.target for e in examples], np.float32),
                                     encoded.multiple_choice, encoded.truncated)
        features.lists = getattr(examples, "lists", None)
        return features

    def batches(self, features, batch_size: int, *, shuffle: bool, seed: int = 0):
        return finetune_data.batches(features, batch_size, self.buckets, shuffle=shuffle,
                                     seed=seed, process_index=jax.process_index(),
                                     process_count=jax.process_count(),
                                     group_by_length=self.group_by_length)

    def batch_spec(self, batch_size: int, max_seq_length: int):
        tokens = (batch_size, max_seq_length)
        if self.passages > 1:
            tokens = (batch_size, self.passages, max_seq_length)
        rows = lambda dtype: jax.ShapeDtypeStruct((batch_size,), dtype)  # noqa: E731
        ids = jax.ShapeDtypeStruct(tokens, jnp.int32)
        return {"input_ids": ids, "segment_ids": ids, "input_mask": ids,
                "labels": rows(jnp.float32), "weights": rows(jnp.float32),
                "example_index": rows(jnp.int32)}

    def describe(self, features) -> str:
        start = ", from the init checkpoint's classifier" if self.own_classifier else ""
        return (f"; {self.kind}: {self.passages} passage(s) a row{start}, "
                f"{self.activation} activation at predict")

    # ---- model and loss

    def initial_params(self, model_config, pretrained):
        """The encoder, and the classifier of an init checkpoint converted from a
        CrossEncoder (checkpoint_dir.CLASSIFIER_FILE), which then goes on learning."""
        params = super().initial_params(model_config, pretrained)
        head = self.init_checkpoint and checkpoint_dir.load_classifier(self.init_checkpoint)
        if head:
            if head["kernel"].shape != (model_config.hidden_size, 1):
                raise ConfigError(f"config.init_checkpoint={self.init_checkpoint}: its "
                                  f"classifier is {head['kernel'].shape}, not "
                                  f"[{model_config.hidden_size}, 1]")
            params["classifier"] = head
            self.own_classifier = True
        return params

    def model(self, model_config):
        return BertForSequenceClassification(model_config, 1,
                                             classifier_pooling=self.classifier_pooling,
                                             classifier_dropout=self.classifier_dropout)

    def init_inputs(self) -> tuple:
        ids = jnp.zeros((1, 8), jnp.int32)
        return ids, ids, ids

    def outputs(self, model, params, batch, **kwargs):
        """logits [batch, passages]: every pair of a row ([batch, seq], or [batch, passages,
        seq] for a training group) scored as its own sequence."""
        ids = batch["input_ids"]
        logits = model.apply({"params": params}, sequence_rows(ids),
                             sequence_rows(batch["segment_ids"]),
                             sequence_rows(batch["input_mask"]), **kwargs)
        return logits.reshape(ids.shape[0], -1)

    def loss(self, logits, batch, denominators=None):
        denominator = None if denominators is None else denominators["examples"]
        weights, targets = batch["weights"], batch["labels"]
        if self.kind == "listwise":
            return losses.listwise_loss(logits, weights, denominator)
        if self.kind == "margin":
            return losses.margin_mse_loss(logits, targets, weights, denominator)
        loss_fn = losses.bce_loss if self.kind == "labelled" else losses.mse_loss
        return loss_fn(logits[:, 0], targets, weights, denominator)

    def denominators(self, batch):
        return {"examples": losses.weight_sum(batch["weights"])}

    def predict(self, logits, batch) -> dict[str, Array]:
        """{"score": [batch]}: the logit of each pair (predictions are of pairs)."""
        return {"score": logits[:, 0].astype(jnp.float32)}

    def metrics(self, predictions, features, split: str) -> dict[str, float]:
        return reranking_metrics(features.lists, predictions["score"])

    # ---- export and serving

    def hf_head(self):
        return {**hf_head("BertForSequenceClassification"),
                "cross_encoder": {"activation": self.activation}}

    def state(self):
        return {"kind": self.kind, "activation": self.activation}

    def restore(self, state):
        self.kind, self.activation = state["kind"], state["activation"]

    def read_inputs(self, path, fields):
        raise ConfigError("a reranking run reranks candidate lists: python -m bertjax.predict "
                          f"rerank --input={path} (or bertjax.Reranker)")

    def examples(self, items):
        """(query, passage) pairs."""
        out = []
        for i, item in enumerate(items):
            if not (isinstance(item, tuple | list) and len(item) == 2
                    and all(isinstance(t, str) and t.strip() for t in item)):
                raise DataError(f"input[{i}]: give a (query, passage) pair of non-empty texts")
            out.append(RerankExample(f"input[{i}]", item[0], (item[1],), 0.0, str(i)))
        if not out:
            raise DataError("no inputs")
        return out

    def records(self, predictions, features, examples):
        """{id, score} per pair, the score as CrossEncoder.predict gives it (activated)."""
        scores = activate(predictions["score"], self.activation)
        return [{"id": e.index, "score": float(s)} for e, s in zip(examples, scores)]

"""SQuAD v1.1 / v2.0 extractive question answering, as a task family of the fine-tuning
plug-in (tasks/base.py): examples from readers.py, windows from features.py, the span head
(models/squad.py), n-best answers and prediction files from postprocess.py, the official
metrics from metrics.py. Training batches are windows of max_seq_length; evaluation and
prediction batches are length buckets (a short question + context is not padded to 384).

Loss = the mean of the start and end cross-entropies over the whole window (float32);
positions outside the context are excluded from the answer search only, as in the reference.
v2.0: the null threshold is chosen on dev to maximise F1 (or `config.task.null_threshold`),
before the dev and test prediction files are written (`write_outputs`, from the best
checkpoint).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from bertjax.errors import ConfigError, DataError
from bertjax.models.squad import BertForQuestionAnswering
from bertjax.paths import DEFAULT_ENCODING
from bertjax.tasks.base import Splits, Task, hf_head
from bertjax.tasks.squad import features as squad_features
from bertjax.tasks.squad import metrics as squad_metrics
from bertjax.tasks.squad import readers
from bertjax.tasks.squad.postprocess import (
    Answer,
    final_predictions,
    gold_answers,
    postprocess,
    write_prediction_files,
)
from data_pipeline import finetune_data
from data_pipeline.hosts import host_rows

Array = jax.Array


def span_denominators(weights: Array) -> dict[str, Array]:
    """{"rows": [] float32}: the normaliser of `span_loss`'s means over a batch, the sum of the
    row weights [batch] (at least 1e-6: a batch of filler rows gives 0, not NaN)."""
    return {"rows": jnp.maximum(jnp.sum(weights.astype(jnp.float32)), 1e-6)}


def span_loss(start_logits: Array, end_logits: Array, start_positions: Array,
              end_positions: Array, weights: Array | None = None,
              denominators: dict[str, Array] | None = None
              ) -> tuple[Array, dict[str, Array]]:
    """Mean of the start and end softmax cross-entropies over all positions of the window.
    logits [batch, seq]; positions [batch] int; weights [batch] (0 = filler row);
    denominators: `span_denominators` of the batch the means run over (None: this one)."""

    def nll(logits, positions):
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(log_probs, positions[:, None].astype(jnp.int32), -1)[:, 0]

    per_row = 0.5 * (nll(start_logits, start_positions) + nll(end_logits, end_positions))
    if weights is None:
        weights = jnp.ones_like(per_row)
    weights = weights.astype(jnp.float32)
    if denominators is None:
        denominators = span_denominators(weights)
    total = denominators["rows"]
    loss = jnp.sum(per_row * weights) / total
    hit = ((jnp.argmax(start_logits, -1) == start_positions)
           & (jnp.argmax(end_logits, -1) == end_positions)).astype(jnp.float32)
    return loss, {"loss": loss, "span_accuracy": jnp.sum(hit * weights) / total}


def _batch(features, indices: np.ndarray, rows: int, length: int) -> dict[str, np.ndarray]:
    """This host's share of a global batch of `rows` windows cut to their first `length`
    tokens: the windows `indices` [<= rows], then weight-0 filler rows. Tokens [batch, length];
    start_positions, end_positions, weights, example_index (-1: filler) [batch]."""
    index = np.full(rows, -1, np.int64)
    index[:len(indices)] = indices
    index = index[host_rows(rows, jax.process_index(), jax.process_count())]
    take, real = np.maximum(index, 0), index >= 0
    return {
        "input_ids": features.input_ids[take, :length] * real[:, None],
        "segment_ids": features.segment_ids[take, :length] * real[:, None],
        "input_mask": features.input_mask[take, :length] * real[:, None],
        "start_positions": np.where(real, features.start_positions[take], 0),
        "end_positions": np.where(real, features.end_positions[take], 0),
        "weights": real.astype(np.float32),
        "example_index": index.astype(np.int32),
    }


def _parse_source(spec: str, default_split: str) -> tuple[str, str]:
    """`tfds:squad/v2.0[validation]` → (`tfds:squad/v2.0`, `validation`); files unchanged."""
    if spec.startswith("tfds:") and spec.endswith("]") and "[" in spec:
        name, split = spec[:-1].split("[", 1)
        return name, split
    return spec, default_split


class SquadTask(Task):
    """config.task.family = squad; config.task: version_2, doc_stride, max_query_length,
    n_best_size, max_answer_length, null_threshold (None: chosen on dev), num_workers."""

    def __init__(self, config):
        super().__init__(config)
        task = config.task
        self.version_2 = bool(task.version_2)
        self.doc_stride, self.max_query_length = task.doc_stride, task.max_query_length
        self.n_best_size, self.max_answer_length = task.n_best_size, task.max_answer_length
        self.null_threshold = task.get("null_threshold")
        self.num_workers = task.get("num_workers", 1)
        self.bilstm_units = int(task.get("bilstm_units", 0))  # 0: the paper's head
        self.threshold = 0.0 if self.null_threshold is None else float(self.null_threshold)
        if self.version_2:
            self.metric_names = ("exact", "f1", "HasAns_exact", "HasAns_f1", "NoAns_exact",
                                 "NoAns_f1", "best_exact", "best_f1")
            self.primary_metric = "best_f1"
        else:
            self.metric_names, self.primary_metric = ("exact_match", "f1"), "f1"
        self._encoded: dict[int, object] = {}

    def read(self, config) -> Splits:
        """Examples of config.data.train / validation / (test): local SQuAD-format JSON files
        or `tfds:squad/v1.1`-style names."""
        data = config.data
        for field in ("train", "validation"):
            if not data[field]:
                raise ConfigError(f"config.data.{field} is empty; give a SQuAD-format JSON "
                                  "file or tfds:squad/v1.1 | tfds:squad/v2.0")

        def read(field: str, split: str):
            source, split = _parse_source(data[field], split)
            examples = readers.read_squad(source, split, data.get("tfds_data_dir") or None,
                                          data.get("encoding") or DEFAULT_ENCODING)
            if not self.version_2:
                bad = next((e for e in examples if e.is_impossible), None)
                if bad is not None:
                    raise DataError(f"{data[field]}: question {bad.qas_id}: is_impossible but "
                                    "config.task.version_2 is false (use "
                                    "experiments/squad.py:v2 or --config.task.version_2=true)")
            return examples

        train, dev = read("train", "train"), read("validation", "validation")
        test = {"dev": dev}  # dev prediction files come from the best checkpoint too
        if data.test:
            test["test"] = read("test", "validation")
        return Splits(train, {"dev": dev}, test)

    def encode(self, tokenizer, examples, max_seq_length: int):
        key = id(examples)  # dev is both evaluated and written: converted once
        if key not in self._encoded:
            self._encoded[key] = squad_features.convert(
                tokenizer, examples, max_seq_length=max_seq_length, doc_stride=self.doc_stride,
                max_query_length=self.max_query_length, training=True,
                num_workers=self.num_workers)
        self.max_seq_length = max_seq_length
        return self._encoded[key]

    def batches(self, features, batch_size: int, *, shuffle: bool, seed: int = 0):
        """One epoch of this host's batches. Training: `batch_size` windows of max_seq_length
        in a shuffled order. Unshuffled (evaluation, prediction): finetune_data's prediction
        plan over the windows' own lengths (the real tokens come first), so a window's batch
        shape (rows, length) depends on its length only and short windows are not padded to
        max_seq_length."""
        width = features.input_ids.shape[1]
        if shuffle:
            order = np.random.default_rng(seed).permutation(len(features))
            for first in range(0, len(order), batch_size):
                yield _batch(features, order[first:first + batch_size], batch_size, width)
            return
        buckets = self.bucket_lengths(width)
        lengths = features.input_mask.sum(axis=1)
        for length, rows, indices in finetune_data.prediction_plan(lengths, batch_size,
                                                                   buckets):
            yield _batch(features, indices, rows, length)

    def batch_spec(self, batch_size: int, max_seq_length: int):
        i32 = jnp.int32
        tokens = jax.ShapeDtypeStruct((batch_size, max_seq_length), i32)
        rows = jax.ShapeDtypeStruct((batch_size,), i32)
        return {"input_ids": tokens, "segment_ids": tokens, "input_mask": tokens,
                "start_positions": rows, "end_positions": rows,
                "weights": jax.ShapeDtypeStruct((batch_size,), jnp.float32),
                "example_index": rows}

    def describe(self, features) -> str:
        return (f"; {len(features)} train windows of {features.input_ids.shape[1]} tokens "
                f"(doc_stride {self.doc_stride}, max_query_length {self.max_query_length})")

    def hf_head(self):
        # v2.0: the dev-chosen null threshold, under the name transformers' QA post-processing
        # takes it by (null_score_diff_threshold).
        extra = {"null_score_diff_threshold": self.threshold} if self.version_2 else None
        return hf_head("BertForQuestionAnswering", bilstm_units=self.bilstm_units,
                       extra_config=extra)

    def model(self, model_config):
        return BertForQuestionAnswering(model_config, self.bilstm_units, self.classifier_dropout)

    def init_inputs(self) -> tuple:
        ids = jnp.zeros((1, 8), jnp.int32)
        return ids, ids, ids

    def loss(self, outputs, batch, denominators=None):
        start, end = outputs
        return span_loss(start, end, batch["start_positions"], batch["end_positions"],
                         batch["weights"], denominators)

    def denominators(self, batch):
        return span_denominators(batch["weights"])

    def predict(self, outputs, batch):
        start, end = outputs
        return {"start_logits": start.astype(jnp.float32),
                "end_logits": end.astype(jnp.float32)}

    def _answers(self, predictions, features) -> dict[str, Answer]:
        return postprocess(features, predictions["start_logits"],
                           predictions["end_logits"], n_best_size=self.n_best_size,
                           max_answer_length=self.max_answer_length, version_2=self.version_2)

    def _evaluate(self, answers: dict[str, Answer], examples) -> dict[str, float]:
        golds = gold_answers(examples)
        predicted = final_predictions(answers, self.version_2, self.threshold)
        if not self.version_2:
            return squad_metrics.evaluate(predicted, golds)
        non_null = {q: a.best_text for q, a in answers.items()}
        odds = {q: a.null_odds for q, a in answers.items()}
        return squad_metrics.evaluate(predicted, golds, True, non_null, odds)

    def metrics(self, predictions, features, split: str) -> dict[str, float]:
        return self._evaluate(self._answers(predictions, features), features.examples)

    # ---- predictions from a finished run (bertjax/serving)

    def state(self):
        return {"version_2": self.version_2, "threshold": self.threshold}

    def legacy_state(self, record, config):
        extra = record.get("extra_config") or {}
        return {"version_2": bool(config.task.version_2),
                "threshold": float(extra.get("null_score_diff_threshold", 0.0))}

    def input_chunks(self, path, rows, fields, directory):
        """SQuAD-layout .json: chunks of whole paragraphs (readers.squad_json_chunks)."""
        if path.lower().endswith(".json"):
            return readers.squad_json_chunks(path, rows, directory,
                                             fields.get("encoding") or DEFAULT_ENCODING)
        return super().input_chunks(path, rows, fields, directory)

    def restore(self, state):
        self.version_2 = bool(state["version_2"])
        self.threshold = float(state["threshold"])  # the run's dev-chosen or given one

    def read_inputs(self, path, fields):
        """Questions of an official-layout SQuAD .json file (answers optional) or of a .jsonl
        file of {question, context[, id]} objects (`fields`: question, context, id);
        labelled when every question has answers (or is_impossible)."""
        encoding = fields.get("encoding") or DEFAULT_ENCODING
        if path.lower().endswith(".jsonl"):
            examples = readers.read_questions_jsonl(
                path, fields.get("question") or "question", fields.get("context") or "context",
                fields.get("id") or "id", encoding)
            return examples, False
        examples = readers.read_squad_json(path, require_answers=False, encoding=encoding)
        labelled = all(e.answers or e.is_impossible for e in examples)
        if labelled and not self.version_2 and any(e.is_impossible for e in examples):
            raise DataError(f"{path}: has unanswerable questions but the model is SQuAD v1.1")
        return examples, labelled

    def examples(self, items):
        """(question, context) pairs or {"question", "context"[, "id"]} dicts."""
        out = []
        for i, item in enumerate(items):
            if isinstance(item, dict) and {"question", "context"} <= item.keys():
                question, context, qid = item["question"], item["context"], item.get("id", i)
            elif isinstance(item, tuple | list) and len(item) == 2:
                (question, context), qid = item, i
            else:
                raise DataError(f"input[{i}]: give (question, context) or a dict with "
                                "question and context")
            out.append(readers.SquadExample(str(qid), str(question), str(context), []))
        if not out:
            raise DataError("no inputs")
        return out

    def records(self, predictions, features, examples):
        """{id, answer, start, end (characters of the context; -1 for no answer), score,
        nbest [{text, probability, start_logit, end_logit, start, end}]}; v2.0 adds null_odds
        (the answer is "" when it exceeds the run's null threshold, `threshold`)."""
        answers = self._answers(predictions, features)
        final = final_predictions(answers, self.version_2, self.threshold)
        out = []
        for example in examples:
            answer = answers[example.qas_id]
            nbest = [{**entry, "start": a, "end": b}
                     for entry, (a, b) in zip(answer.nbest, answer.spans)]
            text = final[example.qas_id]
            span = next(((a, b) for e, (a, b) in zip(answer.nbest, answer.spans)
                         if text and e["text"] == text), (-1, -1))
            record = {"id": example.qas_id, "answer": text, "start": span[0], "end": span[1],
                      "score": float(answer.best_score) if text else None, "nbest": nbest}
            if self.version_2:
                record["null_odds"] = float(min(answer.null_odds, 1e30))
                record["threshold"] = self.threshold
            out.append(record)
        return out

    def release(self, examples):
        self._encoded.pop(id(examples), None)

    def write_outputs(self, predictions, examples, split: str, workdir, log) -> None:
        features = self._encoded[id(examples)]
        answers = self._answers(predictions, features)
        if split == "dev":
            if self.version_2 and self.null_threshold is None:
                self.threshold = 0.0  # the search is over the non-null predictions
                found = self._evaluate(answers, examples)
                self.threshold = found["best_f1_thresh"]
                log(f"null threshold {self.threshold:.4f} (best dev F1 "
                    f"{found['best_f1']:.2f}); predictions use it")
            result = self._evaluate(answers, examples)
            log("dev: " + json.dumps({k: round(v, 4) for k, v in result.items()}))
        predicted = final_predictions(answers, self.version_2, self.threshold)
        paths = write_prediction_files(str(workdir), "" if split == "dev" else f"{split}_",
                                       answers, predicted, self.version_2)
        log(f"wrote {len(predicted)} {split} predictions: " + ", ".join(paths))

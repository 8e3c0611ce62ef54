"""SQuAD v1.1 / v2.0 extractive question answering, as a task family of the fine-tuning
plug-in (tasks/base.py).

The paper's head (Sec. 4.2-4.3): a start vector S and an end vector E (one dense layer
`qa_outputs` to 2 logits per token, as the reference and transformers'
`BertForQuestionAnswering`); score(i, j) = S·T_i + E·T_j for j ≥ i. Loss = the mean of the
start and end cross-entropies over the whole window (float32); positions outside the context
are excluded from the answer search only, as in the reference.

Post-processing (`postprocess`): for every window, all (start, end) pairs with both ends in
the context, end ≥ start, at most `max_answer_length` tokens, and the start token in its max
context window; across a question's windows the `n_best_size` best distinct texts, each cut
from the ORIGINAL context characters through the tokenizer's offsets. v2.0: the null score is
the [CLS] start + end score, the minimum over the question's windows; "" is predicted when
null_odds = score_null - best_non_null exceeds a threshold chosen on dev to maximise F1 (or
`config.task.null_threshold`).

Files (written by `write_outputs` from the best checkpoint, for the dev split and a test
split): `predictions.json` (id → text), `nbest_predictions.json` (id → [{text, probability,
start_logit, end_logit}]) and for v2.0 `null_odds.json` (id → null_odds), the layouts the
official evaluation scripts read; a test split's files are prefixed with its name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from bertjax import paths as file_paths
from bertjax.errors import ConfigError, DataError
from bertjax.models import BertConfig, BertModel
from bertjax.models.bert import dense
from bertjax.models.bilstm import BiLSTMHead
from bertjax.tasks import squad_metrics
from bertjax.tasks.base import Splits, Task, hf_head
from data_pipeline.hosts import host_rows

Array = jax.Array


class BertForQuestionAnswering(nn.Module):
    """params: {"bert": BertModel params, "qa_outputs": {kernel [hidden, 2], bias [2]}}.

    bilstm_units > 0: "+ BiLSTM" (paper Table 5): a randomly initialised BiLSTM ("bilstm")
    between the encoder and qa_outputs (kernel [2 * bilstm_units, 2]).
    """

    config: BertConfig
    bilstm_units: int = 0

    @nn.compact
    def __call__(self, input_ids: Array, segment_ids: Array | None = None,
                 input_mask: Array | None = None, *, deterministic: bool = True
                 ) -> tuple[Array, Array]:
        """input_ids, segment_ids, input_mask: [batch, seq] int → (start_logits, end_logits),
        each [batch, seq] float32."""
        outputs = BertModel(self.config, name="bert")(
            input_ids, segment_ids, input_mask, deterministic=deterministic)
        sequence = outputs["sequence_output"]
        if self.bilstm_units:
            sequence = BiLSTMHead(self.bilstm_units, self.config.initializer_range,
                                  self.config.dtype, name="bilstm")(sequence, input_mask)
        logits = dense(self.config, 2, ("embed", "classes"), "qa_outputs")(
            sequence).astype(jnp.float32)
        logits = nn.with_logical_constraint(logits, ("batch", "length", "classes"))
        return logits[..., 0], logits[..., 1]


def span_loss(start_logits: Array, end_logits: Array, start_positions: Array,
              end_positions: Array, weights: Array | None = None
              ) -> tuple[Array, dict[str, Array]]:
    """Mean of the start and end softmax cross-entropies over all positions of the window.
    logits [batch, seq]; positions [batch] int; weights [batch] (0 = filler row)."""

    def nll(logits, positions):
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(log_probs, positions[:, None].astype(jnp.int32), -1)[:, 0]

    per_row = 0.5 * (nll(start_logits, start_positions) + nll(end_logits, end_positions))
    if weights is None:
        weights = jnp.ones_like(per_row)
    weights = weights.astype(jnp.float32)
    total = jnp.maximum(jnp.sum(weights), 1e-6)
    loss = jnp.sum(per_row * weights) / total
    hit = ((jnp.argmax(start_logits, -1) == start_positions)
           & (jnp.argmax(end_logits, -1) == end_positions)).astype(jnp.float32)
    return loss, {"loss": loss, "span_accuracy": jnp.sum(hit * weights) / total}


# ---------------------------------------------------------------------------------------------
# Post-processing (NumPy)


@dataclasses.dataclass
class Answer:
    """A question's post-processed answer. nbest: [{text, probability, start_logit,
    end_logit}] best first; best_text/best_score: the best non-null span ("" / -inf if none);
    null_score: min over windows of the [CLS] start + end logits (v2.0)."""

    best_text: str
    best_score: float
    null_score: float
    nbest: list[dict]

    @property
    def null_odds(self) -> float:
        return self.null_score - self.best_score


def window_spans(start_logits: np.ndarray, end_logits: np.ndarray, valid_start: np.ndarray,
                 valid_end: np.ndarray, max_answer_length: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every allowed (start, end) pair of one window: (scores, starts, ends), each [pairs].

    logits, valid_*: [seq]; a pair needs valid_start[start], valid_end[end] and
    0 ≤ end - start < max_answer_length. Built as a [seq, max_answer_length] band, so the
    cost is linear in seq."""
    seq = len(start_logits)
    starts = np.arange(seq)[:, None]
    ends = starts + np.arange(max_answer_length)[None, :]  # [seq, L]
    inside = ends < seq
    ends_c = np.minimum(ends, seq - 1)
    ok = inside & valid_start[:, None] & valid_end[ends_c]
    scores = start_logits[:, None] + end_logits[ends_c]
    i, k = np.nonzero(ok)
    return scores[i, k], i, ends[i, k]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x)) if len(x) else x
    return e / np.sum(e) if len(x) else e


def best_distinct(scores: np.ndarray, text_of, n_best: int) -> list[int]:
    """Indices of the `n_best` highest scores with distinct texts (text_of(index) → str),
    highest first; exact, but sorts only a growing top slice rather than every pair."""
    k = min(len(scores), 2 * n_best)
    while True:
        top = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
        # Stable order on ties: score descending, then index ascending.
        top = top[np.lexsort((top, -scores[top]))]
        chosen, seen = [], set()
        for index in top:
            text = text_of(int(index))
            if text not in seen:
                seen.add(text)
                chosen.append(int(index))
                if len(chosen) == n_best:
                    return chosen
        if k >= len(scores):
            return chosen
        k = min(len(scores), 2 * k)


def _slicer(context: str, char_starts: np.ndarray, char_ends: np.ndarray):
    """k → the context's characters of candidate k (the original text, not word pieces)."""
    return lambda k: context[char_starts[k]:char_ends[k]]


def postprocess(features, start_logits: np.ndarray, end_logits: np.ndarray, *,
                n_best_size: int = 20, max_answer_length: int = 30, version_2: bool = False
                ) -> dict[str, Answer]:
    """Question id → Answer, from every window's logits ([len(features), seq] each)."""
    windows: dict[int, list[int]] = {}
    for w, e in enumerate(features.example_index):
        windows.setdefault(int(e), []).append(w)
    answers = {}
    for e, example in enumerate(features.examples):
        context = example.context
        all_scores, all_win, all_start, all_end = [], [], [], []
        null_score, null_logits = np.inf, (0.0, 0.0)
        for w in windows.get(e, []):
            s, t = start_logits[w], end_logits[w]
            offset, length = features.doc_offset[w], features.doc_length[w]
            valid_end = np.zeros(len(s), bool)
            valid_end[offset:offset + length] = True
            valid_start = valid_end & features.max_context[w]
            scores, i, j = window_spans(s, t, valid_start, valid_end, max_answer_length)
            all_scores.append(scores)
            all_win.append(np.full(len(i), w))
            all_start.append(i)
            all_end.append(j)
            if s[0] + t[0] < null_score:
                null_score, null_logits = float(s[0] + t[0]), (float(s[0]), float(t[0]))
        scores = np.concatenate(all_scores) if all_scores else np.zeros(0)
        win = np.concatenate(all_win) if all_win else np.zeros(0, int)
        starts = np.concatenate(all_start) if all_start else np.zeros(0, int)
        ends = np.concatenate(all_end) if all_end else np.zeros(0, int)
        spans = features.contexts[features.context_index[e]]

        # Token positions in the window → context tokens → characters of the context.
        shift = features.doc_start[win] - features.doc_offset[win]
        text_of = _slicer(context, spans[starts + shift, 0], spans[ends + shift, 1])

        chosen = best_distinct(scores, text_of, n_best_size) if len(scores) else []
        entries = [(float(scores[k]), text_of(k), float(start_logits[win[k]][starts[k]]),
                    float(end_logits[win[k]][ends[k]])) for k in chosen]
        best_text, best_score = (entries[0][1], entries[0][0]) if entries else ("", -np.inf)
        if version_2 and np.isfinite(null_score):
            # The null answer competes in the n-best like the reference's, and is always in it.
            null = (null_score, "", *null_logits)
            entries = sorted(entries + [null], key=lambda x: -x[0])[:n_best_size]
            if null not in entries:  # the reference appends it (n_best_size + 1 entries)
                entries.append(null)
        probabilities = _softmax(np.array([x[0] for x in entries]))
        nbest = [{"text": text, "probability": float(p), "start_logit": sl, "end_logit": el}
                 for (_, text, sl, el), p in zip(entries, probabilities)]
        answers[example.qas_id] = Answer(best_text, best_score, null_score, nbest)
    return answers


def final_predictions(answers: dict[str, Answer], version_2: bool, threshold: float
                      ) -> dict[str, str]:
    """id → text; v2.0: "" when null_odds > threshold."""
    if not version_2:
        return {q: a.best_text for q, a in answers.items()}
    return {q: "" if a.null_odds > threshold or not a.best_text else a.best_text
            for q, a in answers.items()}


def gold_answers(examples) -> dict[str, list[str]]:
    return {e.qas_id: [] if e.is_impossible else [t for t, _ in e.answers] for e in examples}


def _write_json(path: str, value) -> None:
    """Whole file or nothing: written beside the target, then renamed over it (a remote
    object store writes whole objects anyway)."""
    if file_paths.is_remote(path):
        text = json.dumps(value, indent=2, ensure_ascii=False) + "\n"
        epath.Path(path).write_text(text)
        return
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp_", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=2, ensure_ascii=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_prediction_files(workdir: str, prefix: str, answers: dict[str, Answer],
                           predictions: dict[str, str], version_2: bool) -> list[str]:
    """predictions.json, nbest_predictions.json (and null_odds.json) under workdir."""
    file_paths.makedirs(workdir)
    paths = [file_paths.join(workdir, f"{prefix}{name}.json")
             for name in ("predictions", "nbest_predictions", "null_odds")]
    _write_json(paths[0], predictions)
    _write_json(paths[1], {q: a.nbest for q, a in answers.items()})
    if not version_2:
        return paths[:2]
    # A question without any allowed span has null_odds +inf; JSON has no infinity.
    _write_json(paths[2], {q: float(min(a.null_odds, 1e30)) for q, a in answers.items()})
    return paths


# ---------------------------------------------------------------------------------------------
# The task family


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
        from data_pipeline import squad

        data = config.data
        for field in ("train", "validation"):
            if not data[field]:
                raise ConfigError(f"config.data.{field} is empty; give a SQuAD-format JSON "
                                  "file or tfds:squad/v1.1 | tfds:squad/v2.0")

        def read(field: str, split: str):
            source, split = _parse_source(data[field], split)
            examples = squad.read_squad(source, split, data.get("tfds_data_dir") or None)
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
        from data_pipeline import squad

        key = id(examples)  # dev is both evaluated and written: converted once
        if key not in self._encoded:
            self._encoded[key] = squad.convert(
                tokenizer, examples, max_seq_length=max_seq_length, doc_stride=self.doc_stride,
                max_query_length=self.max_query_length, training=True,
                num_workers=self.num_workers)
        self.max_seq_length = max_seq_length
        return self._encoded[key]

    def batches(self, features, batch_size: int, *, shuffle: bool, seed: int = 0):
        order = (np.random.default_rng(seed).permutation(len(features)) if shuffle
                 else np.arange(len(features)))
        mine = host_rows(batch_size, jax.process_index(), jax.process_count())
        for first in range(0, len(order), batch_size):
            rows = np.full(batch_size, -1, np.int64)
            chunk = order[first:first + batch_size]
            rows[:len(chunk)] = chunk  # the last batch is filled with weight-0 rows
            rows = rows[mine]
            take = np.maximum(rows, 0)
            real = rows >= 0
            yield {
                "input_ids": features.input_ids[take] * real[:, None],
                "segment_ids": features.segment_ids[take] * real[:, None],
                "input_mask": features.input_mask[take] * real[:, None],
                "start_positions": np.where(real, features.start_positions[take], 0),
                "end_positions": np.where(real, features.end_positions[take], 0),
                "weights": real.astype(np.float32),
                "example_index": rows.astype(np.int32),
            }

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
        return BertForQuestionAnswering(model_config, self.bilstm_units)

    def init_inputs(self) -> tuple:
        ids = jnp.zeros((1, 8), jnp.int32)
        return ids, ids, ids

    def loss(self, outputs, batch):
        start, end = outputs
        return span_loss(start, end, batch["start_positions"], batch["end_positions"],
                         batch["weights"])

    def predict(self, outputs, batch):
        start, end = outputs
        return {"start_logits": start.astype(jnp.float32),
                "end_logits": end.astype(jnp.float32)}

    def _answers(self, predictions, features) -> dict[str, Answer]:
        return postprocess(features, np.stack(predictions["start_logits"]),
                           np.stack(predictions["end_logits"]), n_best_size=self.n_best_size,
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

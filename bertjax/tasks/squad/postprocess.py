"""SQuAD post-processing (NumPy): window logits → each question's n-best answers → the
predictions and the files the official evaluation scripts read.

`postprocess`: for every window, all (start, end) pairs with both ends in the context,
end ≥ start, at most `max_answer_length` tokens, and the start token in its max context window;
across a question's windows the `n_best_size` best distinct texts, each cut from the ORIGINAL
context characters through the tokenizer's offsets. v2.0: the null score is the [CLS] start +
end score, the minimum over the question's windows; "" is predicted (`final_predictions`) when
null_odds = score_null - best_non_null exceeds a threshold chosen on dev to maximise F1 (or
`config.task.null_threshold`).

Files (`write_prediction_files`, from the best checkpoint, for the dev split and a test
split): `predictions.json` (id → text), `nbest_predictions.json` (id → [{text, probability,
start_logit, end_logit}]) and for v2.0 `null_odds.json` (id → null_odds), the layouts the
official evaluation scripts read; a test split's files are prefixed with its name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import numpy as np
from etils import epath

from bertjax import paths as file_paths


@dataclasses.dataclass
class Answer:
    """A question's post-processed answer. nbest: [{text, probability, start_logit,
    end_logit}] best first; best_text/best_score: the best non-null span ("" / -inf if none);
    null_score: min over windows of the [CLS] start + end logits (v2.0)."""

    best_text: str
    best_score: float
    null_score: float
    nbest: list[dict]
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # nbest's [start,
    # end) characters in the context; (-1, -1) for the null answer


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


def postprocess(features, start_logits, end_logits, *, n_best_size: int = 20,
                max_answer_length: int = 30, version_2: bool = False) -> dict[str, Answer]:
    """Question id → Answer, from every window's logits: start_logits[w], end_logits[w]
    [length] for window w, length ≥ its tokens (its prediction bucket's, or max_seq_length: a
    [len(features), seq] array); positions outside its context are never an answer."""
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
            valid_start = valid_end & features.max_context[w, :len(s)]
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
        char_start = spans[starts + shift, 0]
        char_end = spans[ends + shift, 1]
        entries = [(float(scores[k]), text_of(k), float(start_logits[win[k]][starts[k]]),
                    float(end_logits[win[k]][ends[k]]), (int(char_start[k]), int(char_end[k])))
                   for k in chosen]
        best_text, best_score = (entries[0][1], entries[0][0]) if entries else ("", -np.inf)
        if version_2 and np.isfinite(null_score):
            # The null answer competes in the n-best like the reference's, and is always in it.
            null = (null_score, "", *null_logits, (-1, -1))
            entries = sorted(entries + [null], key=lambda x: -x[0])[:n_best_size]
            if null not in entries:  # the reference appends it (n_best_size + 1 entries)
                entries.append(null)
        probabilities = _softmax(np.array([x[0] for x in entries]))
        nbest = [{"text": text, "probability": float(p), "start_logit": sl, "end_logit": el}
                 for (_, text, sl, el, _), p in zip(entries, probabilities)]
        answers[example.qas_id] = Answer(best_text, best_score, null_score, nbest,
                                         [x[4] for x in entries])
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

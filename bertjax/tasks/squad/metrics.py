"""SQuAD's official metrics, written from the specification of the v1.1 and v2.0 evaluation
scripts: exact match and token F1 after normalisation (lower-case, punctuation removed, the
articles a/an/the removed, whitespace collapsed), the maximum over the gold answers; for v2.0
an unanswerable question's only gold answer is "" and the no-answer threshold is searched on
the null-odds (`score_null - best_non_null`) to maximise EM or F1. Percentages (0-100), as the
official scripts print them.
"""

from __future__ import annotations

import collections
import re
import string

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation, drop articles, collapse whitespace (in that order)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    """Token F1 of the normalised strings; an empty side scores 1 only if both are empty."""
    pred_tokens, gold_tokens = normalize_answer(prediction).split(), \
        normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    common = sum((collections.Counter(pred_tokens) & collections.Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def best_over_golds(metric, prediction: str, golds: list[str]) -> float:
    """The maximum of `metric` over the gold answers ([""] for an unanswerable question)."""
    return max(metric(prediction, g) for g in (golds or [""]))


def raw_scores(predictions: dict[str, str], golds: dict[str, list[str]]
               ) -> tuple[dict[str, float], dict[str, float]]:
    """({id: EM}, {id: F1}) of every gold question (a missing prediction scores 0)."""
    exact, f1 = {}, {}
    for qid, answers in golds.items():
        if qid not in predictions:
            exact[qid] = f1[qid] = 0.0
            continue
        exact[qid] = best_over_golds(exact_match, predictions[qid], answers)
        f1[qid] = best_over_golds(f1_score, predictions[qid], answers)
    return exact, f1


def best_threshold(predictions: dict[str, str], scores: dict[str, float],
                   null_odds: dict[str, float], has_answer: dict[str, bool]
                   ) -> tuple[float, float]:
    """(best score in %, threshold) over thresholds on null_odds: predict "" when
    null_odds > threshold. Starts from all-null (threshold 0.0 kept if nothing beats it) and
    admits questions in increasing null_odds, as the official v2.0 script does; `scores` are
    the questions' EM or F1 with their non-null `predictions`."""
    current = best = float(sum(1 for q in scores if not has_answer[q]))
    threshold = 0.0
    for qid in sorted(null_odds, key=lambda q: null_odds[q]):
        if qid not in scores:
            continue
        if has_answer[qid]:
            current += scores[qid]
        else:
            current += -1.0 if predictions[qid] else 0.0
        if current > best:
            best, threshold = current, null_odds[qid]
    return 100.0 * best / max(len(scores), 1), threshold


def evaluate(predictions: dict[str, str], golds: dict[str, list[str]],
             version_2: bool = False, non_null: dict[str, str] | None = None,
             null_odds: dict[str, float] | None = None) -> dict[str, float]:
    """Official metrics. v1.1: exact_match, f1. v2.0: exact, f1, HasAns_* and NoAns_* (when
    such questions exist), and with `null_odds` (+ the non-null predictions `non_null`, default
    `predictions`) best_exact, best_exact_thresh, best_f1, best_f1_thresh."""
    exact, f1 = raw_scores(predictions, golds)
    n = max(len(golds), 1)
    if not version_2:
        return {"exact_match": 100.0 * sum(exact.values()) / n,
                "f1": 100.0 * sum(f1.values()) / n}
    out = {"exact": 100.0 * sum(exact.values()) / n, "f1": 100.0 * sum(f1.values()) / n}
    has_answer = {q: bool(a) for q, a in golds.items()}
    for name, wanted in (("HasAns", True), ("NoAns", False)):
        ids = [q for q in golds if has_answer[q] == wanted]
        if ids:
            out[f"{name}_exact"] = 100.0 * sum(exact[q] for q in ids) / len(ids)
            out[f"{name}_f1"] = 100.0 * sum(f1[q] for q in ids) / len(ids)
    if null_odds is not None:
        non_null = predictions if non_null is None else non_null
        exact_nn, f1_nn = raw_scores(non_null, golds)
        for name, scores in (("exact", exact_nn), ("f1", f1_nn)):
            best, threshold = best_threshold(non_null, scores, null_odds, has_answer)
            out[f"best_{name}"], out[f"best_{name}_thresh"] = best, threshold
    return out

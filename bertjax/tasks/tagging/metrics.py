"""Entity-level precision / recall / F1 as conlleval counts chunks, token accuracy, and the
per-type table of the log.

Pure Python and NumPy; the chunks come from schemes.py (the rules the readers check files
with). An entity is counted correct when the predicted and the gold chunk have the same type,
start and end. Micro-averaged over all sentences (conlleval's "overall"), and per type; 0 when
a denominator is 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bertjax.tasks.tagging.schemes import chunks, strict_chunks


def _ratio(a: int, b: int) -> float:
    return a / b if b else 0.0


def entity_scores(gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]],
                  strict_scheme: str | None = None) -> dict[str, dict[str, float]]:
    """{"overall" | type: {"precision", "recall", "f1", "gold", "predicted", "correct"}}.

    gold, predicted: tag sequences of the same sentences (same lengths). strict_scheme:
    None = conlleval's chunks (`chunks`); "iob2" / "bioes" = only well-formed chunks.
    """
    if len(gold) != len(predicted):
        raise ValueError(f"{len(gold)} gold sentences but {len(predicted)} predicted")
    def extract(tags):
        return chunks(tags) if strict_scheme is None else strict_chunks(tags, strict_scheme)

    counts: dict[str, list[int]] = {}  # type → [gold, predicted, correct]
    for g, p in zip(gold, predicted):
        if len(g) != len(p):
            raise ValueError(f"a sentence has {len(g)} gold tags but {len(p)} predicted")
        g_chunks, p_chunks = set(extract(g)), set(extract(p))
        for chunk in g_chunks:
            counts.setdefault(chunk[0], [0, 0, 0])[0] += 1
        for chunk in p_chunks:
            counts.setdefault(chunk[0], [0, 0, 0])[1] += 1
        for chunk in g_chunks & p_chunks:
            counts[chunk[0]][2] += 1
    total = [sum(c[k] for c in counts.values()) for k in range(3)]
    out = {}
    for name, (n_gold, n_pred, correct) in [("overall", total), *sorted(counts.items())]:
        precision, recall = _ratio(correct, n_pred), _ratio(correct, n_gold)
        out[name] = {"precision": precision, "recall": recall,
                     "f1": _ratio(2 * precision * recall, precision + recall),
                     "gold": n_gold, "predicted": n_pred, "correct": correct}
    return out


def token_accuracy(gold: Sequence[Sequence], predicted: Sequence[Sequence]) -> float:
    """Share of words whose predicted tag equals the gold one."""
    g = np.concatenate([np.asarray(s, object) for s in gold]) if gold else np.zeros(0)
    p = np.concatenate([np.asarray(s, object) for s in predicted]) if predicted else np.zeros(0)
    return float(np.mean(g == p)) if len(g) else 0.0


def table(scores: dict[str, dict[str, float]]) -> str:
    """conlleval-like per-type lines: type, precision, recall, F1 (percent), counts."""
    lines = [f"{'type':<12} {'prec':>7} {'rec':>7} {'F1':>7} {'gold':>7} {'pred':>7}"]
    for name, s in scores.items():
        lines.append(f"{name:<12} {100 * s['precision']:7.2f} {100 * s['recall']:7.2f} "
                     f"{100 * s['f1']:7.2f} {s['gold']:7d} {s['predicted']:7d}")
    return "\n".join(lines)

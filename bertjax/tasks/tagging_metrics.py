"""Entity-level precision / recall / F1 as conlleval counts chunks, and token accuracy.

Pure Python and NumPy (data_pipeline.conll reads files with the same chunk rules). A chunk is
(type, start, end) with `end` exclusive; an entity is counted correct when the predicted and the
gold chunk have the same type, start and end. Micro-averaged over all sentences (conlleval's
"overall"), and per type; 0 when a denominator is 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Chunk = tuple[str, int, int]  # (type, start, end), end exclusive


def split_tag(tag: str) -> tuple[str, str]:
    """"B-PER" → ("B", "PER"); "O" → ("O", ""). The prefix is the first character and the type
    what follows the first "-", as conlleval and seqeval read tags."""
    if tag == "O":
        return "O", ""
    return tag[0], tag[1:].split("-", 1)[-1] or "_"


def chunks(tags: Sequence[str]) -> list[Chunk]:
    """Chunks by conlleval's rules (extended to E- / S- as seqeval's default mode).

    A chunk ends before a tag when the previous one was E- or S-, when B- or S- or O follows
    B- or I-, or when the type changes; one starts at B- or S-, at I- or E- after O, E- or S-,
    or at a change of type. So an I- tag after O starts a chunk (conlleval's IOB1 reading).
    """
    out: list[Chunk] = []
    prev_prefix, prev_type, start = "O", "", -1
    for i, tag in enumerate([*tags, "O"]):
        prefix, type_ = split_tag(tag)
        if start >= 0 and _ends(prev_prefix, prefix, prev_type, type_):
            out.append((prev_type, start, i))
            start = -1
        if _starts(prev_prefix, prefix, prev_type, type_):
            start = i
        prev_prefix, prev_type = prefix, type_
    return out


def _ends(prev: str, cur: str, prev_type: str, type_: str) -> bool:
    if prev in "ES":
        return True
    if prev in "BI" and cur in "BSO":
        return True
    return prev not in "O." and prev_type != type_


def _starts(prev: str, cur: str, prev_type: str, type_: str) -> bool:
    if cur in "BS":
        return True
    if prev in "OES" and cur in "IE":
        return True
    return cur not in "O." and prev_type != type_


def strict_chunks(tags: Sequence[str], scheme: str) -> list[Chunk]:
    """Only well-formed chunks (seqeval's strict mode): iob2 B-X I-X*; bioes S-X or B-X I-X* E-X.
    Tags that belong to no well-formed chunk count for nothing."""
    if scheme not in ("iob2", "bioes"):
        raise ValueError(f"strict chunks are defined for iob2 and bioes, not {scheme!r}")
    parsed = [split_tag(t) for t in tags]
    out: list[Chunk] = []
    i = 0
    while i < len(parsed):
        prefix, type_ = parsed[i]
        if prefix == "S" and scheme == "bioes":
            out.append((type_, i, i + 1))
        if prefix != "B":
            i += 1
            continue
        j = i + 1
        while j < len(parsed) and parsed[j] == ("I", type_):
            j += 1
        if scheme == "iob2":
            out.append((type_, i, j))
            i = j
        elif j < len(parsed) and parsed[j] == ("E", type_):
            out.append((type_, i, j + 1))
            i = j + 1
        else:  # B- I-* without its E-: not an entity
            i = j
    return out


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

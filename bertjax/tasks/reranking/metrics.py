"""Reranking metrics: each query's candidates ordered by score, then nDCG@10 and MRR@10 in
trec_eval's definitions (the embedding family's `retrieval_metrics`, as BEIR reports them),
averaged over the judged queries with at least one relevant candidate."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bertjax.tasks.embedding import metrics as retrieval
from bertjax.tasks.reranking.readers import CandidateList

RERANKING_METRICS = ("ndcg@10", "mrr@10")


def orders(lists: Sequence[CandidateList], scores) -> list[np.ndarray]:
    """scores [pairs] (each list's candidates in turn, as readers.pair_examples) → each list's
    candidate positions, best first; equal scores keep the input order (CrossEncoder.rank's
    stable sort)."""
    scores = np.asarray(scores, np.float64)
    total = sum(len(c.ids) for c in lists)
    if scores.shape != (total,):
        raise ValueError(f"scores {scores.shape} must be [{total}] (one per candidate)")
    out, start = [], 0
    for c in lists:
        out.append(np.argsort(-scores[start:start + len(c.ids)], kind="stable"))
        start += len(c.ids)
    return out


def reranking_metrics(lists: Sequence[CandidateList], scores) -> dict[str, float]:
    """{"ndcg@10", "mrr@10"} of the candidates ordered by `scores` [pairs] (`orders`), over the
    judged lists."""
    ranked = {c.id: [c.ids[i] for i in order] for c, order in zip(lists, orders(lists, scores))}
    qrels = {c.id: dict(zip(c.ids, c.relevance)) for c in lists if c.relevance is not None}
    found = retrieval.retrieval_metrics(ranked, qrels)
    return {name: found[name] for name in RERANKING_METRICS}


def input_order(lists: Sequence[CandidateList]) -> np.ndarray:
    """Scores [pairs] that keep each list's own order (the first stage's ranking)."""
    return np.concatenate([-np.arange(len(c.ids), dtype=np.float64) for c in lists])

"""The sentence-transformers side of the fidelity family `rerank` (test extra: torch,
transformers, sentence-transformers, datasets): a cross-encoder trained on (query, positive,
hard negative) rows with sentence-transformers' own model, loss and reranking evaluator, scored
on candidate lists. Nothing here imports the library (only the other references' seeding,
optimizer and mining), so a slip on bertjax's side shows as a difference instead of being
copied.

Protocol: the starting sentence-transformers directory `model_dir` (a bi-encoder) mines each
training question's hard negatives as in bertjax/fidelity/reference_embedding.py (`mine`);
`CrossEncoder(model_dir, num_labels=1)` then turns its BERT into a cross-encoder with a fresh
1-logit head over the pooled [CLS] (transformers' BertForSequenceClassification, as bertjax's
reranking task), pairs cut to `max_seq_length`, float32, dropout on while training. The loss
is the listwise one of bertjax's `listwise` kind: the softmax cross-entropy of each row's
positive among its own negatives, on the raw logits. sentence-transformers' cross-encoder
`MultipleNegativesRankingLoss(activation_fn=None, scale=1)` computes it from its hard
negatives alone, but its `num_negatives=0` (no in-batch negatives) fails in torch.multinomial,
so the loop calls the loss's own two steps, `call_model_with_columns` (the pairs scored) and
`calculate_loss` (their cross-entropy), for the positive and negative columns. A plain loop as
bertjax/fidelity/reference.py's (every epoch a fresh `random.Random(seed)` order, consecutive
rows a batch; AdamW eps 1e-6, weight decay 0.01 except biases and LayerNorm, 10% warmup then
linear decay, clipping 1.0). The dev metric: `CrossEncoderRerankingEvaluator` (at_k 10,
always_rerank_positives=False: each query's candidates as listed) on the candidate lists file,
after every epoch; the best epoch by nDCG@10 is reported, with the lists' own order (the first
stage's) as "retriever_<metric>".
"""

from __future__ import annotations

import json
import random
import time

import numpy as np

from bertjax.fidelity.reference import optimizer, read_jsonl, seeded, update
from bertjax.fidelity.reference_embedding import mine


def evaluator_samples(path: str) -> list[dict]:
    """The candidate lists (bertjax/tasks/reranking/readers.py's JSONL) as the evaluator's
    samples: {"query", "positive": the relevant texts, "documents": every text in order}."""
    samples = []
    for record in read_jsonl(path):
        texts = [c["text"] for c in record["candidates"]]
        positive = [c["text"] for c in record["candidates"] if c.get("relevant", 0) > 0]
        samples.append({"query": record["query"], "positive": positive, "documents": texts})
    return samples


def run(model_dir: str, train_file: str, candidates_file: str, *, columns: tuple[str, str] = (
        "question", "passage"), mine_settings: dict, max_seq_length: int = 256, seed: int,
        learning_rate: float, batch_size: int, epochs: int, threads: int = 2,
        log=print) -> dict[str, float]:
    """Trains a cross-encoder from `model_dir` on the (anchor, positive) `columns` of the JSONL
    `train_file` with the hard negatives the starting bi-encoder mines (`mine_settings`:
    reference_embedding.mine's keywords); the reranking metrics of the best epoch on the
    candidate lists of `candidates_file`."""
    import torch
    from sentence_transformers import CrossEncoder, SentenceTransformer
    from sentence_transformers.cross_encoder.evaluation import CrossEncoderRerankingEvaluator
    from sentence_transformers.cross_encoder.losses import MultipleNegativesRankingLoss

    seeded(seed, threads)
    records = mine(SentenceTransformer(model_dir, device="cpu"), read_jsonl(train_file),
                   columns, **mine_settings)
    columns = (*columns, *(f"negative_{i}" for i in range(1, mine_settings["num_negatives"] + 1)))
    texts = [[r[c] for r in records] for c in columns]
    log(f"sentence-transformers mined {len(records)} rows")
    model = CrossEncoder(model_dir, num_labels=1, max_length=max_seq_length, device="cpu")
    loss_fn = MultipleNegativesRankingLoss(model, activation_fn=None, scale=1.0)
    evaluator = CrossEncoderRerankingEvaluator(evaluator_samples(candidates_file), at_k=10,
                                               always_rerank_positives=False, batch_size=64,
                                               write_csv=False)

    def evaluate() -> dict[str, float]:
        model.eval()
        with torch.no_grad():
            scores = evaluator(model)
        return {"ndcg@10": float(scores["ndcg@10"]), "mrr@10": float(scores["mrr@10"]),
                "retriever_ndcg@10": float(scores["base_ndcg@10"]),
                "retriever_mrr@10": float(scores["base_mrr@10"])}

    steps = epochs * -(-len(records) // batch_size)
    opt, schedule = optimizer(model, learning_rate, steps)
    order = random.Random(seed)
    best = None
    for epoch in range(epochs):
        model.train()
        perm = list(range(len(records)))
        order.shuffle(perm)
        losses, began = [], time.perf_counter()
        for first in range(0, len(perm), batch_size):
            rows = perm[first:first + batch_size]
            queries = [texts[0][i] for i in rows]
            # Logits [passages][rows], the positive first: calculate_loss's layout.
            logits = [loss_fn.call_model_with_columns(queries, [column[i] for i in rows])
                      for column in texts[1:]]
            loss = loss_fn.calculate_loss(logits, len(rows))
            losses.append(update(model, opt, schedule, loss))
        metrics = evaluate()
        log(f"sentence-transformers epoch {epoch + 1}: loss {np.mean(losses):.4f} "
            f"({time.perf_counter() - began:.0f} s) {json.dumps(metrics)}")
        if best is None or metrics["ndcg@10"] > best["ndcg@10"]:
            best = metrics
    return best

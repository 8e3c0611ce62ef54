"""The sentence-transformers side of the fidelity families `embedding` and `embedding_mined`
(test extra: torch, transformers, sentence-transformers; datasets for the mining): contrastive
fine-tuning of a sentence-transformers directory on (anchor, positive[, negatives]) rows with
sentence-transformers' own model, loss and retrieval evaluator, scored on a BEIR directory.
Nothing here imports the library (only the transformers side's own optimizer and seeding,
bertjax/fidelity/reference.py), so a slip on bertjax's side shows as a difference instead of
being copied.

Protocol: `SentenceTransformer(model_dir)` (its modules: BERT, pooling, Normalize) with
`max_seq_length` set, float32, dropout on while training; `MultipleNegativesRankingLoss`
(scale 20, cosine: each anchor against every positive of its batch); a plain loop rather than
`SentenceTransformerTrainer` (which needs `accelerate`): every epoch a fresh
random order of the rows (`random.Random(seed)`, as bertjax/fidelity/reference.py), batches of
`batch_size` consecutive rows, the last one shorter when the rows do not divide; torch AdamW
(eps 1e-6) with weight decay 0.01 except biases and LayerNorm, linear warmup over 10% of the
steps then linear decay to 0, gradient clipping 1.0. The dev metrics come from
`InformationRetrievalEvaluator` (exact cosine search over the whole corpus; nDCG@10 with
binary gains as trec_eval's ndcg_cut_10 for 0/1 qrels), before training ("start_" metrics:
the starting checkpoint) and after every epoch; the best epoch by nDCG@10 is reported.

With `mine_settings` (the family `embedding_mined`): before training, the starting model
gives each anchor hard negatives by `sentence_transformers.util.mine_hard_negatives` (sampling
"top", output "n-tuple": columns negative_1 .. negative_n; the searched texts are the
positives, at the model's own max_seq_length), and the loss reads (anchor, positive,
negative_1 ..); batches then come from sentence-transformers' `NoDuplicatesBatchSampler` (no
text twice in a batch: a mined negative is another row's positive), as bertjax's
`task.no_duplicates`.
"""

from __future__ import annotations

import json
import os
import random
import time

import numpy as np

from bertjax.fidelity.reference import optimizer, seeded, update

NAMES = {"ndcg@10": "cosine_ndcg@10", "mrr@10": "cosine_mrr@10",
         "recall@1": "cosine_recall@1", "recall@10": "cosine_recall@10",
         "recall@100": "cosine_recall@100"}


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_beir(directory: str, split: str = "dev"
              ) -> tuple[dict[str, str], dict[str, str], dict[str, set[str]]]:
    """(queries, corpus, relevant docs) of a BEIR directory; a document's text is its title
    and text joined by a space (BEIR's sentence-embedding convention)."""
    corpus = {}
    for r in read_jsonl(os.path.join(directory, "corpus.jsonl")):
        title = r.get("title") or ""
        corpus[str(r["_id"])] = f"{title} {r['text']}".strip() if title else r["text"].strip()
    queries = {str(r["_id"]): r["text"].strip()
               for r in read_jsonl(os.path.join(directory, "queries.jsonl"))}
    relevant: dict[str, set[str]] = {}
    with open(os.path.join(directory, "qrels", f"{split}.tsv"), encoding="utf-8") as f:
        for number, line in enumerate(f):
            fields = line.rstrip("\n").split("\t")
            if len(fields) < 3 or (number == 0 and not fields[-1].strip().isdigit()):
                continue
            if int(fields[-1]) > 0:
                relevant.setdefault(fields[0], set()).add(fields[1])
    return {q: t for q, t in queries.items() if q in relevant}, corpus, relevant


def mine(model, records: list[dict], columns: tuple[str, str], *, num_negatives: int,
         relative_margin: float, range_max: int) -> list[dict]:
    """`records` with hard negatives (columns negative_1 .. negative_n) by sentence-transformers'
    `mine_hard_negatives` with `model`; the rows of an anchor left with too few are dropped."""
    from datasets import Dataset
    from sentence_transformers.util import mine_hard_negatives

    pairs = Dataset.from_dict({c: [r[c] for r in records] for c in columns})
    mined = mine_hard_negatives(pairs, model, anchor_column_name=columns[0],
                                positive_column_name=columns[1], num_negatives=num_negatives,
                                relative_margin=relative_margin, range_max=range_max,
                                sampling_strategy="top", output_format="n-tuple",
                                batch_size=64, verbose=False)
    return mined.to_list()


def batch_plan(records: list[dict], columns: tuple[str, ...], batch_size: int, epochs: int,
               seed: int, no_duplicates: bool) -> list[list[list[int]]]:
    """Each epoch's batches of row indices: consecutive rows of a fresh `random.Random(seed)`
    order, or (no_duplicates) those of `NoDuplicatesBatchSampler` (seed + epoch), whose passes
    can yield more batches than its length: the plan is drawn first so that the schedule
    counts every step."""
    if not no_duplicates:
        order, plan = random.Random(seed), []
        for _ in range(epochs):
            perm = list(range(len(records)))
            order.shuffle(perm)
            plan.append([perm[i:i + batch_size] for i in range(0, len(perm), batch_size)])
        return plan
    import torch
    from datasets import Dataset
    from sentence_transformers.base.sampler import NoDuplicatesBatchSampler

    rows = Dataset.from_dict({c: [r[c] for r in records] for c in columns})
    sampler = NoDuplicatesBatchSampler(rows, batch_size, drop_last=False,
                                       generator=torch.Generator(), seed=seed)
    plan = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        plan.append([list(batch) for batch in sampler])
    return plan


def run(model_dir: str, train_file: str, beir_dir: str, *, columns: tuple[str, str] = (
        "question", "passage"), max_seq_length: int = 128, seed: int, learning_rate: float,
        batch_size: int, epochs: int, scale: float = 20.0, mine_settings: dict | None = None,
        threads: int = 2, log=print) -> dict[str, float]:
    """Fine-tunes the sentence-transformers directory `model_dir` on the `columns` (anchor,
    positive) of the JSONL `train_file`, with `mine_settings` (`mine`'s keywords) on the
    hard negatives the starting model mines; the dev metrics of the best epoch by nDCG@10,
    with the starting checkpoint's as "start_<metric>"."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import (
        InformationRetrievalEvaluator,
    )
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.util import cos_sim

    seeded(seed, threads)
    model = SentenceTransformer(model_dir, device="cpu")
    records = read_jsonl(train_file)
    if mine_settings:  # at the model's own length, as bertjax's `predict mine --checkpoint`
        records = mine(model, records, columns, **mine_settings)
        columns = (*columns, *(f"negative_{i}"
                               for i in range(1, mine_settings["num_negatives"] + 1)))
        log(f"sentence-transformers mined {len(records)} rows")
    model.max_seq_length = max_seq_length
    texts = [[r[c] for r in records] for c in columns]  # per column: anchors, positives, ...
    queries, corpus, relevant = read_beir(beir_dir)
    evaluator = InformationRetrievalEvaluator(
        queries, corpus, relevant, mrr_at_k=[10], ndcg_at_k=[10], accuracy_at_k=[1, 10],
        precision_recall_at_k=[1, 10, 100], map_at_k=[100], batch_size=64,
        score_functions={"cosine": cos_sim}, write_csv=False)
    loss_fn = MultipleNegativesRankingLoss(model, scale=scale)

    def evaluate() -> dict[str, float]:
        model.eval()
        with torch.no_grad():
            scores = evaluator(model)
        return {name: float(scores[key]) for name, key in NAMES.items()}

    start = evaluate()
    log(f"sentence-transformers before training: {json.dumps(start)}")
    plan = batch_plan(records, columns, batch_size, epochs, seed, bool(mine_settings))
    opt, schedule = optimizer(model, learning_rate, sum(map(len, plan)))
    best = None
    for epoch, batches in enumerate(plan):
        model.train()
        losses, began = [], time.perf_counter()
        for rows in batches:
            features = [model.preprocess([column[i] for i in rows]) for column in texts]
            loss = loss_fn(features, None)
            losses.append(update(model, opt, schedule, loss))
        metrics = evaluate()
        log(f"sentence-transformers epoch {epoch + 1}: loss {np.mean(losses):.4f} "
            f"({time.perf_counter() - began:.0f} s) {json.dumps(metrics)}")
        if best is None or metrics["ndcg@10"] > best["ndcg@10"]:
            best = metrics
    return {**best, **{f"start_{k}": v for k, v in start.items()}}

"""Independent transformers (PyTorch) reference for SQuAD-style extractive QA.

The "transformers side" of the fidelity harness: fine-tunes
``BertForQuestionAnswering`` on a SQuAD v1.1 / v2.0 JSON file and scores the dev
file with the official SQuAD metrics.  It imports nothing of bertjax's model, task or data
code (only the other references' seeding, optimizer and update step), so a slip on bertjax's
side shows as a difference instead of being copied.
"""

from __future__ import annotations

import collections
import json
import math
import re
import string
import time

import numpy as np
import torch
from transformers import BertForQuestionAnswering, BertTokenizerFast

from bertjax.fidelity.reference import optimizer, seeded, update

# ----------------------------------------------------------------- metrics ---


def normalize_answer(s: str) -> str:
    """Official SQuAD normalisation: lower, drop punctuation, articles, extra whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_score(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str, version_2: bool = False) -> float:
    """Token-level F1; v2.0 scores empty-vs-empty as 1 (the v1.1 script gives 0)."""
    pred_toks, gold_toks = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if version_2 and (not pred_toks or not gold_toks):
        return float(pred_toks == gold_toks)
    num_same = sum((collections.Counter(pred_toks) & collections.Counter(gold_toks)).values())
    if num_same == 0:
        return 0.0
    precision, recall = num_same / len(pred_toks), num_same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def squad_v1_metrics(preds: dict[str, str], golds: dict[str, list[str]]) -> dict[str, float]:
    """Official v1.1 script: max over gold answers, mean over all questions (percent)."""
    golds = {q: gs or [""] for q, gs in golds.items()}
    em = [max(exact_score(preds.get(q, ""), g) for g in gs) for q, gs in golds.items()]
    f1 = [max(f1_score(preds.get(q, ""), g) for g in gs) for q, gs in golds.items()]
    return {"exact_match": 100.0 * np.mean(em), "f1": 100.0 * np.mean(f1)}


def _best_threshold(preds, raw, na_odds, has_ans) -> float:
    """Official v2.0 ``find_best_thresh``: sweep questions sorted by null odds."""
    cur = best = sum(1 for q in raw if not has_ans[q])
    for q in sorted(raw, key=lambda k: na_odds[k]):
        cur += raw[q] if has_ans[q] else (-1 if preds[q] else 0)
        best = max(best, cur)
    return 100.0 * best / len(raw)


def squad_v2_metrics(preds: dict[str, str], golds: dict[str, list[str]],
                     na_odds: dict[str, float]) -> dict[str, float]:
    """Official v2.0 script with ``--na-prob-file`` = null odds (preds already thresholded at 0).

    ``golds`` holds the raw answer texts ([] for unanswerable questions).
    """
    has_ans = {q: bool(gs) for q, gs in golds.items()}
    golds = {q: [g for g in gs if normalize_answer(g)] or [""] for q, gs in golds.items()}
    raw_em = {q: max(exact_score(preds[q], g) for g in gs) for q, gs in golds.items()}
    raw_f1 = {q: max(f1_score(preds[q], g, True) for g in gs) for q, gs in golds.items()}
    # The official default na_prob_thresh=1.0 changes nothing here: odds > 0 already predict "".
    out = {"exact": 100.0 * np.mean(list(raw_em.values())),
           "f1": 100.0 * np.mean(list(raw_f1.values())),
           "best_exact": _best_threshold(preds, raw_em, na_odds, has_ans),
           "best_f1": _best_threshold(preds, raw_f1, na_odds, has_ans)}
    for name, keep in (("HasAns", True), ("NoAns", False)):
        qs = [q for q in golds if has_ans[q] == keep]
        if qs:
            out[f"{name}_f1"] = 100.0 * np.mean([raw_f1[q] for q in qs])
    return out


# ---------------------------------------------------------------- features ---


def read_squad(path: str) -> list[dict]:
    """Flatten a SQuAD JSON into one dict per question.

    Keys: id, question, context, answers ([{text, answer_start}]), is_impossible.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)["data"]
    return [{"id": qa["id"], "question": qa["question"], "context": p["context"],
             "answers": qa.get("answers", []),
             "is_impossible": bool(qa.get("is_impossible", False)) or not qa.get("answers")}
            for article in data for p in article["paragraphs"] for qa in p["qas"]]


def featurize(tokenizer, examples, max_seq_length, doc_stride, max_query_length, train: bool):
    """One row per window: {input_ids, token_type_ids, [start, end] | [example, offsets]}.

    Windows advance by ``doc_stride`` context tokens (the BERT reference's meaning);
    transformers' ``stride`` is the overlap, so it is set to budget - doc_stride.
    ``offsets[i]`` is the (char_start, char_end) of context token i, None elsewhere.
    """
    rows = []
    for ex_idx, ex in enumerate(examples):
        question = ex["question"]
        q_enc = tokenizer(question, add_special_tokens=False, return_offsets_mapping=True)
        if len(q_enc["input_ids"]) > max_query_length:
            question = question[: q_enc["offset_mapping"][max_query_length - 1][1]]
            q_len = max_query_length
        else:
            q_len = len(q_enc["input_ids"])
        budget = max_seq_length - q_len - 3
        enc = tokenizer(question, ex["context"], truncation="only_second",
                        max_length=max_seq_length, stride=max(budget - doc_stride, 0),
                        return_overflowing_tokens=True, return_offsets_mapping=True, padding=False)
        for w in range(len(enc["input_ids"])):
            seq_ids, offsets = enc.sequence_ids(w), enc["offset_mapping"][w]
            row = {"input_ids": enc["input_ids"][w], "token_type_ids": enc["token_type_ids"][w]}
            if train:
                row["start"], row["end"] = _answer_positions(ex, seq_ids, offsets)
            else:
                row["example"] = ex_idx
                row["offsets"] = [o if s == 1 else None for o, s in zip(offsets, seq_ids)]
            rows.append(row)
    return rows


def _answer_positions(ex, seq_ids, offsets) -> tuple[int, int]:
    """Token (start, end) of the first answer inside this window, or (0, 0) = [CLS]."""
    if ex["is_impossible"]:
        return 0, 0
    ans = ex["answers"][0]
    char_start = ans["answer_start"]
    char_end = char_start + len(ans["text"])
    ctx = [i for i, s in enumerate(seq_ids) if s == 1]
    if not ctx or offsets[ctx[0]][0] > char_start or offsets[ctx[-1]][1] < char_end:
        return 0, 0
    start = ctx[0]
    while start <= ctx[-1] and offsets[start][0] <= char_start:
        start += 1
    end = ctx[-1]
    while end >= ctx[0] and offsets[end][1] >= char_end:
        end -= 1
    return start - 1, end + 1


def collate(rows, pad_id: int) -> dict[str, torch.Tensor]:
    """Pad rows to the longest in the batch: input_ids/token_type_ids/attention_mask [B, L]."""
    length = max(len(r["input_ids"]) for r in rows)
    batch = {k: torch.zeros(len(rows), length, dtype=torch.long)
             for k in ("input_ids", "token_type_ids", "attention_mask")}
    batch["input_ids"].fill_(pad_id)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        batch["input_ids"][i, :n] = torch.tensor(r["input_ids"])
        batch["token_type_ids"][i, :n] = torch.tensor(r["token_type_ids"])
        batch["attention_mask"][i, :n] = 1
    if "start" in rows[0]:
        batch["start_positions"] = torch.tensor([r["start"] for r in rows])
        batch["end_positions"] = torch.tensor([r["end"] for r in rows])
    return batch


# -------------------------------------------------------------- prediction ---


@torch.no_grad()
def predict(model, rows, examples, pad_id, n_best_size, max_answer_length, eval_batch=64):
    """Best span text per question id, and null_odds = null score - best non-null span score."""
    model.eval()
    best = {}  # example index -> (score, text)
    null = {}  # example index -> min over windows of start[0] + end[0]
    for b in range(0, len(rows), eval_batch):
        chunk = rows[b:b + eval_batch]
        out = model(**collate(chunk, pad_id))
        for row, start_l, end_l in zip(chunk, out.start_logits.numpy(), out.end_logits.numpy()):
            n, ex, offsets = len(row["input_ids"]), row["example"], row["offsets"]
            start_l, end_l = start_l[:n], end_l[:n]
            null[ex] = min(null.get(ex, math.inf), float(start_l[0] + end_l[0]))
            top_ends = np.argsort(-end_l, kind="stable")[:n_best_size]
            for s in np.argsort(-start_l, kind="stable")[:n_best_size]:
                for e in top_ends:
                    if offsets[s] is None or offsets[e] is None:
                        continue
                    if e < s or e - s + 1 > max_answer_length:
                        continue
                    score = float(start_l[s] + end_l[e])
                    if score > best.get(ex, (-math.inf,))[0]:
                        best[ex] = (score, examples[ex]["context"][offsets[s][0]:offsets[e][1]])
    texts, odds = {}, {}
    for i, ex in enumerate(examples):
        score, texts[ex["id"]] = best.get(i, (-math.inf, ""))
        odds[ex["id"]] = null.get(i, 0.0) - score  # +inf when no valid span exists
    return texts, odds


def evaluate(model, rows, examples, pad_id, n_best_size, max_answer_length, version_2):
    """Official metrics on the dev set (v2.0: predict "" where null_odds > 0)."""
    texts, odds = predict(model, rows, examples, pad_id, n_best_size, max_answer_length)
    golds = {ex["id"]: [a["text"] for a in ex["answers"]] for ex in examples}
    if not version_2:
        return squad_v1_metrics(texts, golds)
    preds = {q: "" if odds[q] > 0 else t for q, t in texts.items()}
    return squad_v2_metrics(preds, golds, odds)


# ---------------------------------------------------------------- training ---


def run(model_dir: str, train_json: str, dev_json: str, *, seed: int, learning_rate: float,
        batch_size: int, epochs: int, max_seq_length: int = 384, doc_stride: int = 128,
        max_query_length: int = 64, n_best_size: int = 20, max_answer_length: int = 30,
        version_2: bool = False, warmup_proportion: float = 0.1, weight_decay: float = 0.01,
        threads: int = 2, log=print) -> dict[str, float]:
    """Fine-tune on ``train_json``; return dev metrics of the best epoch (by f1 / best_f1)."""
    seeded(seed, threads)
    tokenizer = BertTokenizerFast.from_pretrained(model_dir)
    model = BertForQuestionAnswering.from_pretrained(model_dir, dtype=torch.float32,
                                                     attn_implementation="eager")
    pad_id = tokenizer.pad_token_id

    train_rows = featurize(tokenizer, read_squad(train_json), max_seq_length, doc_stride,
                           max_query_length, train=True)
    dev_examples = read_squad(dev_json)
    dev_rows = featurize(tokenizer, dev_examples, max_seq_length, doc_stride, max_query_length,
                         train=False)
    log(f"train windows {len(train_rows)}, dev questions {len(dev_examples)}, "
        f"dev windows {len(dev_rows)}")

    opt, schedule = optimizer(model, learning_rate,
                              epochs * math.ceil(len(train_rows) / batch_size),
                              warmup_proportion, weight_decay)

    primary = "best_f1" if version_2 else "f1"
    generator = torch.Generator().manual_seed(seed)
    best: dict[str, float] = {}
    for epoch in range(1, epochs + 1):
        t0 = time.time()
        model.train()
        losses = []
        order = torch.randperm(len(train_rows), generator=generator).tolist()
        for b in range(0, len(order), batch_size):
            loss = model(**collate([train_rows[i] for i in order[b:b + batch_size]], pad_id)).loss
            losses.append(update(model, opt, schedule, loss))
        metrics = evaluate(model, dev_rows, dev_examples, pad_id, n_best_size, max_answer_length,
                           version_2)
        metrics = {k: float(v) for k, v in metrics.items()}
        log(f"epoch {epoch}/{epochs} loss {np.mean(losses):.4f} "
            + " ".join(f"{k} {v:.2f}" for k, v in metrics.items()) + f" ({time.time() - t0:.0f}s)")
        if not best or metrics[primary] > best[primary]:
            best = metrics
    return best

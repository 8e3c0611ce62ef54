"""The transformers side of the fidelity families (test extra: torch, transformers, seqeval,
scipy): a plain PyTorch fine-tuning loop as the transformers examples write it, on the same
files and settings as bertjax's command. Nothing here imports bertjax, so a slip on bertjax's
side shows as a difference instead of being copied.

Protocol (each family): `BertTokenizerFast` / `Bert*` `from_pretrained(model_dir)` (the head
newly initialised), float32, dropout on; torch AdamW (eps 1e-6) with weight decay 0.01 except
biases and LayerNorm, linear warmup over 10% of the steps then linear decay to 0, gradient
clipping 1.0; every epoch a fresh random order of the training rows, batches padded to their
longest row; the dev metric after every epoch, the best epoch reported.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence

import numpy as np

Row = dict  # {"input_ids": [len] ints, "token_type_ids": [len] ints, "labels": ...}


def seeded(seed: int, threads: int) -> None:
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.set_num_threads(threads)


def optimizer(model, learning_rate: float, total_steps: int, warmup_proportion: float = 0.1,
              weight_decay: float = 0.01):
    """(torch AdamW, linear warmup / decay schedule)."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if name.endswith("bias") or "LayerNorm" in name else decay).append(param)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=learning_rate, eps=1e-6)
    return opt, get_linear_schedule_with_warmup(opt, int(warmup_proportion * total_steps),
                                                total_steps)


def update(model, opt, schedule, loss) -> float:
    """One step of `optimizer`'s pair on `loss` (gradients clipped to norm 1.0); the loss."""
    import torch

    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    schedule.step()
    opt.zero_grad()
    return float(loss.detach())


def pad(rows: Sequence[Row], label_pad: int = -100) -> dict:
    """Tensors of `rows` padded to the longest: input_ids, token_type_ids, attention_mask
    [batch, (choices,) seq] and labels [batch] or [batch, seq] (padded with `label_pad`)."""
    import torch

    def padded(values, fill):
        longest = max(len(v) for v in values)
        return [list(v) + [fill] * (longest - len(v)) for v in values]

    multiple = isinstance(rows[0]["input_ids"][0], list)
    flat = [c for r in rows for c in (r["input_ids"] if multiple else [r["input_ids"]])]
    types = [c for r in rows for c in (r["token_type_ids"] if multiple else
                                       [r["token_type_ids"]])]
    ids = torch.tensor(padded(flat, 0))
    out = {"input_ids": ids, "token_type_ids": torch.tensor(padded(types, 0)),
           "attention_mask": (torch.tensor(padded([[1] * len(f) for f in flat], 0)))}
    if multiple:
        out = {k: v.view(len(rows), -1, v.shape[-1]) for k, v in out.items()}
    labels = [r["labels"] for r in rows]
    if isinstance(labels[0], list):
        out["labels"] = torch.tensor(padded(labels, label_pad))
    else:
        out["labels"] = torch.tensor(labels)
    return out


def train(model, rows: Sequence[Row], evaluate: Callable[[], dict], primary: str, *, seed: int,
          learning_rate: float, batch_size: int, epochs: int, log=print) -> dict[str, float]:
    """Fine-tunes `model` on `rows`; returns the dev metrics (`evaluate()`) of the best epoch by
    `primary`."""
    import torch

    steps = epochs * math.ceil(len(rows) / batch_size)
    opt, schedule = optimizer(model, learning_rate, steps)
    order = random.Random(seed)
    best = None
    for epoch in range(epochs):
        model.train()
        perm = list(range(len(rows)))
        order.shuffle(perm)
        losses = []
        for first in range(0, len(perm), batch_size):
            loss = model(**pad([rows[i] for i in perm[first:first + batch_size]])).loss
            losses.append(update(model, opt, schedule, loss))
        model.eval()
        with torch.no_grad():
            metrics = evaluate()
        log(f"transformers epoch {epoch + 1}: loss {np.mean(losses):.4f} {json.dumps(metrics)}")
        if best is None or metrics[primary] > best[primary]:
            best = metrics
    return best


def predict_batches(model, rows: Sequence[Row], batch_size: int = 64):
    """Logits of `rows` in order, batch by batch (padded to each batch's longest row)."""
    for first in range(0, len(rows), batch_size):
        batch = pad(rows[first:first + batch_size])
        batch.pop("labels")
        yield model(**batch).logits


# ---------------------------------------------------------------------------------------------
# Families


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sequence_classification(model_dir: str, train_file: str, dev_file: str, *, kind: str,
                            text_a: str, text_b: str | None = None, label: str = "label",
                            choices: Sequence[str] = (), max_seq_length: int = 128, seed: int,
                            learning_rate: float, batch_size: int, epochs: int, threads: int = 2,
                            log=print) -> dict[str, float]:
    """JSONL rows → BertForSequenceClassification (kind classification: accuracy; regression:
    pearson, spearman) or BertForMultipleChoice (accuracy; `text_a` the context, `choices` the
    endings' fields, `label` the right ending's index). Labels of classification: the sorted
    distinct training values."""
    import transformers
    from scipy import stats

    seeded(seed, threads)
    tokenizer = transformers.BertTokenizerFast.from_pretrained(model_dir)
    train_records, dev_records = read_jsonl(train_file), read_jsonl(dev_file)
    names = sorted({str(r[label]) for r in train_records}) if kind == "classification" else []

    def encode(record) -> Row:
        if kind == "multiple_choice":
            enc = tokenizer([record[text_a]] * len(choices), [record[c] for c in choices],
                            truncation=True, max_length=max_seq_length)
            return {"input_ids": enc["input_ids"], "token_type_ids": enc["token_type_ids"],
                    "labels": int(record[label])}
        enc = tokenizer(record[text_a], record[text_b] if text_b else None, truncation=True,
                        max_length=max_seq_length)
        target = (float(record[label]) if kind == "regression"
                  else names.index(str(record[label])))
        return {"input_ids": enc["input_ids"], "token_type_ids": enc["token_type_ids"],
                "labels": target}

    train_rows = [encode(r) for r in train_records]
    dev_rows = [encode(r) for r in dev_records]
    if kind == "multiple_choice":
        model = transformers.BertForMultipleChoice.from_pretrained(model_dir)
    else:
        model = transformers.BertForSequenceClassification.from_pretrained(
            model_dir, num_labels=1 if kind == "regression" else len(names),
            problem_type="regression" if kind == "regression" else
            "single_label_classification")
    gold = np.array([r["labels"] for r in dev_rows])

    def evaluate() -> dict[str, float]:
        logits = np.concatenate([b.numpy() for b in predict_batches(model, dev_rows)])
        if kind == "regression":
            return {"pearson": float(stats.pearsonr(logits[:, 0], gold)[0]),
                    "spearman": float(stats.spearmanr(logits[:, 0], gold)[0])}
        return {"accuracy": float(np.mean(logits.argmax(-1) == gold))}

    primary = "pearson" if kind == "regression" else "accuracy"
    return train(model, train_rows, evaluate, primary, seed=seed, learning_rate=learning_rate,
                 batch_size=batch_size, epochs=epochs, log=log)


def read_conll(path: str) -> list[tuple[list[str], list[str]]]:
    """(words, tags) of each sentence of a CoNLL column file (token first, tag last);
    -DOCSTART- lines are skipped: transformers encodes each sentence alone."""
    sentences, words, tags = [], [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            columns = line.split()
            if not columns or columns[0] == "-DOCSTART-":
                if words:
                    sentences.append((words, tags))
                words, tags = [], []
                continue
            words.append(columns[0])
            tags.append(columns[-1])
    if words:
        sentences.append((words, tags))
    return sentences


def token_classification(model_dir: str, train_file: str, dev_file: str, *,
                         max_seq_length: int = 128, seed: int, learning_rate: float,
                         batch_size: int, epochs: int, threads: int = 2,
                         log=print) -> dict[str, float]:
    """CoNLL files (IOB2) → BertForTokenClassification with each word's label on its first
    sub-token (-100 elsewhere), sentences encoded alone; seqeval's entity F1 / precision /
    recall over the dev words (a word cut by truncation predicted "O")."""
    import transformers
    from seqeval.metrics import f1_score, precision_score, recall_score

    seeded(seed, threads)
    tokenizer = transformers.BertTokenizerFast.from_pretrained(model_dir)
    train_sentences, dev_sentences = read_conll(train_file), read_conll(dev_file)
    names = sorted({t for _, tags in train_sentences for t in tags},
                   key=lambda t: (t != "O", t))
    ids = {t: i for i, t in enumerate(names)}

    def encode(words, tags) -> tuple[Row, list[int]]:
        enc = tokenizer(words, is_split_into_words=True, truncation=True,
                        max_length=max_seq_length)
        labels, firsts, previous = [], [], None
        for position, word in enumerate(enc.word_ids()):
            first = word is not None and word != previous
            labels.append(ids.get(tags[word], 0) if first else -100)
            if first:
                firsts.append(position)
            previous = word
        return ({"input_ids": enc["input_ids"], "token_type_ids": enc["token_type_ids"],
                 "labels": labels}, firsts)

    train_rows = [encode(w, t)[0] for w, t in train_sentences]
    dev = [encode(w, t) for w, t in dev_sentences]
    dev_rows = [row for row, _ in dev]
    model = transformers.BertForTokenClassification.from_pretrained(model_dir,
                                                                    num_labels=len(names))

    def evaluate() -> dict[str, float]:
        predicted = []
        batches = predict_batches(model, dev_rows)
        logits = [row for batch in batches for row in batch.argmax(-1).tolist()]
        for (words, _), (_, firsts), tags in zip(dev_sentences, dev, logits):
            out = [names[tags[p]] for p in firsts]
            predicted.append(out + ["O"] * (len(words) - len(out)))
        gold = [tags for _, tags in dev_sentences]
        return {"f1": float(f1_score(gold, predicted)),
                "precision": float(precision_score(gold, predicted)),
                "recall": float(recall_score(gold, predicted))}

    return train(model, train_rows, evaluate, "f1", seed=seed, learning_rate=learning_rate,
                 batch_size=batch_size, epochs=epochs, log=log)

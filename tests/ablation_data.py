"""Test-scale data for the `bertjax.ablations` runner: write_test_data writes a vocabulary,
unmasked pair TFRecords (create_pretraining_data) of a few news-like sentences, and a
sentiment task's JSONL splits, and returns the grid's --set overrides that point at them; used
by tests/grids/test_ablations.py and the multi-host ablation cell of
tests/train/test_multihost.py."""

import functools
import json

WORDS = ("the team won a big match", "a market fell on bad news", "the minister lost a vote",
         "new phones sold well", "the coach said the season was good", "shares rose again")


def write_test_data(root):
    """A vocabulary, unmasked pair TFRecords (create_pretraining_data) and a sentiment task."""
    import random

    from bertjax import tokenization
    from data_pipeline import create_pretraining_data as cpd

    words = sorted({w for line in WORDS for w in line.split()} | {"good", "bad", "."})
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    r = random.Random(0)
    corpus = root / "corpus.txt"
    corpus.write_text("".join("".join(r.choice(WORDS) + " .\n" for _ in range(6)) + "\n"
                              for _ in range(40)))
    cfg = cpd.CreateConfig(input=str(corpus), output_dir=str(root / "pairs"),
                           max_seq_length=32, max_predictions_per_seq=5, dupe_factor=1)
    cpd.create_pretraining_data(
        cfg, functools.partial(tokenization.load_tokenizer, str(vocab), do_lower_case=True))
    for split, n in (("train", 48), ("dev", 24)):
        with open(root / f"{split}.jsonl", "w") as f:
            for i in range(n):
                good = i % 2
                f.write(json.dumps({"text": f"{r.choice(WORDS)} {'good' if good else 'bad'}",
                                    "label": good}) + "\n")
    return {"pretrain.vocab": str(vocab),
            "pretrain.phases.phase1.data": str(root / "pairs" / "*.tfrecord"),
            "pretrain.phases.phase1.eval_data": str(root / "pairs" / "*.tfrecord"),
            "tasks.rotten_tomatoes.config.data.train": str(root / "train.jsonl"),
            "tasks.rotten_tomatoes.config.data.validation": str(root / "dev.jsonl"),
            "tasks.rotten_tomatoes.config.data.test": ""}

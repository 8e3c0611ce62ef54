"""The keyword classification task of the fine-tuning tests ("good" → 1, "bad" → 0 among
filler words, conftest's KEYWORD_VOCAB): the module-scoped `checkpoint` fixture (a tiny random
BERT with that vocabulary; a test module takes it with `checkpoint = finetune_task.checkpoint`),
its JSONL splits (write_task), the `python -m bertjax.finetune` arguments of a run on them
(finetune_args), and what a run leaves (train_losses, outputs)."""

import json
import os
import random

import pytest
from conftest import KEYWORD_VOCAB, filler_sentence, write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), KEYWORD_VOCAB)


def write_task(directory):
    """A binary JSONL task: "good" → 1, "bad" → 0; train, dev and test splits."""
    rng = random.Random(5)
    for name, n in (("train", 96), ("dev", 32), ("test", 24)):
        with open(directory / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                y = rng.random() < 0.5
                f.write(json.dumps({"text": filler_sentence(rng, "good" if y else "bad"),
                                    "label": int(y)}) + "\n")


def finetune_args(checkpoint, data, workdir, epochs=3, every=2):
    return ["-m", "bertjax.finetune", "--config=experiments/finetune_files.py:classification",
            f"--workdir={workdir}", f"--config.init_checkpoint={checkpoint}",
            f"--config.data.train={data}/train.jsonl", f"--config.data.validation={data}/dev.jsonl",
            f"--config.data.test={data}/test.jsonl", "--config.max_seq_length=32",
            "--config.min_bucket_length=32", "--config.train.batch_size=16",
            f"--config.train.num_epochs={epochs}", "--config.optimizer.learning_rate=1e-3",
            "--config.log_every_steps=1", f"--config.checkpoint.every_steps={every}",
            "--config.checkpoint.max_to_keep=2", "--config.eval.every_steps=5",
            "--config.eval.batch_size=16"]


def train_losses(workdir):
    """step → loss, the last record of each step winning (a resumed run repeats steps)."""
    out = {}
    for line in open(os.path.join(workdir, "metrics.jsonl")):
        record = json.loads(line)
        if record["split"] == "train":
            out[record["step"]] = record["loss"]
    return out


def outputs(workdir):
    results = json.loads(open(os.path.join(workdir, "results.json")).read())
    predictions = open(os.path.join(workdir, "submission", "test.tsv")).read()
    return results, predictions

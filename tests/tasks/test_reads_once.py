"""Before step 0 a fine-tuning run reads each of its files once: the init checkpoint's
config.json and vocabulary (the checks hand what they read to the job) and the training file
(the labels are inferred from the rows the examples are made of)."""

import collections
import json
import os
import random
import sys

import pytest
from conftest import KEYWORD_VOCAB, filler_sentence, write_tiny_checkpoint

from bertjax import cli, tasks

_OPENED: list[str] | None = None


def _count_opens(event, args):
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, os.PathLike)):
        _OPENED.append(os.fspath(args[0]))


sys.addaudithook(_count_opens)  # audit hooks stay for the process: it counts only when asked


@pytest.fixture
def opened():
    global _OPENED
    _OPENED = []
    yield _OPENED
    _OPENED = None


def test_each_file_is_read_once_before_step_0(tmp_path, monkeypatch, opened):
    checkpoint = write_tiny_checkpoint(tmp_path, KEYWORD_VOCAB)
    rng = random.Random(0)
    for split, n in (("train", 16), ("dev", 8)):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            for i in range(n):
                keyword = "good" if i % 2 else "bad"
                f.write(json.dumps({"text": filler_sentence(rng, keyword), "label": keyword})
                        + "\n")
    config = cli.load_config("experiments/finetune_files.py:classification")
    config.update_from_flattened_dict({
        "init_checkpoint": checkpoint, "data.train": str(tmp_path / "train.jsonl"),
        "data.validation": str(tmp_path / "dev.jsonl"), "data.text_a": "text",
        "max_seq_length": 32, "train.batch_size": 4})
    monkeypatch.setattr(tasks.loop, "train", lambda job, *args, **kwargs: job)
    opened.clear()
    job = tasks.train_and_evaluate(config, str(tmp_path / "run"))
    assert job.task.label_names == ("bad", "good")  # the labels, from the single read
    reads = collections.Counter(os.path.relpath(p, tmp_path) for p in opened
                                if p.startswith(str(tmp_path)))
    for name in ("ckpt/config.json", "ckpt/vocab.txt", "train.jsonl", "dev.jsonl"):
        assert reads[name] == 1, (name, reads)

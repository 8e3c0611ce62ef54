"""Fine-tuning end to end on CPU: a tiny random bertjax checkpoint (tests/finetune_task.py's,
written with save_pretrained) learns small generated separable tasks — GLUE-layout
classification through `python -m bertjax.finetune`, regression and multiple choice from users'
files in-process."""

import csv
import json
import os
import random

import finetune_task
import numpy as np
import pytest
from conftest import filler_sentence, run_python

checkpoint = finetune_task.checkpoint  # the module-scoped tiny-checkpoint fixture


@pytest.mark.slow
def test_glue_sst2_layout_cli(checkpoint, tmp_path):
    rng = random.Random(0)
    task_dir = tmp_path / "glue_data" / "SST-2"
    task_dir.mkdir(parents=True)
    dev_labels = []
    for name, n in (("train", 384), ("dev", 128)):
        labels = [int(rng.random() < 0.4) for _ in range(n)]  # 60/40: majority class = 0
        dev_labels = labels
        rows = "".join(f"{filler_sentence(rng, 'good' if y else 'bad')}\t{y}\n" for y in labels)
        (task_dir / f"{name}.tsv").write_text("sentence\tlabel\n" + rows)
    test_labels = [i % 3 == 0 for i in range(30)]
    (task_dir / "test.tsv").write_text("index\tsentence\n" + "".join(
        f"{i}\t{filler_sentence(rng, 'good' if y else 'bad')}\n"
        for i, y in enumerate(test_labels)))
    workdir = tmp_path / "run"
    result = run_python([
        "-m", "bertjax.finetune", "--config=experiments/glue.py:sst2",
        f"--config.init_checkpoint={checkpoint}", f"--workdir={workdir}",
        f"--config.data.dir={tmp_path / 'glue_data'}", "--config.train.batch_size=16",
        "--config.train.num_epochs=4", "--config.optimizer.learning_rate=1e-3",
        # A few dozen steps, set for the reference's uncorrected Adam (larger early steps).
        "--config.optimizer.name=bert_adamw", "--config.optimizer.schedule=reference",
        "--config.max_seq_length=32", "--config.log_every_steps=24",
    ], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "best accuracy" in result.stdout
    evals = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    evals = [r for r in evals if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [24, 48, 72, 96]  # every epoch
    majority = max(np.mean(dev_labels), 1 - np.mean(dev_labels))
    results = json.loads((workdir / "results.json").read_text())
    best = max(evals, key=lambda r: r["accuracy"])
    assert results["best"]["accuracy"] == best["accuracy"] >= 0.95 > majority
    # Kept: the best dev accuracy's checkpoint and the last one (max_to_keep=1), no other.
    kept = sorted(int(p) for p in os.listdir(workdir / "checkpoints") if p.isdigit())
    assert kept == sorted({results["best_step"], 96})
    assert next(r for r in evals if r["step"] == results["best_step"])["accuracy"] == best[
        "accuracy"]
    with open(workdir / "submission" / "SST-2.tsv") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    assert rows[0] == ["index", "prediction"]
    assert [r[0] for r in rows[1:]] == [str(i) for i in range(30)]
    predicted = np.array([int(r[1]) for r in rows[1:]])
    assert np.mean(predicted == np.array(test_labels, int)) >= 0.9


def _files_config(kind, checkpoint, tmp_path, **data):
    from experiments.finetune_files import get_config

    config = get_config(kind)
    config.init_checkpoint = checkpoint
    config.max_seq_length = 32
    config.train.batch_size = 16
    config.optimizer.learning_rate = 1e-3
    # A few dozen steps, set for the reference's uncorrected Adam (larger early steps).
    config.optimizer.name, config.optimizer.schedule = "bert_adamw", "reference"
    config.log_every_steps = 1000
    config.eval.batch_size = 32
    config.min_bucket_length = 32  # one bucket: fewer compiles (the CLI test covers bucketing)
    for key, value in data.items():
        config.data[key] = value
    return config


@pytest.mark.slow
def test_regression_from_jsonl_reaches_pearson_09(checkpoint, tmp_path):
    from bertjax.tasks import train_and_evaluate

    rng = random.Random(1)
    for name, n in (("train", 320), ("dev", 96)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                count = rng.randint(0, 3)  # the score is the number of "good"s
                text = filler_sentence(rng, "good", count)
                f.write(json.dumps({"text": text, "score": count + rng.uniform(-0.2, 0.2)})
                        + "\n")
    config = _files_config("regression", checkpoint, tmp_path, train=str(tmp_path /
                           "train.jsonl"), validation=str(tmp_path / "dev.jsonl"), label="score")
    config.train.num_epochs = 6
    config.eval.every_steps = 60  # every 3 epochs of 20 steps
    summary = train_and_evaluate(config, str(tmp_path / "run"), log=lambda *_: None)
    print("regression dev", summary["best"])
    assert summary["primary_metric"] == "pearson"
    assert summary["best"]["pearson"] >= 0.9


@pytest.mark.slow
def test_multiple_choice_from_csv_far_above_chance(checkpoint, tmp_path):
    from bertjax.tasks import train_and_evaluate

    rng = random.Random(2)
    for name, n in (("train", 192), ("dev", 64), ("test", 16)):
        with open(tmp_path / f"{name}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["context", "a", "b", "c", "d", "answer"])
            for _ in range(n):
                answer = rng.randrange(4)  # the right ending is the one with "good"
                endings = [filler_sentence(rng, "good" if i == answer else "bad") for i in range(4)]
                writer.writerow([filler_sentence(rng), *endings, answer])
    config = _files_config(
        "multiple_choice", checkpoint, tmp_path, train=str(tmp_path / "train.csv"),
        validation=str(tmp_path / "dev.csv"), test=str(tmp_path / "test.csv"),
        text_a="context", choices="a,b,c,d", label="answer")
    config.train.num_epochs = 4
    config.eval.every_steps = 24  # every 2 epochs of 12 steps
    workdir = tmp_path / "run"
    summary = train_and_evaluate(config, str(workdir), log=lambda *_: None)
    print("multiple choice dev", summary["best"])
    assert summary["best"]["accuracy"] >= 0.7  # chance is 0.25
    with open(workdir / "submission" / "test.tsv") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    assert len(rows) == 17 and all(r[1] in "0123" for r in rows[1:])


def test_missing_checkpoint_is_one_line_error(tmp_path):
    from bertjax.errors import ConfigError
    from bertjax.tasks import train_and_evaluate
    from experiments.glue import get_config

    config = get_config("rte")
    config.data.dir = str(tmp_path)
    with pytest.raises(ConfigError, match="config.init_checkpoint is empty"):
        train_and_evaluate(config, str(tmp_path / "run"))

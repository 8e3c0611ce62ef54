"""SQuAD end to end on CPU: a tiny random checkpoint learns a generated extractive QA set (the
answer is the context's one run of name words, in contexts longer than a window) through
`python -m bertjax.finetune --config=experiments/squad.py:v1`, and a v2.0-style set whose
unanswerable questions have no name run learns to abstain; the prediction files are in the
official layouts."""

import json

import pytest
from conftest import run_python, write_tiny_checkpoint
from convert_cli import convert_main
from squad_data import VOCAB, generate


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qa"), VOCAB)


@pytest.mark.slow
def test_squad_v1_cli_learns_and_writes_files(checkpoint, tmp_path):
    train = generate(tmp_path / "train.json", 500, seed=1)
    dev = generate(tmp_path / "dev.json", 120, seed=2)
    workdir = tmp_path / "run"
    result = run_python([
        "-m", "bertjax.finetune", "--config=experiments/squad.py:v1",
        f"--config.init_checkpoint={checkpoint}", f"--workdir={workdir}",
        f"--config.data.train={train}", f"--config.data.validation={dev}",
        f"--config.data.test={dev}", "--config.max_seq_length=64",
        "--config.task.doc_stride=16", "--config.task.max_query_length=10",
        "--config.train.batch_size=32", "--config.train.num_epochs=3",
        "--config.optimizer.learning_rate=1e-3", "--config.log_every_steps=1000",
        "--config.model.hidden_dropout_prob=0.0", "--config.model.attention_dropout_prob=0.0",
    ], timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((workdir / "results.json").read_text())
    print("squad v1 dev", results["best"])
    assert results["primary_metric"] == "f1"
    assert results["best"]["f1"] >= 90.0 and results["best"]["exact_match"] >= 80.0
    predictions = json.loads((workdir / "predictions.json").read_text())
    nbest = json.loads((workdir / "nbest_predictions.json").read_text())
    dev_data = json.loads(open(dev).read())
    ids = [qa["id"] for p in dev_data["data"][0]["paragraphs"] for qa in p["qas"]]
    assert sorted(predictions) == sorted(ids) == sorted(nbest)
    assert all(isinstance(v, str) for v in predictions.values())
    for qid in ids[:10]:
        entries = nbest[qid]
        assert 1 <= len(entries) <= 20 and entries[0]["text"] == predictions[qid]
        assert set(entries[0]) == {"text", "probability", "start_logit", "end_logit"}
        assert abs(sum(e["probability"] for e in entries) - 1.0) < 1e-6
    # Predictions are recomputed from the best checkpoint: they score its dev F1.
    from bertjax.tasks.squad import metrics as squad_metrics
    golds = {qa["id"]: [a["text"] for a in qa["answers"]]
             for p in dev_data["data"][0]["paragraphs"] for qa in p["qas"]}
    assert squad_metrics.evaluate(predictions, golds)["f1"] == pytest.approx(
        results["best"]["f1"])
    assert (workdir / "test_predictions.json").exists()
    assert not (workdir / "null_odds.json").exists()


@pytest.mark.slow
@pytest.mark.extended
def test_squad_v2_learns_to_abstain(checkpoint, tmp_path):
    from bertjax.tasks import train_and_evaluate
    from experiments.squad import get_config

    config = get_config("v2")
    config.init_checkpoint = checkpoint
    config.data.train = generate(tmp_path / "train.json", 500, seed=3, impossible_rate=0.4)
    config.data.validation = generate(tmp_path / "dev.json", 120, seed=4, impossible_rate=0.4)
    config.data.test = config.data.validation  # the dev-chosen threshold applies to test
    config.max_seq_length = 64
    config.task.doc_stride, config.task.max_query_length = 16, 10
    config.train.batch_size, config.train.num_epochs = 32, 3
    config.optimizer.learning_rate = 1e-3
    # A few dozen steps, set for the reference's uncorrected Adam (larger early steps).
    config.optimizer.name, config.optimizer.schedule = "bert_adamw", "reference"
    config.model.hidden_dropout_prob = config.model.attention_dropout_prob = 0.0
    config.log_every_steps = 1000
    logs = []
    summary = train_and_evaluate(config, str(tmp_path / "run"), log=logs.append)
    best = summary["best"]
    print("squad v2 dev", best)
    assert summary["primary_metric"] == "best_f1"
    assert best["best_f1"] >= 90.0
    assert best["NoAns_f1"] >= 80.0 and best["HasAns_f1"] >= 80.0
    null_odds = json.loads((tmp_path / "run" / "null_odds.json").read_text())
    predictions = json.loads((tmp_path / "run" / "predictions.json").read_text())
    assert sorted(null_odds) == sorted(predictions)
    assert any(v == "" for v in predictions.values())
    assert any("null threshold" in str(line) for line in logs)
    test = json.loads((tmp_path / "run" / "test_predictions.json").read_text())
    assert test == predictions
    assert json.loads((tmp_path / "run" / "test_null_odds.json").read_text()) == null_odds
    # Exported to transformers, the model keeps the dev-chosen threshold: applied to the null
    # odds it gives the run's predictions ("" where the null answer wins).
    convert_main(["to_hf", "--input", tmp_path / "run", "--output", tmp_path / "hf"])
    threshold = json.loads((tmp_path / "hf" / "config.json").read_text())[
        "null_score_diff_threshold"]
    assert threshold == best["best_f1_thresh"]
    assert {q for q, odds in null_odds.items() if odds > threshold} == {
        q for q, text in predictions.items() if text == ""}


def test_bad_file_is_one_line_and_nothing_written(checkpoint, tmp_path):
    train = generate(tmp_path / "train.json", 20, seed=5)
    data = json.loads(open(train).read())
    qa = data["data"][0]["paragraphs"][3]["qas"][1]
    qa["answers"][0]["answer_start"] += 1
    (tmp_path / "bad.json").write_text(json.dumps(data))
    workdir = tmp_path / "run"
    result = run_python([
        "-m", "bertjax.finetune", "--config=experiments/squad.py:v1",
        f"--config.init_checkpoint={checkpoint}", f"--workdir={workdir}",
        f"--config.data.train={tmp_path / 'bad.json'}", f"--config.data.validation={train}",
        "--config.max_seq_length=64", "--config.task.doc_stride=16",
        "--config.task.max_query_length=10",
    ], timeout=120)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert errors[0].startswith(f"error: {tmp_path / 'bad.json'}: question {qa['id']}: answer ")
    assert "does not match the context at answer_start=" in errors[0]
    assert not workdir.exists()

"""A fine-tuning workdir written as a Hugging Face model (`python -m bertjax.convert to_hf
--input=WORKDIR`): transformers loads it as the task's class, with the run's label names, and
its logits equal bertjax's for the best checkpoint (1e-4); its tokenizer gives bertjax's ids."""

import csv
import json
import random

import numpy as np
import pytest
import tagging_data as td
from conftest import KEYWORD_VOCAB, filler_sentence, write_tiny_checkpoint
from convert_cli import convert_main

from bertjax.train.checkpoints import read_params


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), KEYWORD_VOCAB)



def finetune(config, checkpoint, workdir, **data):
    from bertjax.tasks import train_and_evaluate

    config.init_checkpoint = checkpoint
    config.max_seq_length = 32
    config.min_bucket_length = 32
    config.train.batch_size = 16
    config.optimizer.learning_rate = 1e-3
    config.log_every_steps = 1000
    config.checkpoint.async_save = False
    config.data.update(data)
    return train_and_evaluate(config, str(workdir), log=lambda *_: None)


def export(workdir, out, *extra):
    convert_main(["to_hf", "--input", workdir, "--output", out, *extra])
    return json.loads((out / "config.json").read_text())


def torch_batch(ids, mask, segments):
    import torch

    return dict(input_ids=torch.tensor(np.asarray(ids), dtype=torch.long),
                attention_mask=torch.tensor(np.asarray(mask), dtype=torch.long),
                token_type_ids=torch.tensor(np.asarray(segments), dtype=torch.long))


def bertjax_logits(workdir, model, *inputs):
    best = json.loads((workdir / "results.json").read_text())["best_step"]
    return np.asarray(model.apply({"params": read_params(str(workdir), best)}, *inputs))


@pytest.mark.slow
@pytest.mark.extended
def test_classification_run_is_a_transformers_classifier_with_its_labels(checkpoint, tmp_path):
    import torch
    import transformers

    from bertjax.checkpoint_dir import load_pretrained
    from bertjax.models.classification import BertForSequenceClassification
    from experiments.finetune_files import get_config

    rng = random.Random(0)
    for name, n in (("train", 384), ("dev", 64)):
        with open(tmp_path / f"{name}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            for _ in range(n):
                label = rng.choice(["pos", "neg"])
                writer.writerow([filler_sentence(rng, "good" if label == "pos" else "bad"), label])
    workdir = tmp_path / "run"
    config = get_config("classification")
    config.train.num_epochs = 4
    summary = finetune(config, checkpoint, workdir, train=str(tmp_path / "train.csv"),
                       validation=str(tmp_path / "dev.csv"), labels="neg,pos")
    assert summary["best"]["accuracy"] >= 0.8  # a trained head, not the initial one

    out = tmp_path / "hf"
    hf_config = export(workdir, out)
    assert hf_config["architectures"] == ["BertForSequenceClassification"]
    assert hf_config["id2label"] == {"0": "neg", "1": "pos"}
    assert hf_config["problem_type"] == "single_label_classification"
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    with open(tmp_path / "dev.csv") as f:
        dev = list(csv.DictReader(f))
    encoded = tokenizer([row["text"] for row in dev], padding=True, return_tensors="np")
    ours_tokenizer = load_pretrained(checkpoint)[2]
    for row, ids in zip(dev[:8], encoded["input_ids"]):
        ours = ours_tokenizer.encode(row["text"])
        expected = [i for i, m in zip(ours.input_ids, ours.input_mask) if m]
        assert ids[:len(expected)].tolist() == expected
    with torch.no_grad():
        theirs = hf(**torch_batch(encoded["input_ids"], encoded["attention_mask"],
                                  encoded["token_type_ids"])).logits.numpy()
    model_config = load_pretrained(checkpoint)[0]
    ours = bertjax_logits(workdir, BertForSequenceClassification(model_config, 2),
                          encoded["input_ids"], encoded["token_type_ids"],
                          encoded["attention_mask"])
    np.testing.assert_allclose(theirs, ours, atol=1e-4)
    predicted = [hf.config.id2label[int(i)] for i in theirs.argmax(-1)]
    accuracy = np.mean([p == row["label"] for p, row in zip(predicted, dev)])
    assert accuracy == pytest.approx(summary["best"]["accuracy"], abs=1.5 / len(dev))

    # --architecture=BertModel: the fine-tuned encoder alone.
    encoder_config = export(workdir, tmp_path / "encoder", "--architecture=BertModel")
    assert encoder_config["architectures"] == ["BertModel"]
    encoder = transformers.BertModel.from_pretrained(str(tmp_path / "encoder")).eval()
    with torch.no_grad():
        pooled = encoder(**torch_batch(encoded["input_ids"], encoded["attention_mask"],
                                       encoded["token_type_ids"])).pooler_output.numpy()
    np.testing.assert_allclose(pooled @ hf.classifier.weight.detach().numpy().T
                               + hf.classifier.bias.detach().numpy(), theirs, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["regression", "multiple_choice"])
@pytest.mark.extended
def test_regression_and_multiple_choice_runs_match_transformers(checkpoint, tmp_path, kind):
    import torch
    import transformers

    from bertjax.checkpoint_dir import load_pretrained
    from bertjax.tasks import BertForMultipleChoice, BertForSequenceClassification
    from experiments.finetune_files import get_config

    rng = random.Random(1)
    for name, n in (("train", 64), ("dev", 32)):
        with open(tmp_path / f"{name}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "a", "b", "label"])
            for _ in range(n):
                label = rng.randrange(2)
                good, bad = ("good", "bad") if label == 0 else ("bad", "good")
                writer.writerow([filler_sentence(rng), filler_sentence(rng, good),
                                 filler_sentence(rng, bad),
                                 label if kind == "multiple_choice" else rng.uniform(0, 5)])
    config = get_config(kind)
    config.train.num_epochs = 1
    workdir = tmp_path / "run"
    data = dict(choices="a,b") if kind == "multiple_choice" else {}
    finetune(config, checkpoint, workdir, train=str(tmp_path / "train.csv"),
             validation=str(tmp_path / "dev.csv"), **data)
    hf_config = export(workdir, tmp_path / "hf")
    model_config = load_pretrained(checkpoint)[0]
    ids = np.random.default_rng(0).integers(5, len(KEYWORD_VOCAB), (3, 2, 12)).astype(np.int32)
    mask, segments = np.ones_like(ids), np.zeros_like(ids)
    mask[1, :, 8:] = 0
    segments[:, :, 6:] = 1
    if kind == "regression":
        assert hf_config["problem_type"] == "regression"
        hf = transformers.BertForSequenceClassification.from_pretrained(str(tmp_path / "hf"))
        assert hf.config.num_labels == 1
        ids, mask, segments = ids[:, 0], mask[:, 0], segments[:, 0]
        model = BertForSequenceClassification(model_config, 1)
    else:
        assert hf_config["architectures"] == ["BertForMultipleChoice"]
        hf = transformers.BertForMultipleChoice.from_pretrained(str(tmp_path / "hf"))
        model = BertForMultipleChoice(model_config)
    with torch.no_grad():
        theirs = hf.eval()(**torch_batch(ids, mask, segments)).logits.numpy()
    ours = bertjax_logits(workdir, model, ids, segments, mask)
    np.testing.assert_allclose(theirs, ours, atol=1e-4)


@pytest.mark.slow
@pytest.mark.extended
def test_token_classification_run_keeps_its_tags(tmp_path):
    import torch
    import transformers

    from bertjax.checkpoint_dir import load_pretrained
    from bertjax.models.tagging import BertForTokenClassification
    from experiments.ner import get_config

    checkpoint = td.write_checkpoint(tmp_path)
    for name, seed, n in (("eng.train", 0, 96), ("eng.testa", 1, 32), ("eng.testb", 2, 8)):
        td.write_conll(tmp_path / name, td.dataset(seed, n))
    config = get_config("conll2003")
    config.data.scheme = "iob2"
    config.train.num_epochs = 1
    workdir = tmp_path / "run"
    finetune(config, checkpoint, workdir, dir=str(tmp_path))
    hf_config = export(workdir, tmp_path / "hf")
    labels = ["O", *(f"{p}-{t}" for t in td.TYPES for p in "BI")]
    assert sorted(hf_config["id2label"].values()) == sorted(labels)
    assert len(hf_config["id2label"]) == len(labels)
    hf = transformers.BertForTokenClassification.from_pretrained(str(tmp_path / "hf")).eval()
    ids = np.random.default_rng(0).integers(5, len(td.VOCAB), (2, 10)).astype(np.int32)
    mask, segments = np.ones_like(ids), np.zeros_like(ids)
    with torch.no_grad():
        theirs = hf(**torch_batch(ids, mask, segments)).logits.numpy()
    model = BertForTokenClassification(load_pretrained(checkpoint)[0], len(labels))
    np.testing.assert_allclose(theirs, bertjax_logits(workdir, model, ids, segments, mask),
                               atol=1e-4)


@pytest.mark.slow
@pytest.mark.extended
def test_runs_without_a_transformers_class_or_not_finished_are_one_line(checkpoint, tmp_path):
    from experiments.finetune_files import get_config

    with open(tmp_path / "train.csv", "w") as f:
        f.write("text,label\n" + "".join(f"{filler_sentence(random.Random(i), 'good')},{i % 2}\n"
                                          for i in range(32)))
    config = get_config("classification")
    config.task.bilstm_units = 4
    config.train.num_epochs = 1
    workdir = tmp_path / "run"
    finetune(config, checkpoint, workdir, train=str(tmp_path / "train.csv"),
             validation=str(tmp_path / "train.csv"))
    with pytest.raises(SystemExit, match=r"^error: --input .*run: the \+ BiLSTM head "):
        export(workdir, tmp_path / "hf")
    (workdir / "export.json").unlink()
    with pytest.raises(SystemExit, match=r"no export.json: the fine-tuning run has not finished"):
        export(workdir, tmp_path / "hf")
    with pytest.raises(SystemExit, match="^error: --architecture=BertForMaskedLM: a "):
        (workdir / "export.json").write_text(json.dumps(
            {"architecture": "BertForSequenceClassification"}))
        export(workdir, tmp_path / "hf", "--architecture=BertForMaskedLM")
    assert not (tmp_path / "hf").exists()

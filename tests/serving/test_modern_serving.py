"""Serving a ModernBERT: fill-mask is transformers' ModernBertForMaskedLM (its top-k the argmax
of that model's logits, computed directly), extract_features gives transformers' hidden states
(its last layer ModernBertModel's output), and `python -m bertjax.predict` / `Predictor`
predict every fine-tuned family as the run itself scored it."""

import json
import random

import numpy as np
import pytest
import squad_data
import tagging_data as td
from conftest import filler_sentence, run_python
from convert_cli import convert_main
from modern_checkpoint import write_hf_modern, write_modern_checkpoint

from bertjax import checkpoint_dir
from bertjax.serving.extraction import parse_line, run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXTS = ["filler1 [MASK] filler2 good", "[MASK] filler3 [MASK] " + "filler4 " * 12 + "bad"]
LINES = ["filler3 good filler7 filler1", "bad filler2 ||| filler9 good",
         "filler4 " * 40,  # past max_seq_length: truncated
         ""]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A random transformers ModernBertForMaskedLM and its bertjax checkpoint directory."""
    root = tmp_path_factory.mktemp("modern_hf")
    model = write_hf_modern(root / "hf")
    convert_main(["from_hf", "--input", root / "hf", "--output", root / "ckpt"])
    return model, root / "ckpt"


def test_fill_mask_top_k_is_the_argmax_of_transformers_logits(converted):
    from bertjax import FillMask

    model, ckpt = converted
    fill = FillMask.from_checkpoint(str(ckpt), max_seq_length=32, batch_size=2)
    ours = fill(TEXTS, top_k=3)
    tokenizer = checkpoint_dir.load_pretrained(ckpt)[2]
    for text, masks in zip(TEXTS, ours):
        enc = tokenizer.encode(text, max_seq_length=32)
        assert [m["position"] for m in masks] == [
            i for i, t in enumerate(enc.input_ids) if t == tokenizer.mask_id]
        real = enc.input_ids[:sum(enc.input_mask)]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([real])).logits[0].numpy()
        probabilities = np.exp(logits - logits.max(-1, keepdims=True))
        probabilities /= probabilities.sum(-1, keepdims=True)
        for mask in masks:
            reference = logits[mask["position"]]
            ranked = [i for i in np.argsort(-reference) if i not in tokenizer.special_ids][:3]
            assert [c["token"] for c in mask["candidates"]] == tokenizer.convert_ids_to_tokens(
                ranked)
            for c, i in zip(mask["candidates"], ranked):
                assert abs(c["probability"] - probabilities[mask["position"], i]) < 1e-5


def test_extract_features_are_transformers_hidden_states(converted, tmp_path):
    model, ckpt = converted
    (tmp_path / "in.txt").write_text("\n".join(LINES) + "\n")
    num_layers = model.config.num_hidden_layers
    layers = "-1," + ",".join(str(i) for i in range(num_layers - 1))
    assert run(str(ckpt), str(tmp_path / "in.txt"), str(tmp_path / "out.jsonl"), layers=layers,
               max_seq_length=16, batch_size=2) == len(LINES)
    examples = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    tokenizer = checkpoint_dir.load_pretrained(ckpt)[2]
    for line, example in zip(LINES, examples):
        enc = tokenizer.encode(*parse_line(line), max_seq_length=16)
        n = sum(enc.input_mask)
        assert [f["token"] for f in example["features"]] == enc.tokens[:n]
        with torch.no_grad():
            out = model.model(input_ids=torch.tensor([enc.input_ids[:n]]),
                              output_hidden_states=True)
        # The last layer is ModernBertModel's output; layer i is transformers' hidden_states
        # [i + 1] (hidden_states[0]: the embeddings').
        want = {-1: out.last_hidden_state[0].numpy(),
                **{i: out.hidden_states[i + 1][0].numpy() for i in range(num_layers - 1)}}
        np.testing.assert_array_equal(out.hidden_states[-1][0].numpy(), want[-1])
        for position, feature in enumerate(example["features"]):
            for layer in feature["layers"]:
                np.testing.assert_allclose(layer["values"], want[layer["index"]][position],
                                           atol=2e-5)


def test_embedder_of_a_checkpoint_mean_pools_transformers_hidden_states(converted):
    from bertjax.serving.embedder import Embedder

    model, ckpt = converted
    texts = [parse_line(line)[0] for line in LINES[:3]]
    ours = Embedder.from_checkpoint(str(ckpt), max_seq_length=16)(texts)
    tokenizer = checkpoint_dir.load_pretrained(ckpt)[2]
    for text, vector in zip(texts, ours):
        enc = tokenizer.encode(text, max_seq_length=16)
        with torch.no_grad():
            hidden = model.model(input_ids=torch.tensor([enc.input_ids[:sum(enc.input_mask)]])
                                 ).last_hidden_state[0].numpy()
        np.testing.assert_allclose(vector, hidden.mean(0), atol=1e-5)


@pytest.mark.slow
def test_fill_mask_and_extract_features_commands(converted, tmp_path):
    _, ckpt = converted
    result = run_python(["-m", "bertjax.predict", "fill_mask", f"--checkpoint={ckpt}",
                         "--top_k=2", TEXTS[0]])
    assert result.returncode == 0, result.stderr[-2000:]
    from bertjax import FillMask

    best = FillMask.from_checkpoint(str(ckpt), max_seq_length=128)(TEXTS[0], top_k=1)[0]
    assert result.stdout.splitlines()[1].startswith(
        "  [MASK] at token 2: " + best["candidates"][0]["word"])
    (tmp_path / "in.txt").write_text("\n".join(LINES) + "\n")
    result = run_python(["-m", "bertjax.extract_features", f"--checkpoint={ckpt}",
                         f"--input_file={tmp_path / 'in.txt'}", "--layers=-1",
                         f"--output_file={tmp_path / 'cli.jsonl'}", "--max_seq_length=16",
                         "--batch_size=2", "--cpu_devices=1"])
    assert result.returncode == 0, result.stderr[-2000:]
    run(str(ckpt), str(tmp_path / "in.txt"), str(tmp_path / "api.jsonl"), layers="-1",
        max_seq_length=16, batch_size=2)
    assert (tmp_path / "cli.jsonl").read_text() == (tmp_path / "api.jsonl").read_text()


# ----------------------------------------------------------------------- fine-tuned runs


def _train(config, checkpoint, workdir):
    from bertjax.tasks import train_and_evaluate

    config.init_checkpoint = checkpoint
    config.max_seq_length = 32 if config.task.family != "squad" else 64
    config.min_bucket_length = 16
    config.train.batch_size, config.eval.batch_size = 16, 8
    config.train.num_epochs = 1
    config.optimizer.learning_rate = 1e-3
    config.log_every_steps = 1000
    return train_and_evaluate(config, str(workdir), log=lambda *_: None)


@pytest.mark.slow
def test_predict_every_fine_tuned_family_as_the_run_scored_it(tmp_path):
    """For each family: the predictor's metrics on the dev file are the run's best dev
    metrics (the same batches, the same compiled function, the same params), and the
    command writes what the Python API gives."""
    from bertjax import Predictor
    from experiments.finetune_files import get_config as files_config
    from experiments.ner import get_config as ner_config
    from experiments.squad import get_config as squad_config

    checkpoint = write_modern_checkpoint(tmp_path)
    rng = random.Random(4)
    runs = {}

    def jsonl(name, rows):
        with open(tmp_path / name, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        return str(tmp_path / name)

    dev = jsonl("cls.jsonl", [{"text": filler_sentence(rng, w), "label": w}
                              for w in ["good", "bad"] * 24])
    config = files_config("classification")
    config.data.train = config.data.validation = dev
    runs["classification"] = (config, dev)
    dev = jsonl("reg.jsonl", [{"text": filler_sentence(rng, "good", k % 3), "label": k % 3}
                              for k in range(48)])
    config = files_config("regression")
    config.data.train = config.data.validation = dev
    runs["regression"] = (config, dev)
    rows = []
    for _ in range(32):
        answer = rng.randrange(3)
        rows.append({"text": filler_sentence(rng), "label": answer, **{
            c: filler_sentence(rng, "good" if i == answer else "bad")
            for i, c in enumerate("abc")}})
    dev = jsonl("mc.jsonl", rows)
    config = files_config("multiple_choice")
    config.data.train = config.data.validation = dev
    config.data.choices = "a,b,c"
    runs["multiple_choice"] = (config, dev)
    td.write_conll(tmp_path / "ner.conll", td.dataset(1, 48), docs_every=4)
    config = ner_config("files")
    config.data.train = config.data.validation = str(tmp_path / "ner.conll")
    config.data.scheme, config.data.token_column = "iob2", 0
    runs["ner"] = (config, str(tmp_path / "ner.conll"))
    dev = squad_data.generate(tmp_path / "qa.json", 40, seed=1, impossible_rate=0.3)
    config = squad_config("v2")
    config.data.train = config.data.validation = dev
    config.task.doc_stride, config.task.max_query_length = 16, 10
    runs["squad"] = (config, dev)

    for name, (config, dev) in runs.items():
        summary = _train(config, checkpoint, tmp_path / name)
        predictor = Predictor.from_workdir(str(tmp_path / name))
        records, metrics = predictor.predict_file(dev)[1:]
        best = {k: v for k, v in summary["best"].items() if k != "epoch"}
        if name == "squad":  # the run's dev scores were taken before it chose the threshold
            best = {k: v for k, v in best.items() if k.startswith("best_")}
            metrics = {k: metrics[k] for k in best}
            written = json.loads((tmp_path / name / "predictions.json").read_text())
            assert {r["id"]: r["answer"] for r in records} == written
        assert metrics == pytest.approx(best, abs=1e-9), name
        out = tmp_path / f"{name}.out"
        if name in ("classification", "ner"):  # the command too
            suffix = ".conll" if name == "ner" else ".jsonl"
            out = out.with_suffix(suffix)
            result = run_python(["-m", "bertjax.predict", f"--workdir={tmp_path / name}",
                                 f"--input={dev}", f"--output={out}"])
            assert result.returncode == 0, (name, result.stderr[-3000:])
            if name == "classification":
                written = [json.loads(x) for x in out.read_text().splitlines()]
                assert [r["label"] for r in written] == [r["label"] for r in records]
            else:
                assert out.read_text() == (tmp_path / name / "predictions" /
                                           "dev.conll").read_text()

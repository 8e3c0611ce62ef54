"""Serving a ModernBERT: fill-mask is transformers' ModernBertForMaskedLM (its top-k the argmax
of that model's logits, computed directly), extract_features gives transformers' hidden states
(its last layer ModernBertModel's output); the Embedder of a checkpoint mean-pools
transformers' hidden states. (`Predictor` and `python -m bertjax.predict` on every fine-tuned
family's run: tests/tasks/test_modern_finetuning.py, on the runs trained there.)"""

import json

import numpy as np
import pytest
from conftest import run_python
from convert_cli import convert_main
from modern_checkpoint import write_hf_modern

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
    cli, api = ([json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
                for name in ("cli.jsonl", "api.jsonl"))
    _assert_same_records(cli, api)


def _assert_same_records(got, want, atol=1e-5):
    """JSON records equal: the same structure, keys and strings, numbers within atol (the
    command's process and this one may reduce in another order)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys()
        for key in want:
            _assert_same_records(got[key], want[key], atol)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for a, b in zip(got, want):
            _assert_same_records(a, b, atol)
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=atol)
    else:
        assert got == want

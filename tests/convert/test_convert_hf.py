"""from_hf / to_hf against transformers itself: checkpoints written here by transformers'
BertForPreTraining / BertModel / BertForMaskedLM on a tiny random config."""

import json

import numpy as np
import pytest
from convert_cli import convert_main
from safetensors.numpy import load_file, save_file

from bertjax import checkpoint_dir
from bertjax.models import BertForPreTraining, BertModel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

L, H, A, FFN, V, P = 2, 32, 4, 37, 100, 64
TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(V - 5)]


def hf_config(**overrides):
    return transformers.BertConfig(
        vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=A,
        intermediate_size=FFN, max_position_embeddings=P, hidden_act="gelu", **overrides)


def write_vocab(directory, tokens=TOKENS):
    (directory / "vocab.txt").write_text("".join(t + "\n" for t in tokens))


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(hf_config()).eval()
    with torch.no_grad():  # non-trivial biases and LayerNorm parameters too
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module")
def hf_dirs(hf_model, tmp_path_factory):
    """One directory per source layout, each written the way users get them."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {}

    def save(name, model):
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
        write_vocab(dirs[name])

    save("BertForPreTraining", hf_model)
    encoder = transformers.BertModel(hf_config()).eval()
    encoder.load_state_dict(hf_model.bert.state_dict())
    save("BertModel", encoder)
    masked_lm = transformers.BertForMaskedLM(hf_config()).eval()
    state = {k: v for k, v in hf_model.state_dict().items() if not k.startswith(
        ("bert.pooler", "cls.seq_relationship"))}
    masked_lm.load_state_dict(state, strict=False)
    save("BertForMaskedLM", masked_lm)
    # A BertModel whose keys carry the `bert.` prefix (as some exports have them).
    prefixed = root / "BertModel_prefixed"
    prefixed.mkdir()
    tensors = load_file(dirs["BertModel"] / "model.safetensors")
    save_file({f"bert.{k}": v for k, v in tensors.items()}, prefixed / "model.safetensors",
              metadata={"format": "pt"})
    (prefixed / "config.json").write_text((dirs["BertModel"] / "config.json").read_text())
    write_vocab(prefixed)
    dirs["BertModel_prefixed"] = prefixed
    # The legacy torch.save(state_dict) file: includes the tied decoder copies.
    legacy = root / "pytorch_bin"
    legacy.mkdir()
    torch.save(hf_model.state_dict(), legacy / "pytorch_model.bin")
    (legacy / "config.json").write_text((dirs["BertForPreTraining"] / "config.json").read_text())
    write_vocab(legacy)
    dirs["pytorch_bin"] = legacy
    # bfloat16 weights (NumPy has no name for the type; the round trip must still be exact).
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file as save_torch

    bf16 = root / "bfloat16"
    bf16.mkdir()
    state = load_torch(dirs["BertForPreTraining"] / "model.safetensors")
    save_torch({k: v.to(torch.bfloat16) for k, v in state.items()}, bf16 / "model.safetensors",
               metadata={"format": "pt"})
    (bf16 / "config.json").write_text((dirs["BertForPreTraining"] / "config.json").read_text())
    write_vocab(bf16)
    dirs["bfloat16"] = bf16
    return dirs


def convert(*args):
    convert_main([str(a) for a in args])


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("bertjax") / "ckpt"
    convert("from_hf", "--input", hf_dirs["BertForPreTraining"], "--output", out)
    return out


@pytest.mark.slow
def test_forward_matches_transformers(hf_model, converted):
    config = checkpoint_dir.load_config(converted)
    assert config.hidden_act == "gelu"  # HF "gelu" is the exact erf form
    params = checkpoint_dir.load_params(converted, config)
    r = np.random.default_rng(0)
    ids = r.integers(0, V, (3, 12)).astype(np.int64)
    segments = (np.arange(12)[None] >= np.array([[5], [7], [12]])).astype(np.int64)
    mask = (np.arange(12)[None] < np.array([[12], [9], [6]])).astype(np.int64)
    positions = np.array([[0, 4, 11], [1, 2, 8], [3, 4, 5]])
    with torch.no_grad():
        ref = hf_model(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(segments),
                       attention_mask=torch.tensor(mask), output_hidden_states=True)
        ref_pooled = hf_model.bert.pooler(ref.hidden_states[-1]).numpy()
    ref_seq = ref.hidden_states[-1].numpy()
    ref_mlm = np.take_along_axis(ref.prediction_logits.numpy(), positions[..., None], axis=1)
    ours = BertForPreTraining(config).apply({"params": params}, ids, segments, mask, positions)
    enc = BertModel(config).apply({"params": params["bert"]}, ids, segments, mask)
    real = mask.astype(bool)
    tol = dict(atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(enc["sequence_output"])[real], ref_seq[real], **tol)
    np.testing.assert_allclose(enc["pooled_output"], ref_pooled, **tol)
    np.testing.assert_allclose(ours["mlm_logits"], ref_mlm, **tol)
    np.testing.assert_allclose(ours["nsp_logits"], ref.seq_relationship_logits.numpy(), **tol)


def _source_tensors(directory):
    """name → (dtype name, shape, raw bytes), read with torch (independent of our reader)."""
    if (directory / "model.safetensors").exists():
        from safetensors.torch import load_file as load_torch

        state = load_torch(directory / "model.safetensors")
    else:
        state = torch.load(directory / "pytorch_model.bin", weights_only=True)
    return {k: (str(v.dtype), tuple(v.shape), v.contiguous().view(torch.uint8).numpy().tobytes())
            for k, v in state.items()}


@pytest.mark.parametrize("layout,architecture,initialised,dtype", [
    ("BertForPreTraining", "BertForPreTraining", [], "float32"),
    ("BertModel", "BertModel", ["mlm", "nsp"], "float32"),
    ("BertModel_prefixed", "BertModel", ["mlm", "nsp"], "float32"),
    ("BertForMaskedLM", "BertForMaskedLM", ["bert/pooler", "nsp"], "float32"),
    ("pytorch_bin", "BertForPreTraining", [], "float32"),
    ("bfloat16", "BertForPreTraining", [], "bfloat16"),
])
def test_from_hf_to_hf_round_trip_is_bitwise(hf_dirs, tmp_path, layout, architecture,
                                             initialised, dtype):
    src = hf_dirs[layout]
    convert("from_hf", "--input", src, "--output", tmp_path / "bj")
    report = json.loads((tmp_path / "bj" / "conversion.json").read_text())
    assert report["initialised"] == initialised
    convert("to_hf", "--input", tmp_path / "bj", "--output", tmp_path / "hf",
            "--architecture", architecture, "--dtype", dtype)
    original = _source_tensors(src)
    if layout == "BertModel_prefixed":  # BertModel is written with its own (unprefixed) keys
        original = {k.removeprefix("bert."): v for k, v in original.items()}
    tied = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
            "cls.predictions.decoder.bias": "cls.predictions.bias"}
    if layout == "pytorch_bin":  # tied copies: not written again, but they were equal
        assert sorted(report["skipped"]) == sorted(tied)
        for copy, source in tied.items():
            assert original.pop(copy) == original[source]
    exported = _source_tensors(tmp_path / "hf")
    assert sorted(exported) == sorted(original)
    for name, (value_dtype, shape, raw) in original.items():
        assert exported[name][:2] == (value_dtype, shape), name
        assert exported[name][2] == raw, name
    assert (tmp_path / "hf" / "vocab.txt").read_text() == (src / "vocab.txt").read_text()


def test_transformers_loads_to_hf_output(hf_dirs, converted, tmp_path):
    convert("to_hf", "--input", converted, "--output", tmp_path / "hf")
    loaded, info = transformers.BertForPreTraining.from_pretrained(
        tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # The reference is the source loaded the same way: a model built by from_pretrained can
    # differ in the last bit from the in-memory one it was saved from (transformers' own round
    # trip does: 4e-8 in the NSP logits, torch 2.13 on CPU).
    original = transformers.BertForPreTraining.from_pretrained(hf_dirs["BertForPreTraining"])
    ids = torch.tensor([[2, 17, 33, 4, 3, 50, 3]])
    with torch.no_grad():
        a, b = loaded.eval()(input_ids=ids), original.eval()(input_ids=ids)
    torch.testing.assert_close(a.prediction_logits, b.prediction_logits, rtol=0, atol=0)
    torch.testing.assert_close(a.seq_relationship_logits, b.seq_relationship_logits,
                               rtol=0, atol=0)
    tokenizer = transformers.BertTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.convert_tokens_to_ids(["[CLS]", "w7"]) == [2, 12]
    assert tokenizer.do_lower_case


def _mutated_copy(src, dst, mutate_tensors=None, mutate_config=None, vocab=TOKENS):
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    if mutate_tensors:
        mutate_tensors(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if mutate_config:
        mutate_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    write_vocab(dst, vocab)
    return dst


BAD_CASES = {
    "missing": (lambda t: t.pop("bert.encoder.layer.1.attention.self.key.bias"), None, TOKENS,
                "missing tensor bert.encoder.layer.1.attention.self.key.bias"),
    "shape": (lambda t: t.update({"bert.encoder.layer.0.output.dense.weight":
                                  np.zeros((H, FFN + 1), np.float32)}), None, TOKENS,
              "tensor bert.encoder.layer.0.output.dense.weight has shape (32, 38) but the "
              "config (vocab_size=100, hidden_size=32"),
    "config_vocab": (None, lambda c: c.update(vocab_size=V + 4), TOKENS,
                     "tensor bert.embeddings.word_embeddings.weight has shape (100, 32)"),
    "config_hidden": (None, lambda c: c.update(hidden_size=64), TOKENS,
                      "tensor bert.embeddings.word_embeddings.weight has shape (100, 32)"),
    "vocab_file": (None, None, TOKENS[:-3], "vocab.txt has 97 entries but "
                   "bert/embeddings/word_embeddings has 100 rows"),
    "untied_decoder": (lambda t: t.update({"cls.predictions.decoder.weight":
                                           np.zeros((V, H), np.float32)}), None, TOKENS,
                       "tensor cls.predictions.decoder.weight differs from "
                       "bert.embeddings.word_embeddings.weight"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_hf_checkpoint_fails_with_one_line_naming_the_tensor(hf_dirs, tmp_path, case):
    mutate_tensors, mutate_config, vocab, expected = BAD_CASES[case]
    src = _mutated_copy(hf_dirs["BertForPreTraining"], tmp_path / "src", mutate_tensors,
                        mutate_config, vocab)
    with pytest.raises(SystemExit) as exc:
        convert("from_hf", "--input", src, "--output", tmp_path / "out")
    message = str(exc.value)
    assert message.startswith("error: ") and "\n" not in message
    assert expected in message, message
    assert not (tmp_path / "out").exists()


def test_cli_entry_point_reports_the_tensor(hf_dirs, tmp_path):
    from conftest import run_python

    src = _mutated_copy(hf_dirs["BertModel"], tmp_path / "src",
                        lambda t: t.pop("encoder.layer.0.intermediate.dense.weight"))
    result = run_python(["-m", "bertjax.convert", "from_hf", "--input", str(src),
                         "--output", str(tmp_path / "out")], timeout=120)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == (f"error: --input {src}/model.safetensors: missing tensor "
                    "encoder.layer.0.intermediate.dense.weight")

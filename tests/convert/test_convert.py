"""The tensor table, the scan layout and the checkpoint directory API (save/load_pretrained)."""

import json

import flax
import jax
import numpy as np
import pytest
from convert_cli import convert_main

import bertjax
from bertjax import checkpoint_dir
from bertjax.convert.mapping import ConversionError, reference_specs
from bertjax.models import BertConfig
from bertjax.models.layout import stack_layers, unstack_layers

CONFIG = BertConfig(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4,
                    intermediate_size=37, max_position_embeddings=64)
TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"Word{i}" for i in range(35)]


def random_params(config, seed=0):
    r = np.random.default_rng(seed)
    return jax.tree.map(lambda s: r.normal(size=s.shape).astype(np.float32),
                        checkpoint_dir.abstract_params(config))


@pytest.fixture
def vocab(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("".join(t + "\n" for t in TOKENS))
    return path


def test_tensor_table_covers_every_model_parameter_exactly_once():
    flat = flax.traverse_util.flatten_dict(checkpoint_dir.abstract_params(CONFIG))
    want = {"/".join(path): value.shape for path, value in flat.items()}
    specs = reference_specs(CONFIG)
    assert {"/".join(s.path): s.shape for s in specs} == want
    assert len({s.tf_name for s in specs}) == len({s.hf_name for s in specs}) == len(specs)
    for spec in specs:  # both external layouts have as many elements as the bertjax one
        assert np.prod(spec.flat_shape) == np.prod(spec.shape)


def test_layer_stacking_round_trips_and_matches_the_scanned_model():
    params = random_params(CONFIG)
    scanned = stack_layers(params)
    scan_config = BertConfig(**{**CONFIG.to_dict(), "scan_layers": True})
    expected = jax.tree.map(lambda s: s.shape, checkpoint_dir.abstract_params(scan_config))
    assert jax.tree.map(np.shape, scanned) == expected
    jax.tree.map(np.testing.assert_array_equal, unstack_layers(scanned), params)
    np.testing.assert_array_equal(
        scanned["bert"]["encoder"]["layers"]["layer"]["output"]["bias"][1],
        params["bert"]["encoder"]["layer_1"]["output"]["bias"])


def test_save_then_load_pretrained_round_trips(tmp_path, vocab):
    params = random_params(CONFIG)
    summary = checkpoint_dir.save_pretrained(tmp_path / "ckpt", CONFIG, stack_layers(params), vocab)
    assert summary["initialised"] == [] and not (tmp_path / "ckpt" / "conversion.json").exists()
    # Upper-case tokens in the vocabulary: a cased model.
    assert json.loads((tmp_path / "ckpt" / "tokenizer_config.json").read_text()) == {
        "type": "wordpiece", "do_lower_case": False}
    config, loaded, tokenizer = bertjax.load_pretrained(tmp_path / "ckpt")
    assert config == CONFIG  # stored unrolled, whatever layout was passed in
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
    assert tokenizer.vocab_size == len(TOKENS) and not tokenizer.do_lower_case

    config, loaded, _ = bertjax.load_pretrained(tmp_path / "ckpt", scan_layers=True,
                                                param_dtype="bfloat16")
    assert config.scan_layers and config.param_dtype == "bfloat16"
    kernel = loaded["bert"]["encoder"]["layers"]["layer"]["intermediate"]["kernel"]
    assert kernel.shape == (2, 32, 37) and kernel.dtype == jax.numpy.bfloat16


def test_heads_missing_from_params_are_initialised_and_recorded(tmp_path, vocab):
    params = random_params(CONFIG)
    encoder_only = {"bert": {k: v for k, v in params["bert"].items() if k != "pooler"}}
    summary = checkpoint_dir.save_pretrained(tmp_path / "ckpt", CONFIG, encoder_only, vocab, seed=3)
    assert summary["initialised"] == ["bert/pooler", "mlm", "nsp"]
    recorded = json.loads((tmp_path / "ckpt" / "conversion.json").read_text())
    assert recorded["initialised"] == ["bert/pooler", "mlm", "nsp"]
    loaded = checkpoint_dir.load_params(tmp_path / "ckpt", CONFIG)
    jax.tree.map(np.testing.assert_array_equal, loaded["bert"]["encoder"],
                 params["bert"]["encoder"])
    # The model's own initialisers: truncated normal (stddev 0.02) kernels, zero biases.
    assert 0.01 < np.std(loaded["nsp"]["kernel"]) < 0.03
    assert not np.any(loaded["mlm"]["output_bias"])
    np.testing.assert_array_equal(loaded["mlm"]["transform_layer_norm"]["scale"], 1.0)


@pytest.mark.parametrize("case,expected", [
    ("vocab", "has 39 entries but bert/embeddings/word_embeddings has 40 rows"),
    ("shape", "parameter mlm/transform/kernel has shape (32, 31) but the config"),
    ("missing", "missing parameter bert/encoder/layer_1/output/bias"),
    ("unexpected", "unexpected parameter bert/encoder/layer_2/output/bias"),
])
def test_save_pretrained_rejects_mismatches(tmp_path, vocab, case, expected):
    params = random_params(CONFIG)
    if case == "vocab":
        vocab.write_text("".join(t + "\n" for t in TOKENS[:-1]))
    elif case == "shape":
        params["mlm"]["transform"]["kernel"] = np.zeros((32, 31), np.float32)
    elif case == "missing":
        del params["bert"]["encoder"]["layer_1"]["output"]["bias"]
    elif case == "unexpected":
        params["bert"]["encoder"]["layer_2"] = {"output": {"bias": np.zeros(32, np.float32)}}
    with pytest.raises(ConversionError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        checkpoint_dir.save_pretrained(tmp_path / "ckpt", CONFIG, params, vocab)
    assert not (tmp_path / "ckpt").exists()


def test_load_pretrained_points_a_hugging_face_directory_to_the_converter(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConversionError, match="python -m bertjax.convert from_hf --input"):
        bertjax.load_pretrained(tmp_path)


def test_sentencepiece_vocabulary_is_stored_and_checked(tmp_path):
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    text = ["the quick brown fox jumps over the lazy dog", "a dog sleeps", "foxes run fast"] * 20
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_writer=model, vocab_size=40, model_type="unigram",
        pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, pad_piece="[PAD]", unk_piece="[UNK]",
        user_defined_symbols=["[CLS]", "[SEP]", "[MASK]"], hard_vocab_limit=False,
        minloglevel=2)
    (tmp_path / "sp.model").write_bytes(model.getvalue())
    size = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model")).get_piece_size()
    config = BertConfig(**{**CONFIG.to_dict(), "vocab_size": size})
    with pytest.raises(ConversionError, match=f"sp.model has {size} entries but .* has "
                                              f"{size + 1} rows"):
        bigger = BertConfig(**{**CONFIG.to_dict(), "vocab_size": size + 1})
        checkpoint_dir.save_pretrained(tmp_path / "bad", bigger, random_params(bigger),
                                   tmp_path / "sp.model")
    checkpoint_dir.save_pretrained(tmp_path / "ckpt", config, random_params(config),
                               tmp_path / "sp.model")
    assert json.loads((tmp_path / "ckpt" / "tokenizer_config.json").read_text()) == {
        "type": "sentencepiece", "do_lower_case": False}
    _, _, tokenizer = bertjax.load_pretrained(tmp_path / "ckpt")
    assert tokenizer.vocab_size == size and tokenizer.cls_id == 2


@pytest.mark.parametrize("args,expected", [
    ([], "name a command (from_tf, from_hf, to_hf); see --help"),
    (["from_pt"], "unknown command 'from_pt'; expected one of from_tf, from_hf, to_hf"),
    (["to_hf", "--input", "a"], "to_hf: --output is required"),
    (["to_hf", "--input", "a", "--output", "b", "--seed", "1"], "to_hf does not take --seed"),
    (["from_hf", "--input", "a", "--output", "b", "true"],
     "from_hf: unexpected argument 'true'"),
    (["to_hf", "--input", "/nonexistent", "--output", "b"],
     "/nonexistent is not a bertjax checkpoint (no params/)"),
])
def test_cli_misuse_stops_with_one_line(args, expected):
    with pytest.raises(SystemExit) as exc:
        convert_main(args)
    assert str(exc.value) == f"error: {expected}"

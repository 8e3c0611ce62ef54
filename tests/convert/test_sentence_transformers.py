"""from_hf / to_hf with sentence-transformers directories, against sentence-transformers itself:
a tiny random BERT with a Pooling (and Normalize) module, saved by SentenceTransformer.save."""

import json
import shutil

import numpy as np
import pytest
from convert_cli import convert_main
from st_models import MAX_SEQ_LENGTH, H, save_sentence_transformer, st

from bertjax import checkpoint_dir
from bertjax.convert.sentence_transformers import read_modules
from bertjax.errors import CheckpointError
from bertjax.models.embedding import POOLING_FILE, BertForEmbedding, Pooling

SENTENCES = [
    "The cat sat.",
    "A big, RED dog ran to the house!",
    "Café?",  # accents stripped by the uncased tokenizer
    "the quick brown fox jumps over the lazy dog and the cat plays on the mat",  # > 16 tokens
    "Runs played jumper xyzzy",  # word pieces and an unknown word
    "is",
]
# (pooling mode, normalize): each mode once, normalisation once.
CASES = [("mean", True), ("cls", False), ("max", False)]


def convert(*args):
    convert_main([str(a) for a in args])


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}{'_normalized' * c[1]}")
def converted(request, tmp_path_factory):
    """(sentence-transformers dir, bertjax checkpoint converted from it, the report)."""
    mode, normalize = request.param
    root = tmp_path_factory.mktemp(f"st_{mode}")
    source = save_sentence_transformer(root, mode, normalize)
    convert("from_hf", "--input", source, "--output", root / "ckpt")
    return source, root / "ckpt", Pooling(mode, normalize)


def _reference(directory):
    model = st.SentenceTransformer(str(directory), device="cpu")
    assert model.max_seq_length == MAX_SEQ_LENGTH
    return model.encode(SENTENCES, convert_to_numpy=True)


def _bertjax_vectors(directory, pooling):
    config, params, tokenizer = checkpoint_dir.load_pretrained(directory)
    assert tokenizer.do_lower_case
    encodings = tokenizer.encode_batch(SENTENCES, max_seq_length=MAX_SEQ_LENGTH)
    ids, segments, mask = (np.array([getattr(e, name) for e in encodings])[:, None]
                           for name in ("input_ids", "segment_ids", "input_mask"))
    assert ids.shape == (len(SENTENCES), 1, MAX_SEQ_LENGTH) and mask[3].all()  # one was cut
    vectors = BertForEmbedding(config, pooling).apply(
        {"params": {"bert": params["bert"]}}, ids, segments, mask)
    return np.asarray(vectors)[:, 0]


def test_vectors_match_sentence_transformers(converted):
    source, ckpt, pooling = converted
    assert checkpoint_dir.load_pooling(ckpt) == pooling
    assert read_modules(source)[1] == pooling
    report = json.loads((ckpt / "conversion.json").read_text())
    assert report["sentence_transformers"]["max_seq_length"] == MAX_SEQ_LENGTH
    ours = _bertjax_vectors(ckpt, pooling)
    reference = _reference(source)
    assert ours.shape == reference.shape == (len(SENTENCES), H)
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5)
    if pooling.normalize:
        np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, rtol=1e-6)


def test_the_converted_model_embeds_at_its_own_length_unless_told(converted):
    """The model's max_seq_length (16 here, below its 64 positions) travels with it: the
    Embedder, `predict embed` and embedding fine-tuning cut texts there by default, so the long
    sentence's vector is sentence-transformers' own; a length given still wins."""
    from bertjax.serving.embedder import Embedder
    from bertjax.tasks import own_max_seq_length
    from experiments.embedding import get_config

    source, ckpt, _ = converted
    reference = _reference(source)
    np.testing.assert_allclose(Embedder.from_checkpoint(str(ckpt))(SENTENCES), reference,
                               rtol=1e-5, atol=1e-5)
    longer = Embedder.from_checkpoint(str(ckpt), max_seq_length=64)(SENTENCES)
    assert np.abs(longer[3] - reference[3]).max() > 1e-3  # the long one, no longer cut
    config = get_config("pairs")
    config.init_checkpoint = str(ckpt)
    own_max_seq_length(config)
    assert config.max_seq_length == MAX_SEQ_LENGTH
    config.max_seq_length = 32  # given: kept
    own_max_seq_length(config)
    assert config.max_seq_length == 32


def test_to_hf_writes_a_directory_sentence_transformers_loads(converted, tmp_path, capsys):
    source, ckpt, pooling = converted
    convert("to_hf", "--input", ckpt, "--output", tmp_path / "hf")
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'hf'}: BertModel (float32)" in out  # the default for pooling
    assert f"SentenceTransformer({tmp_path / 'hf'}) loads it" in out
    transformer_dir, read_back = read_modules(tmp_path / "hf")
    assert read_back == pooling and transformer_dir == tmp_path / "hf"
    np.testing.assert_allclose(_reference(tmp_path / "hf"), _reference(source),
                               rtol=1e-5, atol=1e-5)
    # ... and from_hf reads the written (older) layout back to the same checkpoint.
    convert("from_hf", "--input", tmp_path / "hf", "--output", tmp_path / "again")
    out = capsys.readouterr().out
    assert (f"pooling: {pooling.mode}{', normalized' if pooling.normalize else ''} "
            f"(max_seq_length={MAX_SEQ_LENGTH})") in out
    assert checkpoint_dir.load_pooling(tmp_path / "again") == pooling


def test_from_hf_of_plain_hf_directory_writes_no_pooling(converted, tmp_path):
    """A stale pooling.json goes when --output is overwritten from a plain BERT directory."""
    source, ckpt, _ = converted
    shutil.copytree(ckpt, tmp_path / "ckpt")
    plain = tmp_path / "plain"
    shutil.copytree(source.parent / "bert", plain)
    convert("from_hf", "--input", plain, "--output", tmp_path / "ckpt", "--overwrite")
    assert not (tmp_path / "ckpt" / POOLING_FILE).exists()
    assert checkpoint_dir.load_pooling(tmp_path / "ckpt") is None


def _edit_json(path, edit):
    value = json.loads(path.read_text())
    value = edit(value) or value
    path.write_text(json.dumps(value))


BAD_CASES = {
    "dense": ("modules.json", lambda m: m.append(
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}),
        "module 2 (sentence_transformers.models.Dense) is not supported after the Pooling"),
    "weightedmean": ("1_Pooling/config.json", lambda c: c.update(pooling_mode="weightedmean"),
                     "pooling mode 'weightedmean' is not supported"),
    "two_modes": ("1_Pooling/config.json", lambda c: c.update(pooling_mode=["cls", "mean"]),
                  "pooling modes cls + mean at once"),
    "roberta": ("config.json", lambda c: c.update(model_type="roberta"),
                "model_type='roberta' is not supported"),
}


@pytest.fixture(scope="module")
def mean_source(tmp_path_factory):
    return save_sentence_transformer(tmp_path_factory.mktemp("st_bad"), "mean", False)


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_unsupported_modules_fail_with_one_line_naming_the_file(mean_source, tmp_path, case):
    source = mean_source
    name, edit, expected = BAD_CASES[case]
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    _edit_json(bad / name, edit)
    with pytest.raises(SystemExit) as exc:
        convert("from_hf", "--input", bad, "--output", tmp_path / "out")
    message = str(exc.value)
    assert message.startswith(f"error: {bad / name}: ") and "\n" not in message, message
    assert expected in message, message
    if case != "roberta":
        assert ("supported: Transformer (BERT or ModernBERT), then Pooling with one mode of mean"
                in message)
    assert not (tmp_path / "out").exists()


def test_malformed_pooling_json_is_one_line_naming_it(tmp_path):
    (tmp_path / POOLING_FILE).write_text(json.dumps({"mode": "sum"}))
    with pytest.raises(CheckpointError, match=f"^{tmp_path / POOLING_FILE}: pooling mode 'sum'"):
        checkpoint_dir.load_pooling(tmp_path)
    (tmp_path / POOLING_FILE).write_text("{")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        checkpoint_dir.load_pooling(tmp_path)
    assert checkpoint_dir.load_pooling(tmp_path / "none") is None

"""from_hf of a sentence-transformers directory whose Transformer module is a ModernBERT: a tiny
random transformers ModernBertModel (tokenizer.json vocabulary, local attention narrower than
the texts) wrapped in Pooling (and Normalize) modules, saved by SentenceTransformer.save. The
converted checkpoint's vectors (Embedder.from_checkpoint, `predict embed --checkpoint`) equal
SentenceTransformer.encode's within 1e-5, and to_hf writes it back as a directory
SentenceTransformer loads to the same vectors."""

import contextlib
import io
import json
import shutil

import numpy as np
import pytest
from conftest import run_python
from convert_cli import convert_main
from modern_checkpoint import write_hf_modern

from bertjax import checkpoint_dir
from bertjax.models.embedding import Pooling
from bertjax.serving.embedder import Embedder

torch = pytest.importorskip("torch")
st = pytest.importorskip("sentence_transformers")
st_modules = pytest.importorskip("sentence_transformers.sentence_transformer.modules")

HIDDEN = 32  # write_hf_modern's
MAX_SEQ_LENGTH = 16  # twice the local attention window (8); the long text is cut there
SENTENCES = [
    "filler3 good filler7 filler1",
    "BAD Filler2",  # lower-cased by the tokenizer.json's normalizer
    "filler9 filler4 good good filler0 filler11 filler12 filler13 filler14 filler15 filler16 "
    "filler17 filler18 filler19 filler20",  # > 16 tokens
    "xyzzy good",  # an unknown word
    "good",
]
CASES = [("mean", True), ("cls", False)]


def convert(*args):
    convert_main([str(a) for a in args])


def _save_sentence_transformer(root, mode, normalize):
    """root/st: a ModernBertModel saved by transformers (tokenizer.json alone) in
    sentence-transformers modules, saved by SentenceTransformer.save."""
    write_hf_modern(root / "hf", "ModernBertModel")
    modules = [st_modules.Transformer(str(root / "hf"), max_seq_length=MAX_SEQ_LENGTH),
               st_modules.Pooling(HIDDEN, pooling_mode=mode)]
    if normalize:
        modules.append(st_modules.Normalize())
    st.SentenceTransformer(modules=modules, device="cpu").save(str(root / "st"))
    return root / "st"


def _reference(directory):
    model = st.SentenceTransformer(str(directory), device="cpu")
    assert model.max_seq_length == MAX_SEQ_LENGTH
    return model.encode(SENTENCES, convert_to_numpy=True)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}{'_normalized' * c[1]}")
def converted(request, tmp_path_factory):
    """(sentence-transformers dir, the bertjax checkpoint converted from it, its pooling,
    from_hf's report)."""
    mode, normalize = request.param
    root = tmp_path_factory.mktemp(f"st_modern_{mode}")
    source = _save_sentence_transformer(root, mode, normalize)
    assert not (source / "vocab.txt").exists()  # the vocabulary is the tokenizer.json
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        convert("from_hf", "--input", source, "--output", root / "ckpt")
    return source, root / "ckpt", Pooling(mode, normalize), out.getvalue()


def test_modernbert_vectors_match_sentence_transformers(converted):
    source, ckpt, pooling, report = converted
    assert f"pooling: {pooling.mode}" in report and f"max_seq_length={MAX_SEQ_LENGTH}" in report
    assert checkpoint_dir.load_pooling(ckpt) == pooling
    assert (ckpt / "tokenizer.json").exists()
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "modernbert"
    record = json.loads((ckpt / "conversion.json").read_text())
    assert record["sentence_transformers"]["max_seq_length"] == MAX_SEQ_LENGTH
    ours = Embedder.from_checkpoint(str(ckpt), max_seq_length=MAX_SEQ_LENGTH)(SENTENCES)
    reference = _reference(source)
    assert ours.shape == reference.shape == (len(SENTENCES), HIDDEN)
    print(f"max |bertjax - sentence-transformers| ({pooling.mode}): "
          f"{np.abs(ours - reference).max():.2e}")
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5)
    if pooling.normalize:
        np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, rtol=1e-6)


def test_to_hf_of_the_converted_modernbert_is_the_same_sentence_transformer(converted, tmp_path,
                                                                            capsys):
    source, ckpt, pooling, _ = converted
    convert("to_hf", "--input", ckpt, "--output", tmp_path / "hf")
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'hf'}: ModernBertModel (float32)" in out
    assert f"SentenceTransformer({tmp_path / 'hf'}) loads it" in out
    np.testing.assert_allclose(_reference(tmp_path / "hf"), _reference(source),
                               rtol=1e-5, atol=1e-5)


def test_predict_embed_reads_the_converted_modernbert(converted, tmp_path):
    source, ckpt, pooling, _ = converted
    if pooling.mode != "mean":
        pytest.skip("one subprocess is enough: the pooling is the Embedder's")
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"id": i, "text": t}) + "\n"
                             for i, t in enumerate(SENTENCES)))
    result = run_python(["-m", "bertjax.predict", "embed", f"--checkpoint={ckpt}",
                         f"--input={texts}", f"--output={tmp_path / 'v.npy'}",
                         f"--max_seq_length={MAX_SEQ_LENGTH}"])
    assert result.returncode == 0, result.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "v.npy"), _reference(source),
                               rtol=1e-5, atol=1e-5)


def test_do_lower_case_over_a_tokenizer_json_that_keeps_case(converted, tmp_path):
    """sentence-transformers lower-cases the texts before a tokenizer.json whose normalizer
    keeps case (sentence_bert_config.json do_lower_case=true); so does bertjax, and to_hf
    says so again."""
    source = tmp_path / "cased"
    shutil.copytree(converted[0], source)
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    tokenizer["normalizer"]["lowercase"] = False
    (source / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((source / "sentence_bert_config.json").read_text())
    (source / "sentence_bert_config.json").write_text(json.dumps({**config,
                                                                  "do_lower_case": True}))
    convert("from_hf", "--input", source, "--output", tmp_path / "ckpt")
    upper = [t.upper() for t in SENTENCES]
    reference = st.SentenceTransformer(str(source), device="cpu").encode(upper)
    ours = Embedder.from_checkpoint(str(tmp_path / "ckpt"))
    np.testing.assert_allclose(ours(upper), reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours(upper), ours(SENTENCES), rtol=1e-6, atol=1e-6)
    convert("to_hf", "--input", tmp_path / "ckpt", "--output", tmp_path / "hf")
    np.testing.assert_allclose(
        st.SentenceTransformer(str(tmp_path / "hf"), device="cpu").encode(upper), reference,
        rtol=1e-5, atol=1e-5)

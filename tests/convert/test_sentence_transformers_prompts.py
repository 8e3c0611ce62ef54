"""A converted sentence-transformers model keeps its own text settings, against
sentence-transformers itself (tiny local models, vectors within 1e-5): its prompts and default
prompt name (the Embedder's __call__ / embed_queries / embed_documents are encode /
encode_query / encode_document, prompt_name= and prompt= override; predict embed / search the
same with flags), do_lower_case (the texts lower-cased, not the tokenizer: a cased vocabulary
keeps its accents), include_prompt, and its max_seq_length on texts past 128 tokens; to_hf
writes them all back, so that SentenceTransformer(output) encodes as bertjax does."""

import contextlib
import io
import json
import random

import numpy as np
import pytest
from conftest import run_python
from convert_cli import convert_main
from st_models import CASED_TOKENS, WORDS, assert_close, reference, save_sentence_transformer

from bertjax import checkpoint_dir
from bertjax.errors import ConfigError
from bertjax.serving.embedder import Embedder

PROMPTS = {"query": "query: ", "passage": "passage: "}
SENTENCES = ["the cat sat on the mat", "A big red dog ran to the house!", "is",
             "the quick brown fox jumps over the lazy dog"]


def convert(*args) -> str:
    """`python -m bertjax.convert ARGS`; its standard output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        convert_main([str(a) for a in args])
    return out.getvalue()


@pytest.fixture(scope="module")
def prompted(tmp_path_factory):
    """(sentence-transformers dir with prompts query / passage, default passage; the
    checkpoint converted from it; from_hf's report)."""
    root = tmp_path_factory.mktemp("st_prompts")
    source = save_sentence_transformer(root, "mean", True, prompts=PROMPTS,
                                       default_prompt_name="passage")
    report = convert("from_hf", "--input", source, "--output", root / "ckpt")
    return source, root / "ckpt", report


def test_from_hf_keeps_the_prompts_and_the_default_prompt_name(prompted):
    _, ckpt, report = prompted
    record = json.loads((ckpt / "conversion.json").read_text())["sentence_transformers"]
    assert {k: record["prompts"][k] for k in PROMPTS} == PROMPTS
    assert record["default_prompt_name"] == "passage" and record["pooling"]["include_prompt"]
    assert record["do_lower_case"] is False
    assert "yourself" not in report and "not kept" not in report, report
    assert "query 'query: ' (default: passage); kept in" in report, report
    assert checkpoint_dir.own_prompts(ckpt).text() == "passage: "


def test_the_embedder_applies_the_prompts_as_sentence_transformers(prompted):
    """encode: the default prompt; encode_query: "query"; encode_document: "document", which
    a SentenceTransformer always has (empty here): never "passage" nor the default."""
    source, ckpt, _ = prompted
    ours, theirs = Embedder.from_checkpoint(str(ckpt)), reference(source)
    assert_close(ours(SENTENCES), theirs.encode(SENTENCES))
    assert_close(ours.embed_queries(SENTENCES), theirs.encode_query(SENTENCES))
    assert_close(ours.embed_documents(SENTENCES), theirs.encode_document(SENTENCES))
    assert_close(ours(SENTENCES, prompt_name="query"),
                 theirs.encode(SENTENCES, prompt_name="query"))
    assert_close(ours(SENTENCES, prompt=""), theirs.encode(SENTENCES, prompt=""))
    assert_close(ours.embed_documents(SENTENCES, prompt_name="passage"),
                 theirs.encode_document(SENTENCES, prompt_name="passage"))
    assert np.abs(ours(SENTENCES) - ours(SENTENCES, prompt="")).max() > 1e-3
    with pytest.raises(ConfigError, match=r"^prompt_name='title' is not one of the model's "
                                          r"prompts \(query, document, passage\)$"):
        ours(SENTENCES, prompt_name="title")


def test_to_hf_writes_the_prompts_back(prompted, tmp_path):
    _, ckpt, _ = prompted
    convert("to_hf", "--input", ckpt, "--output", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config_sentence_transformers.json").read_text())
    assert config["prompts"] == {"query": "query: ", "document": "", "passage": "passage: "}
    assert config["default_prompt_name"] == "passage"
    ours, again = Embedder.from_checkpoint(str(ckpt)), reference(tmp_path / "hf")
    for name in (None, "query", "passage", "document"):
        assert_close(ours(SENTENCES, prompt_name=name),
                     again.encode(SENTENCES, prompt_name=name))
    assert_close(ours.embed_queries(SENTENCES), again.encode_query(SENTENCES))


def test_do_lower_case_lower_cases_the_texts_not_the_tokenizer(tmp_path):
    """sentence_bert_config.json's do_lower_case=true over a cased vocabulary: "CAFÉ" is the
    token "café" (accent kept), as sentence-transformers tokenizes it, not "cafe"."""
    source = save_sentence_transformer(tmp_path, tokens=CASED_TOKENS, lower_case_vocab=False,
                                       do_lower_case=True)
    report = convert("from_hf", "--input", source, "--output", tmp_path / "ckpt")
    assert "do_lower_case=true lower-cases the texts before the tokenizer" in report, report
    texts = ["CAFÉ Cat", "The RED Dog ran to the Café!", "café cafe", "THE CAT SAT."]
    theirs = reference(source).encode(texts)
    assert_close(reference(source).encode([t.upper() for t in texts]), theirs)  # lower-cased
    assert not checkpoint_dir.load_do_lower_case(tmp_path / "ckpt")  # the vocabulary's case
    assert checkpoint_dir.own_lower_case(tmp_path / "ckpt")
    assert_close(Embedder.from_checkpoint(str(tmp_path / "ckpt"))(texts), theirs)
    convert("to_hf", "--input", tmp_path / "ckpt", "--output", tmp_path / "hf")
    sbert = json.loads((tmp_path / "hf" / "sentence_bert_config.json").read_text())
    assert sbert["do_lower_case"] is True
    assert_close(reference(tmp_path / "hf").encode(texts), theirs)


@pytest.mark.parametrize("mode", ["mean", "cls", "max"])
def test_include_prompt_false_pools_after_the_prompt_as_sentence_transformers(mode, tmp_path):
    """A Pooling that leaves the prompt out: every prompt (and none) gives sentence-transformers'
    vectors, a sentence cut inside its prompt included; to_hf writes the setting back."""
    source = save_sentence_transformer(tmp_path, mode, prompts=PROMPTS, include_prompt=False)
    convert("from_hf", "--input", source, "--output", tmp_path / "ckpt")
    assert checkpoint_dir.load_pooling(tmp_path / "ckpt").include_prompt is False
    ours, theirs = Embedder.from_checkpoint(str(tmp_path / "ckpt")), reference(source)
    texts = SENTENCES + [" ".join(["the big red dog"] * 6)]  # past MAX_SEQ_LENGTH
    cut = "query: query: query: query: query: query: query: query: "  # longer than 16 tokens
    for name, prompt in (("query", None), ("passage", None), (None, ""), (None, cut)):
        assert_close(ours(texts, prompt_name=name, prompt=prompt),
                     theirs.encode(texts, prompt_name=name, prompt=prompt))
    assert np.abs(ours(texts, prompt_name="query")
                  - Embedder.from_checkpoint(str(tmp_path / "ckpt"))(
                      ["query: " + t for t in texts], prompt="")).max() > 1e-3
    convert("to_hf", "--input", tmp_path / "ckpt", "--output", tmp_path / "hf")
    pooling = json.loads((tmp_path / "hf" / "1_Pooling" / "config.json").read_text())
    assert pooling["include_prompt"] is False
    assert_close(reference(tmp_path / "hf").encode(texts, prompt_name="query"),
                 theirs.encode(texts, prompt_name="query"))


def long_texts(seed: int = 0) -> list[str]:
    """Texts of 150, 240 and 400 words (the last one cut at 256 tokens)."""
    rng = random.Random(seed)
    words = [w for w in WORDS if not w.startswith("##")]
    return [" ".join(rng.choice(words) for _ in range(n)) for n in (150, 240, 400)]


def test_long_texts_match_at_the_models_own_length(tmp_path):
    """all-MiniLM-L6-v2's shape: max_seq_length 256 under 512 positions, mean pooling,
    normalised: texts past 128 tokens, no length given, are sentence-transformers' vectors."""
    source = save_sentence_transformer(tmp_path, "mean", True, max_seq_length=256,
                                       positions=512)
    convert("from_hf", "--input", source, "--output", tmp_path / "ckpt")
    texts = long_texts()
    theirs = reference(source)
    assert theirs.max_seq_length == 256
    assert theirs.preprocess(texts[:1])["input_ids"].shape[-1] > 128
    ours = Embedder.from_checkpoint(str(tmp_path / "ckpt"))
    assert_close(ours(texts), theirs.encode(texts))


def write_texts(path, texts) -> str:
    path.write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n"
                            for i, t in enumerate(texts)))
    return str(path)


@pytest.mark.slow
@pytest.mark.extended
def test_predict_embed_and_search_apply_the_prompts_unless_a_flag_says(prompted, tmp_path):
    """embed: the default prompt ("passage") unless --prompt_name; search: encode_query's
    prompt for the queries, --corpus_prompt_name's for the corpus; a wrong flag is one line."""
    source, ckpt, _ = prompted
    theirs = reference(source)
    texts = write_texts(tmp_path / "texts.jsonl", SENTENCES)
    for flag, expected in (([], theirs.encode(SENTENCES)),
                           (["--prompt_name=query"],
                            theirs.encode(SENTENCES, prompt_name="query"))):
        result = run_python(["-m", "bertjax.predict", "embed", f"--checkpoint={ckpt}",
                             f"--input={texts}", f"--output={tmp_path / 'v.npy'}", *flag])
        assert result.returncode == 0, result.stderr[-3000:]
        assert_close(np.load(tmp_path / "v.npy"), expected)
    result = run_python(["-m", "bertjax.predict", "search", f"--checkpoint={ckpt}",
                         f"--corpus={texts}", f"--queries={texts}", "--top_k=4",
                         "--corpus_prompt_name=passage", f"--output={tmp_path / 'hits.jsonl'}"])
    assert result.returncode == 0, result.stderr[-3000:]
    cosine = theirs.encode_query(SENTENCES) @ theirs.encode_document(
        SENTENCES, prompt_name="passage").T  # normalised vectors
    for row, line in zip(cosine, (tmp_path / "hits.jsonl").read_text().splitlines()):
        hits = json.loads(line)["hits"]
        assert [h["id"] for h in hits] == [f"t{i}" for i in np.argsort(-row)]
        np.testing.assert_allclose([h["score"] for h in hits], np.sort(row)[::-1], atol=1e-5)
    result = run_python(["-m", "bertjax.predict", "embed", f"--checkpoint={ckpt}",
                         f"--input={texts}", f"--output={tmp_path / 'w.npy'}",
                         "--prompt_name=title"])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0] == ("error: --prompt_name='title' is not one of the model's prompts (query, "
                        "document, passage)"), lines

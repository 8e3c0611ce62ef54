"""`python -m bertjax.predict embed / search` and `bertjax.Embedder`: the vectors of a file
(whole or streamed in chunks) are the Python API's, row for row, with their ids; the .npy
loads with NumPy; search returns the brute-force nearest rows; the pooling of a checkpoint is
its pooling.json's unless overridden."""

import json

import embedding_data as data
import numpy as np
import pytest
from conftest import run_python

from bertjax.models.embedding import POOLING_FILE
from bertjax.serving.embedder import Embedder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return data.tiny_checkpoint(tmp_path_factory.mktemp("embedder"))


def texts_file(path, n=11):
    rows = [{"id": f"t{i}", "text": data.sentence(__import__("random").Random(i),
                                                  data.TOPICS[i % 5], 3 + i % 7)}
            for i in range(n)]
    data.write_jsonl(path, rows)
    return str(path), rows


def test_embed_command_streams_the_vectors_of_the_python_api_with_their_ids(checkpoint,
                                                                             tmp_path):
    path, rows = texts_file(tmp_path / "texts.jsonl")
    expected = Embedder.from_checkpoint(checkpoint, max_seq_length=32)([r["text"] for r in rows])
    for chunk in (0, 4):
        out = tmp_path / f"v{chunk}.npy"
        result = run_python(["-m", "bertjax.predict", "embed", f"--checkpoint={checkpoint}",
                             f"--input={path}", f"--output={out}", "--max_seq_length=32",
                             f"--chunk_rows={chunk}"])
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"wrote 11 vectors [11, 32] to {out}" in result.stdout
        vectors = np.load(out)
        assert vectors.dtype == np.float32 and vectors.shape == (11, 32)
        np.testing.assert_allclose(vectors, expected, rtol=1e-6, atol=1e-6)
        ids = [json.loads(line) for line in (tmp_path / f"v{chunk}.ids.jsonl").read_text()
               .splitlines()]
        assert ids == [r["id"] for r in rows]


def test_search_command_gives_the_brute_force_nearest_rows(checkpoint, tmp_path):
    corpus, corpus_rows = texts_file(tmp_path / "corpus.jsonl", 17)
    queries, query_rows = texts_file(tmp_path / "queries.jsonl", 4)
    out = tmp_path / "hits.jsonl"
    result = run_python(["-m", "bertjax.predict", "search", f"--checkpoint={checkpoint}",
                         f"--corpus={corpus}", f"--queries={queries}", f"--output={out}",
                         "--max_seq_length=32", "--top_k=5"])
    assert result.returncode == 0, result.stderr[-3000:]
    embedder = Embedder.from_checkpoint(checkpoint, max_seq_length=32)
    c = embedder([r["text"] for r in corpus_rows]).astype(np.float64)
    q = embedder([r["text"] for r in query_rows]).astype(np.float64)
    cosine = (q / np.linalg.norm(q, axis=1, keepdims=True)) @ (
        c / np.linalg.norm(c, axis=1, keepdims=True)).T
    hits = [json.loads(line) for line in out.read_text().splitlines()]
    assert [h["id"] for h in hits] == [r["id"] for r in query_rows]
    for row, hit in zip(cosine, hits):
        best = np.argsort(-row)[:5]
        assert [x["id"] for x in hit["hits"]] == [corpus_rows[i]["id"] for i in best]
        np.testing.assert_allclose([x["score"] for x in hit["hits"]], row[best], atol=1e-5)


def test_search_checks_the_queries_before_it_embeds_the_corpus(checkpoint, tmp_path):
    """A missing or bad --queries file stops `search` with one line naming it, before the
    corpus (here bad too, and in a real run the long part) is read or embedded."""
    bad_corpus = tmp_path / "corpus.jsonl"
    bad_corpus.write_text(json.dumps({"body": "x"}) + "\n")
    bad_queries = tmp_path / "queries.jsonl"
    bad_queries.write_text(json.dumps({"question": "y"}) + "\n")
    for queries, expected in ((tmp_path / "none.jsonl", f"error: --queries={tmp_path}/none"
                               ".jsonl: no such file"),
                              (bad_queries, f"error: {bad_queries}:1: no column 'text'")):
        result = run_python(["-m", "bertjax.predict", "search", f"--checkpoint={checkpoint}",
                             f"--corpus={bad_corpus}", f"--queries={queries}",
                             f"--output={tmp_path / 'hits.jsonl'}", "--max_seq_length=32"])
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stderr[-2000:]
        assert lines[0].startswith(expected), lines[0]
    assert not (tmp_path / "hits.jsonl").exists()


def test_pooling_comes_from_pooling_json_unless_overridden(checkpoint, tmp_path):
    import shutil

    texts = ["topic1 word3 word4", "word2 topic2"]
    mean = Embedder.from_checkpoint(checkpoint, max_seq_length=32)
    assert mean.pooling.mode == "mean" and not mean.pooling.normalize
    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    (copy / POOLING_FILE).write_text(json.dumps({"mode": "cls", "normalize": True}))
    cls = Embedder.from_checkpoint(str(copy), max_seq_length=32)
    assert cls.pooling.mode == "cls" and cls.pooling.normalize
    vectors = cls(texts)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-6)
    assert not np.allclose(vectors, mean(texts) / np.linalg.norm(mean(texts), axis=1,
                                                                  keepdims=True), atol=1e-3)


def test_embed_needs_one_model_and_a_npy_output(checkpoint, tmp_path):
    """One error line each, and nothing written (a row without its text fails the read after
    the model is loaded: the vectors are written under temporary names until the end)."""
    path, _ = texts_file(tmp_path / "texts.jsonl", 2)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "topic1 word2"}\n{"title": "no text"}\n')
    for args, message in (
            ([f"--checkpoint={checkpoint}", f"--input={broken}",
              f"--output={tmp_path / 'v.npy'}", "--max_seq_length=32", "--chunk_rows=1"],
             "broken.jsonl: row 2: no column 'text' (config.data.text_a, predict --text_a)"),
            ([f"--input={path}", f"--output={tmp_path / 'v.npy'}"],
             "error: give one of --workdir (an embedding run), --export"),
            ([f"--checkpoint={checkpoint}", f"--input={path}", f"--output={tmp_path / 'v.txt'}"],
             "v.txt: vectors are written to a .npy file")):
        result = run_python(["-m", "bertjax.predict", "embed", *args])
        assert result.returncode != 0
        lines = result.stderr.strip().splitlines()
        assert message in lines[-1] and len([x for x in lines if "error" in x]) == 1, lines
        assert not list(tmp_path.glob("v.*")), list(tmp_path.glob("v.*"))

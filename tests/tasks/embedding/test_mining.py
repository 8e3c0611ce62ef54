"""Hard-negative mining (bertjax/tasks/embedding/mining.py) against an independent NumPy
reference (the full float64 similarity matrix, sorted, then sentence-transformers' filtering),
on random vectors with planted near-duplicates of the positives; the files it reads and
writes; and `python -m bertjax.predict mine` on a tiny checkpoint, whose output the `pairs`
reader reads back."""

import json
import zlib

import embedding_data as data
import numpy as np
import pytest
from conftest import run_python

from bertjax.errors import ConfigError, DataError
from bertjax.tasks.embedding import mining
from bertjax.tasks.embedding.readers import read_texts


def reference(anchors, corpus, positives, exclude, num_negatives, similarity="cosine",
              range_min=0, range_max=None, margin=None, relative_margin=None, max_score=None):
    """(per anchor, its negatives' corpus rows; the float64 scores [anchors, corpus]; the
    least distance of a candidate's score to a threshold): every corpus row scored, sorted
    best first (ties: the lower row), its positives and excluded rows removed, the first
    range_max kept, the filters applied, range_min skipped, num_negatives taken."""
    a, c = np.asarray(anchors, np.float64), np.asarray(corpus, np.float64)
    if similarity == "cosine":
        a = a / np.linalg.norm(a, axis=1, keepdims=True)
        c = c / np.linalg.norm(c, axis=1, keepdims=True)
    full = a @ c.T
    filtered = any(x is not None for x in (margin, relative_margin, max_score))
    window = range_max if range_max is not None else (
        range_min + num_negatives * (10 if filtered else 1))
    out, closest = [], np.inf
    for i, row in enumerate(full):
        positive = min(row[p] for p in positives[i])
        order = [r for r in np.argsort(-row, kind="stable")
                 if r not in positives[i] and r not in exclude[i]][:window]
        thresholds = [t for t in (None if margin is None else positive - margin,
                                  None if relative_margin is None
                                  else positive - abs(positive) * relative_margin, max_score)
                      if t is not None]
        closest = min([closest, *(abs(row[r] - t) for r in order for t in thresholds)])
        if margin is not None:
            order = [r for r in order if not row[r] + margin > positive]
        if relative_margin is not None:
            order = [r for r in order if not row[r] > positive - abs(positive) * relative_margin]
        if max_score is not None:
            order = [r for r in order if not row[r] > max_score]
        out.append(order[range_min:range_min + num_negatives])
    return out, full, closest


def planted(seed=0, anchors=40, corpus=300, hidden=16):
    """Random anchors; each one's positive near it (some anchors two); near-duplicates of
    some positives (score within 0.01 of the positive's) and harder-than-random distractors
    in the corpus."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(anchors, hidden))
    c = rng.normal(size=(corpus, hidden))
    positives, near = [], {}
    for i in range(anchors):
        rows = [i] if i % 7 else [i, anchors + i]
        for r in rows:
            c[r] = a[i] + rng.normal(scale=0.4, size=hidden)
        positives.append(rows)
        if i % 3 == 0:  # a near-duplicate of the first positive
            r = 2 * anchors + i
            c[r] = c[rows[0]] + rng.normal(scale=0.01, size=hidden)
            near[i] = r
        for r in rng.choice(np.arange(3 * anchors, corpus), 4, replace=False):
            c[r] = a[i] + rng.normal(scale=1.2, size=hidden)  # hard, but below the margins
    exclude = [[3 * anchors + i] if i % 5 == 0 else [] for i in range(anchors)]
    return a.astype(np.float32), c.astype(np.float32), positives, exclude, near


# The last leaves some anchors too few negatives.
SETTINGS = [dict(), dict(margin=0.05), dict(relative_margin=0.05), dict(max_score=0.7),
            dict(range_min=2, range_max=12), dict(range_min=1, margin=0.1, max_score=0.9),
            dict(similarity="dot", margin=0.05), dict(num_negatives=4, max_score=0.6, range_max=6)]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(map(str, s.items())))
def test_mining_matches_the_numpy_reference(settings):
    a, c, positives, exclude, _ = planted()
    if settings.get("similarity") == "dot":  # scores of about the cosines' size
        a, c = a / 4, c / 4
    settings = {"num_negatives": 3, **settings}
    expected, full, closest = reference(a, c, positives, exclude, **settings)
    # The search scores in float32: the seed keeps every compared score far from another and
    # from a threshold.
    tolerance = 5e-7 * max(1.0, np.abs(full).max())  # a few float32 roundings
    top = np.sort(full, axis=1)[:, ::-1][:, :60]
    assert np.diff(top, axis=1).max() < -tolerance and closest > tolerance

    mined = mining.mine_hard_negatives(a, c, positives, exclude=exclude, chunk_rows=64,
                                       query_rows=16, **settings)

    n = settings["num_negatives"]
    assert mined.negatives.shape == mined.scores.shape == (len(a), n)
    for i, rows in enumerate(expected):
        assert mined.negatives[i].tolist() == rows + [-1] * (n - len(rows)), i
        np.testing.assert_allclose(mined.scores[i, :len(rows)], full[i, rows], atol=1e-5)
        assert np.isneginf(mined.scores[i, len(rows):]).all()
        assert not set(rows) & (set(positives[i]) | set(exclude[i]))
    assert (mined.complete == [len(r) == n for r in expected]).all()
    assert mined.complete.any() and (settings is not SETTINGS[-1] or not mined.complete.all())


def test_margins_drop_the_near_duplicates_of_the_positives():
    a, c, positives, exclude, near = planted(1)
    plain = mining.mine_hard_negatives(a, c, positives, 3, exclude=exclude)
    # Without a margin a near-duplicate is the hardest negative: what mining must not keep.
    assert all(plain.negatives[i, 0] == r for i, r in near.items())
    for margin in (dict(margin=0.05), dict(relative_margin=0.05), dict(max_score=0.85)):
        mined = mining.mine_hard_negatives(a, c, positives, 3, exclude=exclude, **margin)
        assert all(r not in mined.negatives[i] for i, r in near.items()), margin
        assert mined.complete.all()
    # The margin is measured from the lowest of an anchor's positives.
    assert plain.positive_scores[0] == pytest.approx(min(
        mining.pair_scores(a[[0, 0]], c[positives[0]])))


def test_mining_settings_and_inputs_are_checked():
    a, c, positives, _, _ = planted(anchors=4, corpus=30)
    for settings, message in ((dict(num_negatives=0), "num_negatives=0 must be 1 or more"),
                              (dict(range_min=-1), "range_min=-1 must be 0 or more"),
                              (dict(range_min=3, range_max=4), "range_max=4 leaves fewer")):
        with pytest.raises(ConfigError, match=message):
            mining.mine_hard_negatives(a, c, positives, **settings)
    with pytest.raises(ValueError, match="anchor 1 has no positive"):
        mining.mine_hard_negatives(a, c, [[0], [], [2], [3]])
    with pytest.raises(ValueError, match="corpus row 30 is not one of the corpus's 30 rows"):
        mining.mine_hard_negatives(a, c, [[0], [30], [2], [3]])


def hashed_embed(texts):
    """A deterministic stand-in for an Embedder: the sum of a fixed random vector per word."""
    def word(w):
        return np.random.default_rng(zlib.crc32(w.encode())).normal(size=16)
    return np.stack([sum(word(w) for w in t.split()) for t in texts]).astype(np.float32)


def pair_rows():
    """(anchor, positive) rows: topic sentences, one anchor with two positives, one anchor
    that is also another row's positive, one anchor repeated with the same positive."""
    rows = [(f"topic{i} word{i} word{i + 1}", f"topic{i} word{i + 2} word{i + 3} word{i}")
            for i in range(12)]
    rows.append((rows[0][0], "topic0 word9 word8"))
    rows.append((rows[1][1], "topic1 word5 word6"))
    rows.append(rows[2])
    return rows


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".tsv"])
def test_mine_file_writes_rows_the_pairs_reader_reads(tmp_path, suffix):
    rows = pair_rows()
    pairs = tmp_path / f"pairs{suffix}"
    mining.write_rows(str(pairs), ("query", "passage"), rows)
    corpus = [f"topic{i % 12} word{i} word{i + 5}" for i in range(20)] + [rows[3][1]]
    data.write_jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in corpus])
    out = tmp_path / f"mined{suffix}"

    summary = mining.mine_file(hashed_embed, str(pairs), str(out), 2,
                               corpus_path=str(tmp_path / "corpus.jsonl"),
                               anchor_column="query", positive_column="passage", margin=0.0)

    columns = ("query", "passage", "negative_1", "negative_2")
    assert summary.columns == columns and not list(tmp_path.glob("*.partial"))
    read = read_texts(str(out), columns)
    assert [e.texts for e in read] == [tuple(r) for r in mining.mine_pairs(
        hashed_embed, rows, 2, corpus, ("query", "passage"), margin=0.0)[0]]
    assert summary.rows == len(read) and summary.input_rows == len(rows) == 15
    assert summary.anchors == 13 and summary.corpus == len(set(corpus) | {p for _, p in rows})
    assert summary.rows + sum(1 for a, _ in rows if a not in {e.texts[0] for e in read}) == 15
    written = {e.texts[:2] for e in read}
    assert [r for r in rows if r in written] == [e.texts[:2] for e in read]  # input order
    for example in read:
        anchor, negatives = example.texts[0], example.texts[2:]
        own = {p for a, p in rows if a == anchor} | {anchor}
        assert not own & set(negatives) and len(set(negatives)) == 2
    assert summary.negative_score < summary.positive_score
    assert "train with --config.data.columns=query,passage,negative_1,negative_2" in (
        summary.line(str(out)))


def test_mine_file_names_a_missing_column_and_a_bad_output(tmp_path):
    pairs = data.write_jsonl(tmp_path / "pairs.jsonl", [{"anchor": "a b", "text": "c"}])
    with pytest.raises(DataError, match=r"pairs.jsonl:1: no column 'positive' \(--text_b"):
        mining.mine_file(hashed_embed, pairs, str(tmp_path / "out.jsonl"))
    with pytest.raises(ConfigError, match="--output=.*out.txt: mined rows are written to a "):
        mining.mine_file(hashed_embed, pairs, str(tmp_path / "out.txt"))
    assert not list(tmp_path.glob("out*"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return data.tiny_checkpoint(tmp_path_factory.mktemp("mining"))


def test_mine_command_writes_what_the_python_api_mines(checkpoint, tmp_path):
    """The command on a tiny checkpoint (the CPU split into devices, the search sharded
    over them): the rows of `mine_file` with an Embedder in this process, read back by the
    pairs reader; a missing file is one error line before any model loads."""
    from bertjax.serving.embedder import Embedder

    pairs = data.write_pairs(tmp_path / "pairs.jsonl", 30)
    out = tmp_path / "mined.jsonl"
    result = run_python(["-m", "bertjax.predict", "mine", f"--checkpoint={checkpoint}",
                         f"--pairs={pairs}", f"--output={out}", "--text_a=query",
                         "--text_b=passage", "--num_negatives=2", "--relative_margin=0.01",
                         "--max_seq_length=32"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"to {out} (2 negatives each" in result.stdout, result.stdout
    columns = ("query", "passage", "negative_1", "negative_2")
    mined = read_texts(str(out), columns)
    assert f"wrote {len(mined)} of 30 rows" in result.stdout

    embedder = Embedder.from_checkpoint(checkpoint, max_seq_length=32)
    expected = mining.mine_file(embedder.embed_queries, pairs, str(tmp_path / "api.jsonl"), 2,
                                anchor_column="query", positive_column="passage",
                                embed_corpus=embedder.embed_documents, relative_margin=0.01)
    assert expected.rows == len(mined) > 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        json.loads(line) for line in (tmp_path / "api.jsonl").read_text().splitlines()]

    missing = run_python(["-m", "bertjax.predict", "mine", f"--checkpoint={tmp_path}/none",
                          f"--pairs={tmp_path}/none.jsonl", f"--output={tmp_path}/x.jsonl"])
    lines = missing.stderr.strip().splitlines()
    assert missing.returncode == 1 and lines == [
        f"error: --pairs={tmp_path}/none.jsonl: no such file"], lines

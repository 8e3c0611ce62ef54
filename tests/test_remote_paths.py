"""gs:// paths for vocabularies, TFRecord patterns and their metadata, fine-tuning files and
outputs, offline: `gs://bucket/...` is served from TensorFlow's in-memory file system
(`ram://bucket/...`) under etils.epath's TensorFlow backend, which is what handles gs:// for
real. A path that slipped past bertjax.paths to os / open would find nothing (or write a local
`gs:` directory, which each test checks does not appear). Local behaviour is the same as
Python's own functions."""

from __future__ import annotations

import csv
import dataclasses
import glob
import json

import numpy as np
import pytest
from etils import epath
from etils.epath import backend as epath_backend

from bertjax import paths
from bertjax.errors import DataError
from bertjax.tasks.classification import readers, submission
from bertjax.tasks.squad import postprocess as squad_postprocess
from bertjax.tasks.tagging import readers as tagging_readers
from bertjax.tokenization import load_tokenizer
from bertjax.tokenization.wordpiece import WordPieceTokenizer
from data_pipeline import metadata, pretraining_input
from data_pipeline.corpus import expand_inputs


class _RamForGcs:
    """tf.io.gfile, with gs:// mapped onto ram:// (and back in listings)."""

    def __init__(self, gfile):
        self._gfile = gfile

    def __getattr__(self, name):
        function = getattr(self._gfile, name)

        def call(*args, **kwargs):
            args = [a.replace("gs://", "ram://", 1) if isinstance(a, str) else a for a in args]
            out = function(*args, **kwargs)
            if isinstance(out, list):
                out = [o.replace("ram://", "gs://", 1) if isinstance(o, str) else o for o in out]
            return out

        return call


@pytest.fixture
def gcs(monkeypatch, tmp_path):
    """A fake gs:// (fresh per test); the cwd is an empty directory that must stay empty."""
    import tensorflow as tf

    bucket = f"gs://bucket-{tmp_path.name.replace('_', '-').lower()}"
    monkeypatch.setattr(epath_backend._TfBackend, "gfile",
                        property(lambda self: _RamForGcs(tf.io.gfile)))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield bucket
    assert list(cwd.iterdir()) == [], "a gs:// path was written locally"


def upload(local, remote: str) -> None:
    epath.Path(remote).parent.mkdir(parents=True, exist_ok=True)
    epath.Path(remote).write_bytes(epath.Path(local).read_bytes())


def test_glob_local_is_pythons_and_remote_matches_patterns(gcs, tmp_path):
    for name in ("data/b.tfrecord", "data/a.tfrecord", "data/notes.txt", "data/sub/c.tfrecord"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
        upload(tmp_path / name, f"{gcs}/{name}")
    for pattern in ("data/*.tfrecord", "data/*/*.tfrecord", "data/[ab].tfrecord", "nothing*"):
        assert paths.glob(str(tmp_path / pattern)) == sorted(glob.glob(str(tmp_path / pattern)))
        local = [p[len(str(tmp_path)):] for p in paths.glob(str(tmp_path / pattern))]
        remote = [p[len(gcs):] for p in paths.glob(f"{gcs}/{pattern}")]
        assert remote == local, pattern
    assert paths.glob(f"{gcs}/data/a.tfrecord") == [f"{gcs}/data/a.tfrecord"]
    assert paths.glob(f"{gcs}/data/missing.tfrecord") == []
    # The pre-training reader's file list, and corpus inputs, take gs:// patterns.
    files = pretraining_input.data_files(f"{gcs}/data/*.tfrecord,{gcs}/data/sub/*")
    assert files == [f"{gcs}/data/a.tfrecord", f"{gcs}/data/b.tfrecord",
                     f"{gcs}/data/sub/c.tfrecord"]
    assert expand_inputs(f"{gcs}/data/*.txt") == [f"{gcs}/data/notes.txt"]
    assert paths.dirname(f"{gcs}/data/x.tfrecord") == f"{gcs}/data"
    assert paths.join(gcs, "a", "b.txt") == f"{gcs}/a/b.txt"


def test_vocabulary_and_tfrecord_metadata_from_gcs(gcs, tmp_path):
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "##s", "."]
    saved = WordPieceTokenizer(tokens, True, source="test").save(f"{gcs}/vocab")
    assert saved.startswith(gcs)
    WordPieceTokenizer(tokens, True, source="test").save(str(tmp_path / "vocab"))
    remote, local = load_tokenizer(f"{gcs}/vocab"), load_tokenizer(str(tmp_path / "vocab"))
    text = "The cats sat."
    assert remote.tokenize(text) == local.tokenize(text) == ["the", "cat", "##s", "sat", "."]
    assert load_tokenizer(f"{gcs}/vocab/vocab.txt").vocab_size == len(tokens)

    meta = {"format": "test", "counts": {"instances": 3}}
    (tmp_path / "data").mkdir()
    metadata.write(str(tmp_path / "data"), meta)
    for path in glob.glob(str(tmp_path / "data" / "*")):
        upload(path, f"{gcs}/data/{path.rsplit('/', 1)[1]}")
    found, read = metadata.read(f"{gcs}/data/*.tfrecord")
    assert found.startswith(f"{gcs}/data/") and read == metadata.read(
        str(tmp_path / "data" / "*.tfrecord"))[1] == meta


def _without_source(items):
    return [dataclasses.replace(x, **{k: "" for k in ("guid", "source") if hasattr(x, k)})
            for x in items]


def test_finetuning_files_read_the_same_from_gcs(gcs, tmp_path):
    rows = [["text", "other", "label"], ["a, quoted \"one\"", "x", "pos"],
            ["two\nlines", "y", "neg"], ["ünïcode", "z", "pos"]]
    with open(tmp_path / "train.csv", "w", encoding="utf-8-sig", newline="") as f:
        csv.writer(f).writerows(rows)
    (tmp_path / "train.jsonl").write_text(
        "".join(json.dumps({"text": r[0], "label": r[2]}) + "\n" for r in rows[1:]))
    (tmp_path / "ner.conll").write_text("EU B-ORG\nrejects O\n\nPeter B-PER\nBlackburn I-PER\n")
    for name in ("train.csv", "train.jsonl", "ner.conll"):
        upload(tmp_path / name, f"{gcs}/files/{name}")
    for name in ("train.csv", "train.jsonl"):
        local = readers.read_file(str(tmp_path / name), "classification", text_a="text",
                               labels=("neg", "pos"))
        remote = readers.read_file(f"{gcs}/files/{name}", "classification", text_a="text",
                                labels=("neg", "pos"))
        assert _without_source(remote) == _without_source(local)
        assert [e.text_a for e in remote] == [r[0] for r in rows[1:]]  # BOM gone, newline kept
        assert remote[0].guid.startswith(f"{gcs}/files/{name}:")
    local = tagging_readers.read_file(str(tmp_path / "ner.conll"), scheme="iob2")
    remote = tagging_readers.read_file(f"{gcs}/files/ner.conll", scheme="iob2")
    assert _without_source(remote) == _without_source(local) and len(remote) == 2


def test_outputs_written_to_gcs(gcs, tmp_path):
    indices, predictions = ["0", "1"], np.array([1, 0])
    args = ("MRPC", indices, predictions, ("0", "1"))
    remote = submission.write_submission(f"{gcs}/run/submission", *args)
    local = submission.write_submission(str(tmp_path / "submission"), *args)
    assert remote == f"{gcs}/run/submission/MRPC.tsv"
    assert epath.Path(remote).read_text() == open(local).read() == "index\tprediction\n0\t1\n1\t0\n"

    answer = squad_postprocess.Answer(best_text="Paris", best_score=3.0, null_score=-1.0,
                                      nbest=[{"text": "Paris", "probability": 1.0}])
    written = squad_postprocess.write_prediction_files(f"{gcs}/run", "", {"q1": answer},
                                                       {"q1": "Paris"}, version_2=True)
    assert [p.rsplit("/", 1)[1] for p in written] == [
        "predictions.json", "nbest_predictions.json", "null_odds.json"]
    assert json.loads(epath.Path(written[0]).read_text()) == {"q1": "Paris"}
    assert json.loads(epath.Path(written[2]).read_text()) == {"q1": -4.0}


@pytest.mark.parametrize("writer", ["pairs", "segments"])
def test_pretraining_tfrecords_written_to_gcs_equal_local_ones(gcs, tmp_path, writer):
    import functools

    from data_pipeline import create_pretraining_data as cpd
    from data_pipeline import create_segments

    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "##s", "."]
    vocab = WordPieceTokenizer(tokens, True, source="test").save(str(tmp_path / "vocab"))
    rng = np.random.default_rng(0)
    docs = ["\n".join(" ".join(rng.choice(tokens[5:], 6)) for _ in range(4)) for _ in range(12)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(docs) + "\n")
    factory = functools.partial(cpd.load_tokenizer, vocab, None)

    def write(output_dir):
        common = dict(input=str(tmp_path / "corpus.txt"), output_dir=output_dir,
                      max_seq_length=16, num_shards=2, shuffle_buffer=10)
        if writer == "pairs":
            cfg = cpd.CreateConfig(**common, max_predictions_per_seq=3, dupe_factor=2)
            return cpd.create_pretraining_data(cfg, factory)
        return create_segments.create_segments(create_segments.SegmentsConfig(**common),
                                               factory)

    local, remote = write(str(tmp_path / "out")), write(f"{gcs}/out")
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert sorted(p.name for p in epath.Path(f"{gcs}/out").iterdir()) == names
    assert sum(name.endswith(".tfrecord") for name in names) == 2  # and no *.tmp left
    for name in names:
        if name.endswith(".tfrecord"):
            assert epath.Path(f"{gcs}/out/{name}").read_bytes() == (tmp_path / "out" /
                                                                    name).read_bytes()
    found, meta = metadata.read(f"{gcs}/out/*.tfrecord")

    def counts(meta):  # without the timings
        return {k: v for k, v in meta["counts"].items() if "seconds" not in k}

    assert counts(meta) == counts(local) == counts(remote)
    assert local["counts"]["instances"] > 0

    # A bad line deep in the corpus: the new remote directory is removed with its shards.
    with open(tmp_path / "corpus.txt", "ab") as f:
        f.write(b"\n\nthe cat \xff sat .\n")
    with pytest.raises(DataError, match=r"corpus.txt:\d+: invalid UTF-8"):
        write(f"{gcs}/failed")
    assert not epath.Path(f"{gcs}/failed").exists()


def test_metrics_on_gcs_are_written_in_batches_and_all_at_close(gcs, monkeypatch):
    import types

    import tensorflow as tf
    from tensorboard.summary.writer import event_file_writer

    from bertjax.train.metrics import MetricsWriter

    # TensorBoard's writer opens its files through tf.io.gfile itself: onto the fake gs:// too.
    monkeypatch.setattr(event_file_writer, "tf", types.SimpleNamespace(
        io=types.SimpleNamespace(gfile=_RamForGcs(tf.io.gfile))))
    run = f"{gcs}/run"
    path = epath.Path(f"{run}/metrics.jsonl")
    writer = MetricsWriter(run, enabled=True)
    assert writer.flush_seconds == 60.0  # local workdirs: 0, every line at once
    writer.flush_seconds = 3600.0
    for step in (10, 20, 30):
        writer.write(step, {"loss": 1.0 / step})
    # The first line is written at once (the run is visibly alive), the next ones are not.
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [10]
    writer.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["split"], r["loss"]) for r in lines] == [
        (s, "train", 1.0 / s) for s in (10, 20, 30)]
    events = list(epath.Path(f"{run}/tensorboard/train").iterdir())
    assert len(events) == 1 and events[0].stat().length > 0

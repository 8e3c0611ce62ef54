"""bertjax.demos.rotten_tomatoes on fixture files in the exact vaderSentiment layout (CRLF,
tab-separated, UTF-8 with a Latin-1 line, no final newline, inside the nested sdist archives),
and experiments/finetune_rotten_tomatoes.py reading what it writes."""

import io
import json
import random
import tarfile

import pytest

from bertjax.demos import rotten_tomatoes as rt
from bertjax.errors import DataError
from bertjax.tasks import get_task
from experiments.finetune_rotten_tomatoes import get_config

# (id, score as written, sentence, encoding of that line)
ROWS = [
    ("1", "2.26666666667", "The Rock is destined to be the 21st Century's new ''Conan''.", "utf-8"),
    ("2", "-0.6", "Effective but too tepid biopic", "utf-8"),
    ("3", "1.36", "Münch's genuine insight makes the film forgivable.", "latin-1"),
    ("4", "0.0", "A movie.", "utf-8"),
    ("5", "-1.83333333333", "Contrived pastiche of caper clichés.", "utf-8"),
    ("6", "3.5", "We’ve seen the plot before, but there’s charm.", "utf-8"),
]


def ground_truth_bytes(rows, final_newline=False):
    """The source layout: `id \t score \t sentence` lines joined by CRLF; a row's optional 4th
    element is its encoding."""
    lines = [f"{row[0]}\t{row[1]}\t{row[2]}".encode(row[3] if len(row) > 3 else "utf-8")
             for row in rows]
    return b"\r\n".join(lines) + (b"\r\n" if final_newline else b"")


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _tar_gz(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_converts_every_line_once_with_labels_scores_and_text(tmp_path):
    source = tmp_path / "movieReviewSnippets_GroundTruth.txt"
    source.write_bytes(ground_truth_bytes(ROWS))
    assert b"M\xfcnch" in source.read_bytes()  # really a Latin-1 byte, not UTF-8
    splits = rt.convert(str(source), str(tmp_path / "out"))
    written = {name: read_jsonl(tmp_path / "out" / f"{name}.jsonl") for name in splits}
    everything = [r for name in ("train", "dev", "test") for r in written[name]]
    assert sorted(r["id"] for r in everything) == [r[0] for r in ROWS]
    by_id = {r["id"]: r for r in everything}
    for sid, score, text, _ in ROWS:
        assert by_id[sid] == {"id": sid, "text": text, "score": float(score),
                              "label": int(float(score) > 0)}
    assert by_id["4"]["label"] == 0  # score 0 is not positive
    for records in written.values():  # the source order within each file
        assert [int(r["id"]) for r in records] == sorted(int(r["id"]) for r in records)


def test_split_is_deterministic_80_10_10_and_order_free(tmp_path):
    rng = random.Random(0)
    rows = [(str(i), f"{rng.uniform(-4, 4):.4f}", f"sentence number {i}") for i in range(3000)]
    first = rt.split_records(rt.parse_snippets(ground_truth_bytes(rows), "a"))
    rng.shuffle(rows)
    second = rt.split_records(rt.parse_snippets(ground_truth_bytes(rows, True), "b"))
    assert {k: {r.id for r in v} for k, v in first.items()} == {
        k: {r.id for r in v} for k, v in second.items()}
    fractions = {k: len(v) / 3000 for k, v in first.items()}
    assert fractions["train"] == pytest.approx(0.8, abs=0.03)
    assert fractions["dev"] == pytest.approx(0.1, abs=0.02)
    assert fractions["test"] == pytest.approx(0.1, abs=0.02)


def test_reads_the_text_file_from_the_nested_sdist_archives(tmp_path):
    text = ground_truth_bytes(ROWS)
    inner = _tar_gz({"hutto_ICWSM_2014/_README_.txt": b"readme",
                     rt.SNIPPETS: text,
                     "hutto_ICWSM_2014/tweets_GroundTruth.txt": b"1\t0.5\ttweet"})
    sdist = tmp_path / "vaderSentiment-3.3.2.tar.gz"
    sdist.write_bytes(_tar_gz({"vaderSentiment-3.3.2/setup.py": b"",
                               f"vaderSentiment-3.3.2/{rt.INNER_ARCHIVE}": inner}))
    (tmp_path / "inner.tar.gz").write_bytes(inner)
    assert rt.read_source(str(sdist)) == text
    assert rt.read_source(str(tmp_path / "inner.tar.gz")) == text
    empty = tmp_path / "empty.tar.gz"
    empty.write_bytes(_tar_gz({"x/setup.py": b""}))
    with pytest.raises(DataError, match="empty.tar.gz: expected one member ending in"):
        rt.read_source(str(empty))


@pytest.mark.parametrize("line, message", [
    (b"7\t1.5", r"bad.txt:3: expected id<TAB>score<TAB>sentence, got 2 field"),
    (b"7\tgreat\tA film.", r"bad.txt:3: score 'great' is not a number"),
    (b"1\t1.0\tAgain.", r"bad.txt:3: id '1' already used on line 1"),
    (b"7\t1.0\t  ", r"bad.txt:3: empty sentence"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(ground_truth_bytes(ROWS[:2]) + b"\r\n" + line + b"\r\n")
    with pytest.raises(DataError, match=message):
        rt.convert(str(path), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_command_line_prints_counts(tmp_path):
    from conftest import run_python

    source = tmp_path / "g.txt"
    source.write_bytes(ground_truth_bytes(ROWS))
    result = run_python(["-m", "bertjax.demos.rotten_tomatoes", f"--source={source}",
                         f"--output_dir={tmp_path / 'out'}"])
    assert result.returncode == 0, result.stderr[-2000:]
    printed = result.stdout
    counts = {n: len(read_jsonl(tmp_path / "out" / f"{n}.jsonl")) for n in ("train", "dev",
                                                                          "test")}
    for name, count in counts.items():
        assert f"{name}: {count} sentences" in printed
    result = run_python(["-m", "bertjax.demos.rotten_tomatoes",
                         f"--source={tmp_path / 'nope.txt'}", f"--output_dir={tmp_path / 'out'}"])
    assert result.returncode != 0
    assert result.stderr.splitlines() == [f"error: {tmp_path / 'nope.txt'}: no such file"]


@pytest.mark.parametrize("kind", ["binary", "regression"])
def test_demo_config_reads_the_converted_files(tmp_path, kind):
    source = tmp_path / "g.txt"
    rows = ROWS + [(str(10 + i), f"{(-1) ** i * (i + 1) / 10}", f"line {i}") for i in range(40)]
    source.write_bytes(ground_truth_bytes(rows))
    rt.convert(str(source), str(tmp_path / "rt"))
    config = get_config(kind)
    assert config.data.train == "data/rotten_tomatoes/train.jsonl"
    for field in ("train", "validation", "test"):
        config.data[field] = config.data[field].replace("data/rotten_tomatoes",
                                                        str(tmp_path / "rt"))
    task = get_task(config)
    splits = task.read(config)
    train = read_jsonl(tmp_path / "rt" / "train.jsonl")
    assert [e.text_a for e in splits.train] == [r["text"] for r in train]
    if kind == "binary":
        assert (task.kind, task.label_names, task.primary_metric) == (
            "classification", ("0", "1"), "accuracy")
        assert [e.label for e in splits.train] == [r["label"] for r in train]
    else:
        assert (task.kind, task.primary_metric) == ("regression", "pearson")
        assert [e.label for e in splits.train] == [r["score"] for r in train]
    assert len(splits.test["test"]) == len(read_jsonl(tmp_path / "rt" / "test.jsonl"))
    assert config.max_seq_length == 64


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown kind 'ternary'"):
        get_config("ternary")

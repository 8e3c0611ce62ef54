r"""Demo fine-tuning task: Rotten Tomatoes review sentences with human sentiment scores.

  python -m bertjax.demos.rotten_tomatoes --source=data/vaderSentiment-3.3.2.tar.gz \
      --output_dir=data/rotten_tomatoes

Source: `movieReviewSnippets_GroundTruth.txt` of Hutto & Gilbert (ICWSM 2014), shipped in the
vaderSentiment 3.3.2 sdist as `additional_resources/hutto_ICWSM_2014.tar.gz` (10,605 sentences
of Pang & Lee's Rotten Tomatoes data, the source of SST-2; each score is the mean of 20 raters
on [-4, 4]). `--source` is that sdist, the inner hutto_ICWSM_2014.tar.gz, or the text file;
archives are read in place. Each line is `id \t score \t sentence`; lines are UTF-8 in
vaderSentiment 3.3.2, and a line that is not is read as Latin-1 (older copies).

Writes train.jsonl, dev.jsonl and test.jsonl with `{"id", "text", "label", "score"}`: label
= 1 if score > 0 else 0 (the binary task), score = the regression target. The split is 80 /
10 / 10 by a SHA-256 hash of the id, so it is the same on every machine and does not move
when lines are added or reordered; each file keeps the source order.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import math
import os
import tarfile
from collections.abc import Iterable

from bertjax import cli
from bertjax.errors import DataError

SNIPPETS = "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt"
INNER_ARCHIVE = "additional_resources/hutto_ICWSM_2014.tar.gz"
SPLITS = (("train", 80), ("dev", 90), ("test", 100))  # cumulative percent of the hash range


Record = collections.namedtuple("Record", "id text label score")


def decode_line(raw: bytes) -> str:
    """UTF-8 if the bytes are valid UTF-8, else Latin-1 (every byte sequence is)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def parse_snippets(data: bytes, source: str) -> list[Record]:
    """Records of a GroundTruth file's bytes; bad lines raise DataError naming `source:line`."""
    records, seen = [], {}
    for line_no, raw in enumerate(data.split(b"\n"), 1):
        line = decode_line(raw).rstrip("\r")
        if not line.strip():
            continue
        fields = line.split("\t")
        where = f"{source}:{line_no}"
        if len(fields) != 3:
            raise DataError(f"{where}: expected id<TAB>score<TAB>sentence, got {len(fields)} "
                            "field(s)")
        sid, score_text, text = (f.strip() for f in fields)
        if not sid:
            raise DataError(f"{where}: empty id")
        if sid in seen:
            raise DataError(f"{where}: id {sid!r} already used on line {seen[sid]}")
        seen[sid] = line_no
        try:
            score = float(score_text)
        except ValueError:
            raise DataError(f"{where}: score {score_text!r} is not a number") from None
        if not math.isfinite(score):
            raise DataError(f"{where}: score {score_text!r} is not finite")
        if not text:
            raise DataError(f"{where}: empty sentence")
        records.append(Record(sid, text, int(score > 0), score))
    if not records:
        raise DataError(f"{source}: no sentences")
    return records


def split_of(sid: str) -> str:
    """train | dev | test for an id: its SHA-256 (stable across machines and Python runs)."""
    bucket = int.from_bytes(hashlib.sha256(sid.encode("utf-8")).digest()[:8], "big") % 100
    return next(name for name, upper in SPLITS if bucket < upper)


def split_records(records: Iterable[Record]) -> dict[str, list[Record]]:
    out: dict[str, list[Record]] = {name: [] for name, _ in SPLITS}
    for record in records:
        out[split_of(record.id)].append(record)
    return out


def _member(archive: tarfile.TarFile, suffix: str, source: str) -> bytes:
    names = [m for m in archive.getmembers() if m.isfile() and m.name.endswith(suffix)]
    if len(names) != 1:
        raise DataError(f"{source}: expected one member ending in {suffix}, found {len(names)}")
    return archive.extractfile(names[0]).read()


def read_source(path: str) -> bytes:
    """The GroundTruth file's bytes from the sdist, the inner archive, or the file itself."""
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    if not tarfile.is_tarfile(path):
        with open(path, "rb") as f:
            return f.read()
    try:
        with tarfile.open(path, "r:*") as archive:
            if any(m.name.endswith(SNIPPETS) for m in archive.getmembers()):
                return _member(archive, SNIPPETS, path)
            inner = _member(archive, INNER_ARCHIVE, path)
        with tarfile.open(fileobj=io.BytesIO(inner), mode="r:*") as archive:
            return _member(archive, SNIPPETS, f"{path}!{INNER_ARCHIVE}")
    except tarfile.TarError as e:
        raise DataError(f"{path}: unreadable archive ({e})") from None


def write_jsonl(records: Iterable[Record], path: str) -> None:
    """One JSON object per line, written to a temporary file and then renamed (atomic)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r._asdict(), ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def convert(source: str, output_dir: str) -> dict[str, list[Record]]:
    """Reads `source`, writes output_dir/{train,dev,test}.jsonl; returns the splits."""
    splits = split_records(parse_snippets(read_source(source), source))
    os.makedirs(output_dir, exist_ok=True)
    for name, records in splits.items():
        write_jsonl(records, os.path.join(output_dir, f"{name}.jsonl"))
    return splits


def main(f) -> None:
    splits = convert(f.source, f.output_dir)
    for name, records in splits.items():
        positive = sum(r.label for r in records) / len(records) if records else 0.0
        print(f"{name}: {len(records)} sentences, {100 * positive:.1f}% positive "
              f"(majority baseline {100 * max(positive, 1 - positive):.1f}%)")
    print(f"wrote {', '.join(f'{n}.jsonl' for n in splits)} → {f.output_dir}")


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("source", None, "vaderSentiment-3.3.2.tar.gz, hutto_ICWSM_2014.tar.gz "
                        "or movieReviewSnippets_GroundTruth.txt.", required=True)
    flags.DEFINE_string("output_dir", None, "Directory for the *.jsonl files.", required=True)


if __name__ == "__main__":
    cli.run_flags_command(main, define_flags)

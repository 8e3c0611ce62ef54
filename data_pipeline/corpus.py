"""Corpus readers: streams of documents, each a list of sentence strings.

Formats (`--input_format`):
- `reference`: one sentence per line, a blank line between documents (google-research/bert).
- `plain`: each file is one document; sentences are split automatically.
- `jsonl`: one JSON object per line, the document text under "text"; sentences split.
- `tfds`: a TensorFlow Datasets text dataset by name, e.g. `tfds:wikipedia/20230601.en` (split
  `train`, feature `text`; `tfds:NAME:SPLIT:FEATURE` to choose), one example = one document.

All readers stream: memory holds one document at a time (a single line is split into pieces of
at most MAX_LINE_CHARS characters so that one enormous line cannot exhaust memory or stall the
tokenizer). Sharding: `iter_documents(..., shard_index=i, num_shards=n)` yields the files f
with f % n == i (files in sorted order) when there are at least n files — the Wikipedia-scale
case: each process reads only its own files —, otherwise the documents k with k % n == i of
the whole stream; for TFDS the i-th of n even sub-splits. The output depends only on the input
and n, never on which machine runs which shard.
Invalid UTF-8 raises `CorpusError` naming the file and line; empty files give no documents.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

from bertjax import paths
from bertjax.errors import DataError

MAX_LINE_CHARS = 100_000

Document = list[str]


class CorpusError(DataError):
    """Bad corpus input, with the file (and line) in the message."""


# A sentence ends at . ! or ? (optionally followed by closing quotes/brackets) before
# whitespace and an upper-case letter, digit or opening quote; a few common abbreviations
# do not end sentences.
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(?=\s+[\"'\u201c\u2018(\[]?[A-Z0-9])")
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof st jr sr vs etc e.g i.e no fig inc ltd co corp gen col lt sgt rev".split()
)


def split_sentences(text: str) -> list[str]:
    """Splits running text into sentences (line breaks always end a sentence)."""
    sentences = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        start = 0
        for match in _SENTENCE_END.finditer(line):
            candidate = line[start:match.end()].strip()
            last_word = candidate.rsplit(None, 1)[-1] if candidate else ""
            last_word = last_word.rstrip("\"'\u201d\u2019)]").rstrip(".!?").lower()
            if last_word in _ABBREVIATIONS or len(last_word) == 1:
                continue  # "Mr. Smith", "J. Smith": not a sentence end
            sentences.append(candidate)
            start = match.end()
        rest = line[start:].strip()
        if rest:
            sentences.append(rest)
    return sentences


def _split_long(line: str) -> list[str]:
    """Cuts a line longer than MAX_LINE_CHARS at whitespace into bounded pieces."""
    if len(line) <= MAX_LINE_CHARS:
        return [line]
    pieces = []
    while len(line) > MAX_LINE_CHARS:
        cut = line.rfind(" ", 0, MAX_LINE_CHARS)
        cut = cut if cut > 0 else MAX_LINE_CHARS
        pieces.append(line[:cut])
        line = line[cut:].lstrip()
    if line:
        pieces.append(line)
    return pieces


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, decoded line without newline); bad UTF-8 → CorpusError."""
    for number, line in paths.text_lines(path, error=CorpusError, hint=None):
        yield number, line.rstrip("\r\n")


def read_reference(path: str) -> Iterator[Document]:
    """One sentence per line, blank line between documents."""
    doc: Document = []
    for _, line in _lines(path):
        line = line.strip()
        if not line:
            if doc:
                yield doc
            doc = []
            continue
        doc.extend(_split_long(line))
    if doc:
        yield doc


def read_plain(path: str) -> Iterator[Document]:
    """The whole file is one document, split into sentences."""
    text = "\n".join(piece for _, line in _lines(path) for piece in _split_long(line))
    doc = split_sentences(text)
    if doc:
        yield doc


def read_jsonl(path: str, text_key: str = "text") -> Iterator[Document]:
    """One JSON object per line with the document under `text_key`."""
    for number, record in paths.jsonl_records(path, CorpusError, hint=None):
        if not isinstance(record.get(text_key), str):
            raise CorpusError(f"{path}:{number}: expected an object with a string {text_key!r}")
        doc = [s for piece in _split_long(record[text_key]) for s in split_sentences(piece)]
        if doc:
            yield doc


def read_tfds(name: str, split: str = "train", text_key: str = "text", shard_index: int = 0,
              num_shards: int = 1, data_dir: str | None = None) -> Iterator[Document]:
    """Documents of a TFDS text dataset; shard i of n reads the i-th of n even sub-splits."""
    from bertjax.tf_setup import import_tfds

    tfds = import_tfds()

    sub_split = tfds.even_splits(split, num_shards)[shard_index] if num_shards > 1 else split
    ds = tfds.load(name, split=sub_split, data_dir=data_dir, shuffle_files=False)
    for example in ds.as_numpy_iterator():
        if text_key not in example:
            raise CorpusError(f"tfds:{name}: no feature {text_key!r} (has {sorted(example)})")
        text = example[text_key].decode("utf-8", errors="replace")
        doc = [s for piece in _split_long(text) for s in split_sentences(piece)]
        if doc:
            yield doc


def expand_inputs(inputs: str) -> list[str]:
    """Comma-separated files, globs or directories (all files below) → sorted file list."""
    files = []
    for part in filter(None, (p.strip() for p in inputs.split(","))):
        if os.path.isdir(part):
            matches = [os.path.join(root, name) for root, _, names in os.walk(part)
                       for name in names]
        else:
            matches = paths.glob(part)
        if not matches:
            raise CorpusError(f"{part}: no such input file")
        files.extend(matches)
    return sorted(set(files))


def require_documents(inputs: str, input_format: str = "reference", minimum: int = 1,
                      needed_for: str = "") -> None:
    """Raises CorpusError unless the input has at least `minimum` documents (checked before
    any output is written: an empty corpus would leave empty shards behind; a writer of
    sentence pairs needs a second document for its NotNext partners). needed_for: why, for
    the message."""
    if input_format == "tfds" or inputs.startswith("tfds:"):
        return  # a TFDS dataset is checked as it loads
    files = expand_inputs(inputs)
    documents = iter_documents(inputs, input_format)
    found = [doc for doc, _ in zip(documents, range(minimum))]
    if not found:
        raise CorpusError(f"{inputs}: no documents in {len(files)} file(s) (empty corpus?); "
                          "nothing written")
    if len(found) < minimum:
        expected = {"reference": "one sentence per line, blank lines between documents",
                    "plain": "a file per document"}.get(input_format, "a document per line")
        raise CorpusError(
            f"{inputs}: only {len(found)} document(s) in {len(files)} file(s) (the first of "
            f"{sum(map(len, found[0]))} characters), unusable {needed_for}; expected "
            f"{expected}; nothing written")


_READERS = {"reference": read_reference, "plain": read_plain, "jsonl": read_jsonl}


def iter_documents(inputs: str, input_format: str = "reference", shard_index: int = 0,
                   num_shards: int = 1) -> Iterator[Document]:
    """The documents of shard `shard_index` of `num_shards` (see module docstring)."""
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index {shard_index} not in [0, {num_shards})")
    if input_format == "tfds" or inputs.startswith("tfds:"):
        parts = inputs.removeprefix("tfds:").split(":")
        name, split, key = (parts + ["train", "text"][len(parts) - 1:])[:3]
        yield from read_tfds(name, split, key, shard_index, num_shards)
        return
    if input_format not in _READERS:
        raise ValueError(f"--input_format must be one of {sorted(_READERS) + ['tfds']}, "
                         f"got {input_format!r}")
    reader = _READERS[input_format]
    files = expand_inputs(inputs)
    if len(files) >= num_shards:  # whole files per shard: nobody reads what it does not use
        for path in files[shard_index::num_shards]:
            yield from reader(path)
        return
    k = 0
    for path in files:
        for doc in reader(path):
            if k % num_shards == shard_index:
                yield doc
            k += 1

"""Tagged sentences for token classification: CoNLL-2003 and other CoNLL column files, JSONL
`{"tokens": [...], "tags": [...]}` and TFDS `conll2003`, and the label set they imply.

Files are read in their own scheme (schemes.py), checked against it, and converted to the
scheme the model predicts.

Files are read in `encoding` (config.data.encoding, default UTF-8). Bad input stops with one
line naming file and line (`DataError`): a byte not of the encoding, ragged columns, a tag that
is not in the label set, a tag that breaks the declared scheme (e.g. an I- tag starting a chunk
in an iob2 file), an empty sentence, a JSON line that is not an object.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Sequence

from bertjax import paths
from bertjax.errors import DataError
from bertjax.tasks.chunks import chunk_files, write_jsonl
from bertjax.tasks.tagging.schemes import SCHEMES, convert, scheme_error, split_tag


@dataclasses.dataclass(frozen=True)
class Sentence:
    words: tuple[str, ...]
    tags: tuple[str, ...] | None  # None: unlabelled (nothing to score)
    source: str  # "file:line" of the first word (or "tfds name/split:index")
    # Sentences of one document share it; document context stays inside it. A document is what
    # the data marks (-DOCSTART- lines, a JSONL "document" field); unmarked sentences each
    # stand alone (a file of unrelated sentences, e.g. tweets, gets no context from its
    # neighbours).
    document: int
    lines: tuple[int, ...] = dataclasses.field(default=(), compare=False)  # each word's line

    def where(self, word: int = 0) -> str:
        """"file:line" of word `word` (for error messages)."""
        path = self.source.rpartition(":")[0]
        return f"{path}:{self.lines[word]}" if self.lines else self.source


@dataclasses.dataclass
class _Builder:
    """Collects one file's sentences, checking each against the scheme as it closes."""

    path: str
    scheme: str
    target: str
    labelled: bool
    sentences: list[Sentence] = dataclasses.field(default_factory=list)
    document: int = 0

    def add(self, words: list[str], tags: list[str] | None, lines: list[int]) -> None:
        if not words:
            raise DataError(f"{self.path}:{lines[0] if lines else '?'}: empty sentence")
        for word, line in zip(words, lines):
            if not word:
                raise DataError(f"{self.path}:{line}: empty token")
        if tags is not None:
            bad = scheme_error(tags, self.scheme)
            if bad is not None:
                raise DataError(f"{self.path}:{lines[bad[0]]}: {bad[1]}")
            tags = convert(tags, self.scheme, self.target)
        source = f"{self.path}:{lines[0]}"
        self.sentences.append(Sentence(tuple(words), None if tags is None else tuple(tags),
                                       source, self.document, tuple(lines)))


def _check_scheme(scheme: str, target: str) -> None:
    for name, value in (("scheme", scheme), ("target scheme", target)):
        if value not in SCHEMES:
            raise DataError(f"{name} {value!r} is not one of {' | '.join(SCHEMES)}")
    if (scheme == "none") != (target == "none"):
        raise DataError(f"cannot convert tags from {scheme!r} to {target!r}: plain tags "
                        "(scheme none) have no chunks")


def read_columns(path: str, *, token_column: int = 0, tag_column: int = -1,
                 scheme: str = "iob1", target: str = "iob2", labelled: bool = True,
                 first_document: int = 0, encoding: str = paths.DEFAULT_ENCODING
                 ) -> list[Sentence]:
    """A CoNLL column file: one token a line (columns split by tabs if the line has any,
    otherwise by whitespace), a blank line after each sentence, `-DOCSTART-` lines between
    documents (CoNLL-2003: `token POS chunk NER`, token_column 0, tag_column -1 = 3).

    Every line must have as many columns as the file's first token line. Without -DOCSTART-
    lines every sentence is a document by itself (a file of unrelated sentences: no document
    context); one -DOCSTART- line at the top makes the whole file one document.
    labelled=False: the tag column may be absent.
    """
    _check_scheme(scheme, target)
    builder = _Builder(path, scheme, target, labelled, document=first_document)
    words: list[str] = []
    tags: list[str] = []
    lines: list[int] = []
    width = None
    started = marked = False
    try:
        handle = paths.open_text(path, encoding)
    except OSError as e:
        raise DataError(f"{path}: {e.strerror}") from None
    with handle:
        for number, raw in enumerate(handle, 1):
            line = raw.rstrip("\r\n")
            columns = line.split("\t") if "\t" in line else line.split()
            if not line.strip():
                if words:
                    builder.add(words, tags if labelled else None, lines)
                    words, tags, lines = [], [], []
                continue
            if columns[0] == "-DOCSTART-":
                marked = True
                if words:
                    builder.add(words, tags if labelled else None, lines)
                    words, tags, lines = [], [], []
                if started:
                    builder.document += 1
                continue
            started = True
            if width is None:
                width = len(columns)
                for name, column in (("token", token_column),
                                     ("tag", tag_column if labelled else token_column)):
                    if not -width <= column < width:
                        raise DataError(f"{path}:{number}: the {name} column {column} does not "
                                        f"exist in a line of {width} columns")
            elif len(columns) != width:
                raise DataError(f"{path}:{number}: {len(columns)} columns, but the file's first "
                                f"token line has {width}")
            words.append(columns[token_column])
            if labelled:
                tags.append(columns[tag_column])
            lines.append(number)
    if words:
        builder.add(words, tags if labelled else None, lines)
    if not builder.sentences:
        raise DataError(f"{path}: no sentences")
    if not marked:
        return [dataclasses.replace(s, document=first_document + i)
                for i, s in enumerate(builder.sentences)]
    return builder.sentences


def read_jsonl(path: str, *, tokens_key: str = "tokens", tags_key: str = "tags",
               scheme: str = "iob2", target: str = "iob2", labelled: bool = True,
               first_document: int = 0, encoding: str = paths.DEFAULT_ENCODING
               ) -> list[Sentence]:
    """One JSON object a line: {"tokens": [...], "tags": [...]} and optionally "document" (any
    value): consecutive lines with the same value form a document; a line without the field
    is a document by itself (no document context)."""
    _check_scheme(scheme, target)
    builder = _Builder(path, scheme, target, labelled, document=first_document)
    previous_document = None
    for number, record in paths.jsonl_records(path, DataError, encoding):
        if not isinstance(record.get(tokens_key), list):
            raise DataError(f"{path}:{number}: no list field {tokens_key!r}")
        words = [str(w) for w in record[tokens_key]]
        tags = None
        if labelled:
            tags = record.get(tags_key)
            if not isinstance(tags, list):
                raise DataError(f"{path}:{number}: no list field {tags_key!r}")
            if len(tags) != len(words):
                raise DataError(f"{path}:{number}: {len(words)} tokens but {len(tags)} tags")
            tags = [str(t) for t in tags]
        document = record["document"] if "document" in record else object()  # unmarked: alone
        if builder.sentences and document != previous_document:
            builder.document += 1
        previous_document = document
        builder.add(words, tags, [number] * max(len(words), 1))
    if not builder.sentences:
        raise DataError(f"{path}: no sentences")
    return builder.sentences


def read_file(path: str, *, fmt: str = "auto", **kwargs) -> list[Sentence]:
    """`fmt`: conll | jsonl | auto (jsonl for *.jsonl / *.json, otherwise columns)."""
    if fmt == "auto":
        fmt = "jsonl" if path.endswith((".jsonl", ".json")) else "conll"
    if fmt == "jsonl":
        kwargs.pop("token_column", None)
        kwargs.pop("tag_column", None)
        return read_jsonl(path, **kwargs)
    if fmt == "conll":
        kwargs.pop("tokens_key", None)
        kwargs.pop("tags_key", None)
        return read_columns(path, **kwargs)
    raise DataError(f"{path}: format {fmt!r} is not one of conll | jsonl | auto")


def has_tags(path: str, fmt: str, tokens_key: str = "tokens", tags_key: str = "tags",
             encoding: str = paths.DEFAULT_ENCODING) -> bool:
    """Whether a file's first sentence carries tags: a JSONL `tags_key` field, or a CoNLL
    token line with a column besides the token's (unlabelled CoNLL: one word a line)."""
    if fmt == "jsonl":
        for number, record in paths.jsonl_records(path, DataError, encoding):
            if not isinstance(record.get(tokens_key), list):
                raise DataError(f"{path}:{number}: no list field {tokens_key!r}")
            return tags_key in record
        raise DataError(f"{path}: no sentences")
    try:
        handle = paths.open_text(path, encoding)
    except OSError as e:
        raise DataError(f"{path}: {e.strerror}") from None
    with handle:
        for raw in handle:
            line = raw.rstrip("\r\n")
            columns = line.split("\t") if "\t" in line else line.split()
            if line.strip() and columns[0] != "-DOCSTART-":
                return len(columns) > 1
    raise DataError(f"{path}: no sentences")


# TFDS `conll2003` split names for bertjax's split names.
TFDS_SPLITS = {"train": "train", "dev": "dev", "test": "test"}


def read_tfds(split: str, *, data_dir: str | None = None, tag_feature: str = "ner",
              scheme: str = "iob2", target: str = "iob2", name: str = "conll2003"
              ) -> list[Sentence]:
    """TFDS `conll2003` (features `tokens`, and class-label sequences `ner`, `pos`, `chunks`).

    TFDS keeps no document boundaries, so a split is one document (document context then reads
    across the neighbouring sentences of the split, which in CoNLL-2003 are mostly of the same
    article). Tags are mapped through the feature's class names.
    """
    from bertjax.tf_setup import import_tfds

    tfds = import_tfds()

    _check_scheme(scheme, target)
    builder = tfds.builder(name, data_dir=data_dir)
    names = builder.info.features[tag_feature].feature.names
    dataset = builder.as_dataset(split=TFDS_SPLITS.get(split, split))
    where = f"tfds {name}/{split}"
    out = _Builder(where, scheme, target, True)
    for index, record in enumerate(tfds.as_numpy(dataset)):
        words = [w.decode("utf-8") if isinstance(w, bytes) else str(w)
                 for w in record["tokens"]]
        ids = [int(i) for i in record[tag_feature]]
        if any(not 0 <= i < len(names) for i in ids):
            raise DataError(f"{where}:{index}: a tag id outside the {len(names)} class names")
        out.add(words, [names[i] for i in ids], [index] * max(len(words), 1))
    if not out.sentences:
        raise DataError(f"{where}: no sentences")
    return out.sentences


def infer_labels(sentences: Sequence[Sentence], scheme: str = "iob2") -> tuple[str, ...]:
    """Tags seen in `sentences`: "O" first (if present), then by type and prefix order (plain
    tags, scheme "none": sorted), so label ids do not depend on the order of the data."""
    order = {p: i for i, p in enumerate("BIES")}
    seen = {t for s in sentences if s.tags for t in s.tags}
    if scheme == "none":
        return tuple(sorted(seen))
    rest = sorted(seen - {"O"}, key=lambda t: (split_tag(t)[1], order.get(t[0], 9), t))
    return (("O",) if "O" in seen else ()) + tuple(rest)


def check_labels(sentences: Sequence[Sentence], labels: Sequence[str]) -> None:
    """Every tag must be in `labels` (tags converted to the target scheme)."""
    known = set(labels)
    for sentence in sentences:
        for offset, tag in enumerate(sentence.tags or ()):
            if tag not in known:
                raise DataError(f"{sentence.where(offset)}: unknown tag {tag!r} (in the model's "
                                f"scheme); labels are {', '.join(labels)}")


# Streaming (Task.input_chunks): chunks cut only between documents, so that a sentence's
# document context stays what the whole file gives it.


def conll_chunks(path: str, rows: int, directory: str, encoding: str = paths.DEFAULT_ENCODING
                 ) -> Iterator[tuple[str, int]]:
    """CoNLL chunks of at least `rows` sentences, cut only where a document starts
    (-DOCSTART-): a sentence's document context stays what the whole file gives it."""
    with paths.open_text(path, encoding) as f:
        yield from chunk_files(conll_documents(f), rows, directory, ".conll",
                               lambda out, documents: out.writelines(
                                   line for lines in documents for line in lines))


def conll_documents(lines: Iterable[str]) -> Iterator[tuple[list[str], int]]:
    """(a document's lines, from its -DOCSTART- line (none for the first) to the next, its
    sentences: runs of word lines)."""
    document, sentences, in_sentence = [], 0, False
    for raw in lines:
        fields = raw.split()
        if fields and fields[0] == "-DOCSTART-" and document:
            yield document, sentences
            document, sentences = [], 0
        if fields and fields[0] != "-DOCSTART-":
            sentences += not in_sentence
            in_sentence = True
        else:
            in_sentence = False
        document.append(raw if raw.endswith("\n") else raw + "\n")
    if document:
        yield document, sentences


def tagging_jsonl_chunks(path: str, rows: int, directory: str,
                         encoding: str = paths.DEFAULT_ENCODING) -> Iterator[tuple[str, int]]:
    """JSONL tagging chunks of at least `rows` sentences, cut only where a document starts (a
    line without a "document" field, or with another value than the line before)."""
    records = (record for _, record in paths.jsonl_records(path, DataError, encoding))
    # A line without a document field is a document of its own.
    documents = itertools.groupby(
        records, lambda record: record["document"] if "document" in record else object())
    units = ((group, len(group)) for group in (list(lines) for _, lines in documents))
    yield from chunk_files(units, rows, directory, ".jsonl",
                           lambda out, groups: write_jsonl(out, [r for g in groups for r in g]))

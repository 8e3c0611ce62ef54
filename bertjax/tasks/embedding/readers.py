"""Users' files for the embedding family: training rows of texts (anchor, positive, hard
negatives) or scored pairs (text_a, text_b, score) in CSV / TSV / JSONL, and retrieval sets in
the BEIR layout:

  DIR/corpus.jsonl       {"_id", "title" (optional), "text"} per line
  DIR/queries.jsonl      {"_id", "text"} per line
  DIR/qrels/SPLIT.tsv    query-id <TAB> corpus-id <TAB> score, after a header line

A document's text is its title and text joined by a space, as BEIR's sentence-embedding
models read it.
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Sequence

from bertjax import paths
from bertjax.errors import DataError
from bertjax.tasks.classification import readers as table


@dataclasses.dataclass(frozen=True)
class TextsExample:
    """Texts encoded each on its own, in columns (anchor, positive, negatives...; a scored
    pair's two texts; a single text), with the pair's score where there is one."""

    guid: str  # "file:line"
    texts: tuple[str, ...]
    score: float | None = None
    index: str = ""  # the row's id
    prompts: tuple[str, ...] = ()  # the prompt each text starts with (none: no prompts)


def read_texts(path: str, columns: Sequence[str], *, score: str = "", id_column: str = "id",
               field: str = "columns", encoding: str = paths.DEFAULT_ENCODING
               ) -> list[TextsExample]:
    """Rows of `columns` (each a non-empty text) from a .csv / .tsv / .jsonl file; `score`:
    the column of a scored pair's float score ("" for none). `field` names the setting that
    gave the columns, for errors."""
    examples = []
    for line, record in table.records(path, encoding):
        texts = tuple(table.text_field(record, c, path, line, field) for c in columns)
        value = None
        if score:
            value = table.regression_target(str(table.get_field(record, score, path, line,
                                                                "score")), f"{path}:{line}")
        row_id = record.get(id_column)
        index = str(len(examples)) if row_id is None or row_id == "" else str(row_id)
        examples.append(TextsExample(f"{path}:{line}", texts, value, index))
    if not examples:
        raise DataError(f"{path}: no examples")
    return examples


@dataclasses.dataclass
class RetrievalSet:
    """queries {id: text}, corpus {id: text}, qrels {query id: {corpus id: relevance}} (only
    the queries that have qrels)."""

    queries: dict[str, str]
    corpus: dict[str, str]
    qrels: dict[str, dict[str, int]]
    directory: str = ""  # where it was read (named in warnings)


def _jsonl_texts(path: str, encoding: str, with_title: bool) -> dict[str, str]:
    texts = {}
    for line, record in paths.jsonl_records(path, DataError, encoding):
        if "_id" not in record:
            raise DataError(f"{path}:{line}: no field '_id'")
        text = record.get("text")
        if not isinstance(text, str):
            raise DataError(f"{path}:{line}: no text field 'text'")
        title = record.get("title") if with_title else None
        text = f"{title} {text}".strip() if title else text.strip()
        if not text:
            raise DataError(f"{path}:{line}: empty text")
        key = str(record["_id"])
        if key in texts:
            raise DataError(f"{path}:{line}: _id {key!r} appears twice")
        texts[key] = text
    if not texts:
        raise DataError(f"{path}: no records")
    return texts


def read_qrels(path: str, queries: dict[str, str], corpus: dict[str, str],
               encoding: str = paths.DEFAULT_ENCODING) -> dict[str, dict[str, int]]:
    """{query id: {corpus id: relevance}} of a BEIR qrels TSV; ids absent from the queries or
    the corpus are errors (a typo would silently lower every score)."""
    qrels: dict[str, dict[str, int]] = {}
    with paths.open_text(path, encoding, newline="") as f:
        for number, row in enumerate(csv.reader(f, delimiter="\t"), start=1):
            if not row or not "".join(row).strip():
                continue
            if number == 1 and not row[-1].strip().lstrip("-").isdigit():
                continue  # the header
            if len(row) < 3:
                raise DataError(f"{path}:{number}: expected query-id, corpus-id, score (tab "
                                f"separated), got {len(row)} field(s)")
            query, doc, value = row[0].strip(), row[1].strip(), row[-1].strip()
            if query not in queries:
                raise DataError(f"{path}:{number}: query id {query!r} is not in queries.jsonl")
            if doc not in corpus:
                raise DataError(f"{path}:{number}: corpus id {doc!r} is not in corpus.jsonl")
            try:
                relevance = int(value)
            except ValueError:
                raise DataError(f"{path}:{number}: score {value!r} is not an integer") from None
            qrels.setdefault(query, {})[doc] = relevance
    if not any(r > 0 for judged in qrels.values() for r in judged.values()):
        raise DataError(f"{path}: no relevant (score > 0) pair")
    return qrels


def read_beir(directory: str, split: str, encoding: str = paths.DEFAULT_ENCODING
              ) -> RetrievalSet:
    """The BEIR layout of `directory` (module docstring) with qrels/`split`.tsv."""
    files = {name: paths.join(directory, *name.split("/"))
             for name in ("corpus.jsonl", "queries.jsonl", f"qrels/{split}.tsv")}
    for path in files.values():
        if not paths.exists(path):
            raise DataError(f"{path}: no such file (a BEIR directory holds corpus.jsonl, "
                            f"queries.jsonl and qrels/{split}.tsv)")
    corpus = _jsonl_texts(files["corpus.jsonl"], encoding, with_title=True)
    queries = _jsonl_texts(files["queries.jsonl"], encoding, with_title=False)
    qrels = read_qrels(files[f"qrels/{split}.tsv"], queries, corpus, encoding)
    return RetrievalSet({q: queries[q] for q in qrels}, corpus, qrels, directory)

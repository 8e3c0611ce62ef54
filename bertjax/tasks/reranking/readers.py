"""Users' files for the reranking family.

Training rows, CSV / TSV / JSONL, the text columns in config.data.columns and the number in
config.data.label:

  labelled   query, passage, label       label 1 relevant, 0 not (or a probability in [0, 1])
  distill    query, passage, score       a teacher's score of the pair
  listwise   query, positive, negative_1 .. negative_n
  margin     query, positive, negative, margin   the teacher's positive minus negative score

Candidate lists (the dev set, and what `python -m bertjax.predict rerank` reads), JSONL, one
query a line:

  {"id": "q1", "query": "...", "candidates": [{"id": "d7", "text": "...", "relevant": 1},
                                              {"id": "d2", "text": "..."}, "a passage", ...]}

"id"s are optional (a query's is then its 0-based row, a candidate's its position); a
candidate is an object with "text" or the text itself; "relevant" (a number, 0 when absent; 1
relevant, or graded 2, 3 ...) makes the line judged, and the metrics read the judged lines.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from bertjax import paths
from bertjax.errors import DataError
from bertjax.tasks.classification import readers as table


@dataclasses.dataclass(frozen=True)
class RerankExample:
    """A query and the passages scored against it: a pair's one, a training group's positive
    first; `target` the row's label, teacher score or margin (0 where it has none)."""

    guid: str  # "file:line"
    query: str
    passages: tuple[str, ...]
    target: float = 0.0
    index: str = ""  # the row's id


def _number(record: dict, column: str, path: str, line: int) -> float:
    if record.get(column) is None:
        raise DataError(f"{path}:{line}: no column {column!r} (config.data.label); the file's "
                        f"columns: {', '.join(map(str, record))}")
    return table.regression_target(str(record[column]), f"{path}:{line}: column {column!r}")


def read_rows(path: str, columns: Sequence[str], label: str = "", *, probability: bool = False,
              encoding: str = paths.DEFAULT_ENCODING) -> list[RerankExample]:
    """Training rows of a .csv / .tsv / .jsonl file: the texts of `columns` (query first, then
    the passages, each non-empty), the number in column `label` ("" for none; probability:
    it must lie in [0, 1], a binary cross-entropy's target)."""
    examples = []
    for line, record in table.records(path, encoding):
        texts = [table.text_field(record, c, path, line, "columns") for c in columns]
        target = _number(record, label, path, line) if label else 0.0
        if probability and not 0.0 <= target <= 1.0:
            raise DataError(f"{path}:{line}: label {target:g} (column {label!r}) is not in "
                            "[0, 1]: 1 relevant, 0 not, or a probability")
        examples.append(RerankExample(f"{path}:{line}", texts[0], tuple(texts[1:]), target,
                                      str(len(examples))))
    if not examples:
        raise DataError(f"{path}: no examples")
    return examples


@dataclasses.dataclass(frozen=True)
class CandidateList:
    """A query and its candidates (ids and texts in the file's order); relevance: each
    candidate's judgement (0 where not given), None where the line judges none."""

    guid: str  # "file:line"
    id: str
    query: str
    ids: tuple[str, ...]
    texts: tuple[str, ...]
    relevance: tuple[float, ...] | None = None


def _candidate(item, where: str, position: int) -> tuple[str, str, float | None]:
    """(id, text, relevance or None) of one entry of "candidates"."""
    if isinstance(item, str):
        item = {"text": item}
    if not isinstance(item, dict):
        raise DataError(f"{where}: give a text or an object with \"text\", not "
                        f"{type(item).__name__}")
    text = item.get("text")
    if not isinstance(text, str) or not text.strip():
        raise DataError(f"{where}: no text (a non-empty string \"text\")")
    relevant = item.get("relevant")
    if relevant is not None and (isinstance(relevant, bool) or not isinstance(
            relevant, (int, float)) or not math.isfinite(relevant)):
        raise DataError(f"{where}: \"relevant\" {relevant!r} is not a number (1 relevant, 0 "
                        "not, or a grade)")
    key = item.get("id")
    return str(position) if key is None else str(key), text.strip(), relevant


def read_candidates(path: str, encoding: str = paths.DEFAULT_ENCODING) -> list[CandidateList]:
    """The candidate lists of a JSONL file (module docstring), in its order."""
    lists: list[CandidateList] = []
    seen: set[str] = set()
    for line, record in paths.jsonl_records(path, DataError, encoding):
        where = f"{path}:{line}"
        query = record.get("query")
        if not isinstance(query, str) or not query.strip():
            raise DataError(f"{where}: no query (a non-empty string \"query\"); the line's "
                            f"fields: {', '.join(map(str, record))}")
        candidates = record.get("candidates")
        if not isinstance(candidates, list):
            raise DataError(f"{where}: no list \"candidates\" (the passages to rerank)")
        if not candidates:
            raise DataError(f"{where}: \"candidates\" is empty; give the passages to rerank")
        key = str(record["id"]) if record.get("id") is not None else str(len(lists))
        if key in seen:
            raise DataError(f"{where}: query id {key!r} appears twice")
        seen.add(key)
        parsed = [_candidate(c, f"{where}: candidates[{i}]", i) for i, c in enumerate(candidates)]
        ids = [p[0] for p in parsed]
        if len(set(ids)) < len(ids):
            repeated = next(i for i in ids if ids.count(i) > 1)
            raise DataError(f"{where}: candidate id {repeated!r} appears twice")
        judged = any(p[2] is not None for p in parsed)
        relevance = tuple(float(p[2] or 0) for p in parsed) if judged else None
        lists.append(CandidateList(where, key, query.strip(), tuple(ids),
                                   tuple(p[1] for p in parsed), relevance))
    if not lists:
        raise DataError(f"{path}: no candidate lists")
    return lists


def pair_examples(lists: Sequence[CandidateList]) -> list[RerankExample]:
    """Each list's (query, candidate) pairs, list after list in the candidates' order."""
    return [RerankExample(c.guid, c.query, (text,), 0.0, f"{c.id}/{key}")
            for c in lists for key, text in zip(c.ids, c.texts)]

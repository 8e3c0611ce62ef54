"""Streaming a file of new rows larger than memory: chunk files of about `rows` rows each,
written to a directory, each readable by the task's `read_inputs` (`Task.input_chunks`;
`bertjax.Predictor.predict_stream`). Every chunker yields (chunk path, its first row's 0-based
number in the whole file) in order; the chunks are UTF-8 whatever the input's encoding."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

from bertjax import paths
from bertjax.errors import DataError


def chunk_files(units: Iterable[tuple[Any, int]], rows: int, directory: str, suffix: str,
                write: Callable[[IO[str], list], None]) -> Iterator[tuple[str, int]]:
    """Consecutive units (an item, the rows it holds) gathered into chunk files of at least
    `rows` rows, cut only between units: (`directory`/chunk<n><suffix>, its first row's
    0-based number), each written by `write(file, items)`. An empty input gives one empty
    chunk (what the one-shot reader reads of an empty file)."""
    start, items, count, number = 0, [], 0, 0

    def flush() -> str:
        chunk = os.path.join(directory, f"chunk{number}{suffix}")
        with open(chunk, "w", encoding="utf-8", newline="") as f:
            write(f, items)
        return chunk

    for item, n in units:
        if count >= rows:
            yield flush(), start
            start, items, count, number = start + count, [], 0, number + 1
        items.append(item)
        count += n
    if items or start == 0:
        yield flush(), start


def csv_chunks(path: str, rows: int, id_field: str, directory: str, fill_empty: bool = True,
               encoding: str = paths.DEFAULT_ENCODING) -> Iterator[tuple[str, int]]:
    """CSV / TSV chunks, the header repeated; a row without an id (the column absent, or with
    `fill_empty` its cell empty) gets its 0-based row number in the whole file (what the
    one-shot reader gives it)."""
    delimiter = "\t" if path.lower().endswith(".tsv") else ","
    with paths.open_text(path, encoding, newline="") as f:
        reader = csv.reader(f, delimiter=delimiter)
        header = next((h for h in reader if h and any(x.strip() for x in h)), None)
        if header is None:
            raise DataError(f"{path}: empty file (expected a header row)")
        names = [h.strip() for h in header]
        add_id = id_field not in names
        column = len(header) if add_id else names.index(id_field)

        def with_id(index: int, row: list[str]) -> list[str]:
            if add_id:
                return row + [""] * max(len(header) - len(row), 0) + [str(index)]
            if fill_empty and column < len(row) and row[column] == "":
                return row[:column] + [str(index)] + row[column + 1:]
            return row

        def write(out, batch):
            writer = csv.writer(out, delimiter=delimiter)
            writer.writerow(header + ([id_field] if add_id else []))
            writer.writerows(batch)

        filled = enumerate(row for row in reader if row and any(x.strip() for x in row))
        yield from chunk_files(((with_id(i, row), 1) for i, row in filled), rows, directory,
                               path[-4:], write)


def jsonl_chunks(path: str, rows: int, id_field: str | None, directory: str,
                 encoding: str = paths.DEFAULT_ENCODING) -> Iterator[tuple[str, int]]:
    """JSONL chunks; an object without `id_field` gets its 0-based number in the whole file."""
    records = enumerate(record for _, record in paths.jsonl_records(path, DataError, encoding))
    units = (({**record, id_field: i} if id_field and id_field not in record else record, 1)
             for i, record in records)
    yield from chunk_files(units, rows, directory, ".jsonl", write_jsonl)


def write_jsonl(out: IO[str], records: list[dict[str, Any]]) -> None:
    out.writelines(dump(r) + "\n" for r in records)


def json_array_items(path: str, key: str, block: int = 1 << 20,
                     encoding: str = paths.DEFAULT_ENCODING) -> Iterator[Any]:
    """The items of the array `key` of the JSON object in `path`, one at a time, reading
    `block` characters at a time (a file larger than memory, e.g. SQuAD's {"data": [...]});
    the object's other values are read and dropped."""
    decoder = json.JSONDecoder()
    state = {"buffer": "", "pos": 0, "eof": False, "block": block}
    handle = paths.open_text(path, encoding)

    def more() -> bool:
        text = handle.read(state["block"])
        state["eof"] = not text
        state["buffer"] = state["buffer"][state["pos"]:] + text
        state["pos"] = 0
        return bool(text)

    def peek() -> str:
        while True:
            buffer, pos = state["buffer"], state["pos"]
            while pos < len(buffer) and buffer[pos] in " \t\r\n":
                pos += 1
            state["pos"] = pos
            if pos < len(buffer):
                return buffer[pos]
            if not more():
                raise DataError(f"{path}: the JSON ends early")

    def take(expected: str) -> None:
        if peek() not in expected:
            raise DataError(f"{path}: not a JSON object with a {key!r} list (expected "
                            f"{' or '.join(expected)} at {state['buffer'][state['pos']:][:20]!r})")
        state["pos"] += 1

    def value():
        while True:
            peek()
            try:
                item, end = decoder.raw_decode(state["buffer"], state["pos"])
                if end < len(state["buffer"]) or state["eof"]:  # a number may continue
                    state["pos"] = end
                    return item
            except json.JSONDecodeError as e:
                if state["eof"]:
                    raise DataError(f"{path}: not valid JSON ({e.msg})") from None
            state["block"] *= 2  # an item longer than the buffer: read more at a time
            more()

    with handle:
        take("{")
        while peek() != "}":
            name = value()
            take(":")
            if name != key:
                value()
            else:
                take("[")
                while peek() != "]":
                    yield value()
                    if peek() != "]":
                        take(",")
                take("]")
            if peek() != "}":
                take(",")
        take("}")


def by_extension(path: str, rows: int, fields: dict[str, Any], directory: str
                 ) -> Iterator[tuple[str, int]]:
    """CSV / TSV / JSONL chunks, ids from fields["id"] (default "id"); `path` read in
    fields["encoding"] (default UTF-8)."""
    lower = path.lower()
    encoding = fields.get("encoding") or paths.DEFAULT_ENCODING
    if lower.endswith((".csv", ".tsv")):
        return csv_chunks(path, rows, fields.get("id") or "id", directory, encoding=encoding)
    if lower.endswith(".jsonl"):
        return jsonl_chunks(path, rows, fields.get("id") or "id", directory, encoding)
    raise DataError(f"--input={path}: streaming (--chunk_rows) reads .csv, .tsv, .jsonl, "
                    "SQuAD-layout .json, CoNLL or JSONL tagging files")


def dump(record: dict[str, Any]) -> str:
    """One JSONL line (non-ASCII kept as written)."""
    return json.dumps(record, ensure_ascii=False)

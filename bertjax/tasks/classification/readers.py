"""Readers of sequence-level fine-tuning examples: the 9 GLUE tasks (official directory layout
or TFDS `glue/<task>`), SWAG (official CSV files) and users' own CSV / TSV / JSONL files.

Readers return lists of `Example` (text pairs) or `ChoiceExample` (multiple choice), the input
types of data_pipeline/finetune_data.py; labels are class ids (int, an index into the task's
label names), floats (regression) or None (test sets). Files are read in `encoding`
(config.data.encoding, default UTF-8). Bad input stops with one line naming the file and line:
a byte not of the encoding, a missing column, an empty text, a label outside the label set. The
official GLUE files are tab-separated without quoting (the texts contain bare quote
characters), CoLA's train/dev files have no header, and QQP's train / dev files have rows with
missing fields, which the reference skips (so does this reader). TensorFlow (TFDS) is imported
only when a TFDS split is read.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from absl import logging

from bertjax import paths
from bertjax.errors import DataError
from data_pipeline.finetune_data import ChoiceExample, Example

# Some GLUE / SWAG fields are longer than csv's default field limit.
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))


# ---------------------------------------------------------------------------------------------
# GLUE task definitions


@dataclasses.dataclass(frozen=True)
class Split:
    name: str  # eval name ("dev", "matched") or the submission file stem ("MNLI-m")
    file: str  # file in the official GLUE task directory
    tfds_split: str


@dataclasses.dataclass(frozen=True)
class GlueTask:
    name: str  # config name: cola, sst2, ...
    directory: str  # official GLUE directory name: CoLA, SST-2, ...
    labels: tuple[str, ...]  # label names as in the files and on the leaderboard; () = regression
    metrics: tuple[str, ...]  # metrics.py names; the first one selects checkpoints
    text_a: str | int  # column name (header) or index (CoLA: no header)
    text_b: str | int | None
    label: str | int
    tfds_text: tuple[str, ...]  # TFDS feature names of text_a (and text_b)
    dev: tuple[Split, ...]
    test: tuple[Split, ...]
    header: bool = True  # train/dev files have a header row (test files always have one)
    test_text: tuple[str, ...] = ()  # test-file columns when they differ from train/dev
    skip_malformed: bool = False  # QQP: skip train/dev rows with missing fields, as reference

    @property
    def regression(self) -> bool:
        return not self.labels

    @property
    def num_labels(self) -> int:
        return len(self.labels) or 1

    @property
    def primary_metric(self) -> str:
        return f"{self.dev[0].name}_{self.metrics[0]}" if len(self.dev) > 1 else self.metrics[0]


def _standard_splits(stem: str) -> tuple[tuple[Split, ...], tuple[Split, ...]]:
    return (Split("dev", "dev.tsv", "validation"),), (Split(stem, "test.tsv", "test"),)


def _task(name, directory, labels, metrics, text_a, text_b, label, tfds_text, **kw) -> GlueTask:
    dev, test = _standard_splits(directory)
    kw.setdefault("dev", dev)
    kw.setdefault("test", test)
    return GlueTask(name, directory, labels, metrics, text_a, text_b, label, tfds_text, **kw)


BINARY = ("0", "1")
# Label order = TFDS ClassLabel order, so TFDS label ids are used as they are.
GLUE_TASKS: dict[str, GlueTask] = {t.name: t for t in (
    # CoLA train/dev: source, label, original label, sentence — no header.
    _task("cola", "CoLA", BINARY, ("matthews_corrcoef",), 3, None, 1, ("sentence",),
          header=False, test_text=("sentence",)),
    _task("sst2", "SST-2", BINARY, ("accuracy",), "sentence", None, "label", ("sentence",)),
    _task("mrpc", "MRPC", BINARY, ("f1", "accuracy"), "#1 String", "#2 String", "Quality",
          ("sentence1", "sentence2")),
    _task("stsb", "STS-B", (), ("spearman", "pearson"), "sentence1", "sentence2", "score",
          ("sentence1", "sentence2")),
    _task("qqp", "QQP", BINARY, ("f1", "accuracy"), "question1", "question2", "is_duplicate",
          ("question1", "question2"), skip_malformed=True),
    _task("mnli", "MNLI", ("entailment", "neutral", "contradiction"), ("accuracy",),
          "sentence1", "sentence2", "gold_label", ("premise", "hypothesis"),
          dev=(Split("matched", "dev_matched.tsv", "validation_matched"),
               Split("mismatched", "dev_mismatched.tsv", "validation_mismatched")),
          test=(Split("MNLI-m", "test_matched.tsv", "test_matched"),
                Split("MNLI-mm", "test_mismatched.tsv", "test_mismatched"))),
    _task("qnli", "QNLI", ("entailment", "not_entailment"), ("accuracy",), "question",
          "sentence", "label", ("question", "sentence")),
    _task("rte", "RTE", ("entailment", "not_entailment"), ("accuracy",), "sentence1",
          "sentence2", "label", ("sentence1", "sentence2")),
    _task("wnli", "WNLI", BINARY, ("accuracy",), "sentence1", "sentence2", "label",
          ("sentence1", "sentence2")),
)}


def glue_task(name: str) -> GlueTask:
    """The GLUE task definition of a config name (cola, sst2, "SST-2", ...)."""
    key = name.lower().replace("-", "")
    if key not in GLUE_TASKS:
        raise DataError(f"unknown GLUE task {name!r}; choose one of {sorted(GLUE_TASKS)}")
    return GLUE_TASKS[key]


# ---------------------------------------------------------------------------------------------
# Rows of delimited files


def _open_rows(path: str, delimiter: str, quoting: int, encoding: str = paths.DEFAULT_ENCODING
               ) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields) for every non-blank record of a CSV/TSV file."""
    with paths.open_text(path, encoding, newline="") as f:
        reader = csv.reader(f, delimiter=delimiter, quoting=quoting)
        for fields in reader:
            if fields and any(x.strip() for x in fields):
                yield reader.line_num, fields


def _column(header: list[str] | None, key: str | int, path: str) -> int:
    if isinstance(key, int):
        return key
    if header is None or key not in header:
        raise DataError(f"{path}: no column {key!r} in the header {header}")
    return header.index(key)


def _field(fields: list[str], column: int, name: Any, path: str, line: int) -> str:
    if column >= len(fields):
        raise DataError(f"{path}:{line}: missing column {name!r} (the row has {len(fields)} "
                        f"fields)")
    return fields[column]


def nonempty_text(value: str, name: Any, path: str, line: int) -> str:
    if not value.strip():
        raise DataError(f"{path}:{line}: empty text in column {name!r}")
    return value


def label_id(value: str, labels: Sequence[str], where: str) -> int:
    value = value.strip()
    if value not in labels:
        raise DataError(f"{where}: label {value!r} is not one of {list(labels)}")
    return list(labels).index(value)


def regression_target(value: str, where: str) -> float:
    try:
        target = float(value)
    except ValueError:
        raise DataError(f"{where}: regression label {value!r} is not a number") from None
    if not math.isfinite(target):  # would end, steps later, as "loss is nan"
        raise DataError(f"{where}: regression label {value!r} is not a finite number")
    return target


# ---------------------------------------------------------------------------------------------
# GLUE: the official directory layout


def task_directory(data_dir: str, task: GlueTask) -> str:
    """`data_dir` itself, or its official subdirectory (glue_data/SST-2) when present."""
    sub = paths.join(data_dir, task.directory)
    return sub if paths.isdir(sub) else data_dir


def read_glue_file(path: str, task: GlueTask, labelled: bool,
                   encoding: str = paths.DEFAULT_ENCODING) -> list[Example]:
    """One official GLUE TSV file: train/dev (`labelled`) or test (no labels, an index)."""
    if not paths.exists(path):
        raise DataError(f"{path}: no such file (expected the official GLUE {task.directory} "
                        "layout)")
    rows = _open_rows(path, "\t", csv.QUOTE_NONE, encoding)
    has_header = task.header or not labelled
    header = [h.strip() for h in next(rows)[1]] if has_header else None
    if labelled:
        names = (task.text_a, task.text_b)
        label_col = _column(header, task.label, path)
    else:
        names = tuple(task.test_text) or (task.text_a, task.text_b)
        names = names + (None,) * (2 - len(names))
        label_col = None
    text_cols = [None if n is None else _column(header, n, path) for n in names]
    index_col = next((header.index(k) for k in ("index", "id") if header and k in header), None)
    examples, skipped = [], 0
    for line, fields in rows:
        where = f"{path}:{line}"
        try:
            texts = [None if c is None
                     else nonempty_text(_field(fields, c, n, path, line), n, path, line)
                     for c, n in zip(text_cols, names)]
            if label_col is None:
                label = None
            else:
                raw = _field(fields, label_col, task.label, path, line)
                label = (regression_target(raw, where) if task.regression
                         else label_id(raw, task.labels, where))
        except DataError:
            if labelled and task.skip_malformed:
                skipped += 1
                continue
            raise
        index = fields[index_col] if index_col is not None else str(len(examples))
        examples.append(Example(where, texts[0], texts[1], label, index))
    if skipped:
        logging.warning("%s: skipped %d malformed rows (as the reference does)", path, skipped)
    return examples


def read_glue(data_dir: str, task: GlueTask, encoding: str = paths.DEFAULT_ENCODING
              ) -> dict[str, list[Example]]:
    """{"train": ..., <dev split names>: ..., <test submission names>: ...} from a directory."""
    directory = task_directory(data_dir, task)
    splits = {"train": read_glue_file(paths.join(directory, "train.tsv"), task, True, encoding)}
    for split in task.dev:
        splits[split.name] = read_glue_file(paths.join(directory, split.file), task, True,
                                            encoding)
    for split in task.test:
        path = paths.join(directory, split.file)
        if paths.exists(path):  # test sets are optional (no submission without them)
            splits[split.name] = read_glue_file(path, task, False, encoding)
    return splits


# ---------------------------------------------------------------------------------------------
# GLUE: TFDS


def read_tfds_split(task: GlueTask, split: str, labelled: bool,
                    data_dir: str | None = None) -> list[Example]:
    from bertjax.tf_setup import import_tfds

    tfds = import_tfds()

    name = f"glue/{task.name}"
    dataset = tfds.load(name, split=split, data_dir=data_dir, shuffle_files=False)
    examples = []
    for record in tfds.as_numpy(dataset):
        idx = int(record["idx"])
        where = f"{name}[{split}] idx {idx}"
        texts = [record[k].decode("utf-8") for k in task.tfds_text]
        for key, text in zip(task.tfds_text, texts):
            nonempty_text(text, key, name, f"[{split}] idx {idx}")
        label = None
        if labelled:
            if task.regression:
                label = float(record["label"])
            else:
                label = int(record["label"])
                if not 0 <= label < task.num_labels:
                    raise DataError(f"{where}: label {label} is outside 0..{task.num_labels - 1}")
        examples.append(Example(where, texts[0], texts[1] if len(texts) > 1 else None, label,
                                str(idx)))
    examples.sort(key=lambda e: int(e.index))  # submissions list test examples by index
    return examples


def read_glue_tfds(task: GlueTask, data_dir: str | None = None) -> dict[str, list[Example]]:
    splits = {"train": read_tfds_split(task, "train", True, data_dir)}
    for split in task.dev:
        splits[split.name] = read_tfds_split(task, split.tfds_split, True, data_dir)
    for split in task.test:
        splits[split.name] = read_tfds_split(task, split.tfds_split, False, data_dir)
    return splits


# ---------------------------------------------------------------------------------------------
# SWAG: the official CSV files (train.csv, val.csv, test.csv)

SWAG_ENDINGS = ("ending0", "ending1", "ending2", "ending3")


def read_swag_file(path: str, labelled: bool, encoding: str = paths.DEFAULT_ENCODING
                   ) -> list[ChoiceExample]:
    """Context = sent1; each choice's second segment = sent2 + " " + ending_i (the paper's
    `[CLS] context [SEP] ending [SEP]`, where sent2 starts every ending)."""
    if not paths.exists(path):
        raise DataError(f"{path}: no such file (expected the official SWAG CSV)")
    rows = _open_rows(path, ",", csv.QUOTE_MINIMAL, encoding)
    header = [h.strip() for h in next(rows)[1]]
    needed = ("sent1", "sent2", *SWAG_ENDINGS) + (("label",) if labelled else ())
    cols = {k: _column(header, k, path) for k in needed}
    id_col = header.index("fold-ind") if "fold-ind" in header else None
    examples = []
    for line, fields in rows:
        value = {k: _field(fields, c, k, path, line) for k, c in cols.items()}
        context = nonempty_text(value["sent1"], "sent1", path, line)
        endings = tuple(nonempty_text(f"{value['sent2']} {value[k]}".strip(), k, path, line)
                        for k in SWAG_ENDINGS)
        label = (label_id(value["label"], ("0", "1", "2", "3"), f"{path}:{line}")
                 if labelled else None)
        index = fields[id_col] if id_col is not None else str(len(examples))
        examples.append(ChoiceExample(f"{path}:{line}", context, endings, label, index))
    return examples


def read_swag(data_dir: str, encoding: str = paths.DEFAULT_ENCODING
              ) -> dict[str, list[ChoiceExample]]:
    splits = {"train": read_swag_file(paths.join(data_dir, "train.csv"), True, encoding),
              "dev": read_swag_file(paths.join(data_dir, "val.csv"), True, encoding)}
    test = paths.join(data_dir, "test.csv")
    if paths.exists(test):
        splits["test"] = read_swag_file(test, False, encoding)
    return splits


# ---------------------------------------------------------------------------------------------
# Users' own files: CSV, TSV or JSONL with configurable columns


def records(path: str, encoding: str = paths.DEFAULT_ENCODING
             ) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line, {column: value}) for a .csv, .tsv or .jsonl file (type from the extension)."""
    if not paths.exists(path):
        raise DataError(f"{path}: no such file")
    lower = path.lower()
    if lower.endswith((".jsonl", ".json")):
        yield from paths.jsonl_records(path, DataError, encoding)
        return
    if lower.endswith(".tsv"):
        delimiter = "\t"
    elif lower.endswith(".csv"):
        delimiter = ","
    else:
        raise DataError(f"{path}: unknown file type; use .csv, .tsv or .jsonl")
    rows = _open_rows(path, delimiter, csv.QUOTE_MINIMAL, encoding)
    try:
        header = [h.strip() for h in next(rows)[1]]
    except StopIteration:
        raise DataError(f"{path}: empty file (expected a header row)") from None
    for line, fields in rows:
        if len(fields) < len(header):
            raise DataError(f"{path}:{line}: missing column {header[len(fields)]!r} (the row has "
                            f"{len(fields)} fields, the header {len(header)})")
        if len(fields) > len(header):  # would shift a piece of text into the label column
            raise DataError(f"{path}:{line}: the row has {len(fields)} fields but the header "
                            f"{len(header)} (an unquoted {'comma' if delimiter == ',' else 'tab'}"
                            " in a text? quote the field)")
        yield line, dict(zip(header, fields))


# The column settings `python -m bertjax.predict` also takes as flags (--text_a, ...).
PREDICT_FIELDS = ("text_a", "text_b", "label", "choices", "id")


def get_field(record: dict[str, Any], column: str, path: str, line: int, field: str) -> Any:
    """record[column]; `field`: the setting that names the column (config.data.<field>, and
    predict's --<field> where it has one), for the error."""
    if column not in record or record[column] is None:
        setting = f"config.data.{field}" + (f", predict --{field}" if field in PREDICT_FIELDS
                                            else "")
        raise DataError(f"{path}:{line}: no column {column!r} ({setting}); the file's "
                        f"columns: {', '.join(map(str, record))}")
    return record[column]


def text_field(record: dict[str, Any], column: str, path: str, line: int, field: str) -> str:
    """The non-empty text of record[column] (`field` as in `get_field`)."""
    return nonempty_text(str(get_field(record, column, path, line, field)), column, path, line)


def first_record(path: str, encoding: str = paths.DEFAULT_ENCODING) -> dict[str, Any]:
    """The first row of a user file as {column: value} (a CSV / TSV header-only file: its
    columns, empty values), to tell labelled from unlabelled files."""
    for _, record in records(path, encoding):
        return record
    if path.lower().endswith((".csv", ".tsv")):
        header = next(_open_rows(path, "\t" if path.lower().endswith(".tsv") else ",",
                                 csv.QUOTE_MINIMAL, encoding))[1]
        return {h.strip(): "" for h in header}
    raise DataError(f"{path}: no examples")


def read_file(path: str, kind: str, *, text_a: str, text_b: str = "", label: str = "label",
              choices: Sequence[str] = (), labels: Sequence[str] | None = None,
              labelled: bool = True, id_column: str = "", encoding: str = paths.DEFAULT_ENCODING,
              rows=None) -> list[Example] | list[ChoiceExample]:
    """Examples of `kind` (classification | regression | multiple_choice) from a user file.

    classification: `labels` are the label names (ids follow their order); multiple_choice:
    `text_a` is the context, `choices` the ending columns, and `label` the 0-based index of
    the right one. Unlabelled files (test sets) need no label column. Each example's `index`
    is its `id_column` value where the row has one, else its 0-based row number. rows: the
    file's (line, record) pairs where the caller has read them (`records`).
    """
    examples = []
    for line, record in records(path, encoding) if rows is None else rows:
        where = f"{path}:{line}"
        row_id = record.get(id_column) if id_column else None
        index = str(len(examples)) if row_id is None or row_id == "" else str(row_id)
        raw = str(get_field(record, label, path, line, "label")) if labelled else None
        if kind == "multiple_choice":
            context = text_field(record, text_a, path, line, "text_a")
            endings = tuple(text_field(record, c, path, line, "choices") for c in choices)
            y = label_id(raw, [str(i) for i in range(len(choices))], where) if labelled else None
            examples.append(ChoiceExample(where, context, endings, y, index))
            continue
        a = text_field(record, text_a, path, line, "text_a")
        b = text_field(record, text_b, path, line, "text_b") if text_b else None
        if not labelled:
            y = None
        elif kind == "regression":
            y = regression_target(raw, where)
        elif kind == "classification":
            if labels is None:
                raise DataError(f"{path}: label names are needed (infer_labels or config)")
            y = label_id(raw, labels, where)
        else:
            raise DataError(f"unknown task kind {kind!r}; use classification | regression | "
                            "multiple_choice")
        examples.append(Example(where, a, b, y, index))
    if not examples:
        raise DataError(f"{path}: no examples")
    return examples


def infer_labels(path: str, label: str, encoding: str = paths.DEFAULT_ENCODING, rows=None
                 ) -> tuple[str, ...]:
    """The sorted distinct values of column `label` (numeric order when all are integers);
    rows: as for `read_file`."""
    values = set()
    for line, record in records(path, encoding) if rows is None else rows:
        value = str(get_field(record, label, path, line, "label")).strip()
        if not value:  # would become a class of its own
            raise DataError(f"{path}:{line}: empty label in column {label!r}")
        values.add(value)
    try:
        return tuple(sorted(values, key=int))
    except ValueError:
        return tuple(sorted(values))

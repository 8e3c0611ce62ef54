"""SQuAD v1.1 / v2.0 readers: the official JSON layout (`data → paragraphs → qas`, also
users' own files) and the TFDS `squad/v1.1` / `squad/v2.0` splits, as `SquadExample`s (one per
question). Files are read in `encoding` (config.data.encoding, default UTF-8). Every answer is
checked against the context characters at its `answer_start`; bad input is one line naming
the file (or split) and the question, or the line of a byte not of the encoding.

TensorFlow is imported only by `read_squad_tfds`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

from bertjax import paths
from bertjax.errors import ConfigError, DataError
from bertjax.tasks.chunks import chunk_files, dump, json_array_items


@dataclasses.dataclass
class SquadExample:
    """One question. answers: (text, answer_start) pairs (several on dev; none when
    unanswerable). For v2.0 training files the first answer is the one trained on."""

    qas_id: str
    question: str
    context: str
    answers: list[tuple[str, int]]
    is_impossible: bool = False
    title: str = ""


def _field(record: dict, key: str, kind, where: str):
    if not isinstance(record, dict) or key not in record:
        raise DataError(f"{where}: missing field {key!r}")
    value = record[key]
    if not isinstance(value, kind):
        raise DataError(f"{where}: field {key!r} is {type(value).__name__}, "
                        f"expected {kind.__name__ if isinstance(kind, type) else kind}")
    return value


def check_answer(context: str, text: str, start: int, where: str) -> None:
    """The answer's characters must be the context's at answer_start."""
    found = context[start:start + len(text)] if 0 <= start <= len(context) else None
    if found != text:
        raise DataError(f"{where}: answer {text!r} does not match the context at "
                        f"answer_start={start} (the context has {found!r} there)")


def parse_squad(data: dict, source: str, require_answers: bool = True) -> list[SquadExample]:
    """Examples of a parsed SQuAD-format dict (`data → paragraphs → qas`).
    require_answers=False: a question without an `answers` field is read unanswered (new
    questions to predict)."""
    examples = []
    articles = _field(data, "data", list, source)
    for a, article in enumerate(articles):
        title = article.get("title", "") if isinstance(article, dict) else ""
        for p, paragraph in enumerate(_field(article, "paragraphs", list,
                                             f"{source}: data[{a}]")):
            where_p = f"{source}: data[{a}].paragraphs[{p}]"
            context = _field(paragraph, "context", str, where_p)
            for q, qa in enumerate(_field(paragraph, "qas", list, where_p)):
                qid = qa.get("id") if isinstance(qa, dict) else None
                where = f"{source}: question {qid}" if qid else f"{where_p}.qas[{q}]"
                qid = str(_field(qa, "id", (str, int), where))
                question = _field(qa, "question", str, where)
                impossible = bool(qa.get("is_impossible", False))
                answers = []
                if not require_answers and not impossible and "answers" not in qa:
                    examples.append(SquadExample(qid, question, context, [], False, title))
                    continue
                for ans in _field(qa, "answers", list, where) if not impossible else []:
                    text = _field(ans, "text", str, where)
                    start = _field(ans, "answer_start", int, where)
                    check_answer(context, text, start, where)
                    answers.append((text, start))
                if not impossible and not answers:
                    raise DataError(f"{where}: no answers and is_impossible is not true")
                examples.append(SquadExample(qid, question, context, answers, impossible,
                                             title))
    if not examples:
        raise DataError(f"{source}: no questions")
    ids = [e.qas_id for e in examples]
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dup = next(i for i in ids if i in seen or seen.add(i))
        raise DataError(f"{source}: question {dup}: id used more than once")
    return examples


def read_squad_json(path: str, require_answers: bool = True,
                    encoding: str = paths.DEFAULT_ENCODING) -> list[SquadExample]:
    """Examples of an official-layout SQuAD JSON file (v1.1 or v2.0, or users' own)."""
    if not paths.exists(path):
        raise DataError(f"{path}: no such file")
    try:
        data = json.loads(paths.read_text(path, encoding))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from e
    return parse_squad(data, path, require_answers)


def read_questions_jsonl(path: str, question: str = "question", context: str = "context",
                         id_field: str = "id", encoding: str = paths.DEFAULT_ENCODING
                         ) -> list[SquadExample]:
    """Unanswered questions of a JSONL file, one {question, context[, id]} object a line (the
    id defaults to the 0-based line number among the questions)."""
    examples = []
    for number, record in paths.jsonl_records(path, DataError, encoding):
        where = f"{path}:{number}"
        text = _field(record, question, str, where)
        passage = _field(record, context, str, where)
        qid = str(record.get(id_field, len(examples)))
        examples.append(SquadExample(qid, text, passage, []))
    if not examples:
        raise DataError(f"{path}: no questions")
    return examples


TFDS_NAMES = ("squad/v1.1", "squad/v2.0")


def read_squad_tfds(name: str, split: str, data_dir: str | None = None) -> list[SquadExample]:
    """Examples of a TFDS SQuAD split (`squad/v1.1` or `squad/v2.0`; split train/validation)."""
    from bertjax.tf_setup import import_tfds

    tfds = import_tfds()

    if name not in TFDS_NAMES:
        raise ConfigError(f"tfds:{name} is not one of {' | '.join(TFDS_NAMES)}")
    source = f"tfds:{name}[{split}]"
    try:
        dataset = tfds.load(name, split=split, data_dir=data_dir or None, download=False)
    except Exception as e:  # noqa: BLE001 - TFDS raises many kinds; one line names the cause
        raise DataError(f"{source}: cannot load ({type(e).__name__}: {e}); prepare it with "
                        "tfds build squad first") from e

    def text(x) -> str:
        return x.decode("utf-8") if isinstance(x, bytes) else str(x)

    examples = []
    for record in tfds.as_numpy(dataset):
        qid = text(record["id"])
        where = f"{source}: question {qid}"
        context = text(record["context"])
        answers = [(text(t), int(s)) for t, s in zip(record["answers"]["text"],
                                                      record["answers"]["answer_start"])]
        impossible = bool(record.get("is_impossible", False)) or not answers
        for answer_text, start in answers:
            check_answer(context, answer_text, start, where)
        examples.append(SquadExample(qid, text(record["question"]), context,
                                     [] if impossible else answers, impossible,
                                     text(record.get("title", b""))))
    if not examples:
        raise DataError(f"{source}: no questions")
    return examples


def read_squad(spec: str, split: str, data_dir: str | None = None,
               encoding: str = paths.DEFAULT_ENCODING) -> list[SquadExample]:
    """A local JSON file, or `tfds:squad/v2.0` (split: `train` or `validation`)."""
    if spec.startswith("tfds:"):
        return read_squad_tfds(spec[len("tfds:"):], split, data_dir)
    return read_squad_json(spec, encoding=encoding)


def squad_json_chunks(path: str, rows: int, directory: str,
                      encoding: str = paths.DEFAULT_ENCODING) -> Iterator[tuple[str, int]]:
    """SQuAD-layout .json chunks of whole paragraphs holding at least `rows` questions (an
    article's paragraphs may fall in two chunks: each question is predicted by itself)."""
    def paragraphs():
        for article in json_array_items(path, "data", encoding=encoding):
            if not isinstance(article, dict):
                raise DataError(f"{path}: data[] holds {type(article).__name__}, not articles")
            for paragraph in article.get("paragraphs") or ():
                questions = (len(paragraph.get("qas") or ()) if isinstance(paragraph, dict)
                             else 0)
                yield {"title": article.get("title", ""), "paragraphs": [paragraph]}, questions

    yield from chunk_files(paragraphs(), rows, directory, ".json",
                           lambda out, articles: out.write(dump({"data": articles})))

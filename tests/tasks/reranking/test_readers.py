"""The reranking family's files: training rows and candidate lists read, bad input as one line
naming the file, line and field; the metrics of candidates ordered by score (ties keep the
input order) against hand-computed values; the configs refuse what a kind cannot read."""

import json

import numpy as np
import pytest
import reranking_data as data

from bertjax import tasks
from bertjax.errors import ConfigError, DataError
from bertjax.tasks.reranking import metrics, readers
from experiments import reranking


def write(tmp_path, name, rows):
    return data.write_jsonl(tmp_path / name, rows)


def test_training_rows_of_each_kind(tmp_path):
    rows = readers.read_rows(data.write_labelled(tmp_path / "l.jsonl", 3),
                             ("query", "passage"), "label", probability=True)
    assert len(rows) == 6 and [r.target for r in rows[:2]] == [1.0, 0.0]
    assert all(len(r.passages) == 1 for r in rows)
    columns = ("query", "positive", "negative_1", "negative_2")
    rows = readers.read_rows(data.write_listwise(tmp_path / "g.jsonl", 4, negatives=2), columns)
    assert rows[0].guid.endswith("g.jsonl:1") and len(rows[0].passages) == 3
    csv = tmp_path / "m.csv"
    csv.write_text("query,positive,negative,margin\nq one,p one,n one,2.5\n")
    (row,) = readers.read_rows(str(csv), ("query", "positive", "negative"), "margin")
    assert (row.query, row.passages, row.target) == ("q one", ("p one", "n one"), 2.5)


def test_bad_training_rows_are_one_line_naming_the_file_line_and_field(tmp_path):
    labelled = data.write_labelled(tmp_path / "l.jsonl", 2)
    with pytest.raises(DataError, match=r"l.jsonl:1: no column 'answer' \(config.data.columns"
                                        r".*the file's columns: query, passage, label"):
        readers.read_rows(labelled, ("query", "answer"), "label")
    with pytest.raises(DataError, match=r"l.jsonl:1: no column 'score' \(config.data.label\)"):
        readers.read_rows(labelled, ("query", "passage"), "score")
    bad = write(tmp_path, "b.jsonl", [{"query": "q", "passage": "p", "label": 2}])
    with pytest.raises(DataError, match=r"b.jsonl:1: label 2 \(column 'label'\) is not in "
                                        r"\[0, 1\]"):
        readers.read_rows(bad, ("query", "passage"), "label", probability=True)
    bad = write(tmp_path, "n.jsonl", [{"query": "q", "passage": "p", "label": "high"}])
    with pytest.raises(DataError, match=r"n.jsonl:1: column 'label': regression label 'high' "
                                        "is not a number"):
        readers.read_rows(bad, ("query", "passage"), "label")


def test_candidate_lists_take_ids_texts_and_judgements(tmp_path):
    path = write(tmp_path, "c.jsonl", [
        {"id": 7, "query": "q a", "candidates": [{"id": "x", "text": "one", "relevant": 2},
                                                 "two", {"text": " three "}]},
        {"query": "q b", "candidates": ["four"]}])
    first, second = readers.read_candidates(path)
    assert (first.id, first.ids, first.texts) == ("7", ("x", "1", "2"), ("one", "two", "three"))
    assert first.relevance == (2.0, 0.0, 0.0) and second.relevance is None
    assert second.id == "1" and second.guid.endswith("c.jsonl:2")
    pairs = readers.pair_examples([first, second])
    assert [(p.query, p.passages, p.index) for p in pairs[2:]] == [
        ("q a", ("three",), "7/2"), ("q b", ("four",), "1/0")]


@pytest.mark.parametrize("line, message", [
    ({"query": "q", "candidates": []}, r":1: \"candidates\" is empty; give the passages"),
    ({"query": "q"}, r":1: no list \"candidates\""),
    ({"question": "q", "candidates": ["a"]}, r":1: no query .*fields: question, candidates"),
    ({"query": "q", "candidates": ["a", {"id": 3}]}, r":1: candidates\[1\]: no text"),
    ({"query": "q", "candidates": ["a", 5]}, r":1: candidates\[1\]: give a text or an object"),
    ({"query": "q", "candidates": [{"text": "a", "relevant": "yes"}]},
     r":1: candidates\[0\]: \"relevant\" 'yes' is not a number"),
    ({"query": "q", "candidates": [{"id": "d", "text": "a"}, {"id": "d", "text": "b"}]},
     r":1: candidate id 'd' appears twice"),
])
def test_bad_candidate_lists_are_one_line_naming_the_line(tmp_path, line, message):
    path = write(tmp_path, "c.jsonl", [line])
    with pytest.raises(DataError, match="c.jsonl" + message) as error:
        readers.read_candidates(path)
    assert "\n" not in str(error.value)


def test_repeated_query_ids_and_empty_files_are_refused(tmp_path):
    path = write(tmp_path, "c.jsonl", [{"id": "q", "query": "a", "candidates": ["x"]}] * 2)
    with pytest.raises(DataError, match=r"c.jsonl:2: query id 'q' appears twice"):
        readers.read_candidates(path)
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DataError, match="e.jsonl: no candidate lists"):
        readers.read_candidates(str(tmp_path / "e.jsonl"))


def test_metrics_of_candidates_ordered_by_score(tmp_path):
    path = write(tmp_path, "c.jsonl", [
        {"id": "a", "query": "q", "candidates": [{"text": "x", "relevant": 0},
                                                 {"text": "y", "relevant": 1},
                                                 {"text": "z", "relevant": 0}]},
        {"id": "b", "query": "q", "candidates": [{"text": "x", "relevant": 1}, "y"]},
        {"id": "c", "query": "q", "candidates": ["x"]}])  # not judged: not counted
    lists = readers.read_candidates(path)
    scores = np.array([0.5, 0.2, 0.9, 1.0, 1.0, 3.0])
    orders = metrics.orders(lists, scores)
    assert [o.tolist() for o in orders] == [[2, 0, 1], [0, 1], [0]]  # the tie: input order
    found = metrics.reranking_metrics(lists, scores)
    assert found == pytest.approx({"ndcg@10": (0.5 + 1.0) / 2, "mrr@10": (1 / 3 + 1.0) / 2})
    before = metrics.reranking_metrics(lists, metrics.input_order(lists))
    assert before == pytest.approx({"ndcg@10": (1 / np.log2(3) + 1.0) / 2,
                                    "mrr@10": (0.5 + 1.0) / 2})


def config_for(tmp_path, kind="labelled", **fields):
    config = reranking.get_config(kind)
    config.init_checkpoint = data.tiny_checkpoint(tmp_path)
    config.max_seq_length = 32
    config.data.update(fields)
    return config


def test_configs_refuse_what_a_kind_cannot_read(tmp_path):
    with pytest.raises(ValueError, match="unknown kind 'pointwise'"):
        reranking.get_config("pointwise")
    train = data.write_labelled(tmp_path / "t.jsonl", 4)
    config = config_for(tmp_path, train=train)
    with pytest.raises(ConfigError, match="config.data.validation is empty; give a dev file"):
        tasks.train_and_evaluate(config, str(tmp_path / "run"))
    config = reranking.get_config("margin")
    config.init_checkpoint, config.max_seq_length = str(tmp_path / "ckpt"), 32
    config.data.update(train=train, validation=train, columns="query,passage")
    with pytest.raises(ConfigError, match=r"config.data.columns='query,passage': a margin task "
                                          "reads 3 text columns"):
        tasks.train_and_evaluate(config, str(tmp_path / "run"))
    config.task.activation = "tanh"
    with pytest.raises(ConfigError, match="config.task.activation='tanh' is not one of"):
        tasks.get_task(config)


def test_a_dev_set_without_a_relevant_candidate_is_refused(tmp_path):
    config = config_for(tmp_path, train=data.write_labelled(tmp_path / "t.jsonl", 4),
                        validation=data.write_candidates(tmp_path / "d.jsonl", 3, judged=False))
    with pytest.raises(DataError, match=r"d.jsonl: no relevant candidate"):
        tasks.train_and_evaluate(config, str(tmp_path / "run"))
    assert json.loads(open(config.data.validation).readline())["candidates"]

"""The TFDS reader (`tfds:squad/v1.1`, `tfds:squad/v2.0`) on tfds.testing.mock_data records
in the squad builder's feature layout: questions, several answers, unanswerable ones, splits,
and a mismatching answer_start as one line."""

import numpy as np
import pytest

from bertjax.errors import DataError
from bertjax.tasks.squad import readers

CONTEXT = "Tom went to Paris in 1905 with Ann."
RECORDS = {
    "train": [dict(id="t1", title="A", context=CONTEXT, question="Where?",
                   answers=dict(text=["Paris"], answer_start=[12]), is_impossible=False)],
    "validation": [
        dict(id="v1", title="A", context=CONTEXT, question="When?",
             answers=dict(text=["1905", "in 1905"], answer_start=[21, 18]),
             is_impossible=False),
        dict(id="v2", title="A", context=CONTEXT, question="Who flew?",
             answers=dict(text=[], answer_start=[]), is_impossible=True),
    ],
}


def mock(records):
    import tensorflow as tf
    import tensorflow_datasets as tfds

    def as_dataset(self, *args, split=None, **kwargs):
        rows = records[str(split if split is not None else args[0])]

        def generate():
            for r in rows:
                yield {"id": r["id"], "title": r["title"], "context": r["context"],
                       "question": r["question"], "is_impossible": r["is_impossible"],
                       "answers": {"text": np.array(r["answers"]["text"], dtype=object),
                                   "answer_start": np.array(r["answers"]["answer_start"],
                                                            np.int32)}}

        string = tf.TensorSpec([], tf.string)
        return tf.data.Dataset.from_generator(generate, output_signature={
            "id": string, "title": string, "context": string, "question": string,
            "is_impossible": tf.TensorSpec([], tf.bool),
            "answers": {"text": tf.TensorSpec([None], tf.string),
                        "answer_start": tf.TensorSpec([None], tf.int32)}})

    return tfds.testing.mock_data(as_dataset_fn=as_dataset)


def test_tfds_squad_v2_and_v1():
    with mock(RECORDS):
        train = readers.read_squad("tfds:squad/v2.0", "train")
        dev = readers.read_squad("tfds:squad/v2.0", "validation")
        v1 = readers.read_squad("tfds:squad/v1.1", "train")
    assert [(e.qas_id, e.answers, e.is_impossible) for e in train] == [
        ("t1", [("Paris", 12)], False)]
    assert v1[0].answers == [("Paris", 12)] and v1[0].title == "A"
    assert dev[0].answers == [("1905", 21), ("in 1905", 18)] and not dev[0].is_impossible
    assert dev[1].is_impossible and dev[1].answers == []
    assert dev[0].context == CONTEXT and dev[1].question == "Who flew?"


def test_tfds_bad_answer_is_one_line():
    bad = {"train": [dict(RECORDS["train"][0], answers=dict(text=["Paris"],
                                                            answer_start=[3]))]}
    with mock(bad), pytest.raises(DataError) as info:
        readers.read_squad("tfds:squad/v1.1", "train")
    assert str(info.value).startswith("tfds:squad/v1.1[train]: question t1: answer 'Paris'")
    assert "\n" not in str(info.value)

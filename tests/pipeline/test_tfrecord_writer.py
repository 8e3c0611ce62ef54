"""The TensorFlow-free TFRecord writer against TensorFlow's own Example encoder and writer."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from data_pipeline import tfrecords


def random_features(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """1-D features covering every varint length, negatives, extremes, floats and empty lists."""
    info = np.iinfo(np.int64)
    wide = rng.integers(info.min, info.max, 40, dtype=np.int64, endpoint=True)
    # Random bits at every position, bit 63 included (negative numbers).
    shifted = rng.integers(0, 2, 64, dtype=np.int64) << np.arange(64, dtype=np.int64)
    return {
        "input_ids": rng.integers(0, 30_522, 128),
        "input_mask": (np.arange(128) < rng.integers(1, 129)).astype(np.int64),
        "segment_ids": rng.integers(0, 2, 128),
        "wide": np.concatenate([wide, [info.min, info.max, -1, 0, 127, 128, 16383, 16384]]),
        "powers": np.left_shift(np.int64(1), np.arange(63, dtype=np.int64)) - 1,
        "shifted": shifted,
        "next_sentence_labels": rng.integers(0, 2, 1),
        "masked_lm_weights": rng.normal(size=20).astype(np.float32),
        "empty_ints": np.zeros(0, np.int64),
        "empty_floats": np.zeros(0, np.float32),
        "ünïcode name": rng.integers(-5, 5, 3),
    }


def tf_example_bytes(features: dict[str, np.ndarray]) -> bytes:
    feats = {
        k: tf.train.Feature(float_list=tf.train.FloatList(value=v.tolist())) if v.dtype.kind == "f"
        else tf.train.Feature(int64_list=tf.train.Int64List(value=v.tolist()))
        for k, v in features.items()}
    return tf.train.Example(features=tf.train.Features(feature=feats)).SerializeToString(
        deterministic=True)


def test_crc32c_check_value():
    # The standard CRC-32C (Castagnoli) check value of "123456789" (RFC 3720 test data).
    import google_crc32c

    assert google_crc32c.value(b"123456789") == 0xE3069283


def test_examples_are_byte_identical_to_tensorflow():
    rng = np.random.default_rng(0)
    for _ in range(20):
        features = random_features(rng)
        assert tfrecords.serialize_example(features) == tf_example_bytes(features)
    assert tfrecords.serialize_example({}) == tf_example_bytes({})


def test_batch_encoding_equals_one_at_a_time_and_parses():
    rng = np.random.default_rng(1)
    rows = [random_features(rng) for _ in range(16)]
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    encoded = tfrecords.serialize_examples(batch)
    assert encoded == [tf_example_bytes(r) for r in rows]
    spec = {k: tf.io.FixedLenFeature([len(v)], tf.float32 if v.dtype.kind == "f" else tf.int64)
            for k, v in rows[0].items()}
    for serialized, row in zip(encoded, rows):
        parsed = tf.io.parse_single_example(serialized, spec)
        for k, v in row.items():
            np.testing.assert_array_equal(parsed[k].numpy(), v)


def test_shard_files_equal_tf_record_writer_and_crcs_verify(tmp_path):
    rng = np.random.default_rng(2)
    records = [tfrecords.serialize_example(random_features(rng)) for _ in range(10)]
    records.append(b"")  # a zero-length record frames too
    ours = str(tmp_path / "ours.tfrecord")
    with tfrecords.ShardWriter(ours) as w:
        w.write(records[0])
        w.write_many(records[1:])
    assert w.count == len(records)
    reference = str(tmp_path / "tf.tfrecord")
    with tf.io.TFRecordWriter(reference) as w:
        for r in records:
            w.write(r)
    data = open(ours, "rb").read()
    assert data == open(reference, "rb").read()
    read = [r.numpy() for r in tf.data.TFRecordDataset(ours)]  # TF checks both CRCs
    assert read == records
    # The CRCs are really checked: one flipped byte in a record's data or length is an error.
    for offset in (len(data) // 2, 3):
        corrupt = bytearray(data)
        corrupt[offset] ^= 0x01
        path = tmp_path / f"corrupt{offset}.tfrecord"
        path.write_bytes(bytes(corrupt))
        with pytest.raises(tf.errors.DataLossError):
            list(tf.data.TFRecordDataset(str(path)))


def test_bad_feature_shape_names_the_feature():
    with pytest.raises(ValueError, match="feature 'b': expected"):
        tfrecords.serialize_examples({"a": np.zeros((2, 3)), "b": np.zeros((3, 3))})


def test_creation_path_never_imports_tensorflow(tmp_path, project_root):
    from conftest import run_python

    words = [f"w{i}" for i in range(50)]
    (tmp_path / "vocab.txt").write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    docs = [" ".join(words[(d + s) % 50] for s in range(12)) + ".\n" for d in range(30)]
    (tmp_path / "corpus.txt").write_text("\n".join(d + d for d in docs))
    script = textwrap.dedent(f"""
        import functools, sys
        from data_pipeline import create_pretraining_data as cpd
        cfg = cpd.CreateConfig(input={str(tmp_path / "corpus.txt")!r},
                               output_dir={str(tmp_path / "out")!r}, masking="static",
                               dupe_factor=2, num_shards=2)
        meta = cpd.create_pretraining_data(
            cfg, functools.partial(cpd.load_tokenizer, {str(tmp_path / "vocab.txt")!r}, None))
        assert meta["counts"]["instances"] > 0
        assert "tensorflow" not in sys.modules, "TensorFlow imported"
    """)
    result = run_python(["-c", script])
    assert result.returncode == 0, result.stderr[-2000:]
    read = list(tf.data.TFRecordDataset(sorted(
        str(p) for p in (tmp_path / "out").glob("part-*.tfrecord"))))
    assert len(read) == json.loads((tmp_path / "out" / "metadata.json").read_text())[
        "counts"]["instances"]

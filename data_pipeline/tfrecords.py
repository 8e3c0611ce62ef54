"""TFRecord shards in the reference schema, plus the JSON metadata written beside them.

Reference features (all int64 in the file except masked_lm_weights, float):
  input_ids, input_mask, segment_ids [seq]; masked_lm_positions, masked_lm_ids,
  masked_lm_weights [max_predictions]; next_sentence_labels [1] (0 = IsNext, 1 = NotNext).
Unmasked (dynamic-masking) records carry only input_ids, input_mask, segment_ids and
next_sentence_labels.

Shards are written under a temporary name and renamed when complete, so a crash never leaves a
partial file that matches `part-*.tfrecord`; the metadata is written last the same way.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

import numpy as np

METADATA_PREFIX = "metadata"
SHARD_PATTERN = "part-*.tfrecord"


def shard_name(index: int, count: int) -> str:
    return f"part-{index:05d}-of-{count:05d}.tfrecord"


def feature_spec(seq_len: int, max_predictions: int, masked: bool) -> dict:
    """tf.io parsing spec of the reference features (unmasked: no masked_lm_* features)."""
    import tensorflow as tf

    spec = {
        "input_ids": tf.io.FixedLenFeature([seq_len], tf.int64),
        "input_mask": tf.io.FixedLenFeature([seq_len], tf.int64),
        "segment_ids": tf.io.FixedLenFeature([seq_len], tf.int64),
        "next_sentence_labels": tf.io.FixedLenFeature([1], tf.int64),
    }
    if masked:
        spec.update({
            "masked_lm_positions": tf.io.FixedLenFeature([max_predictions], tf.int64),
            "masked_lm_ids": tf.io.FixedLenFeature([max_predictions], tf.int64),
            "masked_lm_weights": tf.io.FixedLenFeature([max_predictions], tf.float32),
        })
    return spec


def pad_example(tokens: np.ndarray, segment_ids: np.ndarray, is_random_next: bool,
                seq_len: int, masked: tuple[np.ndarray, np.ndarray] | None,
                max_predictions: int) -> dict[str, np.ndarray]:
    """Pads one instance to the reference shapes.

    tokens, segment_ids: [n] with n <= seq_len; masked: (positions [k], labels [k]) or None.
    Returns NumPy arrays: input_ids/input_mask/segment_ids [seq_len] int64,
    masked_lm_* [max_predictions], next_sentence_labels [1].
    """
    n = len(tokens)
    if n > seq_len:
        raise ValueError(f"instance of {n} tokens longer than max_seq_length {seq_len}")
    out = {
        "input_ids": np.zeros(seq_len, np.int64),
        "input_mask": np.zeros(seq_len, np.int64),
        "segment_ids": np.zeros(seq_len, np.int64),
        "next_sentence_labels": np.array([int(is_random_next)], np.int64),
    }
    out["input_ids"][:n] = tokens
    out["input_mask"][:n] = 1
    out["segment_ids"][:n] = segment_ids
    if masked is not None:
        positions, labels = masked
        k = len(positions)
        out["masked_lm_positions"] = np.zeros(max_predictions, np.int64)
        out["masked_lm_ids"] = np.zeros(max_predictions, np.int64)
        out["masked_lm_weights"] = np.zeros(max_predictions, np.float32)
        out["masked_lm_positions"][:k] = positions
        out["masked_lm_ids"][:k] = labels
        out["masked_lm_weights"][:k] = 1.0
    return out


def serialize_example(features: dict[str, np.ndarray]) -> bytes:
    """tf.train.Example bytes of a dict of 1-D arrays (float arrays → FloatList)."""
    import tensorflow as tf

    feature = {}
    for name, value in features.items():
        if value.dtype.kind == "f":
            feature[name] = tf.train.Feature(float_list=tf.train.FloatList(value=value.tolist()))
        else:
            feature[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=value.tolist()))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString(
        deterministic=True)  # sorted map keys: byte-identical output in every process


class ShardWriter:
    """Writes one TFRecord shard atomically: `<path>.tmp` while writing, renamed on close."""

    def __init__(self, path: str):
        import tensorflow as tf

        self.path = path
        self._tmp = path + ".tmp"
        self._writer = tf.io.TFRecordWriter(self._tmp)
        self.count = 0

    def write(self, serialized: bytes) -> None:
        self._writer.write(serialized)
        self.count += 1

    def close(self) -> None:
        self._writer.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._writer.close()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()


def vocab_hash(tokens: list[str]) -> str:
    """sha256 of the vocabulary in id order (one token per line) — identifies any tokenizer."""
    return hashlib.sha256("\n".join(tokens).encode("utf-8")).hexdigest()


def write_json_atomic(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def metadata_files(file_pattern: str) -> list[str]:
    """The metadata*.json files in the directory of a shard pattern (may be empty)."""
    directory = os.path.dirname(file_pattern) or "."
    return sorted(glob.glob(os.path.join(glob.escape(directory), METADATA_PREFIX + "*.json")))


def read_metadata(file_pattern: str) -> tuple[str, dict] | None:
    """(path, metadata) of the data at `file_pattern`, or None when there is none."""
    files = metadata_files(file_pattern)
    if not files:
        return None
    with open(files[0]) as f:
        try:
            return files[0], json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{files[0]}: invalid JSON ({e.msg})") from None

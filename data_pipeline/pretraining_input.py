"""tf.data reader of pre-training TFRecords → per-host batches of NumPy arrays.

One global order, whatever the number of hosts: every process reads all the files (sorted)
→ shuffle file order → repeat → interleave records → shuffle → global batches (drop
remainder: static shapes) → prefetch; that stream is the same on every process, and the batch
at step s holds the same examples on 1, 2 or N hosts. Each process then takes its rows of the
global batch, parses them and masks them (`GlobalBatches.to_host`; the masks are drawn for the
whole global batch, so a row gets the same mask on any number of hosts). Every random op has a
seed, so the stream is deterministic for a seed, and `InputIterator.save/restore` checkpoints
the global stream's position (shuffle buffers included): a resumed run neither replays nor
skips data, and resumes on a slice with another number of hosts too.

The request is first checked against the metadata.json beside the files
(`data_pipeline.metadata`), which also gives the dynamic masking config
(`masking_from_metadata`, re-exported here).

A phase is (data path, seq length, max predictions): 128/20 for phase 1, 512/80 for phase 2.

Bad files are named before or while reading: 0-byte shards (what an empty corpus leaves) are
skipped with a warning, or refused when every file is empty (repeating an empty dataset would
spin forever); the first record of each file must carry the features read (`check_schema`);
a truncated or corrupted record found by tf.data is reported with its file and byte offset
(`InputIterator`).

Batches (`[batch]` = this host's rows of the global batch, batch_size / process_count):
  input_ids, input_mask, segment_ids: [batch, seq] int32
  masked_lm_positions, masked_lm_ids: [batch, max_predictions] int32
  masked_lm_weights: [batch, max_predictions] float32
  next_sentence_labels: [batch] int32
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np
from absl import logging

from bertjax import paths
from bertjax.errors import DataError
from bertjax.tf_setup import import_tensorflow
from data_pipeline import masking as masking_lib
from data_pipeline import metadata, tfrecords
from data_pipeline.hosts import host_rows
from data_pipeline.masking import MaskingConfig
from data_pipeline.metadata import masking_from_metadata

tf = import_tensorflow()

__all__ = ["GlobalBatches", "InputIterator", "MaskingConfig", "check_schema", "data_files",
           "feature_spec", "host_rows", "make_dataset", "masking_from_metadata",
           "record_stream"]


def feature_spec(seq_len: int, max_predictions: int, masked: bool) -> dict:
    """tf.io parsing spec of the reference features (unmasked: no masked_lm_* features)."""
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


def _is_empty(path: str) -> bool:
    return os.path.isfile(path) and os.path.getsize(path) == 0  # (a FIFO is not "empty")


def data_files(file_pattern: str) -> list[str]:
    """The non-empty files of `file_pattern` (comma-separated globs), sorted; every process
    reads them all. Empty (0-byte) files are skipped with a warning naming them, and refused
    when every file is empty."""
    files = sorted(f for pattern in file_pattern.split(",") for f in paths.glob(pattern))
    if not files:
        raise DataError(f"{file_pattern}: no files match")
    empty = [f for f in files if _is_empty(f)]
    if len(empty) == len(files):
        raise DataError(f"{file_pattern}: all {len(files)} matching files are empty (0 bytes, "
                        f"e.g. {files[0]}); was the corpus they were made from empty?")
    if empty:
        logging.warning("%s: skipping %d empty (0-byte) files: %s", file_pattern, len(empty),
                        ", ".join(empty))
        files = [f for f in files if f not in set(empty)]
    return files


@dataclasses.dataclass(frozen=True)
class GlobalBatches:
    """An input as every process sees it. `stream`: (batch index, global batch) elements, the
    same on every process (its iterator state is the input position saved in checkpoints);
    `to_host(index, element)`: this process's rows of that batch, parsed and masked, as a
    dict of tensors; `files`: the files read (to name the one at fault)."""

    stream: tf.data.Dataset
    to_host: Callable[[Any, Any], dict[str, Any]]
    files: tuple[str, ...]


_TF_KINDS = {tf.int64: "int64_list", tf.float32: "float_list", tf.string: "bytes_list"}


def check_schema(files: list[str], spec: dict) -> None:
    """The first record of each file must have every feature of `spec` (a FixedLenFeature
    spec), of its kind and length; otherwise a DataError names the file and the feature."""
    for path in files:
        if not os.path.isfile(path):  # e.g. a FIFO: reading ahead would consume or block
            continue
        with open(path, "rb") as f:
            try:
                first = next(tfrecords.frames(f), None)
            except tfrecords.FramingError as e:
                raise DataError(f"{path}: {e}; not a TFRecord file, or a damaged one") from None
        if first is None:
            continue
        try:
            features = tf.train.Example.FromString(first[1]).features.feature
        except Exception:  # protobuf's DecodeError
            raise DataError(f"{path}: the first record is not a tf.train.Example") from None
        missing = sorted(set(spec) - set(features))
        if missing:
            raise DataError(
                f"{path}: records lack feature(s) {', '.join(missing)} (they have "
                f"{', '.join(sorted(features)) or 'none'}); not pre-training data of this kind")
        for name, want in spec.items():
            kind = features[name].WhichOneof("kind")
            count = len(getattr(features[name], kind).value) if kind else 0
            if kind != _TF_KINDS[want.dtype] or count != want.shape[0]:
                raise DataError(f"{path}: feature {name} is {kind} of {count} values, expected "
                                f"{_TF_KINDS[want.dtype]} of {want.shape[0]} (the seq_len / "
                                "max_predictions the data was made with?)")


def _unmask(batch):
    """Restores the original ids of pre-masked records (to re-mask them dynamically)."""
    ids = batch["input_ids"]
    valid = batch["masked_lm_weights"] > 0
    positions = tf.where(valid, batch["masked_lm_positions"], 0)
    original = tf.where(valid, batch["masked_lm_ids"], tf.gather(ids, positions, batch_dims=1))
    rows = tf.broadcast_to(tf.range(tf.shape(ids)[0])[:, None], tf.shape(positions))
    return tf.tensor_scatter_nd_update(ids, tf.stack([rows, positions], -1), original)


def record_stream(files: list[str], *, seed: int, shuffle: bool, repeat: bool,
                  shuffle_buffer: int, cycle_length: int) -> tf.data.Dataset:
    """Serialized records of `files`: file order shuffled per epoch, files interleaved, then
    records shuffled; deterministic for a seed (and so restorable from a saved position)."""
    ds = tf.data.Dataset.from_tensor_slices(files)
    if shuffle:
        ds = ds.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)
    if repeat:
        ds = ds.repeat()
    ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=min(cycle_length, len(files)),
                       block_length=1, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if shuffle:
        ds = ds.shuffle(shuffle_buffer, seed=seed + 1, reshuffle_each_iteration=True)
    return ds


def make_dataset(file_pattern: str, *, seq_len: int, max_predictions: int, batch_size: int,
                 seed: int = 0, shuffle: bool = True, repeat: bool = True,
                 process_index: int = 0, process_count: int = 1,
                 masking: MaskingConfig | None = None,
                 shuffle_buffer: int = 10_000, cycle_length: int = 8) -> GlobalBatches:
    """Global batches of `batch_size` rows, of which this process gets its `host_rows` (see
    the module docstring for the features). Wrap in `InputIterator`.

    masking=None: static (pre-masked) records are read as they are. Otherwise records are
    masked on the fly with a fresh mask per batch (and so per epoch), keyed by (seed, batch
    number); pre-masked records are first restored to their original ids.
    """
    if masking is not None and masking.max_predictions != max_predictions:
        raise ValueError(f"masking.max_predictions={masking.max_predictions} but "
                         f"max_predictions={max_predictions}")
    static = metadata.check_pretraining(file_pattern, seq_len, max_predictions, masking)
    rows = host_rows(batch_size, process_index, process_count)
    files = data_files(file_pattern)
    spec = feature_spec(seq_len, max_predictions, masked=static)
    check_schema(files, spec)

    stream = record_stream(files, seed=seed, shuffle=shuffle, repeat=repeat,
                           shuffle_buffer=shuffle_buffer, cycle_length=cycle_length)
    stream = stream.batch(batch_size, drop_remainder=True).enumerate()

    def to_host(index, serialized):
        parsed = tf.io.parse_example(serialized[rows.start:rows.stop], spec)
        batch = {k: tf.cast(v, tf.float32 if v.dtype == tf.float32 else tf.int32)
                 for k, v in parsed.items()}
        batch["next_sentence_labels"] = tf.reshape(batch["next_sentence_labels"], [-1])
        if masking is not None:
            if static:
                batch["input_ids"] = _unmask(batch)
            batch.update(mask_rows(batch, masking, seed, index, rows, batch_size))
        return batch

    return GlobalBatches(stream.prefetch(tf.data.AUTOTUNE), to_host, tuple(files))


def mask_rows(batch: dict, masking: MaskingConfig, seed: int, index, rows: slice,
              batch_size: int) -> dict:
    """`masking.mask_batch_tf` of this process's `rows` of global batch number `index`: the
    random draws are the global batch's, so a row's mask does not depend on the host count."""
    key = tf.stack([tf.cast(seed, tf.int64), tf.cast(index, tf.int64)])
    return masking_lib.mask_batch_tf(batch["input_ids"], batch["input_mask"], masking, key,
                                     row_offset=rows.start, global_batch=batch_size)


def _tf_message(error) -> str:
    """A tf.errors message without its op and function-node decorations."""
    text = re.sub(r"\{\{[^}]*\}\}\s*", "", getattr(error, "message", str(error)))
    return re.sub(r"\s*\[Op:[^\]]*\].*", "", text, flags=re.S).strip().split("\n")[0]


def _named(files: tuple[str, ...]) -> str:
    return ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


class InputIterator:
    """This host's NumPy batches of `GlobalBatches`, with a checkpointable position (the
    global stream's, the same on every process). A read error becomes a DataError naming the
    file (`files`, by default the input's)."""

    def __init__(self, batches: GlobalBatches, files: list[str] | None = None):
        self._iterator = iter(batches.stream)
        self._to_host = tf.function(batches.to_host)
        self._checkpoint = tf.train.Checkpoint(iterator=self._iterator)
        self.files = tuple(files if files is not None else batches.files)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        try:
            batch = self._to_host(*next(self._iterator))
        except tf.errors.DataLossError as e:
            raise DataError(self._corruption(e)) from None
        except tf.errors.InvalidArgumentError as e:
            raise DataError(f"records of {_named(self.files) or 'the input'} do not parse as "
                            f"the features read ({_tf_message(e)})") from None
        return {k: v.numpy() for k, v in batch.items()}

    def _corruption(self, error) -> str:
        """Finds the damaged file by re-checking the framing of each (only once reading fails)."""
        for path in self.files:
            if os.path.isfile(path):
                problem = tfrecords.first_problem(path)
                if problem:
                    return f"{path}: {problem}; recreate or remove this file"
        where = _named(self.files) or "the input"
        return f"reading {where} failed: {_tf_message(error)}"

    def save(self, path_prefix: str) -> None:
        """Writes the position (incl. shuffle buffers) to `path_prefix`.{index,data-*}."""
        self._checkpoint.write(path_prefix)

    def restore(self, path_prefix: str) -> None:
        self._checkpoint.read(path_prefix).assert_consumed()

"""tf.data reader of pre-training TFRecords → per-host batches of NumPy arrays.

Pipeline: this host's files (sorted, every `process_count`-th from `process_index`) → shuffle
file order → repeat → interleave records → shuffle → batch (drop remainder: static shapes) →
parse the whole batch at once → (dynamic masking) → prefetch. Every random op has a seed, so
the stream is deterministic for a seed, and `InputIterator.save/restore` checkpoints the
position (shuffle buffers included) so a resumed run neither replays nor skips data.

A phase is (data path, seq length, max predictions): 128/20 for phase 1, 512/80 for phase 2.

Batches (`[batch]` = the per-host batch size):
  input_ids, input_mask, segment_ids: [batch, seq] int32
  masked_lm_positions, masked_lm_ids: [batch, max_predictions] int32
  masked_lm_weights: [batch, max_predictions] float32
  next_sentence_labels: [batch] int32
"""

from __future__ import annotations

import glob

import numpy as np
import tensorflow as tf

from data_pipeline import masking as masking_lib
from data_pipeline import tfrecords
from data_pipeline.masking import MaskingConfig

try:  # accelerators belong to JAX; TF only reads data
    tf.config.set_visible_devices([], "GPU")
    tf.config.set_visible_devices([], "TPU")
except RuntimeError:  # TF already initialised its devices in this process
    pass

__all__ = ["InputIterator", "MaskingConfig", "make_dataset", "masking_from_metadata"]


def _check_metadata(file_pattern: str, seq_len: int, max_predictions: int,
                    masking: MaskingConfig | None) -> bool:
    """Checks the request against metadata.json; returns whether records carry static masks."""
    found = tfrecords.read_metadata(file_pattern)
    if found is None:
        return True  # reference / MLPerf data: always pre-masked, no metadata
    path, meta = found
    if meta.get("max_seq_length") != seq_len:
        raise ValueError(f"{path}: max_seq_length is {meta.get('max_seq_length')} but the reader "
                         f"was asked for seq_len={seq_len}")
    static = meta.get("masking", "static") == "static"
    if static and masking is None and meta.get("max_predictions_per_seq") != max_predictions:
        raise ValueError(f"{path}: max_predictions_per_seq is "
                         f"{meta.get('max_predictions_per_seq')} but the reader was asked for "
                         f"max_predictions={max_predictions}")
    if not static and masking is None:
        raise ValueError(f"{path}: masking is 'dynamic' (records have no masks); pass "
                         "masking=MaskingConfig (e.g. masking_from_metadata)")
    if masking is not None and meta.get("vocab_size") not in (None, masking.vocab_size):
        raise ValueError(f"{path}: vocab_size is {meta.get('vocab_size')} but the masking config "
                         f"has vocab_size={masking.vocab_size}")
    return static


def masking_from_metadata(file_pattern: str, *, max_predictions: int,
                          masked_lm_prob: float | None = None,
                          whole_word: bool | None = None) -> MaskingConfig:
    """The dynamic-masking config of data written by create_pretraining_data (no tokenizer
    needed: vocab size, [MASK], special ids and continuation flags are in the metadata)."""
    found = tfrecords.read_metadata(file_pattern)
    if found is None:
        raise ValueError(f"{file_pattern}: no metadata*.json beside the files")
    path, meta = found
    try:
        return MaskingConfig(
            max_predictions=max_predictions,
            vocab_size=meta["vocab_size"],
            mask_id=meta["mask_id"],
            special_ids=tuple(meta["special_ids"]),
            masked_lm_prob=meta["masked_lm_prob"] if masked_lm_prob is None else masked_lm_prob,
            whole_word=meta["do_whole_word_mask"] if whole_word is None else whole_word,
            continuation=masking_lib.decode_flags(meta["continuation_bits"], meta["vocab_size"]),
        )
    except KeyError as e:
        raise ValueError(f"{path}: missing field {e.args[0]!r}") from None


def host_files(file_pattern: str, process_index: int, process_count: int) -> list[str]:
    """This host's share of the files: sorted, every `process_count`-th from `process_index`."""
    files = sorted(f for pattern in file_pattern.split(",") for f in glob.glob(pattern))
    if not files:
        raise ValueError(f"{file_pattern}: no files match")
    if len(files) < process_count:
        raise ValueError(f"{file_pattern}: {len(files)} files for {process_count} processes; "
                         "write at least one shard per process (--num_shards)")
    return files[process_index::process_count]


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
                 shuffle_buffer: int = 10_000, cycle_length: int = 8) -> tf.data.Dataset:
    """Batches of this host's share of the data (see module docstring for the features).

    masking=None: static (pre-masked) records are read as they are. Otherwise records are
    masked on the fly with a fresh mask per batch (and so per epoch), keyed by (seed, batch
    number); pre-masked records are first restored to their original ids.
    """
    if masking is not None and masking.max_predictions != max_predictions:
        raise ValueError(f"masking.max_predictions={masking.max_predictions} but "
                         f"max_predictions={max_predictions}")
    static = _check_metadata(file_pattern, seq_len, max_predictions, masking)
    files = host_files(file_pattern, process_index, process_count)
    spec = tfrecords.feature_spec(seq_len, max_predictions, masked=static)

    ds = record_stream(files, seed=seed, shuffle=shuffle, repeat=repeat,
                       shuffle_buffer=shuffle_buffer, cycle_length=cycle_length)
    ds = ds.batch(batch_size, drop_remainder=True)

    def parse(serialized):
        parsed = tf.io.parse_example(serialized, spec)
        batch = {k: tf.cast(v, tf.float32 if v.dtype == tf.float32 else tf.int32)
                 for k, v in parsed.items()}
        batch["next_sentence_labels"] = tf.reshape(batch["next_sentence_labels"], [-1])
        return batch

    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if masking is not None:
        def mask(index, batch):
            if static:
                batch["input_ids"] = _unmask(batch)
            key = tf.stack([tf.cast(seed, tf.int64), index])
            batch.update(masking_lib.mask_batch_tf(batch["input_ids"], batch["input_mask"],
                                                   masking, key))
            return batch

        ds = ds.enumerate().map(mask, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)


class InputIterator:
    """NumPy batches from a dataset, with a checkpointable position."""

    def __init__(self, dataset: tf.data.Dataset):
        self._iterator = iter(dataset)
        self._checkpoint = tf.train.Checkpoint(iterator=self._iterator)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return {k: v.numpy() for k, v in next(self._iterator).items()}

    def save(self, path_prefix: str) -> None:
        """Writes the position (incl. shuffle buffers) to `path_prefix`.{index,data-*}."""
        self._checkpoint.write(path_prefix)

    def restore(self, path_prefix: str) -> None:
        self._checkpoint.read(path_prefix).assert_consumed()

r"""Packed pre-training input for training without next sentence prediction, through tf.data.

The examples (`data_pipeline.create_segments`: whole sentences of one document, `[CLS]
sentences [SEP]`, segment 0, unmasked; or unmasked pairs of `create_pretraining_data
--masking=dynamic`, NSP labels ignored) share rows with `packing_ids`, so attention never
crosses examples while rows stay full (docs/pretraining.md, "No NSP"). Pre-masked (static) data
is refused: rows are masked after packing.

Reading (`make_packed_dataset`), in one global order as `pretraining_input.make_dataset`: every
process reads all the files (sorted) → shuffle file order → repeat → interleave → shuffle
records → blocks of `block_size` (1,024) records → parse and pack each block (blocks in
parallel) → unbatch the rows → global batches → prefetch; then each process takes its rows and
masks them (the `masking.mask_batch_tf` rules, keyed by (seed, batch number) and drawn for the
global batch: a fresh mask every epoch, the same on any number of hosts). Deterministic for a
seed; `InputIterator` saves and restores the global position, shuffle buffers included.

Packing a block (`pack_block`) is first fit over `num_open_rows` open rows, the rows and order
of `packing.pack_examples` on the block's examples, every row closed at the block's end:
nothing is carried from block to block, which keeps the iterator state small and lets blocks
be packed in parallel. Where each example goes is decided from the lengths alone (`first_fit`,
a NumPy loop), then the tokens move in one gather, rather than a tf.data scan carrying the
open rows' tokens one example a step.

Masking runs over a whole row: 15% of its real tokens (capped at max_predictions: a full row of
128 tokens needs 20, of 512 needs 80). Every example ends with [SEP], which is never masked, so
a whole word never spans two examples.

Batches (`[batch]` = this host's rows of the global batch; no next_sentence_labels):
  input_ids, input_mask, segment_ids: [batch, seq] int32
  packing_ids: [batch, seq] int32, 1, 2, ... for the examples of a row, 0 for padding
  masked_lm_positions, masked_lm_ids: [batch, max_predictions] int32
  masked_lm_weights: [batch, max_predictions] float32
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from bertjax.tf_setup import import_tensorflow
from data_pipeline import metadata, packing
from data_pipeline.masking import MaskingConfig
from data_pipeline.pretraining_input import (
    GlobalBatches,
    InputIterator,
    check_schema,
    data_files,
    feature_spec,
    host_rows,
    mask_rows,
    masking_from_metadata,
    record_stream,
)

tf = import_tensorflow()

__all__ = ["InputIterator", "first_fit", "make_packed_dataset", "masking_from_metadata",
           "pack_block", "packed_rows", "padding_stats"]


# ------------------------------------------------------------------------------------ packing


def first_fit(lengths: np.ndarray, seq_len: int, num_open_rows: int, max_examples: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.int32]:
    """Where a block's examples go: first fit over `num_open_rows` open rows.

    lengths: [k] int, each 1..seq_len. Returns row, offset, number ([k] int32) and rows ([]):
    example i is the number[i]-th example (1, 2, ...) of row row[i], from token offset[i]. An
    example goes into the first open row (oldest first) with room and fewer than max_examples
    examples; when none has, a new row opens and, if num_open_rows were open, the oldest
    closes (`packing.pack_examples`' rule). Rows are numbered as they open, which is also the
    order they close, and all close at the block's end. Only lengths are handled here (a
    Python loop costs ~1 µs an example); the tokens then move in one gather.
    """
    k = len(lengths)
    row, offset, number = (np.empty(k, np.int32) for _ in range(3))
    used: list[int] = []  # tokens and examples of every row opened so far
    count: list[int] = []
    first = 0  # the open rows are first .. len(used) - 1
    for i, n in enumerate(lengths.tolist()):
        r = first
        while r < len(used) and (used[r] + n > seq_len or count[r] >= max_examples):
            r += 1
        if r == len(used):
            if r - first == num_open_rows:
                first += 1
            used.append(0)
            count.append(0)
        row[i], offset[i], number[i] = r, used[r], count[r] + 1
        used[r] += n
        count[r] += 1
    return row, offset, number, np.int32(len(used))


def _sources(lengths: np.ndarray, width: int, seq_len: int, num_open_rows: int,
             max_examples: int) -> tuple[np.ndarray, np.ndarray]:
    """A block's rows as a gather: (source, packing_ids: [rows * seq_len] int32).

    lengths: [k], 0..width (empty examples are skipped). Slot s of the flattened rows holds
    token source[s] of the flattened [k, width] examples, or k * width (a padding entry)
    where the row is empty; packing_ids: `first_fit`'s numbers, 0 for padding.
    """
    k = len(lengths)
    (real,) = np.nonzero(lengths > 0)
    lengths = lengths[real]
    row, offset, number, rows = first_fit(lengths, seq_len, num_open_rows, max_examples)
    starts = np.cumsum(lengths) - lengths
    within = np.arange(int(lengths.sum()), dtype=np.int32) - np.repeat(starts, lengths)
    slots = np.repeat(row * seq_len + offset, lengths) + within
    source = np.full(int(rows) * seq_len, k * width, np.int32)
    source[slots] = np.repeat(real.astype(np.int32) * width, lengths) + within
    packing_ids = np.zeros(int(rows) * seq_len, np.int32)
    packing_ids[slots] = np.repeat(number, lengths)
    return source, packing_ids


def pack_block(input_ids: tf.Tensor, segment_ids: tf.Tensor, lengths: tf.Tensor, seq_len: int,
               num_open_rows: int = 8, max_examples: int | None = None) -> dict[str, tf.Tensor]:
    """Packs one block of examples into rows, all rows closed at the end of the block.

    input_ids, segment_ids: [k, width] int32 or int64, width <= seq_len, each example's
    `lengths` [k] real tokens first (0 <= length <= width; empty examples are dropped).
    Returns {input_ids, segment_ids, packing_ids, input_mask: [rows, seq_len] int32}: the rows
    of `packing.pack_examples` over the block's non-empty examples, in its order.
    """
    max_examples = seq_len if max_examples is None else max_examples
    if input_ids.shape[1] is not None and input_ids.shape[1] > seq_len:
        raise ValueError(f"examples of {input_ids.shape[1]} tokens do not fit rows of {seq_len}")
    width = tf.shape(input_ids)[1]
    # Placement is a loop over the k lengths only (NumPy, ~1 µs an example); the tokens then
    # move in one gather each (outside the GIL). A pure function: the iterator stays savable.
    source, packing_ids = tf.numpy_function(
        lambda n, w: _sources(n, int(w), seq_len, num_open_rows, max_examples),
        [tf.cast(lengths, tf.int32), width], [tf.int32, tf.int32], stateful=False)

    def place(x):  # [k, width] → [rows, seq_len]; the appended 0 fills the padding
        flat = tf.concat([tf.reshape(tf.cast(x, tf.int32), [-1]), [0]], 0)
        return tf.reshape(tf.gather(flat, source), [-1, seq_len])

    packing_ids = tf.reshape(packing_ids, [-1, seq_len])
    return {"input_ids": place(input_ids), "segment_ids": place(segment_ids),
            "packing_ids": packing_ids, "input_mask": tf.cast(packing_ids > 0, tf.int32)}


def _check_packing(num_open_rows: int, block_size: int) -> None:
    if num_open_rows < 1:
        raise ValueError(f"num_open_rows must be >= 1, got {num_open_rows}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


# ------------------------------------------------------------------------------------ reading


def _record_spec(record_len: int) -> dict:
    spec = feature_spec(record_len, 0, masked=False)
    del spec["next_sentence_labels"]  # no NSP: the label is never read
    return spec


def _parse_and_pack(record_len: int, seq_len: int, num_open_rows: int,
                    max_examples: int | None) -> Callable[[tf.Tensor], dict[str, tf.Tensor]]:
    """[k] serialized records → the block's packed rows ([rows, seq_len], see `pack_block`)."""
    spec = _record_spec(record_len)

    def parse_and_pack(block):
        parsed = tf.io.parse_example(block, spec)
        return pack_block(parsed["input_ids"], parsed["segment_ids"],
                          # Records hold their real tokens first (reference layout).
                          tf.reduce_sum(tf.cast(parsed["input_mask"], tf.int32), axis=1),
                          seq_len, num_open_rows, max_examples)

    return parse_and_pack


def packed_rows(file_pattern: str, *, seq_len: int, seed: int = 0, shuffle: bool = True,
                repeat: bool = True, num_open_rows: int = 8,
                max_examples_per_row: int | None = None, block_size: int = 1024,
                shuffle_buffer: int = 10_000, cycle_length: int = 8,
                masking_cfg: MaskingConfig | None = None) -> tf.data.Dataset:
    """Unmasked packed rows of all the data, in the global order: {input_ids, input_mask,
    segment_ids, packing_ids: [seq_len] int32}.

    block_size: records packed together (`pack_block`); blocks are parsed and packed in
    parallel, and their rows all close at the block's end.
    """
    files, record_len = _checked_input(file_pattern, seq_len, masking_cfg, num_open_rows,
                                       block_size)
    return _packed_rows(files, record_len, seq_len, seed, shuffle, repeat, num_open_rows,
                        max_examples_per_row, block_size, shuffle_buffer, cycle_length)


def _checked_input(file_pattern: str, seq_len: int, masking_cfg: MaskingConfig | None,
                   num_open_rows: int, block_size: int) -> tuple[list[str], int]:
    """(the files, their record length), the metadata, settings and first records checked."""
    record_len = metadata.check_packing(file_pattern, seq_len, masking_cfg)
    _check_packing(num_open_rows, block_size)
    files = data_files(file_pattern)
    check_schema(files, _record_spec(record_len))
    return files, record_len


def _packed_rows(files: list[str], record_len: int, seq_len: int, seed: int, shuffle: bool,
                 repeat: bool, num_open_rows: int, max_examples_per_row: int | None,
                 block_size: int, shuffle_buffer: int, cycle_length: int) -> tf.data.Dataset:
    ds = record_stream(files, seed=seed, shuffle=shuffle, repeat=repeat,
                       shuffle_buffer=shuffle_buffer, cycle_length=cycle_length)
    ds = ds.batch(block_size).map(
        _parse_and_pack(record_len, seq_len, num_open_rows, max_examples_per_row),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.unbatch()


def make_packed_dataset(file_pattern: str, *, seq_len: int, batch_size: int,
                        masking: MaskingConfig | None, seed: int = 0, shuffle: bool = True,
                        repeat: bool = True, process_index: int = 0, process_count: int = 1,
                        num_open_rows: int = 8, max_examples_per_row: int | None = None,
                        block_size: int = 1024, shuffle_buffer: int = 10_000,
                        cycle_length: int = 8) -> GlobalBatches:
    """Global batches of `batch_size` packed rows, of which this process gets its `host_rows`,
    masked (see module docstring for the features). Wrap in `InputIterator`.

    masking: the dynamic-masking config (`masking_from_metadata`); its max_predictions is the
    per-row number of predictions. None: unmasked rows (a left-to-right LM's input).
    """
    rows = host_rows(batch_size, process_index, process_count)
    files, record_len = _checked_input(file_pattern, seq_len, masking, num_open_rows, block_size)
    stream = _packed_rows(files, record_len, seq_len, seed, shuffle, repeat, num_open_rows,
                          max_examples_per_row, block_size, shuffle_buffer, cycle_length)
    stream = stream.batch(batch_size, drop_remainder=True).enumerate()

    def to_host(index, batch):
        batch = {k: v[rows.start:rows.stop] for k, v in batch.items()}
        if masking is not None:
            batch.update(mask_rows(batch, masking, seed, index, rows, batch_size))
        return batch

    return GlobalBatches(stream.prefetch(tf.data.AUTOTUNE), to_host, tuple(files))


def padding_stats(file_pattern: str, *, seq_len: int, num_open_rows: int = 8,
                  max_examples_per_row: int | None = None,
                  block_size: int = 1024) -> packing.PackingStats:
    """Padding fraction before (one example per row) and after packing, over one pass."""
    stats = packing.PackingStats(seq_len)
    rows = packed_rows(file_pattern, seq_len=seq_len, shuffle=False, repeat=False,
                       num_open_rows=num_open_rows, max_examples_per_row=max_examples_per_row,
                       block_size=block_size)
    for block in rows.batch(1024).as_numpy_iterator():
        stats.add_rows(block["packing_ids"])
    return stats

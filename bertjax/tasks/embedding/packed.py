"""config.data.pack for the embedding family: a training batch's texts packed several to a row
instead of one a row padded to the batch's length (sentence-transformers pads each column to
its own longest text; bertjax's unpacked rows pad every column of a row to the row's longest
text, so a short question pays for its long passage).

The batches hold the same rows in the same order as the unpacked ones (the same plan, no
duplicates, filler rows of weight 0 in the last partial batch): only the layout changes.
Every text of the batch (each column's) is put by first fit, longest first, in rows of
`TextPacking.length` tokens (the shortest length bucket with room for two of the run's
longest texts, at most max_seq_length) with at most `slots` texts a row; the row count is
rounded up to a few steps per power of two (a multiple of the devices), so a run compiles a
handful of shapes. The model attends within each text, restarts its positions, pools it
alone and gathers the vectors back into [batch, columns, hidden]
(bertjax/models/embedding.py), so the losses are unchanged.

Where the step encodes a batch in parts (gradient accumulation's micro-batches, the cached
mode's chunks: every k-th row of the batch), the rows are packed in as many groups (`place`):
batch row p's texts sit in rows of group p % groups, every groups-th row, so that each part
holds its own texts' rows.

A packed global batch:
  input_ids, segment_ids, input_mask, packing_ids: [rows, length] int32 (packing_ids: slot + 1
    of each text's tokens, 0 on padding)
  example_starts: [rows, slots] int32, each text's first position (0 for an empty slot)
  text_slots: [batch, columns] int32, row * slots + slot of each text, its row counted within
    its group (-1: a filler row's text)
  labels, weights, example_index: [batch], as the unpacked batch's
Each host takes its share of the rows and of the batch (text_slots index the global rows).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from data_pipeline import finetune_data
from data_pipeline.hosts import host_rows
from data_pipeline.packed_finetune import MAX_SLOTS

# The token arrays of a packed batch, [rows, length]; the arrays whose first axis is its rows
# (the others': its batch).
TOKEN_KEYS = ("input_ids", "segment_ids", "input_mask", "packing_ids")
ROW_KEYS = TOKEN_KEYS + ("example_starts",)


@dataclasses.dataclass(frozen=True)
class TextPacking:
    """The fixed shape of a run's packed rows."""

    length: int  # tokens a row
    slots: int  # texts a row at most
    granule: int  # the row count's multiple (the data-parallel devices)


def text_lengths(features) -> np.ndarray:
    """[examples, columns] int64: each text's tokens, kept on the features (computed once)."""
    if getattr(features, "text_lengths", None) is None:
        features.text_lengths = np.stack([s[:, 2].sum(axis=-1) for s in features.sequences])
    return features.text_lengths


def text_packing(features, buckets, batch_size: int, granule: int) -> TextPacking:
    """Rows of the shortest of `buckets` with room for two of the longest texts (at most the
    longest bucket: max_seq_length), so that a long text leaves room for short ones; slots
    for the shortest text to fill a row (at most MAX_SLOTS and a batch's texts)."""
    lengths = text_lengths(features)
    room = np.array([min(2 * int(lengths.max()), buckets[-1])])
    length = buckets[int(finetune_data.assign_buckets(room, buckets)[0])]
    slots = min(length // max(int(lengths.min()), 1), MAX_SLOTS, batch_size * lengths.shape[1])
    return TextPacking(length, max(slots, 1), granule)


def first_fit(lengths: np.ndarray, packing: TextPacking) -> tuple[np.ndarray, np.ndarray]:
    """(row, slot) [texts] of texts of `lengths` [texts] put longest first (ties in order) in
    the first row with room for their tokens and a free slot."""
    row, slot = np.zeros(len(lengths), np.int64), np.zeros(len(lengths), np.int64)
    used, count = np.zeros(len(lengths), np.int64), np.zeros(len(lengths), np.int64)
    opened = 0
    for t in np.argsort(-lengths, kind="stable"):
        room = np.flatnonzero((used[:opened] + lengths[t] <= packing.length)
                              & (count[:opened] < packing.slots))
        r = int(room[0]) if len(room) else opened
        opened = max(opened, r + 1)
        row[t], slot[t] = r, count[r]
        used[r] += lengths[t]
        count[r] += 1
    return row, slot


def round_rows(rows: int, granule: int) -> int:
    """`rows` rounded up to a multiple of `granule`, in steps of a quarter of the power of two
    below (a few compiled shapes; under a quarter of the rows added)."""
    units = -(-max(rows, 1) // granule)
    step = max(1, (1 << (units.bit_length() - 1)) // 4)
    return -(-units // step) * step * granule


def place(lengths: np.ndarray, packing: TextPacking, groups: int
          ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """Where the texts of `lengths` [n, columns] (a batch's first n rows) go: (rows, row,
    slot, text_slots), the last three [n, columns]. Row p of the batch is in group p % groups,
    whose texts fill rows g, g + groups, ... (what gradient accumulation's micro-batches and
    the cached mode's chunks take); text_slots count within the group (local row * slots +
    slot)."""
    n, columns = lengths.shape
    placed = [(members, *first_fit(lengths[members].reshape(-1), packing))
              for members in (np.arange(g, n, groups) for g in range(groups))]
    per_group = round_rows(max((int(r.max()) + 1 for _, r, _ in placed if len(r)), default=1),
                           packing.granule)
    row, slot, text_slots = (np.zeros((n, columns), np.int64) for _ in range(3))
    for g, (members, local_row, local_slot) in enumerate(placed):
        row[members] = (local_row * groups + g).reshape(-1, columns)
        slot[members] = local_slot.reshape(-1, columns)
        text_slots[members] = (local_row * packing.slots + local_slot).reshape(-1, columns)
    return per_group * groups, row, slot, text_slots


def batch_rows(features, indices: np.ndarray, packing: TextPacking, groups: int) -> int:
    """Rows of the packed batch of examples `indices`."""
    return place(text_lengths(features)[indices], packing, groups)[0]


def make_batch(features, indices: np.ndarray, batch_size: int, packing: TextPacking,
               groups: int = 1, process_index: int = 0, process_count: int = 1
               ) -> dict[str, np.ndarray]:
    """This host's share of the packed global batch of examples `indices` (padded to
    `batch_size` with filler rows), in `groups` (`place`)."""
    lengths = text_lengths(features)[indices]  # [n, columns]
    n, columns = lengths.shape
    rows, row, slot, local = place(lengths, packing, groups)
    tokens = {k: np.zeros((rows, packing.length), np.int32) for k in TOKEN_KEYS}
    starts = np.zeros((rows, packing.slots), np.int32)
    used = np.zeros(rows, np.int64)
    for t in np.lexsort((slot.ravel(), row.ravel())):  # a row's texts back to back by slot
        (i, c), r, s, length = divmod(t, columns), row.flat[t], slot.flat[t], lengths.flat[t]
        at = used[r]
        sequence = features.sequences[indices[i]][c, :, :length]
        tokens["input_ids"][r, at:at + length] = sequence[0]
        tokens["segment_ids"][r, at:at + length] = sequence[1]
        tokens["input_mask"][r, at:at + length] = 1
        tokens["packing_ids"][r, at:at + length] = s + 1
        starts[r, s] = at
        used[r] += length
    text_slots = np.full((batch_size, columns), -1, np.int32)
    text_slots[:n] = local
    labels = np.zeros((batch_size,), features.labels.dtype)
    labels[:n] = features.labels[indices]
    example_index = np.full((batch_size,), -1, np.int32)
    example_index[:n] = indices
    weights = (example_index >= 0).astype(np.float32)
    batch = {**tokens, "example_starts": starts, "text_slots": text_slots, "labels": labels,
             "weights": weights, "example_index": example_index}
    mine = {key: host_rows(rows if key in ROW_KEYS else batch_size, process_index,
                           process_count) for key in batch}
    return {key: value[mine[key]] for key, value in batch.items()}


def describe(features, plan: list[tuple[int, np.ndarray]], batch_size: int, length: int,
             rows: list[int]) -> str:
    """The log line of an epoch's packing (`plan`: its (padded length, indices) batches;
    `rows`: each one's packed rows of `length`) against the padding of its unpacked batches."""
    real = int(text_lengths(features).sum())
    columns = text_lengths(features).shape[1]
    padded = sum(padded_length * batch_size * columns for padded_length, _ in plan)
    computed = sum(rows) * length
    return (f"; packed {columns} text(s) of {batch_size} rows a step into {min(rows)}-"
            f"{max(rows)} rows of {length}: padding {100 * (1 - real / max(padded, 1)):.1f}% → "
            f"{100 * (1 - real / max(computed, 1)):.1f}% of the train tokens computed")

"""Packed (unpadded) training batches for the sequence tasks (classification, regression) and
token tagging: several variable-length examples per row of max_seq_length tokens, instead of
one example per row padded to its batch's length bucket (data_pipeline/finetune_data.py).

config.train.batch_size stays the number of EXAMPLES a step trains on (what the learning-rate
schedule, the epochs and the unpacked runs count); the rows those examples are packed into are
fixed for the run (`packing_shape`: enough rows for a typical draw of batch_size examples), so
every step has the same shape and one compile serves the run.

Each epoch's examples are taken in a shuffled order (the same seed as the unpacked batches,
the same plan on every process; each process keeps its rows, data_pipeline/hosts.py) and put by
first fit into the batch's rows: an example goes to the first row with room for its tokens and
a free example slot. An example that fits no row is carried to the next batch, ahead of the
examples not yet seen; a batch is complete when it holds batch_size examples or has carried
batch_size of them. Carried examples stay in the epoch, so every example is seen exactly once
per epoch; the epoch's last batches hold what is left (fewer examples, empty slots weigh 0).

Batches (`[rows]` = this host's share of the global rows; `place` and `scatter` lay out any
task's, `make_packed_batch` the sequence tasks', bertjax/tasks/tagging/features.py tagging's):
  input_ids, segment_ids, input_mask: [rows, seq] int32 (input_mask 1 on every real token)
  packing_ids: [rows, seq] int32, 1..k for the k examples of a row, 0 for padding
  example_starts: [rows, slots] int32, the position of each example's first token ([CLS]);
    0 for an empty slot
  example_index: [rows, slots] int32, the position in the example list (-1: empty slot)
  sequence tasks: labels [rows, slots] int32 (class id) or float32 (regression) and weights
    [rows, slots] float32 (1 for an example), 0 for an empty slot
  tagging: label_ids [rows, seq] int32 and label_weights [rows, seq] float32, each example's
    own at its tokens (per-token losses exactly the unpacked rows')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from data_pipeline.finetune_data import Features
from data_pipeline.hosts import host_rows

# At most this many examples share a row: the pooled vectors and the head are computed per
# slot, so a bound on the slots keeps the head's work small when a data set has some very
# short examples; rows then just hold fewer of those.
MAX_SLOTS = 64
# Rows a batch is given per row's worth of tokens of an average draw: first fit leaves some of
# each row unused, and a draw of batch_size examples is sometimes longer than the average.
ROW_HEADROOM = 1.15


@dataclasses.dataclass(frozen=True)
class PackingShape:
    """The fixed shape of a run's packed global batches."""

    rows: int  # rows of a global batch
    length: int  # tokens per row (max_seq_length)
    slots: int  # examples per row at most
    examples: int  # examples per batch at most (config.train.batch_size)


def packing_shape(lengths: np.ndarray, batch_size: int, max_seq_length: int,
                  granule: int = 1) -> PackingShape:
    """The packed batch shape of a training set of example `lengths` [num_examples]: rows for
    batch_size examples of the average length (with ROW_HEADROOM), rounded up to a multiple of
    `granule` (the devices and micro-batches the rows must split over), no more than an
    unpacked batch's; slots for the shortest example to fill a row (at most MAX_SLOTS)."""
    lengths = np.asarray(lengths, np.int64)
    tokens = batch_size * float(lengths.mean()) * ROW_HEADROOM
    rows = max(1, int(np.ceil(tokens / max_seq_length)))
    rows = min(rows, batch_size)
    rows = int(np.ceil(rows / granule)) * granule
    slots = max(1, min(max_seq_length // max(int(lengths.min()), 1), MAX_SLOTS, batch_size))
    return PackingShape(rows=rows, length=max_seq_length, slots=slots, examples=batch_size)


def plan_packed(lengths: np.ndarray, shape: PackingShape, seed: int
                ) -> list[list[list[int]]]:
    """One epoch's global packed batches: [batch][row] → example indices, in row order.

    The examples in `np.random.default_rng(seed).permutation` order (the unpacked batches'
    order for the same seed), each put in the first row with room (tokens and a slot); those
    that fit no row are carried to the next batch (module docstring)."""
    lengths = np.asarray(lengths, np.int64)
    order = np.random.default_rng(seed).permutation(len(lengths)).tolist()
    plan, carry, position = [], [], 0
    while carry or position < len(order):
        rows: list[list[int]] = [[] for _ in range(shape.rows)]
        used = [0] * shape.rows
        placed, skipped, taken = 0, [], 0
        # The candidates: the carried examples first, then the epoch's next ones.
        while placed < shape.examples and len(skipped) < shape.examples:
            if taken < len(carry):
                example = carry[taken]
            elif position < len(order):
                example = order[position]
                position += 1
            else:
                break
            taken += 1
            n = int(lengths[example])
            for r in range(shape.rows):
                if used[r] + n <= shape.length and len(rows[r]) < shape.slots:
                    rows[r].append(example)
                    used[r] += n
                    placed += 1
                    break
            else:
                skipped.append(example)
        carry = skipped + carry[taken:]
        plan.append(rows)
    return plan


def place(rows: list[list[int]], lengths: np.ndarray, shape: PackingShape
          ) -> dict[str, np.ndarray]:
    """Where the examples of `rows` (row → example indices, `plan_packed`) sit in a global
    batch, back to back from each row's start: packing_ids, input_mask [rows, seq] int32;
    example_starts, example_index [rows, slots] int32 (module docstring)."""
    packing = np.zeros((shape.rows, shape.length), np.int32)
    mask = np.zeros_like(packing)
    starts = np.zeros((shape.rows, shape.slots), np.int32)
    example_index = np.full((shape.rows, shape.slots), -1, np.int32)
    for row, members in enumerate(rows):
        at = 0
        for slot, i in enumerate(members):
            n = int(lengths[i])
            mask[row, at:at + n], packing[row, at:at + n] = 1, slot + 1
            starts[row, slot], example_index[row, slot] = at, i
            at += n
    return {"packing_ids": packing, "input_mask": mask, "example_starts": starts,
            "example_index": example_index}


def scatter(values: Sequence[np.ndarray], placed: dict[str, np.ndarray], dtype,
            transform: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """[rows, seq] of `dtype`: each placed example's token values (values[i]: [length_i],
    through `transform` if given; only the batch's examples are read) at its positions, 0
    elsewhere. placed: `place`'s layout."""
    out = np.zeros(placed["packing_ids"].shape, dtype)
    index, starts = placed["example_index"], placed["example_starts"]
    for row, slot in zip(*np.nonzero(index >= 0)):
        value = values[index[row, slot]]
        value = value if transform is None else transform(value)
        at = starts[row, slot]
        out[row, at:at + len(value)] = value
    return out


def host_share(batch: dict[str, np.ndarray], process_index: int, process_count: int
               ) -> dict[str, np.ndarray]:
    """This host's rows of a global batch (every array's first axis is the rows)."""
    rows = host_rows(len(batch["input_ids"]), process_index, process_count)
    return {k: v[rows] for k, v in batch.items()}


def make_packed_batch(features: Features, rows: list[list[int]], shape: PackingShape,
                      process_index: int = 0, process_count: int = 1
                      ) -> dict[str, np.ndarray]:
    """The global batch of sequence examples `rows` (row → example indices, `plan_packed`),
    one label a slot; this host's rows."""
    if features.multiple_choice:
        raise ValueError("packed batches are for single-sequence examples")
    placed = place(rows, features.lengths, shape)
    real = placed["example_index"] >= 0
    labels = np.zeros(real.shape, features.labels.dtype)
    labels[real] = features.labels[placed["example_index"][real]]
    sequences = [s[0] for s in features.sequences]  # [3, length]: ids, segments, mask
    batch = {**placed, "labels": labels, "weights": real.astype(np.float32),
             "input_ids": scatter(sequences, placed, np.int32, lambda s: s[0]),
             "segment_ids": scatter(sequences, placed, np.int32, lambda s: s[1])}
    return host_share(batch, process_index, process_count)


def packed_batches(features, shape: PackingShape, seed: int, process_index: int = 0,
                   process_count: int = 1, make: Callable[..., dict[str, np.ndarray]] =
                   make_packed_batch) -> Iterator[dict[str, np.ndarray]]:
    """One training epoch of this host's packed batches (every host plans the same epoch):
    `make(features, rows, shape, process_index, process_count)` builds each (the task's
    batch maker; features: anything with `lengths` [num_examples])."""
    for rows in plan_packed(features.lengths, shape, seed):
        yield make(features, rows, shape, process_index, process_count)


def packed_padding(features, shape: PackingShape, seed: int = 0) -> tuple[int, float, float]:
    """(global batches of the epoch of `seed`, share of its computed token positions that are
    padding, mean examples per batch)."""
    plan = plan_packed(features.lengths, shape, seed)
    real = int(features.lengths.sum())
    computed = len(plan) * shape.rows * shape.length
    return len(plan), 1.0 - real / max(computed, 1), len(features) / max(len(plan), 1)


def describe_packing(features, shape: PackingShape, bucketed_padding: float) -> str:
    """The log line of an epoch's packing (seed 0) against the padding of unpacked batches."""
    steps, padding, per_step = packed_padding(features, shape)
    return (f"packed {len(features)} examples into {steps * shape.rows} rows of "
            f"{shape.length} ({steps} steps of {shape.rows} rows, {per_step:.1f} examples "
            f"a step, at most {shape.slots} a row): padding {100 * bucketed_padding:.1f}% "
            f"→ {100 * padding:.1f}% of the train tokens computed")

"""Fine-tuning examples → token features → length-bucketed NumPy batches.

Each example is tokenized once to its own length (truncated to max_seq_length, longer side
first). The run's bucket lengths are the powers of two ≥ 16 below max_seq_length, and
max_seq_length. A training batch is a uniform draw, as in a reference training loop: the
examples in a random order cut into batches of `batch_size`, each padded only to the smallest
length of the finer grid (`prediction_buckets`: each bucket interval cut in quarters) that
holds its longest example — on short texts a fixed length would spend most of the compute on
padding; the longest row of a uniform draw sits in the tail of the lengths, so few of the
grid's shapes are ever compiled. `group_by_length` (config.train.group_by_length) instead
batches examples of the same bucket together: less padding, but each batch is then a draw of
one length only, which slows short fine-tuning runs (tokens of short sentences weigh more in
the mean, and the steps alternate between length groups; docs/reproducing.md, "Does it train
like the reference?"). The last batch of an epoch may be short; it is filled with weight-0
rows (static shapes: every host runs the same shapes at every step).

Unshuffled batches (evaluation, prediction: a forward pass only, compiled once per shape) use
a finer grid of lengths (`prediction_buckets`: steps of 8 below 64) and more rows when short
(`prediction_rows`: about the tokens of a batch of 128-token rows), and a row's batch shape depends
on its own length only: a bucket's leftover rows make a last batch of their own, filled with
weight-0 rows. XLA's CPU kernels are not bitwise independent of the shape, so this is what
makes a row's prediction the same whatever rows it is read with (a file streamed in chunks).

Batches (`[batch]` = this host's share of the global batch):
  input_ids, segment_ids, input_mask: [batch, seq] int32 ([batch, choices, seq] multiple choice)
  labels: [batch] int32 (class id) or float32 (regression); 0 for test examples
  weights: [batch] float32, 0.0 for filler rows
  example_index: [batch] int32, the position in the example list (-1 for filler rows)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np
from absl import logging

from bertjax.errors import DataError
from data_pipeline.hosts import host_rows


# The input types, as the readers produce them (bertjax/tasks/classification/readers.py).
@dataclasses.dataclass(frozen=True)
class Example:
    """A text or text pair with its label."""

    guid: str  # "file:line" or "tfds-split:idx": where the example came from
    text_a: str
    text_b: str | None
    label: int | float | None  # class id, regression target, or None (test)
    index: str = ""  # the id the leaderboard expects for test predictions


@dataclasses.dataclass(frozen=True)
class ChoiceExample:
    """A multiple-choice example: one context, its candidate endings, the right one's index."""

    guid: str
    context: str
    endings: tuple[str, ...]
    label: int | None  # index into endings, or None (test)
    index: str = ""


@dataclasses.dataclass
class Features:
    """Unpadded token ids of a split. sequences[i]: [choices, 3, length_i] int32 (rows:
    input_ids, segment_ids, input_mask; choices = 1 for single-sequence tasks)."""

    sequences: list[np.ndarray]
    labels: np.ndarray  # [num_examples]
    multiple_choice: bool
    truncated: int = 0  # examples cut to max_seq_length (any of their choices)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([s.shape[-1] for s in self.sequences], np.int64)

    def __len__(self) -> int:
        return len(self.sequences)


def stack_encodings(encodings) -> np.ndarray:
    rows = []
    for enc in encodings:
        n = int(sum(enc.input_mask))  # encode pads to max_seq_length; keep the real tokens
        rows.append(np.array([enc.input_ids[:n], enc.segment_ids[:n], [1] * n], np.int32))
    length = max(r.shape[-1] for r in rows)
    out = np.zeros((len(rows), 3, length), np.int32)  # choices padded to the longest one
    for i, r in enumerate(rows):
        out[i, :, : r.shape[-1]] = r
    return out


def _cut(enc, texts: tuple[str | None, ...]) -> bool:
    """Whether truncation dropped text: an encoding that fills max_seq_length whose last kept
    token of a text ends before that text does (offsets are spans of the source text)."""
    if 0 in enc.input_mask or not hasattr(enc, "sequence_ids"):
        return False
    ends = {}
    for seq, span in zip(enc.sequence_ids, enc.offsets):
        if seq is not None and span is not None:
            ends[seq] = span[1]
    return any(text is not None and text[ends.get(seq, 0):].strip()
               for seq, text in enumerate(texts))


def count_truncated(encodings, texts_a, texts_b, per_example: int = 1) -> int:
    """Examples (groups of `per_example` encodings) of which some text was truncated."""
    cut = [_cut(enc, (a, b)) for enc, a, b in zip(encodings, texts_a, texts_b)]
    return sum(any(cut[i:i + per_example]) for i in range(0, len(cut), per_example))


def warn_truncated(features: Features, examples, max_seq_length: int) -> str | None:
    """One warning line when texts were cut to max_seq_length: the count and share, and the
    file (from the examples' `file:line` ids)."""
    if not features.truncated:
        return None
    source = str(examples[0].guid).rsplit(":", 1)[0]
    line = (f"{source}: {features.truncated} of {len(features)} examples "
            f"({features.truncated / len(features):.1%}) are longer than max_seq_length="
            f"{max_seq_length} tokens and were truncated")
    logging.warning("%s", line)
    return line


def encode(tokenizer, examples: Sequence[Example | ChoiceExample], max_seq_length: int,
           regression: bool = False) -> Features:
    """Tokenizes `[CLS] a [SEP] (b [SEP])` (multiple choice: one such pair per ending)."""
    if not examples:
        raise DataError("no examples to encode")
    multiple_choice = isinstance(examples[0], ChoiceExample)
    if multiple_choice:
        counts = {len(e.endings) for e in examples}
        if len(counts) != 1:
            bad = next(e for e in examples if len(e.endings) != len(examples[0].endings))
            raise DataError(f"{bad.guid}: {len(bad.endings)} choices but the first example has "
                            f"{len(examples[0].endings)}")
        k = counts.pop()
        texts_a = [e.context for e in examples for _ in range(k)]
        texts_b = [ending for e in examples for ending in e.endings]
        encodings = tokenizer.encode_batch(texts_a, texts_b, max_seq_length=max_seq_length)
        sequences = [stack_encodings(encodings[i * k:(i + 1) * k]) for i in range(len(examples))]
        truncated = count_truncated(encodings, texts_a, texts_b, per_example=k)
    else:
        texts_b = [e.text_b for e in examples]
        encodings = tokenizer.encode_batch(
            [e.text_a for e in examples], texts_b if any(b is not None for b in texts_b) else None,
            max_seq_length=max_seq_length)
        sequences = [stack_encodings([enc]) for enc in encodings]
        truncated = count_truncated(encodings, [e.text_a for e in examples], texts_b)
    dtype = np.float32 if regression else np.int32
    labels = np.array([0 if e.label is None else e.label for e in examples], dtype)
    features = Features(sequences, labels, multiple_choice, truncated)
    warn_truncated(features, examples, max_seq_length)
    return features


def bucket_lengths(max_seq_length: int, min_length: int = 16) -> tuple[int, ...]:
    """Powers of two from `min_length` below max_seq_length, then max_seq_length itself."""
    lengths, n = [], min_length
    while n < max_seq_length:
        lengths.append(n)
        n *= 2
    return tuple(lengths) + (max_seq_length,)


def assign_buckets(lengths: np.ndarray, buckets: Sequence[int]) -> np.ndarray:
    """Index of the smallest bucket length ≥ each length: [num_examples] int."""
    if lengths.size and lengths.max() > buckets[-1]:
        raise DataError(f"a sequence of length {lengths.max()} exceeds the largest bucket "
                        f"{buckets[-1]}")
    return np.searchsorted(np.asarray(buckets), lengths, side="left")


def plan_batches(features: Features, batch_size: int, buckets: Sequence[int], *,
                 shuffle: bool, seed: int = 0, group_by_length: bool = False
                 ) -> list[tuple[int, np.ndarray]]:
    """[(bucket length, example indices [<= batch_size])] — one epoch's global batches.

    shuffle: the order of the examples (and the batches') from `seed` (pass a different seed
    each epoch); otherwise the examples' order. Each batch's length is the smallest length of
    `prediction_buckets(buckets)` holding its longest example. group_by_length: batches of one
    bucket of `buckets` each (a bucket's leftover examples join the next, longer bucket: only
    the very last batch is partial).
    """
    rng = np.random.default_rng(seed)
    lengths = features.lengths
    if not group_by_length:
        order = rng.permutation(len(lengths)) if shuffle else np.arange(len(lengths))
        groups = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        if shuffle:  # the short last batch anywhere in the epoch (one bucket: as grouped)
            groups = [groups[i] for i in rng.permutation(len(groups))]
        grid = prediction_buckets(buckets)
        longest = np.array([lengths[rows].max() for rows in groups], np.int64)
        return [(grid[b], rows) for b, rows in zip(assign_buckets(longest, grid), groups)]
    assignment = assign_buckets(lengths, buckets)
    plan, carry = [], np.zeros((0,), np.int64)
    for b, length in enumerate(buckets):
        members = np.flatnonzero(assignment == b)
        if shuffle:
            members = rng.permutation(members)
        members = np.concatenate([carry, members])
        full = len(members) // batch_size * batch_size
        for start in range(0, full, batch_size):
            plan.append((length, members[start:start + batch_size]))
        carry = members[full:]
        if len(carry) and b == len(buckets) - 1:
            plan.append((length, carry))
    if shuffle:
        plan = [plan[i] for i in rng.permutation(len(plan))]
    return plan


def prediction_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    """The run's bucket lengths with each interval cut in steps of a quarter of its lower end
    (at least 8): (16, 32, 64, 128) → (16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128); the
    padding of a row is then under a quarter of its length (or 8 tokens), at a bounded number
    of compiled shapes (≤ 4 per power of two)."""
    out = [buckets[0]]
    for low, high in zip(buckets, buckets[1:]):
        step = max(8, low // 4)
        out += list(range(low + step, high, step)) + [high]
    return tuple(out)


# Short prediction batches are filled up to `batch_size` rows of this many tokens.
SHORT_BATCH_LENGTH = 128


def prediction_rows(batch_size: int, length: int, longest: int) -> int:
    """Rows of an unshuffled batch of `length` tokens: `batch_size` times the largest power of
    two ≤ min(longest, SHORT_BATCH_LENGTH) / length, so a short batch holds about the tokens of
    `batch_size` rows of 128 (fewer dispatches, matmuls large enough to run at speed, memory
    no larger) and still divides over the devices `batch_size` does. No more than that: every
    bucket's last batch is filled with weight-0 rows, and at max_seq_length 384 or 512 larger
    short batches would mostly add filler (SQuAD's windows)."""
    scale = 1
    while length * scale * 2 <= min(longest, SHORT_BATCH_LENGTH):
        scale *= 2
    return batch_size * scale


def prediction_plan(lengths: np.ndarray, batch_size: int, buckets: Sequence[int]
                    ) -> list[tuple[int, int, np.ndarray]]:
    """[(length, rows, example indices [<= rows])]: the unshuffled batches, bucket by bucket
    (`prediction_buckets`), examples in order within a bucket. The shape (rows, length) of an
    example's batch depends on its own length only."""
    grid = prediction_buckets(buckets)
    assignment = assign_buckets(lengths, grid)
    plan = []
    for b, length in enumerate(grid):
        members = np.flatnonzero(assignment == b)
        rows = prediction_rows(batch_size, length, grid[-1])
        plan += [(length, rows, members[i:i + rows]) for i in range(0, len(members), rows)]
    return plan


def make_batch(features: Features, length: int, indices: np.ndarray, batch_size: int,
               process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
    """Pads `indices` to [batch_size] rows of `length` tokens; returns this host's rows."""
    choices = features.sequences[0].shape[0]
    ids = np.zeros((batch_size, choices, length), np.int32)
    segments = np.zeros_like(ids)
    mask = np.zeros_like(ids)
    labels = np.zeros((batch_size,), features.labels.dtype)
    weights = np.zeros((batch_size,), np.float32)
    example_index = np.full((batch_size,), -1, np.int32)
    for row, i in enumerate(indices):
        seq = features.sequences[i]
        n = seq.shape[-1]
        ids[row, :, :n], segments[row, :, :n], mask[row, :, :n] = seq[:, 0], seq[:, 1], seq[:, 2]
        labels[row], weights[row], example_index[row] = features.labels[i], 1.0, i
    if not features.multiple_choice:
        ids, segments, mask = ids[:, 0], segments[:, 0], mask[:, 0]
    batch = {"input_ids": ids, "segment_ids": segments, "input_mask": mask, "labels": labels,
             "weights": weights, "example_index": example_index}
    rows = host_rows(batch_size, process_index, process_count)
    return {k: v[rows] for k, v in batch.items()}


def batches(features: Features, batch_size: int, buckets: Sequence[int], *, shuffle: bool,
            seed: int = 0, process_index: int = 0, process_count: int = 1,
            group_by_length: bool = False) -> Iterator[dict[str, np.ndarray]]:
    """One epoch of this host's batches (every host builds the same global plan); unshuffled:
    the prediction plan (`prediction_plan`, batches of `prediction_rows`)."""
    if not shuffle:
        for length, rows, indices in prediction_plan(features.lengths, batch_size, buckets):
            yield make_batch(features, length, indices, rows, process_index, process_count)
        return
    for length, indices in plan_batches(features, batch_size, buckets, shuffle=True,
                                        seed=seed, group_by_length=group_by_length):
        yield make_batch(features, length, indices, batch_size, process_index, process_count)


def padding_fraction(features: Features, batch_size: int, buckets: Sequence[int],
                     group_by_length: bool = False) -> tuple[float, list[int]]:
    """(share of the token positions computed in a training epoch (seed 0) that are padding or
    filler, the distinct batch lengths of that epoch)."""
    plan = plan_batches(features, batch_size, buckets, shuffle=True,
                        group_by_length=group_by_length)
    computed = sum(length * batch_size for length, _ in plan)
    real = sum(int(s[:, 2].sum()) for s in features.sequences)
    computed *= features.sequences[0].shape[0]
    return 1.0 - real / max(computed, 1), sorted({length for length, _ in plan})

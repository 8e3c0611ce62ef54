"""Packing: several short examples in one row, for no-NSP pre-training and fine-tuning.

Each packed row carries `packing_ids` ([seq] int32: 1, 2, ... for the examples in the row, 0
for padding) and `position_ids` restarting at 0 for each example, so the model
(`BertModel(..., packing_ids=...)`) keeps attention inside each example and positions are as
if the example were alone. Rows are filled first-fit over a small window of open rows (a
streaming approximation of bin packing: memory is `num_open_rows` rows).

Example input (dicts of 1-D arrays): input_ids [n] and optionally segment_ids [n]; masked-LM
fields masked_lm_positions / masked_lm_ids / masked_lm_weights [k] (positions are shifted to
the row); per-example scalars named in `example_features` (e.g. a classification label) are
gathered into [max_examples_per_row] arrays, with example_weights 1.0 where an example exists.

`segments_from_document` cuts a document into the single-segment examples of no-NSP
pre-training (full sentences, written by data_pipeline/create_segments.py); the tf.data packer
of data_pipeline/packed_input.py fills the rows of `pack_examples` block by block (each block
of examples packed on its own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence

import numpy as np


@dataclasses.dataclass
class PackingStats:
    """Token accounting of one packing run (padding fraction = padding / all slots)."""

    seq_len: int
    examples: int = 0
    rows: int = 0
    tokens: int = 0

    @property
    def padding_before(self) -> float:
        """Padding fraction with one example per row (no packing)."""
        return 1.0 - self.tokens / max(1, self.examples * self.seq_len)

    @property
    def padding_after(self) -> float:
        return 1.0 - self.tokens / max(1, self.rows * self.seq_len)

    def add_rows(self, packing_ids: np.ndarray) -> None:
        """Counts already packed rows. packing_ids: [rows, seq_len] int, 1..k per row, 0 = pad."""
        packing_ids = np.asarray(packing_ids)
        if packing_ids.ndim != 2 or packing_ids.shape[1] != self.seq_len:
            raise ValueError(f"packing_ids has shape {packing_ids.shape}; expected "
                             f"[rows, {self.seq_len}]")
        self.rows += packing_ids.shape[0]
        self.examples += int(packing_ids.max(axis=1, initial=0).sum())  # ids are 1..k in a row
        self.tokens += int(np.count_nonzero(packing_ids))

    def summary(self) -> str:
        return (f"packed {self.examples} examples into {self.rows} rows of {self.seq_len}: "
                f"padding {self.padding_before:.1%} → {self.padding_after:.1%}")


class _Row:
    def __init__(self):
        self.examples: list[dict] = []
        self.length = 0
        self.predictions = 0


def _finish(row: _Row, seq_len: int, max_predictions: int | None, max_examples: int,
            example_features: Sequence[str]) -> dict[str, np.ndarray]:
    out = {
        "input_ids": np.zeros(seq_len, np.int32),
        "input_mask": np.zeros(seq_len, np.int32),
        "segment_ids": np.zeros(seq_len, np.int32),
        "packing_ids": np.zeros(seq_len, np.int32),
        "position_ids": np.zeros(seq_len, np.int32),
    }
    if max_predictions is not None:
        out["masked_lm_positions"] = np.zeros(max_predictions, np.int32)
        out["masked_lm_ids"] = np.zeros(max_predictions, np.int32)
        out["masked_lm_weights"] = np.zeros(max_predictions, np.float32)
    for name in example_features:
        out[name] = np.zeros(max_examples, np.asarray(row.examples[0][name]).dtype)
    if example_features:
        out["example_weights"] = np.zeros(max_examples, np.float32)
    start = pred = 0
    for number, ex in enumerate(row.examples):
        n = len(ex["input_ids"])
        span = slice(start, start + n)
        out["input_ids"][span] = ex["input_ids"]
        out["input_mask"][span] = 1
        out["segment_ids"][span] = ex.get("segment_ids", 0)
        out["packing_ids"][span] = number + 1
        out["position_ids"][span] = np.arange(n)
        if max_predictions is not None:
            k = len(ex["masked_lm_positions"])
            shifted = np.asarray(ex["masked_lm_positions"]) + start
            out["masked_lm_positions"][pred:pred + k] = shifted
            out["masked_lm_ids"][pred:pred + k] = ex["masked_lm_ids"]
            out["masked_lm_weights"][pred:pred + k] = ex.get("masked_lm_weights", 1.0)
            pred += k
        for name in example_features:
            out[name][number] = ex[name]
        if example_features:
            out["example_weights"][number] = 1.0
        start += n
    return out


def pack_examples(examples: Iterable[dict], seq_len: int, *, max_predictions: int | None = None,
                  max_examples_per_row: int = 16, example_features: Sequence[str] = (),
                  num_open_rows: int = 8, stats: PackingStats | None = None
                  ) -> Iterator[dict[str, np.ndarray]]:
    """Packs examples into rows of `seq_len` (see module docstring); updates `stats`.

    max_predictions: when set, the masked-LM fields are packed too and a row takes at most
    that many predictions. Examples longer than seq_len are an error (truncate them first).
    """
    stats = stats if stats is not None else PackingStats(seq_len)
    open_rows: list[_Row] = []

    def emit(row):
        stats.rows += 1
        return _finish(row, seq_len, max_predictions, max_examples_per_row, example_features)

    for ex in examples:
        n = len(ex["input_ids"])
        k = len(ex["masked_lm_positions"]) if max_predictions is not None else 0
        if n > seq_len or (max_predictions is not None and k > max_predictions):
            raise ValueError(f"example {stats.examples} has {n} tokens / {k} predictions; the "
                             f"row holds {seq_len} / {max_predictions}")
        stats.examples += 1
        stats.tokens += n
        row = next((r for r in open_rows if r.length + n <= seq_len
                    and len(r.examples) < max_examples_per_row
                    and (max_predictions is None or r.predictions + k <= max_predictions)), None)
        if row is None:
            if len(open_rows) == num_open_rows:
                yield emit(open_rows.pop(0))  # the oldest row has had the most chances
            row = _Row()
            open_rows.append(row)
        row.examples.append(ex)
        row.length += n
        row.predictions += k
    for row in open_rows:
        yield emit(row)


def segments_from_document(sentences: Sequence[np.ndarray], max_tokens: int,
                           whole_sentences: bool = True) -> list[np.ndarray]:
    """Cuts a document into examples of consecutive text, each <= max_tokens.

    sentences: [n_i] int arrays of token ids (no special tokens). whole_sentences: sentences
    are added to the current example while they fit, and a sentence longer than max_tokens on
    its own is split into max_tokens-long pieces; otherwise the text is cut every max_tokens
    tokens, wherever sentences end (only the document's last example is short). No text is
    dropped: returns [m] int32 arrays whose concatenation is the document's tokens in order.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not whole_sentences:
        tokens = np.concatenate([np.zeros(0, np.int32), *sentences]).astype(np.int32)
        return [tokens[i:i + max_tokens] for i in range(0, len(tokens), max_tokens)]
    out: list[np.ndarray] = []
    current: list[np.ndarray] = []
    length = 0
    for sentence in sentences:
        sentence = np.asarray(sentence, np.int32)
        if not len(sentence):
            continue
        if length + len(sentence) > max_tokens and current:
            out.append(np.concatenate(current))
            current, length = [], 0
        while len(sentence) > max_tokens:
            out.append(sentence[:max_tokens])
            sentence = sentence[max_tokens:]
        current.append(sentence)
        length += len(sentence)
    if current:
        out.append(np.concatenate(current))
    return out

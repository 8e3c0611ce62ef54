"""Tagged sentences → sub-token rows → length-bucketed NumPy batches (token classification).

Labels sit on each word's FIRST sub-token (paper Sec. 5.3); the other sub-tokens, [CLS] /
[SEP] and context tokens carry label -1 and weight 0, so loss and metric never see them.

A sentence longer than max_seq_length - 2 pieces is split into windows of that many pieces,
starting every `stride` pieces; each word is scored in exactly one window, the one where its
first sub-token has the most context on its poorer side (as SQuAD's "max context" rule).
With `document_context`, a sentence that fits is encoded with its neighbours from the same
document around it (about as much on each side, up to max_seq_length), and only its own words
are scored: the paper's NER setting. Each sentence's pieces are those of its words joined by
spaces as one text (`sentence_pieces`), also where it is a neighbour's context.

Rows of a split (`TokenFeatures`, one or more per sentence):
  input_ids[r]: [len_r] int32 ([CLS] context sentence context [SEP])
  word_index[r]: [len_r] int32 — the sentence's word scored at that position, -1 elsewhere
  label_ids[r]: [len_r] int32 — that word's label id, -1 elsewhere (and for unlabelled data)
Batches (`[batch]` = this host's share; seq = the bucket length):
  input_ids, segment_ids, input_mask: [batch, seq] int32
  label_ids: [batch, seq] int32 (0 where not scored); label_weights: [batch, seq] float32
  example_index: [batch] int32 — the row (-1 for filler rows)
Packed training batches (config.data.pack, `make_packed_batch`): several rows back to back in
each of [rows, seq], with packing_ids [rows, seq] and example_starts / example_index
[rows, slots] (data_pipeline/packed_finetune.py); label_ids / label_weights each row's own at
its tokens, so the summed token losses are the unpacked rows'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from bertjax.errors import ConfigError
from bertjax.tasks.tagging.readers import Sentence
from data_pipeline import finetune_data, packed_finetune
from data_pipeline.hosts import host_rows


@dataclasses.dataclass
class TokenFeatures:
    input_ids: list[np.ndarray]
    word_index: list[np.ndarray]
    label_ids: list[np.ndarray]
    sentence: np.ndarray  # [rows] int: the sentence each row scores
    num_words: np.ndarray  # [sentences] int
    own: np.ndarray  # [rows, 2] int: [start, end) of the row's own-sentence pieces

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(r) for r in self.input_ids], np.int64)

    def __len__(self) -> int:
        return len(self.input_ids)


def sentence_pieces(tokenizer, sentences: Sequence[Sentence]
                    ) -> list[tuple[list[int], list[int]]]:
    """Per sentence, (ids, firsts): the token ids of its words as one text (the words joined by
    single spaces, tokenized together), and the position of each word's first token.

    Tokens are given to words through the tokenizer's character offsets (a token belongs to
    the word its span starts in), so a tokenizer whose pieces depend on the context is read
    as it reads running text: ByteLevel BPE (ModernBERT's tokenizer.json) marks words after
    the first with "Ġ" and the sentence's first word without, as it tokenizes any text; a
    WordPiece or SentencePiece tokenizer gives the same pieces as word by word. A word with no
    token of its own (only characters the tokenizer drops) gets [UNK] at its place, so every
    word keeps a position to be scored at."""
    texts = [" ".join(s.words) for s in sentences]
    out = []
    for sentence, pieces in zip(sentences, tokenizer._pieces_batch(texts)):  # noqa: SLF001
        starts = np.cumsum([0] + [len(w) + 1 for w in sentence.words[:-1]])
        owner = (np.searchsorted(starts, [b for b, _ in pieces.offsets], side="right") - 1
                 if pieces.offsets else np.zeros(0, np.int64))
        ids, firsts, t = [], [], 0
        for w in range(len(sentence.words)):
            firsts.append(len(ids))
            before = t
            while t < len(pieces.ids) and owner[t] <= w:
                ids.append(pieces.ids[t])
                t += 1
            if t == before:
                ids.append(tokenizer.unk_id)
        out.append((ids, firsts))
    return out


def windows(num_pieces: int, budget: int, stride: int) -> list[tuple[int, int]]:
    """[(start, end)] piece ranges of at most `budget` pieces, every `stride` pieces (at most
    `budget`, so no piece is skipped), the last ending at num_pieces."""
    if stride < 1:
        raise ConfigError(f"config.data.stride={stride} must be positive")
    stride = min(stride, budget)
    out, start = [], 0
    while True:
        end = min(start + budget, num_pieces)
        out.append((start, end))
        if end == num_pieces:
            return out
        start += stride


def best_window(position: int, spans: Sequence[tuple[int, int]]) -> int:
    """Index of the window in which `position` has the most context on its poorer side (the
    first such window on ties)."""
    best, best_score = -1, -1
    for k, (start, end) in enumerate(spans):
        if start <= position < end:
            score = min(position - start, end - 1 - position)
            if score > best_score:
                best, best_score = k, score
    return best


def _context(sentences, pieces_of, index: int, direction: int, limit: int) -> list[int]:
    """Up to `limit` pieces of the neighbouring sentences of the same document, the ones
    nearest sentence `index` (direction -1: before it, +1: after it)."""
    out: list[int] = []
    document = sentences[index].document
    j = index + direction
    while len(out) < limit and 0 <= j < len(sentences) and sentences[j].document == document:
        pieces = pieces_of(j)
        out = (pieces + out)[-limit:] if direction < 0 else (out + pieces)[:limit]
        j += direction
    return out


def encode(tokenizer, sentences: Sequence[Sentence], label_ids: dict[str, int] | None,
           max_seq_length: int, stride: int, document_context: bool) -> TokenFeatures:
    """Rows of every sentence (see the module docstring). label_ids: tag → id (None: no
    labels)."""
    budget = max_seq_length - 2
    encoded = sentence_pieces(tokenizer, sentences)

    def pieces_of(i: int) -> list[int]:
        return encoded[i][0]

    rows_ids, rows_words, rows_labels, row_sentence, row_own = [], [], [], [], []
    for s, sentence in enumerate(sentences):
        own = pieces_of(s)
        firsts = encoded[s][1]
        gold = (np.array([label_ids[t] for t in sentence.tags], np.int32)
                if label_ids is not None and sentence.tags is not None else None)
        left: list[int] = []
        right: list[int] = []
        if len(own) <= budget and document_context:
            extra = budget - len(own)
            # Centre the sentence: half the room to each side, the unused rest to the other.
            right_avail = _context(sentences, pieces_of, s, +1, extra)
            left = _context(sentences, pieces_of, s, -1, extra - min(len(right_avail),
                                                                       extra // 2))
            right = right_avail[:extra - len(left)]
        spans = windows(len(own), budget, stride)
        owner = [best_window(int(p), spans) for p in firsts]
        for k, (start, end) in enumerate(spans):
            ids = [tokenizer.cls_id, *left, *own[start:end], *right, tokenizer.sep_id]
            words = np.full(len(ids), -1, np.int32)
            labels = np.full(len(ids), -1, np.int32)
            offset = 1 + len(left) - start
            for w, (first, window) in enumerate(zip(firsts, owner)):
                if window == k:
                    words[offset + first] = w
                    if gold is not None:
                        labels[offset + first] = gold[w]
            rows_ids.append(np.array(ids, np.int32))
            rows_words.append(words)
            rows_labels.append(labels)
            row_sentence.append(s)
            row_own.append((1 + len(left), 1 + len(left) + end - start))
    return TokenFeatures(rows_ids, rows_words, rows_labels, np.array(row_sentence, np.int64),
                         np.array([len(s.words) for s in sentences], np.int64),
                         np.array(row_own, np.int64).reshape(-1, 2))


def sentence_predictions(features: TokenFeatures, predicted_rows: Sequence[np.ndarray]
                         ) -> list[np.ndarray]:
    """Per-sentence predicted label ids [num_words] from per-row predictions [len_r] (each
    word read at its first sub-token, in the one row that scores it)."""
    out = [np.full(n, -1, np.int64) for n in features.num_words]
    for row, predicted in enumerate(predicted_rows):
        words = features.word_index[row]
        scored = words >= 0
        out[features.sentence[row]][words[scored]] = np.asarray(predicted)[:len(words)][scored]
    return out


def make_batch(features: TokenFeatures, length: int, indices: np.ndarray, batch_size: int,
               process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
    """Rows `indices` padded to [batch_size, length]; this host's share of the rows."""
    ids = np.zeros((batch_size, length), np.int32)
    mask = np.zeros_like(ids)
    labels = np.zeros_like(ids)
    weights = np.zeros((batch_size, length), np.float32)
    example_index = np.full((batch_size,), -1, np.int32)
    for row, i in enumerate(indices):
        n = len(features.input_ids[i])
        ids[row, :n], mask[row, :n] = features.input_ids[i], 1
        gold = features.label_ids[i]
        labels[row, :n] = np.maximum(gold, 0)
        weights[row, :n] = gold >= 0
        example_index[row] = i
    batch = {"input_ids": ids, "segment_ids": np.zeros_like(ids), "input_mask": mask,
             "label_ids": labels, "label_weights": weights, "example_index": example_index}
    rows = host_rows(batch_size, process_index, process_count)
    return {k: v[rows] for k, v in batch.items()}


def make_packed_batch(features: TokenFeatures, rows: list[list[int]],
                      shape: packed_finetune.PackingShape, process_index: int = 0,
                      process_count: int = 1) -> dict[str, np.ndarray]:
    """The packed global batch of feature rows `rows` (packed row → feature rows,
    packed_finetune.plan_packed): input_ids, segment_ids (0), input_mask, packing_ids,
    label_ids, label_weights [rows, seq]; example_starts, example_index [rows, slots]. Each
    feature row's tokens and labels as `make_batch` lays them out alone; this host's rows."""
    placed = packed_finetune.place(rows, features.lengths, shape)
    ids = packed_finetune.scatter(features.input_ids, placed, np.int32)
    batch = {**placed, "input_ids": ids, "segment_ids": np.zeros_like(ids),
             "label_ids": packed_finetune.scatter(features.label_ids, placed, np.int32,
                                                  lambda gold: np.maximum(gold, 0)),
             "label_weights": packed_finetune.scatter(features.label_ids, placed, np.float32,
                                                      lambda gold: gold >= 0)}
    return packed_finetune.host_share(batch, process_index, process_count)


def batches(features: TokenFeatures, batch_size: int, buckets: Sequence[int], *, shuffle: bool,
            seed: int = 0, process_index: int = 0, process_count: int = 1,
            group_by_length: bool = False) -> Iterator[dict[str, np.ndarray]]:
    """One epoch of this host's batches (finetune_data's plans: shuffled, the training plan;
    unshuffled, the prediction plan)."""
    if not shuffle:
        for length, rows, indices in finetune_data.prediction_plan(features.lengths, batch_size,
                                                                   buckets):
            yield make_batch(features, length, indices, rows, process_index, process_count)
        return
    for length, indices in finetune_data.plan_batches(features, batch_size, buckets,
                                                      shuffle=True, seed=seed,
                                                      group_by_length=group_by_length):
        yield make_batch(features, length, indices, batch_size, process_index, process_count)

"""Sentence pairs for masked LM + next sentence prediction, as the reference generator makes them.

Input: a stream of tokenized documents, each a list of sentences, each a [n] int32 array of
token ids (no special tokens). Output: `Instance`s `[CLS] A [SEP] B [SEP]`.

Per document (exactly the reference `create_instances_from_document`):
- target length = max_seq_length - 3; with probability short_seq_prob a random length in
  [2, max_seq_length - 3] instead (drawn once per document pass, as the reference does).
- Sentences are gathered into a chunk until it reaches the target length (or the document
  ends); A = the chunk's first `a_end` sentences, a_end uniform in [1, len(chunk) - 1].
- With probability 0.5 B is NotNext: contiguous sentences from a random start in a
  *different* document, up to the remaining target length; the chunk's unused sentences are
  put back (the next chunk starts at them). Otherwise B is the rest of the chunk (IsNext).
  One deliberate deviation from the reference code: it forces NotNext whenever a chunk has a
  single sentence (e.g. the last sentence of a document), which pushes NotNext to ~55% on
  real corpora; here such a chunk follows the same coin and, for IsNext, is split at a random
  token into A and its true continuation B (the paper's "sentence" is any contiguous span).
  So NotNext is 50% as the paper states.
- The longer segment is truncated one token at a time, from the front or the back at random,
  until A + B fits max_seq_length - 3.

Streaming (the reference holds the whole corpus in memory): `generate_instances` holds a pool
of at most `pool_size` documents. It fills the pool, then repeatedly picks a uniformly random
pool document, creates its instances (dupe_factor passes) with NotNext segments drawn uniformly
from the *other* pool documents, and replaces it with the next document of the stream; at the
end the remaining pool documents are processed in random order (they all stay available as
NotNext sources). So every document is used dupe_factor times, memory is bounded by the pool
(plus the output shuffle buffer), and a NotNext B is still a uniformly random other document
from a random sample of the corpus — the reference semantics, except that the sample is the
pool instead of the whole corpus. A shard with a single document cannot make NotNext pairs;
its chunks become IsNext where they have two or more sentences and are skipped otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

Document = Sequence[np.ndarray]  # sentences of token ids


@dataclasses.dataclass
class Instance:
    """One `[CLS] A [SEP] B [SEP]` example before masking.

    tokens: [n] int32 including [CLS]/[SEP]; segment_ids: [n] int32 (0 for [CLS] A [SEP], 1 for
    B [SEP]); is_random_next: NotNext label. a_doc / b_doc: documents A and B came from (for
    checks and statistics; not written out).
    """

    tokens: np.ndarray
    segment_ids: np.ndarray
    is_random_next: bool
    a_doc: int
    b_doc: int


@dataclasses.dataclass(frozen=True)
class PairConfig:
    max_seq_length: int = 128
    short_seq_prob: float = 0.1
    dupe_factor: int = 10
    pool_size: int = 1000

    def __post_init__(self):
        if self.max_seq_length < 5:
            raise ValueError(f"max_seq_length must be >= 5, got {self.max_seq_length}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"short_seq_prob must be in [0, 1], got {self.short_seq_prob}")
        if self.dupe_factor < 1:
            raise ValueError(f"dupe_factor must be >= 1, got {self.dupe_factor}")
        if self.pool_size < 2:
            raise ValueError(f"pool_size must be >= 2, got {self.pool_size}")


def truncate_seq_pair(tokens_a: list, tokens_b: list, max_num_tokens: int,
                      rng: np.random.Generator) -> None:
    """Trims the longer list, from the front or back at random, until both fit (in place)."""
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def instances_from_document(pool: Sequence[tuple[int, Document]], slot: int, cfg: PairConfig,
                            cls_id: int, sep_id: int,
                            rng: np.random.Generator) -> list[Instance]:
    """One pass of the reference algorithm over the document `pool[slot]`.

    pool: (doc_id, document) pairs of non-empty documents; NotNext segments come from the
    entries other than `slot`.
    """
    doc_id, document = pool[slot]
    max_num_tokens = cfg.max_seq_length - 3
    target = max_num_tokens
    if rng.random() < cfg.short_seq_prob:
        target = int(rng.integers(2, max_num_tokens + 1))
    others = len(pool) - 1

    instances = []
    chunk: list[np.ndarray] = []
    length = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        length += len(document[i])
        if i == len(document) - 1 or length >= target:
            a_end = 1 if len(chunk) < 2 else int(rng.integers(1, len(chunk)))
            # NotNext needs another document (see module docstring); a one-token single
            # sentence cannot be split, so it is NotNext as in the reference.
            random_next = bool(others) and (
                rng.random() < 0.5 or (len(chunk) == 1 and len(chunk[0]) < 2))
            b_doc = doc_id
            tokens_a = [t for s in chunk[:a_end] for t in s.tolist()]
            tokens_b: list[int] = []
            if random_next:
                pick = int(rng.integers(0, others))
                b_doc, other = pool[pick + (pick >= slot)]  # uniform over the other slots
                start = int(rng.integers(0, len(other)))
                for sentence in other[start:]:
                    tokens_b.extend(sentence.tolist())
                    if len(tokens_b) >= target - len(tokens_a):
                        break
                i -= len(chunk) - a_end  # put the unused sentences back
            elif len(chunk) > 1:
                tokens_b = [t for s in chunk[a_end:] for t in s.tolist()]
            elif len(tokens_a) > 1:  # IsNext from one sentence: split it at a random token
                cut = int(rng.integers(1, len(tokens_a)))
                tokens_a, tokens_b = tokens_a[:cut], tokens_a[cut:]
            truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
            if tokens_a and tokens_b:
                tokens = np.array([cls_id, *tokens_a, sep_id, *tokens_b, sep_id], np.int32)
                segments = np.zeros(len(tokens), np.int32)
                segments[len(tokens_a) + 2:] = 1
                instances.append(Instance(tokens, segments, random_next, doc_id, b_doc))
            chunk, length = [], 0
        i += 1
    return instances


def generate_instances(documents: Iterable[Document], cfg: PairConfig, cls_id: int, sep_id: int,
                       rng: np.random.Generator) -> Iterator[Instance]:
    """Streams instances from a stream of documents with a bounded document pool (see top)."""
    pool: list[tuple[int, Document]] = []

    def process(slot: int) -> Iterator[Instance]:
        for _ in range(cfg.dupe_factor):
            yield from instances_from_document(pool, slot, cfg, cls_id, sep_id, rng)

    for doc_id, doc in enumerate(documents):
        if not doc:
            continue
        if len(pool) < cfg.pool_size:
            pool.append((doc_id, doc))
            continue
        slot = int(rng.integers(0, len(pool)))
        yield from process(slot)
        pool[slot] = (doc_id, doc)
    for slot in rng.permutation(len(pool)):
        yield from process(int(slot))


def shuffle_buffer(items: Iterable, size: int, rng: np.random.Generator) -> Iterator:
    """Bounded shuffle (the reference shuffles all instances; memory here is `size` items)."""
    buf = []
    for item in items:
        if len(buf) < size:
            buf.append(item)
            continue
        j = int(rng.integers(0, size))
        yield buf[j]
        buf[j] = item
    for j in rng.permutation(len(buf)):
        yield buf[int(j)]

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

import bisect
import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

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


class RandomDraws:
    """Scalar random numbers from a Generator, drawn in blocks.

    A scalar call on a NumPy Generator costs about a microsecond, many times the Python work
    per instance; a block draw amortises it. Deterministic for the Generator's seed.
    """

    def __init__(self, rng: np.random.Generator, block: int = 4096):
        self.rng = rng
        self._block = block
        self._uniform: list[float] = []
        self._bits: list[int] = []

    def random(self) -> float:
        """Uniform in [0, 1)."""
        if not self._uniform:
            self._uniform = self.rng.random(self._block).tolist()[::-1]
        return self._uniform.pop()

    def integers(self, low: int, high: int) -> int:
        """Uniform integer in [low, high) (high - low far below 2**53)."""
        return low + min(int(self.random() * (high - low)), high - low - 1)

    def heads(self, n: int) -> int:
        """Number of heads in n fair coin flips: the set bits among n random bits."""
        count = 0
        while n > 0:
            if not self._bits:
                self._bits = self.rng.bit_generator.random_raw(self._block).tolist()
            word = self._bits.pop()
            count += (word & ((1 << min(n, 64)) - 1)).bit_count()
            n -= 64
        return count


def _draws(rng: np.random.Generator | RandomDraws) -> RandomDraws:
    return rng if isinstance(rng, RandomDraws) else RandomDraws(rng, block=64)


def truncation(len_a: int, len_b: int, max_num_tokens: int,
               rng: np.random.Generator | RandomDraws) -> tuple[int, int, int, int]:
    """Tokens to trim from (A's front, A's back, B's front, B's back) so that A + B fits.

    The reference rule: while too long, the longer segment (B on a tie) loses one token, from
    the front or the back by a fair coin. Which segment loses each token does not depend on
    the coins: the longer one shrinks until the two are level, then they alternate. So the
    totals per segment are arithmetic, and each segment's front count is Binomial(total, 1/2)
    — the same distribution as flipping a coin per token, in one draw.
    """
    excess = len_a + len_b - max_num_tokens
    if excess <= 0:
        return 0, 0, 0, 0
    if len_a > len_b:  # A shrinks to B's length, then B, A, B, ... alternate
        lead = len_a - len_b
        from_a = excess if excess <= lead else lead + (excess - lead) // 2
    else:  # B shrinks to one below A, then A, B, A, ... alternate
        lead = len_b - len_a + 1
        from_a = 0 if excess <= lead else (excess - lead + 1) // 2
    from_b = excess - from_a
    draws = _draws(rng)
    a_front, b_front = draws.heads(from_a), draws.heads(from_b)
    return a_front, from_a - a_front, b_front, from_b - b_front


class PooledDocument(NamedTuple):
    """A document held in the pool: its sentences concatenated, with sentence boundaries.

    tokens: [total] int32; offsets: sentence k is tokens[offsets[k]:offsets[k + 1]] (a Python
    list of len(sentences) + 1, searched with bisect: chunks need no per-sentence loop).
    """

    doc_id: int
    tokens: np.ndarray
    offsets: list[int]

    @classmethod
    def of(cls, doc_id: int, document: Document) -> PooledDocument:
        lengths = [len(s) for s in document]
        return cls(doc_id, np.concatenate(document).astype(np.int32, copy=False),
                   [0, *itertools.accumulate(lengths)])


def instances_from_document(pool: Sequence[PooledDocument], slot: int, cfg: PairConfig,
                            cls_id: int, sep_id: int,
                            rng: np.random.Generator | RandomDraws) -> list[Instance]:
    """One pass of the reference algorithm over the document `pool[slot]`.

    pool: the non-empty documents held; NotNext segments come from the entries other than
    `slot`.
    """
    rng = _draws(rng)
    doc_id, tokens, off = pool[slot]
    n = len(off) - 1
    max_num_tokens = cfg.max_seq_length - 3
    target = max_num_tokens
    if rng.random() < cfg.short_seq_prob:
        target = rng.integers(2, max_num_tokens + 1)
    others = len(pool) - 1

    instances = []
    i = 0
    while i < n:
        # The chunk is sentences i..j: up to the first that brings it to the target length,
        # or to the end of the document.
        j = min(bisect.bisect_left(off, off[i] + target, i + 1), n) - 1
        size = j - i + 1
        a_end = 1 if size < 2 else rng.integers(1, size)
        # NotNext needs another document (see module docstring); a one-token single
        # sentence cannot be split, so it is NotNext as in the reference.
        random_next = bool(others) and (
            rng.random() < 0.5 or (size == 1 and off[i + 1] - off[i] < 2))
        b_doc = doc_id
        tokens_a = tokens[off[i]:off[i + a_end]]
        tokens_b = tokens[:0]
        if random_next:
            pick = rng.integers(0, others)
            b_doc, other, other_off = pool[pick + (pick >= slot)]  # uniform over other slots
            start = rng.integers(0, len(other_off) - 1)
            # Sentences from `start` until B reaches the remaining target (at least one).
            stop = min(bisect.bisect_left(other_off, other_off[start] + target - len(tokens_a),
                                          start + 1), len(other_off) - 1)
            tokens_b = other[other_off[start]:other_off[stop]]
            next_i = i + a_end  # put the unused sentences back
        else:
            next_i = j + 1
            if size > 1:
                tokens_b = tokens[off[i + a_end]:off[j + 1]]
            elif len(tokens_a) > 1:  # IsNext from one sentence: split it at a random token
                cut = rng.integers(1, len(tokens_a))
                tokens_a, tokens_b = tokens_a[:cut], tokens_a[cut:]
        a_front, a_back, b_front, b_back = truncation(len(tokens_a), len(tokens_b),
                                                      max_num_tokens, rng)
        n_a = len(tokens_a) - a_front - a_back
        n_b = len(tokens_b) - b_front - b_back
        if n_a and n_b:
            ids = np.empty(n_a + n_b + 3, np.int32)
            ids[0] = cls_id
            ids[1:n_a + 1] = tokens_a[a_front:a_front + n_a]
            ids[n_a + 1] = sep_id
            ids[n_a + 2:-1] = tokens_b[b_front:b_front + n_b]
            ids[-1] = sep_id
            segments = np.zeros(len(ids), np.int32)
            segments[n_a + 2:] = 1
            instances.append(Instance(ids, segments, random_next, doc_id, b_doc))
        i = next_i
    return instances


def generate_instances(documents: Iterable[Document], cfg: PairConfig, cls_id: int, sep_id: int,
                       rng: np.random.Generator) -> Iterator[Instance]:
    """Streams instances from a stream of documents with a bounded document pool (see top)."""
    pool: list[PooledDocument] = []
    draws = RandomDraws(rng)

    def process(slot: int) -> Iterator[Instance]:
        for _ in range(cfg.dupe_factor):
            yield from instances_from_document(pool, slot, cfg, cls_id, sep_id, draws)

    for doc_id, doc in enumerate(documents):
        if not doc:
            continue
        if len(pool) < cfg.pool_size:
            pool.append(PooledDocument.of(doc_id, doc))
            continue
        slot = draws.integers(0, len(pool))
        yield from process(slot)
        pool[slot] = PooledDocument.of(doc_id, doc)
    for slot in rng.permutation(len(pool)):
        yield from process(int(slot))


def shuffle_buffer(items: Iterable, size: int, rng: np.random.Generator) -> Iterator:
    """Bounded shuffle (the reference shuffles all instances; memory here is `size` items)."""
    buf = []
    slots: list[int] = []
    for item in items:
        if len(buf) < size:
            buf.append(item)
            continue
        if not slots:  # uniform slots drawn in blocks (a scalar draw costs ~1 us)
            slots = rng.integers(0, size, 4096).tolist()
        j = slots.pop()
        yield buf[j]
        buf[j] = item
    for j in rng.permutation(len(buf)):
        yield buf[int(j)]

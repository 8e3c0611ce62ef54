"""Masked-LM masking: the one home of the selection, 80/10/10 and whole-word rules.

Two implementations of the same rules, sharing `MaskingConfig`:

* `mask_sequence` (NumPy, one sequence): static masking while creating pre-training data.
* `mask_batch_tf` (TensorFlow, a batch): dynamic masking inside tf.data, a fresh mask every
  epoch; stateless random numbers keyed by (seed, batch index) keep it deterministic and make
  the position restorable from an iterator checkpoint.

The rules (Devlin et al., 2018 and the reference generator):

1. Candidates are the real tokens that are not special ([CLS], [SEP], [PAD], [MASK], [UNK]:
   everything in `special_ids`). They are grouped into words: with whole-word masking a
   continuation piece ("##x" in WordPiece, a piece without "▁" in SentencePiece) joins the
   word of the candidate just before it; otherwise every candidate is its own word.
2. num_to_predict = min(max_predictions, max(1, round(n * masked_lm_prob))), n = the number of
   real tokens including [CLS]/[SEP] (as the reference counts `len(tokens)`); round is
   round-half-to-even like Python's `round`.
3. Words are visited in uniformly random order; a word is taken if all its pieces still fit
   into num_to_predict, otherwise skipped (the reference's greedy rule).
4. Each chosen word becomes [MASK] with probability 0.8, a random token with 0.1 and stays
   unchanged with 0.1. The decision is made per word, so a whole word is masked together
   (the reference decides per piece; per word is what whole-word masking means, and for
   single-piece words the two are identical). Random tokens are drawn uniformly from the
   non-special vocabulary.
"""

from __future__ import annotations

import base64
import dataclasses

import numpy as np

MASK_PROB = 0.8
RANDOM_PROB = 0.1  # the remaining 1 - MASK_PROB - RANDOM_PROB stays unchanged


@dataclasses.dataclass(frozen=True)
class MaskingConfig:
    """Masked-LM settings shared by static (NumPy) and dynamic (tf.data) masking.

    continuation: [vocab_size] bool, True for ids that continue the previous word (needed only
      for whole-word masking; None means "no id is a continuation").
    """

    max_predictions: int
    vocab_size: int
    mask_id: int
    special_ids: tuple[int, ...]
    masked_lm_prob: float = 0.15
    whole_word: bool = False
    continuation: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise ValueError(f"masked_lm_prob must be in (0, 1), got {self.masked_lm_prob}")
        if self.max_predictions < 1:
            raise ValueError(f"max_predictions must be >= 1, got {self.max_predictions}")
        if not 0 <= self.mask_id < self.vocab_size:
            raise ValueError(
                f"mask_id {self.mask_id} outside the vocabulary [0, {self.vocab_size})")
        if self.continuation is not None and len(self.continuation) != self.vocab_size:
            raise ValueError(
                f"continuation has {len(self.continuation)} entries, "
                f"vocab_size is {self.vocab_size}"
            )
        if self.whole_word and self.continuation is None:
            raise ValueError("whole_word masking needs the continuation flags of the vocabulary")

    @classmethod
    def from_tokenizer(cls, tokenizer, *, max_predictions: int, masked_lm_prob: float = 0.15,
                       whole_word: bool = False) -> MaskingConfig:
        """Builds the config from a `bertjax.tokenization` tokenizer (or anything with its API)."""
        return cls(
            max_predictions=max_predictions,
            vocab_size=tokenizer.vocab_size,
            mask_id=tokenizer.mask_id,
            special_ids=tuple(sorted(tokenizer.special_ids)),
            masked_lm_prob=masked_lm_prob,
            whole_word=whole_word,
            continuation=continuation_flags(tokenizer),
        )

    def special_table(self) -> np.ndarray:
        """[vocab_size] bool, True for ids that are never masked."""
        table = np.zeros(self.vocab_size, bool)
        table[list(self.special_ids)] = True
        return table

    def continuation_table(self) -> np.ndarray:
        """[vocab_size] bool; all False when whole-word masking is off (every piece a word)."""
        if not self.whole_word or self.continuation is None:
            return np.zeros(self.vocab_size, bool)
        return np.asarray(self.continuation, bool)

    def replacement_ids(self) -> np.ndarray:
        """[n] int32, the ids a "random token" replacement is drawn from (non-special)."""
        return np.flatnonzero(~self.special_table()).astype(np.int32)


def continuation_flags(tokenizer) -> np.ndarray:
    """[vocab_size] bool: `tokenizer.is_continuation` for every id (False for special ids)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(tokenizer.vocab_size)))
    flags = np.array([tokenizer.is_continuation(t) for t in tokens], bool)
    flags[list(tokenizer.special_ids)] = False
    return flags


def encode_flags(flags: np.ndarray) -> str:
    """Bit-packed base64 text of a bool vector (to keep it in the JSON metadata)."""
    return base64.b64encode(np.packbits(np.asarray(flags, bool)).tobytes()).decode("ascii")


def decode_flags(text: str, size: int) -> np.ndarray:
    """Inverse of `encode_flags`."""
    return np.unpackbits(np.frombuffer(base64.b64decode(text), np.uint8))[:size].astype(bool)


def num_to_predict(num_tokens, masked_lm_prob: float, max_predictions: int):
    """min(max_predictions, max(1, round(n * p))), n = real tokens incl. [CLS]/[SEP]."""
    return np.minimum(max_predictions,
                      np.maximum(1, np.round(np.asarray(num_tokens, np.float64) * masked_lm_prob))
                      ).astype(np.int64)


def _greedy_take(lengths: np.ndarray, budget: int) -> np.ndarray:
    """Rule 3: take each word (in the given random order) whose pieces still fit the budget.

    lengths: [words] pieces per word, in visiting order → [words] bool.
    """
    if len(lengths) == 0 or lengths.max() == 1:  # single-piece words: the first `budget`
        return np.arange(len(lengths)) < budget
    taken, total = np.zeros(len(lengths), bool), 0
    for i, n in enumerate(lengths.tolist()):
        if total + n <= budget:
            taken[i] = True
            total += n
            if total == budget:
                break
    return taken


def mask_sequence(ids: np.ndarray, cfg: MaskingConfig, rng: np.random.Generator,
                  special: np.ndarray | None = None, continuation: np.ndarray | None = None,
                  replacements: np.ndarray | None = None):
    """Static masking of one sequence (all of `ids` are real tokens, no padding).

    ids: [n] int. Returns (masked_ids [n] int32, positions [k] int32 ascending,
    labels [k] int32) with k <= cfg.max_predictions. `special` / `continuation` /
    `replacements` are the config's tables, passed in to avoid rebuilding them per sequence.
    """
    ids = np.asarray(ids, np.int32)
    special = cfg.special_table() if special is None else special
    continuation = cfg.continuation_table() if continuation is None else continuation
    replacements = cfg.replacement_ids() if replacements is None else replacements

    candidate = ~special[ids]
    prev_candidate = np.concatenate([[False], candidate[:-1]])
    joins = continuation[ids] & prev_candidate & candidate  # continues the previous word
    starts = np.flatnonzero(candidate & ~joins)
    ends = _word_ends(starts, np.flatnonzero(~joins), len(ids))
    lengths = ends - starts
    order = rng.permutation(len(starts))
    # Python's round (half to even), as the reference; equal to `num_to_predict`.
    budget = min(cfg.max_predictions, max(1, round(len(ids) * cfg.masked_lm_prob)))
    chosen = np.sort(order[_greedy_take(lengths[order], budget)])
    action = rng.random(len(chosen))  # one decision per word
    sizes = lengths[chosen]
    # Positions of all pieces of the chosen words, ascending.
    positions = (np.repeat(starts[chosen] - (np.cumsum(sizes) - sizes), sizes)
                 + np.arange(sizes.sum())).astype(np.int32)
    action = np.repeat(action, sizes)
    out = ids.copy()
    out[positions[action < MASK_PROB]] = cfg.mask_id
    swap = positions[(action >= MASK_PROB) & (action < MASK_PROB + RANDOM_PROB)]
    out[swap] = replacements[rng.integers(0, len(replacements), len(swap))]
    return out, positions, ids[positions]


def _word_ends(starts: np.ndarray, boundary: np.ndarray, n: int) -> np.ndarray:
    """End (exclusive) of each word: the first boundary after its start, or n."""
    idx = np.searchsorted(boundary, starts, side="right")
    padded = np.append(boundary, n)
    return padded[idx]


# ---------------------------------------------------------------------------------------------
# Dynamic masking in tf.data. TensorFlow is imported lazily so the NumPy half stays TF-free.


def mask_batch_tf(input_ids, input_mask, cfg: MaskingConfig, seed):
    """Dynamic masking of a batch, same rules as `mask_sequence`.

    input_ids, input_mask: [batch, seq] int32. seed: [2] int tensor (stateless RNG key; use a
    different one per batch/epoch for a fresh mask). Returns a dict with input_ids [batch, seq],
    masked_lm_positions / masked_lm_ids [batch, max_predictions] int32 and
    masked_lm_weights [batch, max_predictions] float32 (1.0 for real predictions, padded with
    position 0 / id 0 / weight 0).
    """
    import tensorflow as tf

    ids = tf.cast(input_ids, tf.int32)
    real = tf.cast(input_mask, tf.bool)
    batch, seq = tf.shape(ids)[0], tf.shape(ids)[1]
    special = tf.constant(cfg.special_table())
    cont_table = tf.constant(cfg.continuation_table())
    replacements = tf.constant(cfg.replacement_ids())
    seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), 3)

    candidate = real & ~tf.gather(special, ids)
    prev_candidate = tf.pad(candidate[:, :-1], [[0, 0], [1, 0]])
    starts = candidate & ~(tf.gather(cont_table, ids) & prev_candidate)
    # Word number of every candidate position (0-based within the row; -1 elsewhere).
    word = tf.where(candidate, tf.cumsum(tf.cast(starts, tf.int32), axis=1) - 1, -1)
    num_words = tf.reduce_sum(tf.cast(starts, tf.int32), axis=1)  # [batch]
    flat_word = tf.where(candidate, word + tf.range(batch)[:, None] * seq, batch * seq)
    lengths = tf.math.unsorted_segment_sum(
        tf.ones([batch * seq], tf.int32), tf.reshape(flat_word, [-1]), batch * seq + 1)
    lengths = tf.reshape(lengths[:-1], [batch, seq])  # [batch, word] pieces per word

    # Random order of the words: sort uniform keys; absent words sort last.
    keys = tf.random.stateless_uniform([batch, seq], seeds[0])
    keys = tf.where(tf.range(seq)[None, :] < num_words[:, None], keys, 2.0)
    order = tf.argsort(keys, axis=1, stable=True)
    sorted_len = tf.gather(lengths, order, batch_dims=1)  # 0 for absent words

    n_real = tf.reduce_sum(tf.cast(real, tf.float64), axis=1)
    budget = tf.cast(tf.minimum(
        tf.cast(cfg.max_predictions, tf.float64),
        tf.maximum(tf.constant(1.0, tf.float64), tf.round(n_real * cfg.masked_lm_prob))), tf.int32)

    if cfg.whole_word:
        taken_sorted = _greedy_take_tf(sorted_len, budget)
    else:  # every word is one piece: greedy = the first `budget` words in random order
        taken_sorted = (tf.range(seq)[None, :] < budget[:, None]) & (sorted_len > 0)
    # Scatter back from sorted order to word order.
    inverse = tf.argsort(order, axis=1, stable=True)
    taken_word = tf.gather(taken_sorted, inverse, batch_dims=1)  # [batch, word]
    chosen = candidate & tf.gather(taken_word, tf.maximum(word, 0), batch_dims=1)

    action = tf.gather(tf.random.stateless_uniform([batch, seq], seeds[1]),
                       tf.maximum(word, 0), batch_dims=1)  # one decision per word
    random_ids = tf.gather(replacements, tf.random.stateless_uniform(
        [batch, seq], seeds[2], minval=0, maxval=len(cfg.replacement_ids()), dtype=tf.int32))
    new_ids = tf.where(chosen & (action < MASK_PROB), cfg.mask_id, ids)
    new_ids = tf.where(chosen & (action >= MASK_PROB) & (action < MASK_PROB + RANDOM_PROB),
                       random_ids, new_ids)

    # Chosen positions in ascending order, padded to max_predictions.
    index = tf.range(seq)[None, :]
    sort_key = tf.sort(tf.where(chosen, index, seq + index), axis=1)
    k = cfg.max_predictions
    sort_key = tf.pad(sort_key, [[0, 0], [0, tf.maximum(0, k - seq)]], constant_values=2 * seq)
    top = sort_key[:, :k]
    valid = top < seq
    positions = tf.where(valid, top, 0)
    labels = tf.where(valid, tf.gather(ids, positions, batch_dims=1), 0)
    return {
        "input_ids": new_ids,
        "masked_lm_positions": positions,
        "masked_lm_ids": labels,
        "masked_lm_weights": tf.cast(valid, tf.float32),
    }


def _greedy_take_tf(sorted_len, budget):
    """Rule 3 vectorised over the batch; loops over word ranks until every row is full.

    sorted_len: [batch, words] int32 (0 = no word); budget: [batch] int32 → [batch, words] bool.
    """
    import tensorflow as tf

    num = tf.shape(sorted_len)[1]
    rank = tf.range(num)[None, :]

    def cond(r, total, taken):
        return (r < num) & tf.reduce_any(total < budget)

    def body(r, total, taken):
        n = sorted_len[:, r]
        take = (n > 0) & (total + n <= budget)
        total = total + tf.where(take, n, 0)
        return r + 1, total, taken | ((rank == r) & take[:, None])

    _, _, taken = tf.while_loop(
        cond, body, (tf.constant(0), tf.zeros_like(budget), tf.zeros_like(sorted_len, tf.bool)))
    return taken

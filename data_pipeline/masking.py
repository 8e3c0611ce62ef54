"""Masked-LM masking: the one home of the selection, 80/10/10 and whole-word rules.

Two implementations of the same rules, sharing `MaskingConfig`:

* `mask_batch` (NumPy, a padded batch): static masking while creating pre-training data.
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
   unchanged with 0.1 (`MaskingConfig.mix`, configurable for the paper's Table 8). The
   decision is made per word, so a whole word is masked together (the reference decides per
   piece; per word is what whole-word masking means, and for
   single-piece words the two are identical). Random tokens are drawn uniformly from the
   non-special vocabulary.
"""

from __future__ import annotations

import base64
import dataclasses

import numpy as np

from bertjax.errors import ConfigError

# (MASK, SAME, RANDOM): the shares of chosen words replaced by [MASK], kept unchanged, and
# replaced by a random token (the paper's 80/10/10).
DEFAULT_MIX = (0.8, 0.1, 0.1)
# The dynamic masker draws its decision as an integer in [0, MIX_RESOLUTION): shares are exact
# to 1/MIX_RESOLUTION.
MIX_RESOLUTION = 1000


def check_mix(mix, names=("mask", "same", "random")) -> tuple[float, float, float]:
    """(mask, same, random) as floats, each in [0, 1] and summing to 1. `names` are what the
    user set them as (flags, config fields), so the ConfigError names them."""
    if len(mix) != 3:
        raise ConfigError(f"{'/'.join(names)} need 3 shares, got {mix}")
    mix = tuple(float(x) for x in mix)
    for name, share in zip(names, mix):
        if not 0.0 <= share <= 1.0:
            raise ConfigError(f"{name}={share} is not in [0, 1]")
    if abs(sum(mix) - 1.0) > 1e-6:
        raise ConfigError(f"{' + '.join(names)} = {mix[0]:g} + {mix[1]:g} + {mix[2]:g} = "
                          f"{sum(mix):g}, not 1")
    return mix


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
    mix: tuple[float, float, float] = DEFAULT_MIX  # (mask, same, random) shares, sum 1

    def __post_init__(self):
        object.__setattr__(self, "mix", check_mix(self.mix))
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
                       whole_word: bool = False, mix=DEFAULT_MIX) -> MaskingConfig:
        """Builds the config from a `bertjax.tokenization` tokenizer (or anything with its API)."""
        return cls(
            max_predictions=max_predictions,
            vocab_size=tokenizer.vocab_size,
            mask_id=tokenizer.mask_id,
            special_ids=tuple(sorted(tokenizer.special_ids)),
            masked_lm_prob=masked_lm_prob,
            whole_word=whole_word,
            continuation=continuation_flags(tokenizer),
            mix=tuple(mix),
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


def _greedy_take_rows(sorted_len: np.ndarray, budget: np.ndarray) -> np.ndarray:
    """Rule 3 for a batch: walk the words in their random order, taking each that still fits.

    sorted_len: [batch, words] pieces per word in visiting order (0 = no word);
    budget: [batch] → [batch, words] bool. Loops over ranks (vectorised over the batch) until
    every row is full or out of words.
    """
    batch, words = sorted_len.shape
    taken = np.zeros((batch, words), bool)
    total = np.zeros(batch, np.int64)
    last = int((sorted_len > 0).sum(1).max(initial=0))
    for r in range(last):
        n = sorted_len[:, r]
        take = (n > 0) & (total + n <= budget)
        taken[:, r] = take
        total += np.where(take, n, 0)
        if (total == budget).all():
            break
    return taken


def mask_batch(ids: np.ndarray, lengths: np.ndarray, cfg: MaskingConfig,
               rng: np.random.Generator, special: np.ndarray | None = None,
               continuation: np.ndarray | None = None, replacements: np.ndarray | None = None):
    """Static masking of a padded batch (NumPy, the rules above, vectorised over rows).

    ids: [batch, seq] int, the first `lengths[i]` of row i real tokens (the rest padding,
    never touched). Returns (masked_ids [batch, seq] int32, positions [batch, max_predictions]
    int32 ascending then 0-padded, labels [batch, max_predictions] int32 (0-padded),
    counts [batch] int: the number of real predictions per row). `special` / `continuation` /
    `replacements` are the config's tables, passed in to avoid rebuilding them per batch.
    """
    ids = np.asarray(ids, np.int32)
    lengths = np.asarray(lengths, np.int64)
    special = cfg.special_table() if special is None else special
    continuation = cfg.continuation_table() if continuation is None else continuation
    replacements = cfg.replacement_ids() if replacements is None else replacements
    batch, seq = ids.shape
    rows = np.arange(batch)[:, None]

    candidate = (np.arange(seq) < lengths[:, None]) & ~special[ids]
    prev_candidate = np.zeros_like(candidate)
    prev_candidate[:, 1:] = candidate[:, :-1]
    starts = candidate & ~(continuation[ids] & prev_candidate)  # a joining piece starts nothing
    word = np.cumsum(starts, axis=1) - 1  # word number of each candidate within its row
    word = np.where(candidate, word, seq)  # non-candidates: a dummy word past the end
    num_words = starts.sum(1)
    word_len = np.bincount((rows * (seq + 1) + word).ravel(), minlength=batch * (seq + 1))
    word_len = word_len.reshape(batch, seq + 1)[:, :seq]  # [batch, word] pieces per word

    # A uniformly random visiting order of each row's words (absent words sort last).
    keys = np.where(np.arange(seq) < num_words[:, None], rng.random((batch, seq)), 2.0)
    order = np.argsort(keys, axis=1, kind="stable")
    budget = num_to_predict(lengths, cfg.masked_lm_prob, cfg.max_predictions)
    sorted_len = np.take_along_axis(word_len, order, axis=1)
    if cfg.whole_word:
        taken_sorted = _greedy_take_rows(sorted_len, budget)
    else:  # single-piece words: the first `budget` words in random order
        taken_sorted = (np.arange(seq) < budget[:, None]) & (sorted_len > 0)
    taken_word = np.zeros((batch, seq + 1), bool)
    np.put_along_axis(taken_word, order, taken_sorted, axis=1)
    chosen = np.take_along_axis(taken_word, word, axis=1)  # dummy word: never taken

    # One mask / random / same decision per word, shared by all its pieces.
    mask_share, _, random_share = cfg.mix
    action = np.take_along_axis(rng.random((batch, seq + 1)), word, axis=1)
    out = ids.copy()
    out[chosen & (action < mask_share)] = cfg.mask_id
    swap = chosen & (action >= mask_share) & (action < mask_share + random_share)
    out[swap] = replacements[rng.integers(0, len(replacements), int(swap.sum()))]

    counts = chosen.sum(1)
    r, c = np.nonzero(chosen)  # row-major: ascending positions within each row
    slot = np.arange(len(r)) - np.repeat(np.cumsum(counts) - counts, counts)
    positions = np.zeros((batch, cfg.max_predictions), np.int32)
    labels = np.zeros((batch, cfg.max_predictions), np.int32)
    positions[r, slot] = c
    labels[r, slot] = ids[r, c]
    return out, positions, labels, counts


# ---------------------------------------------------------------------------------------------
# Dynamic masking in tf.data. TensorFlow is imported lazily so the NumPy half stays TF-free; the
# readers calling these have imported it through `tf_setup` (CPU only, quiet). (Not
# `tf_setup.import_tensorflow()` here: these functions run inside tf.data maps, whose AutoGraph
# would try to convert it.)


def mask_batch_tf(input_ids, input_mask, cfg: MaskingConfig, seed, row_offset: int = 0,
                  global_batch: int | None = None):
    """Dynamic masking of a batch, same rules as `mask_batch`, vectorised TensorFlow ops.

    input_ids, input_mask: [batch, seq] int32. seed: [2] int tensor (stateless RNG key; use a
    different one per batch/epoch for a fresh mask). With `global_batch`, the batch is rows
    row_offset.. of a global batch of that many rows and gets those rows' random draws: a
    process masks its rows as a single process masking the global batch would.
    Returns a dict with input_ids [batch, seq],
    masked_lm_positions / masked_lm_ids [batch, max_predictions] int32 and
    masked_lm_weights [batch, max_predictions] float32 (1.0 for real predictions, padded with
    position 0 / id 0 / weight 0).
    """
    import tensorflow as tf

    ids = tf.cast(input_ids, tf.int32)
    real = tf.cast(input_mask, tf.bool)
    batch, seq = tf.shape(ids)[0], tf.shape(ids)[1]
    seq_static = ids.shape[1]
    k = cfg.max_predictions
    seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), 2)

    def uniform(key, **kwargs):  # [batch, seq]: this batch's rows of the global draw
        if global_batch is None:
            return tf.random.stateless_uniform([batch, seq], key, **kwargs)
        drawn = tf.random.stateless_uniform([global_batch, seq], key, **kwargs)
        return drawn[row_offset:row_offset + batch]

    candidate = real & ~tf.gather(tf.constant(cfg.special_table()), ids)
    index = tf.range(seq)[None, :]
    n_real = tf.reduce_sum(tf.cast(real, tf.float64), axis=1)
    budget = tf.cast(tf.minimum(
        tf.cast(k, tf.float64),
        tf.maximum(tf.constant(1.0, tf.float64), tf.round(n_real * cfg.masked_lm_prob))), tf.int32)

    # Random keys made unique by the position in their low bits: the uniformly random visiting
    # order is then "ascending key" with no ties, so a top-k or a threshold selects it exactly.
    bits = max(1, (seq_static - 1).bit_length()) if seq_static else 16
    keys = uniform(seeds[0], minval=0, maxval=2 ** (31 - bits), dtype=tf.int32) * 2 ** bits + index
    never = tf.int32.max  # key of positions that are not selectable

    # One integer draw r per position decides both the action and the random token: r // n
    # is uniform over 0..R-1 (R = MIX_RESOLUTION; below R·mask: [MASK], then R·random: a
    # random token, the rest: unchanged) and r % n, independent of it, indexes the
    # replacement ids.
    replacements = cfg.replacement_ids()
    n = len(replacements)
    if MIX_RESOLUTION * n >= 2 ** 31:
        raise ValueError(f"{n} replacement ids are too many for int32 draws")
    draw = uniform(seeds[1], minval=0, maxval=MIX_RESOLUTION * n, dtype=tf.int32)
    random_ids = tf.gather(tf.constant(replacements), draw % n)
    if cfg.whole_word:
        chosen, word = _whole_word_choice(ids, candidate, keys, budget, cfg, never)
        # One decision per word: every piece reads its word's draw (its own random token).
        decision = tf.gather(draw // n, word, batch_dims=1)
    else:
        # Single-piece words: the `budget` candidates with the smallest keys.
        keys = tf.where(candidate, keys, never)
        neg_top, top_index = tf.math.top_k(-keys, k=tf.minimum(k, seq), sorted=True)
        rank = tf.range(tf.shape(top_index)[1])[None, :]
        valid = (rank < budget[:, None]) & (neg_top > -never)
        threshold = tf.reduce_max(tf.where(valid, -neg_top, -1), axis=1)
        chosen = candidate & (keys <= threshold[:, None])
        decision = draw // n

    n_mask = round(cfg.mix[0] * MIX_RESOLUTION)
    n_random = round(cfg.mix[2] * MIX_RESOLUTION)
    new_ids = tf.where(chosen & (decision < n_mask), cfg.mask_id, ids)
    new_ids = tf.where(chosen & (decision >= n_mask) & (decision < n_mask + n_random),
                       random_ids, new_ids)

    # Chosen positions in ascending order, padded to k: the chosen (row, column) pairs come in
    # row-major order, so a pair's slot is its index minus the number of pairs in earlier rows.
    pairs = tf.cast(tf.where(chosen), tf.int32)  # [n, 2]
    per_row = tf.reduce_sum(tf.cast(chosen, tf.int32), axis=1)
    row_start = tf.cumsum(per_row, exclusive=True)
    slot = tf.range(tf.shape(pairs)[0]) - tf.gather(row_start, pairs[:, 0])
    at = tf.stack([pairs[:, 0], slot], axis=1)
    positions = tf.scatter_nd(at, pairs[:, 1], [batch, k])
    valid = tf.range(k)[None, :] < per_row[:, None]
    labels = tf.where(valid, tf.gather(ids, positions, batch_dims=1), 0)
    return {
        "input_ids": new_ids,
        "masked_lm_positions": positions,
        "masked_lm_ids": labels,
        "masked_lm_weights": tf.cast(valid, tf.float32),
    }


def _whole_word_choice(ids, candidate, keys, budget, cfg: MaskingConfig, never):
    """Rule 3 with whole words: ([batch, seq] bool chosen pieces, [batch, seq] word index).

    Word w of a row is ranked by the key at its w-th slot; words are visited in key order and
    taken greedily while they fit the budget.
    """
    import tensorflow as tf

    batch, seq = tf.shape(ids)[0], tf.shape(ids)[1]
    prev_candidate = tf.pad(candidate[:, :-1], [[0, 0], [1, 0]])
    starts = candidate & ~(tf.gather(tf.constant(cfg.continuation_table()), ids) & prev_candidate)
    # Word number of every candidate position (0-based within the row; 0 elsewhere, unused).
    word = tf.maximum(tf.cumsum(tf.cast(starts, tf.int32), axis=1) - 1, 0)
    flat_word = tf.where(candidate, word + tf.range(batch)[:, None] * seq, batch * seq)
    lengths = tf.math.unsorted_segment_sum(
        tf.ones([batch * seq], tf.int32), tf.reshape(flat_word, [-1]), batch * seq + 1)
    lengths = tf.reshape(lengths[:-1], [batch, seq])  # [batch, word] pieces per word

    taken_word = _greedy_take_tf(lengths, tf.where(lengths > 0, keys, never), budget,
                                 cfg.max_predictions, never)
    return candidate & tf.gather(taken_word, word, batch_dims=1), word


def _greedy_take_tf(lengths, word_keys, budget, max_predictions: int, never):
    """Rule 3 vectorised over the batch, without sorting all the words.

    lengths: [batch, words] int32 pieces per word (0 = no word); word_keys: [batch, words]
    unique int32 keys, ascending = visiting order (`never` for absent words); budget: [batch].
    Returns [batch, words] bool, the words taken.

    Walking the words in key order, the greedy rule takes an unbroken prefix while the running
    total stays within the budget — at most `max_predictions` words (each has a piece), found
    with one top-k. Past the first word that does not fit, the room left is smaller than that
    word, and the next word taken is simply the next (in key order) no longer than the room:
    each round of the loop takes one such word per row and shrinks the room, so it runs at most
    `room` rounds instead of one round per word.
    """
    import tensorflow as tf

    num = tf.shape(lengths)[1]
    k = tf.minimum(max_predictions, num)
    neg_keys, top = tf.math.top_k(-word_keys, k=k, sorted=True)
    top_len = tf.gather(lengths, top, batch_dims=1)  # 0 for absent words
    cum = tf.cumsum(top_len, axis=1)
    prefix = (cum <= budget[:, None]) & (top_len > 0)
    n_prefix = tf.reduce_sum(tf.cast(prefix, tf.int32), axis=1)
    room = budget - tf.reduce_max(tf.where(prefix, cum, 0), axis=1)
    # The key of the last word visited so far: the first that did not fit (or the last taken).
    stop_rank = tf.minimum(n_prefix, k - 1)
    last_key = -tf.gather(neg_keys, stop_rank, batch_dims=1)
    taken_key = tf.reduce_max(tf.where(prefix, -neg_keys, -1), axis=1)
    taken = word_keys <= taken_key[:, None]  # unique keys: exactly the prefix words

    def next_fit(room, last_key):
        """[batch] slot of the next word (key order) no longer than the room, and whether any."""
        fits = tf.where((lengths <= room[:, None]) & (word_keys > last_key[:, None]),
                        word_keys, never)  # absent words have key `never`: never fit
        slot = tf.argmin(fits, axis=1, output_type=tf.int32)
        return slot, tf.gather(fits, slot, batch_dims=1) < never

    def body(room, last_key, taken, slot, found):
        room = room - tf.where(found, tf.gather(lengths, slot, batch_dims=1), 0)
        last_key = tf.where(found, tf.gather(word_keys, slot, batch_dims=1), never)
        taken = taken | ((tf.range(num)[None, :] == slot[:, None]) & found[:, None])
        return (room, last_key, taken, *next_fit(room, last_key))

    _, _, taken, _, _ = tf.while_loop(lambda *state: tf.reduce_any(state[-1]), body,
                                      (room, last_key, taken, *next_fit(room, last_key)))
    return taken

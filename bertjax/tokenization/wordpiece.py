"""WordPiece with Google BERT's semantics: an exact path and a fast path with identical output.

Exact path (`WordPieceTokenizer.tokenize_exact`, `pieces_exact`): the reference algorithm
character by character (see `normalization.py`), then greedy longest-match-first WordPiece
with "##" continuations; a word longer than 100 characters, or one with a character sequence
no vocabulary entry matches, becomes a single [UNK]. The special tokens [PAD] [UNK] [CLS] [SEP]
[MASK] written literally in the text are matched before normalisation and never split.

Fast path (`tokenize`, `tokenize_batch`, `encode*`), identical output, two engines:
1. Pure Python (always available, no TensorFlow). Everything after cleaning is a function of
   one whitespace-delimited word, so the words are found with one C-level regex/`str.split`
   pass and looked up in a word cache whose misses are filled by the *same* per-word code as
   the exact path. Natural text is Zipfian, so nearly every word is a hit; the ~90k misses of
   a cold 10 MB corpus still cost as much as all the hits (about 2.5-3x HF `tokenizers`).
2. tensorflow-text (`tf_text_backend`), for batches of at least `tf_text_min_batch` texts
   when it is installed, once the tokenizer's safe text (its earlier batches' and this one's)
   reaches `tf_text_after_chars` characters (default: what starting it costs): texts
   verified to be tokenized identically (ASCII without control characters or "[") go to its
   compiled FastWordpieceTokenizer, all others to engine 1.
   6-8x HF on one core including the routing. tensorflow-text's own normaliser differs from
   the reference (final sigma, Armenian ligature, vulgar fractions) and it needs the full
   TensorFlow package, hence the routing, and a lazy import (seconds) only for much text.
Texts for which the word split is not provably the reference one (literal special tokens;
control characters when offsets are needed) take the exact path. HF `tokenizers` is not used:
an independent reimplementation that differs from the reference (final sigma, see the tests)
and is slower than both engines on one core (measured: `bench`).
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Iterable
from typing import NamedTuple

from bertjax import paths
from bertjax.errors import DataError
from bertjax.tokenization import normalization as norm
from bertjax.tokenization import tf_text_backend
from bertjax.tokenization.base import SPECIAL_TOKENS, Span, TextPieces, Tokenizer

MAX_INPUT_CHARS_PER_WORD = 100
CACHE_SIZE = 1 << 20  # words; the cache is cleared when full (memory bound for huge corpora)
# Batches with at least this many tensorflow-text-safe texts may use it (see tf_text_backend).
TF_TEXT_MIN_BATCH = 512

# ASCII control characters the reference drops (\t \n \r are whitespace, not control).
_ASCII_DROP = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]+")
_ASCII_WORD = re.compile(r"[^ \t\n\r]+")
# BasicTokenizer on an ASCII word: runs of letters/digits, and single punctuation characters
# (every other printable ASCII character is punctuation for the reference).
_ASCII_BASIC = re.compile(r"[A-Za-z0-9]+|[^A-Za-z0-9]")


# A vocabulary file that cannot be used; the message names the file.
VocabError = DataError


def load_vocab(path: str) -> list[str]:
    """Tokens of a `vocab.txt` in id order (one per line, surrounding whitespace stripped).

    Raises VocabError naming the file for: missing/unreadable file, invalid UTF-8, no entries,
    an empty entry, a duplicate entry, or a missing special token.
    """
    try:
        with paths.open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise VocabError(f"{path}: cannot read vocabulary file ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise VocabError(f"{path}: invalid UTF-8 at byte {e.start} (line {line})") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    tokens = [line.strip() for line in lines]
    if not tokens:
        raise VocabError(f"{path}: vocabulary file is empty")
    return validate_vocab(tokens, path)


def validate_vocab(tokens: list[str], source: str) -> list[str]:
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if not token:
            raise VocabError(f"{source}: empty vocabulary entry at line {i + 1}")
        if token in seen:
            raise VocabError(
                f"{source}: duplicate vocabulary entry {token!r} at lines {seen[token] + 1} "
                f"and {i + 1}")
        seen[token] = i
    missing = [t for t in SPECIAL_TOKENS if t not in seen]
    if missing:
        raise VocabError(f"{source}: vocabulary lacks special token(s) {' '.join(missing)}")
    return tokens


class WordRecord(NamedTuple):
    """Tokenization of one cleaned whitespace-delimited word. All `[n_tokens]` but n_words."""

    tokens: tuple[str, ...]
    ids: tuple[int, ...]
    offsets: tuple[Span, ...]  # character spans within the word
    word_ids: tuple[int, ...]  # index of the punctuation-split word within the word
    n_words: int


class _Cache(dict):
    """word -> value, filled on a miss by `fill(word)`; cleared when it reaches CACHE_SIZE."""

    def __init__(self, fill):
        super().__init__()
        self.fill = fill

    def __missing__(self, word):
        value = self.fill(word)
        if len(self) >= CACHE_SIZE:
            self.clear()
        self[word] = value
        return value


class WordPieceTokenizer(Tokenizer):
    """BERT WordPiece tokenizer over a `vocab.txt` vocabulary (see module docstring)."""

    def __init__(self, tokens: list[str], do_lower_case: bool = True, source: str = "<vocab>"):
        tokens = validate_vocab(list(tokens), source)
        self.source = source
        self.do_lower_case = bool(do_lower_case)
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self._inv_vocab = tokens
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
            self.vocab[t] for t in SPECIAL_TOKENS)
        self.unk_token = "[UNK]"
        # No vocabulary entry is longer than this, so longer candidates need no lookup.
        self._max_piece_chars = max(len(t) for t in tokens)
        self._special_re = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
        self._records = _Cache(self._word_record)
        self._token_cache = _Cache(lambda word: self._records[word].tokens)
        self._id_cache = _Cache(lambda word: self._records[word].ids)
        # None: never use tensorflow-text; otherwise the number of safe texts a batch needs.
        self.tf_text_min_batch: int | None = TF_TEXT_MIN_BATCH
        # Safe characters (earlier batches' and the batch's) before it is started; None:
        # tf_text_backend.start_chars(), what starting it costs.
        self.tf_text_after_chars: int | None = None
        self._safe_chars = 0  # safe characters tokenized so far
        # The backend once built; None if building failed; False before the first try.
        self._tf_text: tf_text_backend.FastWordpieceBackend | None | bool = False

    @classmethod
    def from_file(cls, path: str, do_lower_case: bool = True) -> WordPieceTokenizer:
        return cls(load_vocab(path), do_lower_case, source=path)

    # ---- the reference algorithm
    def wordpiece(self, word: str) -> list[tuple[str, int, int]]:
        """Greedy longest-match-first split of one basic token: `[(piece, start, end)]`."""
        n = len(word)
        if n > MAX_INPUT_CHARS_PER_WORD:
            return [(self.unk_token, 0, n)]
        vocab, pieces, start = self.vocab, [], 0
        while start < n:
            end = min(n, start + self._max_piece_chars)
            while start < end:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in vocab:
                    break
                end -= 1
            else:
                return [(self.unk_token, 0, n)]
            pieces.append((piece, start, end))
            start = end
        return pieces

    def _basic_pieces(self, basic_tokens, out: TextPieces, first_word: int) -> int:
        """Appends the WordPiece tokens of `[(basic_token, spans)]`; returns the next word id."""
        word = first_word
        for basic, spans in basic_tokens:
            for piece, start, end in self.wordpiece(basic):
                out.tokens.append(piece)
                out.ids.append(self.vocab[piece])
                out.offsets.append((spans[start][0], spans[end - 1][1]))
                out.word_ids.append(word)
            word += 1
        return word

    def pieces_exact(self, text: str) -> TextPieces:
        """Tokens, ids, offsets into `text` and word ids, by the character-level reference."""
        text = _as_text(text)
        out = TextPieces([], [], [], [])
        word = 0
        for start, end, special in self._segments(text):
            if special:
                token = text[start:end]
                out.tokens.append(token)
                out.ids.append(self.vocab[token])
                out.offsets.append((start, end))
                out.word_ids.append(word)
                word += 1
                continue
            basic = norm.basic_tokenize(text[start:end], self.do_lower_case)
            if start:
                basic = [(t, [(s + start, e + start) for s, e in spans]) for t, spans in basic]
            word = self._basic_pieces(basic, out, word)
        return out

    def tokenize_exact(self, text: str) -> list[str]:
        return self.pieces_exact(text).tokens

    # ---- the fast path
    def _word_record(self, word: str) -> WordRecord:
        """The exact path applied to one cleaned whitespace-delimited word (cache filler)."""
        out = TextPieces([], [], [], [])
        if word.isascii():
            # Same result as the general branch (tests compare them): for ASCII, lower() needs
            # no context and NFD/accent stripping changes nothing, so spans are identities.
            if self.do_lower_case:
                word = word.lower()
            n_words, vocab = 0, self.vocab
            for m in _ASCII_BASIC.finditer(word):
                base = m.start()
                for piece, start, end in self.wordpiece(m.group()):
                    out.tokens.append(piece)
                    out.ids.append(vocab[piece])
                    out.offsets.append((base + start, base + end))
                    out.word_ids.append(n_words)
                n_words += 1
            return WordRecord(tuple(out.tokens), tuple(out.ids), tuple(out.offsets),
                              tuple(out.word_ids), n_words)
        spans = [(i, i + 1) for i in range(len(word))]
        basic = norm.normalize_whitespace_token(word, spans, self.do_lower_case)
        n_words = self._basic_pieces(basic, out, 0)
        return WordRecord(tuple(out.tokens), tuple(out.ids), tuple(out.offsets),
                          tuple(out.word_ids), n_words)

    # The non-ASCII patterns, built on first use: they scan every Unicode code point, a
    # noticeable part of a command's start that ASCII input never needs.
    @functools.cached_property
    def _drop_re(self) -> re.Pattern:
        return norm.bulk_patterns()[0]

    @functools.cached_property
    def _word_re(self) -> re.Pattern:
        _, split, cjk = norm.bulk_patterns()
        cjk_class, split_class = cjk.pattern[1:-1], split.pattern[1:-1]
        # A reference word: one CJK ideograph, or a run of anything but split points and CJK.
        return re.compile(f"[{cjk_class}]|[^{split_class}{cjk_class}]+")

    def _has_special(self, text: str) -> bool:
        return "[" in text and self._special_re.search(text) is not None

    def _words(self, text: str) -> list[str]:
        """The reference's cleaned whitespace-delimited words (for texts without specials)."""
        if text.isascii():
            if _ASCII_DROP.search(text):
                text = _ASCII_DROP.sub("", text)
            # Lowercasing ASCII is context free, so the whole line at once equals per word.
            return (text.lower() if self.do_lower_case else text).split()
        return self._word_re.findall(self._drop_re.sub("", text))

    def tokenize(self, text: str) -> list[str]:
        """WordPiece tokens of `text` (no [CLS]/[SEP]); identical to `tokenize_exact`."""
        text = _as_text(text)
        if self._has_special(text):
            return self.pieces_exact(text).tokens
        return list(itertools.chain.from_iterable(map(self._token_cache.__getitem__,
                                                      self._words(text))))

    def tokenize_batch(self, texts: Iterable[str]) -> list[list[str]]:
        return self._batch(texts, self._token_cache, self.tokenize, self._inv_vocab)

    def tokenize_to_ids_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """`convert_tokens_to_ids` of each `tokenize_batch` result, from a cache of ids."""
        return self._batch(texts, self._id_cache,
                           lambda t: self.convert_tokens_to_ids(self.tokenize(t)), None)

    def _tf_text_for(self, texts: list, safe: list[bool]
                     ) -> tf_text_backend.FastWordpieceBackend | None:
        """The tensorflow-text backend if the batch `texts` (`safe`: tf_text_backend.is_safe of
        each) should use it: enough safe texts, and enough safe text so far to pay for
        starting it. The characters are counted only until it is started."""
        if self.tf_text_min_batch is None or not tf_text_backend.available():
            return None
        enough_texts = sum(safe) >= self.tf_text_min_batch
        if self._tf_text is False:
            self._safe_chars += sum(map(len, itertools.compress(texts, safe)))
            after = self.tf_text_after_chars
            if not enough_texts or self._safe_chars < (
                    tf_text_backend.start_chars() if after is None else after):
                return None
            self._tf_text = tf_text_backend.build(self._inv_vocab, self.do_lower_case)
        return self._tf_text if enough_texts else None

    def _batch(self, texts, cache: _Cache, one, table) -> list[list]:
        texts = texts if isinstance(texts, list) else list(texts)
        safe = list(map(tf_text_backend.is_safe, texts))
        backend = self._tf_text_for(texts, safe)
        if backend is not None:
            done = iter(backend.tokenize(list(itertools.compress(texts, safe)), table))
            return [next(done) if s else one(t) for t, s in zip(texts, safe)]
        # Safe texts are plain ASCII needing no more than lower() + split(): one C-level split
        # and cache lookups.
        get, chain, lower = cache.__getitem__, itertools.chain.from_iterable, self.do_lower_case
        return [list(chain(map(get, (t.lower() if lower else t).split()))) if s else one(t)
                for t, s in zip(texts, safe)]

    def _pieces_batch(self, texts) -> list[TextPieces]:
        texts = list(texts)
        safe = list(map(tf_text_backend.is_safe, texts))
        backend = self._tf_text_for(texts, safe)
        if backend is None:
            return [self._pieces(t) for t in texts]
        done = iter(backend.pieces(list(itertools.compress(texts, safe))))
        return [next(done) if s else self._pieces(t) for t, s in zip(texts, safe)]

    def _pieces(self, text: str) -> TextPieces:
        text = _as_text(text)
        # Dropped characters shift positions inside a word; such texts take the exact path.
        if self._has_special(text):
            return self.pieces_exact(text)
        if text.isascii():
            if _ASCII_DROP.search(text):
                return self.pieces_exact(text)
            # ASCII lowercasing keeps positions; whitespace here is exactly " \t\n\r".
            matches = list(_ASCII_WORD.finditer(text.lower() if self.do_lower_case else text))
        else:
            if self._drop_re.search(text):
                return self.pieces_exact(text)
            matches = list(self._word_re.finditer(text))
        recs = list(map(self._records.__getitem__, map(re.Match.group, matches)))
        bases = map(re.Match.start, matches)
        firsts = itertools.accumulate((r.n_words for r in recs), initial=0)
        return TextPieces(
            [t for r in recs for t in r.tokens],
            [i for r in recs for i in r.ids],
            [(b + s, b + e) for b, r in zip(bases, recs) for s, e in r.offsets],
            [f + w for f, r in zip(firsts, recs) for w in r.word_ids],
        )

    # ---- the rest of the interface
    def is_continuation(self, token: str) -> bool:
        return token.startswith("##")

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Tokens joined by spaces, "##" pieces glued to their word; [PAD] always dropped."""
        drop = self.special_ids if skip_special_tokens else {self.pad_id}
        words: list[str] = []
        for token, i in zip(self.convert_ids_to_tokens(ids), ids):
            if int(i) in drop:
                continue
            if token.startswith("##") and words:
                words[-1] += token[2:]
            else:
                words.append(token)
        return " ".join(words)

    def save(self, directory: str) -> str:
        """Writes `vocab.txt` and `tokenizer_config.json` into `directory`; returns the vocab."""
        paths.makedirs(directory)
        path = paths.join(directory, "vocab.txt")
        with paths.open(path, "w", encoding="utf-8") as f:
            f.write("".join(t + "\n" for t in self._id_to_token()))
        with paths.open(paths.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump({"type": "wordpiece", "do_lower_case": self.do_lower_case}, f)
        return path


def _as_text(text) -> str:
    """Bytes are decoded as UTF-8 with invalid sequences replaced by U+FFFD, which cleaning then
    drops (the reference decodes with errors="ignore": the same tokens)."""
    if isinstance(text, str):
        return text
    if isinstance(text, bytes | bytearray):
        return bytes(text).decode("utf-8", errors="replace")
    raise TypeError(f"expected str or bytes, got {type(text).__name__}")

"""The interface every vocabulary type implements, and BERT's input layout (`Encoding`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

Span = tuple[int, int]

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


@dataclasses.dataclass
class Encoding:
    """One model input: `[CLS] A [SEP]` or `[CLS] A [SEP] B [SEP]`, then padding. All `[seq]`.

    offsets: character span of each token in its own source text (None: special or padding).
    sequence_ids: 0 for text_a, 1 for text_b, None for special tokens and padding.
    word_ids: index of the (punctuation-split) word within its text that a token belongs to.
    """

    input_ids: list[int]
    segment_ids: list[int]
    input_mask: list[int]
    tokens: list[str]
    offsets: list[Span | None]
    sequence_ids: list[int | None]
    word_ids: list[int | None]

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclasses.dataclass
class TextPieces:
    """Tokens of one text with their ids, character spans and word indices. All `[n_tokens]`."""

    tokens: list[str]
    ids: list[int]
    offsets: list[Span]
    word_ids: list[int]

    def head(self, n: int) -> TextPieces:
        return TextPieces(self.tokens[:n], self.ids[:n], self.offsets[:n], self.word_ids[:n])


def truncate_pair(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """Lengths kept: like the reference, remove one token at a time from the end of the longer
    sequence (from B on a tie) until both fit in `budget`."""
    while len_a + len_b > budget:
        if len_a > len_b:
            len_a -= 1
        else:
            len_b -= 1
    return len_a, len_b


class Tokenizer:
    """Common behaviour; subclasses provide `_pieces`, `tokenize`, `tokenize_batch`, `decode`,
    `save`, `is_continuation`, `vocab` and the special ids."""

    vocab: dict[str, int]
    pad_id: int
    unk_id: int
    cls_id: int
    sep_id: int
    mask_id: int
    do_lower_case: bool

    # ---- subclass API

    def _segments(self, text: str):
        """`(start, end, is_special)` spans of `text`: literal special tokens (matched by the
        subclass's `_special_re`) and the text between them."""
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                yield pos, m.start(), False
            yield m.start(), m.end(), True
            pos = m.end()
        if pos < len(text):
            yield pos, len(text), False
    def _pieces(self, text: str) -> TextPieces:
        raise NotImplementedError

    def _pieces_batch(self, texts: Sequence[str]) -> list[TextPieces]:
        return [self._pieces(t) for t in texts]

    def tokenize(self, text: str) -> list[str]:
        raise NotImplementedError

    def tokenize_batch(self, texts: Iterable[str]) -> list[list[str]]:
        return [self.tokenize(t) for t in texts]

    def is_continuation(self, token: str) -> bool:
        raise NotImplementedError

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        raise NotImplementedError

    def save(self, directory: str) -> str:
        raise NotImplementedError

    # ---- shared
    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset((self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id))

    def _id_to_token(self) -> list[str]:
        table = getattr(self, "_inv_vocab", None)
        if table is None:
            table = [""] * len(self.vocab)
            for token, i in self.vocab.items():
                table[i] = token
            self._inv_vocab = table
        return table

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> list[int]:
        """Unknown tokens map to `unk_id`."""
        get, unk = self.vocab.get, self.unk_id
        return [get(t, unk) for t in tokens]

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        table = self._id_to_token()
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(table):
                raise ValueError(f"token id {i} is outside the vocabulary [0, {len(table)})")
            out.append(table[i])
        return out

    def encode(
        self, text_a: str, text_b: str | None = None, max_seq_length: int | None = None
    ) -> Encoding:
        a = self._pieces(text_a)
        b = None if text_b is None else self._pieces(text_b)
        return self._assemble(a, b, max_seq_length)

    def encode_batch(
        self,
        texts_a: Sequence[str],
        texts_b: Sequence[str | None] | None = None,
        max_seq_length: int | None = None,
    ) -> list[Encoding]:
        texts_a = list(texts_a)
        if texts_b is not None:
            texts_b = list(texts_b)
            if len(texts_b) != len(texts_a):
                raise ValueError(
                    f"texts_b has {len(texts_b)} entries but texts_a has {len(texts_a)}")
        pieces_a = self._pieces_batch(texts_a)
        if texts_b is None:
            pieces_b = [None] * len(texts_a)
        else:
            present = [t for t in texts_b if t is not None]
            done = iter(self._pieces_batch(present))
            pieces_b = [None if t is None else next(done) for t in texts_b]
        return [self._assemble(a, b, max_seq_length) for a, b in zip(pieces_a, pieces_b)]

    def _assemble(self, a: TextPieces, b: TextPieces | None, max_seq_length: int | None):
        n_special = 2 if b is None else 3
        if max_seq_length is not None:
            if max_seq_length < n_special:
                raise ValueError(
                    f"max_seq_length={max_seq_length} leaves no room for {n_special} special "
                    "tokens")
            budget = max_seq_length - n_special
            len_a, len_b = truncate_pair(len(a.ids), 0 if b is None else len(b.ids), budget)
            a = a.head(len_a)
            b = None if b is None else b.head(len_b)
        cls_tok, sep_tok = self._special_token(self.cls_id), self._special_token(self.sep_id)
        tokens = [cls_tok, *a.tokens, sep_tok]
        ids = [self.cls_id, *a.ids, self.sep_id]
        segment = [0] * len(ids)
        offsets: list[Span | None] = [None, *a.offsets, None]
        seq_ids: list[int | None] = [None, *itertools.repeat(0, len(a.ids)), None]
        word_ids: list[int | None] = [None, *a.word_ids, None]
        if b is not None:
            tokens += [*b.tokens, sep_tok]
            ids += [*b.ids, self.sep_id]
            segment += [1] * (len(b.ids) + 1)
            offsets += [*b.offsets, None]
            seq_ids += [*itertools.repeat(1, len(b.ids)), None]
            word_ids += [*b.word_ids, None]
        mask = [1] * len(ids)
        if max_seq_length is not None and len(ids) < max_seq_length:
            n_pad = max_seq_length - len(ids)
            pad_tok = self._special_token(self.pad_id)
            tokens += [pad_tok] * n_pad
            ids += [self.pad_id] * n_pad
            segment += [0] * n_pad
            mask += [0] * n_pad
            offsets += [None] * n_pad
            seq_ids += [None] * n_pad
            word_ids += [None] * n_pad
        return Encoding(ids, segment, mask, tokens, offsets, seq_ids, word_ids)

    def _special_token(self, i: int) -> str:
        return self._id_to_token()[i]

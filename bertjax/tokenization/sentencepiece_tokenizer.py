"""SentencePiece models (unigram or BPE) behind the same interface as WordPiece.

The model must contain the pieces [CLS], [SEP] and [MASK]; padding is the piece [PAD] (else the
model's pad id, else "<pad>") and unknown is the model's unk id. Models trained by
`bertjax.tokenization.train` name them [PAD] and [UNK] and make [CLS] [SEP] [MASK]
user-defined symbols. Special tokens written literally in the text are matched first and never
split, exactly as in WordPiece. `do_lower_case` lowercases the text before SentencePiece sees it
(as ALBERT does). A continuation piece is one without the "▁" word-start marker.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence

from bertjax import paths
from bertjax.tokenization.base import SPECIAL_TOKENS, TextPieces, Tokenizer
from bertjax.tokenization.wordpiece import VocabError, _as_text

WORD_START = "\u2581"  # "▁"
MODEL_FILENAME = "sentencepiece.model"


def _lower_with_map(text: str) -> tuple[str, list[int] | None]:
    """`text.lower()` and, when lowercasing changed the length, the original index of every
    lowered character (None when positions are unchanged)."""
    lowered = text.lower()
    if len(lowered) == len(text):
        return lowered, None
    index: list[int] = []
    for i, ch in enumerate(text):
        index.extend([i] * len(ch.lower()))
    return lowered, index


def _byte_to_char(text: str) -> list[int] | None:
    """Character index of every UTF-8 byte offset of `text` (plus the end); None if ASCII."""
    if text.isascii():
        return None
    table: list[int] = []
    for i, ch in enumerate(text):
        table.extend([i] * len(ch.encode("utf-8")))
    table.append(len(text))
    return table


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_proto: bytes, do_lower_case: bool = False, source: str = "<model>"):
        import sentencepiece as spm

        self.source = source
        self.do_lower_case = bool(do_lower_case)
        self._model_proto = model_proto
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(model_proto)
        except Exception as e:  # the binding raises bare RuntimeError/OSError with C++ text
            message = " ".join(str(e).split())
            raise VocabError(f"{source}: not a SentencePiece model ({message})") from None
        n = self.sp.get_piece_size()
        self._inv_vocab = [self.sp.id_to_piece(i) for i in range(n)]
        self.vocab = {p: i for i, p in enumerate(self._inv_vocab)}
        missing = [t for t in ("[CLS]", "[SEP]", "[MASK]") if t not in self.vocab]
        if missing:
            raise VocabError(f"{source}: SentencePiece model lacks piece(s) {' '.join(missing)}")
        self.cls_id, self.sep_id, self.mask_id = (self.vocab[t] for t in ("[CLS]", "[SEP]",
                                                                          "[MASK]"))
        self.unk_id = self.sp.unk_id()
        if "[PAD]" in self.vocab:
            self.pad_id = self.vocab["[PAD]"]
        elif self.sp.pad_id() >= 0:
            self.pad_id = self.sp.pad_id()
        elif "<pad>" in self.vocab:
            self.pad_id = self.vocab["<pad>"]
        else:
            raise VocabError(f"{source}: SentencePiece model has no padding piece ([PAD])")
        self._specials = {self._inv_vocab[i]: i for i in self.special_ids}
        for name in SPECIAL_TOKENS:
            if name in self.vocab:
                self._specials.setdefault(name, self.vocab[name])
        names = sorted(self._specials, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(t) for t in names))

    @classmethod
    def from_file(cls, path: str, do_lower_case: bool = False) -> SentencePieceTokenizer:
        try:
            with paths.open(path, "rb") as f:
                proto = f.read()
        except OSError as e:
            raise VocabError(f"{path}: cannot read SentencePiece model ({e.strerror})") from None
        if not proto:
            raise VocabError(f"{path}: SentencePiece model file is empty")
        return cls(proto, do_lower_case, source=path)

    # ---- tokenization
    def _prepare(self, text: str) -> tuple[str, list[int] | None]:
        if self.do_lower_case:
            return _lower_with_map(text)
        return text, None

    def _pieces(self, text: str) -> TextPieces:
        text = _as_text(text)
        out = TextPieces([], [], [], [])
        word = -1
        for start, end, special in self._segments(text):
            if special:
                token = text[start:end]
                word += 1
                out.tokens.append(token)
                out.ids.append(self._specials[token])
                out.offsets.append((start, end))
                out.word_ids.append(word)
                continue
            word = self._segment_pieces(text, start, end, out, word)
        return out

    def _segment_pieces(self, text: str, start: int, end: int, out: TextPieces, word: int):
        raw = text[start:end]
        prepared, index = self._prepare(raw)
        proto = self.sp.encode(prepared, return_type="proto")
        to_char = _byte_to_char(prepared)
        first = True
        for p in proto.pieces:
            b, e = p.begin, p.end
            if to_char is not None:
                b, e = to_char[b], to_char[e]
            if index is not None:  # lowered position -> original position
                b = index[b] if b < len(index) else len(raw)
                e = index[e - 1] + 1 if e > 0 else 0
            # SentencePiece attaches the preceding space to a word-start piece; offsets point
            # at the visible characters only.
            while b < e and raw[b].isspace():
                b += 1
            while e > b and raw[e - 1].isspace():
                e -= 1
            if first or p.piece.startswith(WORD_START):
                word += 1
                first = False
            out.tokens.append(p.piece)
            out.ids.append(p.id)
            out.offsets.append((start + b, start + e))
            out.word_ids.append(word)
        return word

    def tokenize(self, text: str) -> list[str]:
        return self._pieces(text).tokens

    def tokenize_batch(self, texts: Iterable[str]) -> list[list[str]]:
        """Texts without literal special tokens go to SentencePiece as one batch."""
        texts = [_as_text(t) for t in texts]
        plain = [i for i, t in enumerate(texts) if not self._special_re.search(t)]
        prepared = [self._prepare(texts[i])[0] for i in plain]
        result: list[list[str] | None] = [None] * len(texts)
        for i, pieces in zip(plain, self.sp.encode(prepared, out_type=str)):
            result[i] = pieces
        for i, r in enumerate(result):
            if r is None:
                result[i] = self.tokenize(texts[i])
        return result

    def _pieces_batch(self, texts: Sequence[str]) -> list[TextPieces]:
        return [self._pieces(t) for t in texts]

    # ---- the rest of the interface
    def is_continuation(self, token: str) -> bool:
        return not token.startswith(WORD_START) and token not in self._specials

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """SentencePiece detokenization; special tokens kept as words unless skipped, [PAD]
        always dropped."""
        ids = [int(i) for i in ids]
        self.convert_ids_to_tokens(ids)  # range check
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i == self.pad_id or (skip_special_tokens and i in self.special_ids):
                continue
            if i in self.special_ids:
                if run:
                    parts.append(self.sp.decode(run))
                    run = []
                parts.append(self._inv_vocab[i])
            else:
                run.append(i)
        if run:
            parts.append(self.sp.decode(run))
        return " ".join(p for p in parts if p)

    def save(self, directory: str) -> str:
        paths.makedirs(directory)
        path = paths.join(directory, MODEL_FILENAME)
        with paths.open(path, "wb") as f:
            f.write(self._model_proto)
        with paths.open(paths.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump({"type": "sentencepiece", "do_lower_case": self.do_lower_case}, f)
        return path

"""Any Hugging Face `tokenizer.json` (ByteLevel BPE as in ModernBERT/RoBERTa, or other models)
behind bertjax's `Tokenizer` interface, and `train_bpe` for new ByteLevel BPE vocabularies.

The `tokenizers` library splits each text into pieces (without its own post-processor: no
special tokens, no truncation, no padding); bertjax then assembles `[CLS] A [SEP] B [SEP]` and
truncates longest-first. Longest-first here is the `tokenizers` library's rule
(`truncate_pair_tokenizers`), which transformers applies to these models: it differs from
Google's one-token-at-a-time rule (`base.truncate_pair`, WordPiece and SentencePiece) only for
an odd budget that both texts exceed by half, where B, when at least as long as A, keeps the
extra token (Google's gives it to A). Literal special (added) tokens in the text are matched
by `tokenizers` itself, as in transformers.

Special tokens: each role is looked up under its BERT name, else its RoBERTa name: CLS `[CLS]`
or `<s>`, SEP `[SEP]` or `</s>`, MASK `[MASK]` or `<mask>`, PAD `[PAD]` or `<pad>`, UNK `[UNK]`
or `<unk>`. With RoBERTa names the layout is still BERT's (`<s> A </s> B </s>`, one separator).

`do_lower_case` is what the tokenizer.json's normalizer does (a `Lowercase` normalizer, or a
`BertNormalizer` with lowercase=true, possibly inside a `Sequence`); it cannot be overridden.

Offsets are character spans of the original text, without the whitespace a piece carries (the
"Ġ" of ByteLevel BPE); the pieces of one multi-byte character share its span. `word_ids` are
the `tokenizers` pre-token (word) indices, numbered 0, 1, ... within each text.

`is_continuation(token)` (a function of the token string, as the pre-training masking tables
need): not for special/added tokens; for a WordPiece model or a BPE model with a continuing-
subword prefix, the prefix ("##"); for a ByteLevel pre-tokenizer, a piece without the "Ġ"
word-start marker; for a Metaspace pre-tokenizer, a piece without its "▁" marker; otherwise
never (every piece its own word). With ByteLevel's add_prefix_space=false (ModernBERT's
setting), the first word of a text and punctuation after a word carry no "Ġ" and so count as
continuations: whole-word masking joins them to the preceding word.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from bertjax import paths
from bertjax.tokenization.base import SPECIAL_TOKENS, TextPieces, Tokenizer
from bertjax.tokenization.wordpiece import VocabError, _as_text

TOKENIZER_FILENAME = "tokenizer.json"
BYTE_LEVEL_SPACE = "\u0120"  # "Ġ"
METASPACE = "\u2581"  # "▁"

# role -> accepted names, BERT's first.
SPECIAL_NAMES = {
    "cls": ("[CLS]", "<s>"),
    "sep": ("[SEP]", "</s>"),
    "mask": ("[MASK]", "<mask>"),
    "pad": ("[PAD]", "<pad>"),
    "unk": ("[UNK]", "<unk>"),
}


def truncate_pair_tokenizers(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """Lengths kept by the `tokenizers` library's 'longest_first' truncation: the shorter text
    (A on a tie) keeps min(its length, budget // 2), the other the rest of the budget."""
    if len_a + len_b <= budget:
        return len_a, len_b
    if len_a > len_b:
        kept_b = min(len_b, budget // 2)
        return budget - kept_b, kept_b
    kept_a = min(len_a, budget // 2)
    return kept_a, budget - kept_a


def _components(node) -> Iterable[dict]:
    """A normalizer/pre-tokenizer JSON node and, for a `Sequence`, its members (recursively)."""
    if not isinstance(node, dict):
        return
    yield node
    for key in ("normalizers", "pretokenizers"):
        for child in node.get(key) or ():
            yield from _components(child)


def normalizer_lowercases(spec: dict) -> bool:
    """Whether a tokenizer.json's normalizer lower-cases."""
    for node in _components(spec.get("normalizer")):
        if node.get("type") == "Lowercase":
            return True
        if node.get("type") == "BertNormalizer" and node.get("lowercase", True):
            return True
    return False


def _continuation_rule(spec: dict) -> tuple[str, str | None]:
    """("prefix", p): a continuation starts with p; ("no_marker", m): a continuation does not
    start with m; ("none", None): no piece is a continuation."""
    model = spec.get("model") or {}
    prefix = model.get("continuing_subword_prefix")
    if model.get("type") == "WordPiece":
        return "prefix", prefix or "##"
    if prefix:
        return "prefix", prefix
    for node in _components(spec.get("pre_tokenizer")):
        if node.get("type") == "ByteLevel":
            return "no_marker", BYTE_LEVEL_SPACE
        if node.get("type") == "Metaspace":
            return "no_marker", node.get("replacement") or METASPACE
    return "none", None


class TokenizersTokenizer(Tokenizer):
    """bertjax `Tokenizer` over a `tokenizers.Tokenizer` (see the module docstring)."""

    def __init__(self, tokenizer, do_lower_case: bool | None = None,
                 source: str = "<tokenizer.json>"):
        import tokenizers

        if isinstance(tokenizer, str):  # JSON text
            try:
                tokenizer = tokenizers.Tokenizer.from_str(tokenizer)
            except Exception as e:  # the binding raises bare Exception with Rust text
                message = " ".join(str(e).split())
                raise VocabError(f"{source}: not a tokenizers tokenizer.json ({message})") from None
        self.source = source
        self._tok = tokenizer
        self._tok.no_truncation()
        self._tok.no_padding()
        self._spec = json.loads(tokenizer.to_str())
        self.do_lower_case = normalizer_lowercases(self._spec)
        if do_lower_case is not None and bool(do_lower_case) != self.do_lower_case:
            does = "lower-cases" if self.do_lower_case else "does not lower-case"
            raise VocabError(f"{source}: do_lower_case={bool(do_lower_case)} disagrees with the "
                             f"tokenizer's normalizer, which {does}; leave do_lower_case unset")
        self.vocab = tokenizer.get_vocab(with_added_tokens=True)
        for role, names in SPECIAL_NAMES.items():
            found = next((t for t in names if t in self.vocab), None)
            if found is None:
                raise VocabError(f"{source}: no {' or '.join(names)} token in the vocabulary")
            setattr(self, f"{role}_id", self.vocab[found])
        n = len(self.vocab)
        table = [""] * n
        for token, i in self.vocab.items():
            if not 0 <= i < n or table[i]:
                raise VocabError(f"{source}: token ids are not 0..{n - 1} (id {i} of {token!r})")
            table[i] = token
        self._inv_vocab = table
        self.unk_token = self._inv_vocab[self.unk_id]
        added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
        self._specials = added | {table[i] for i in self.special_ids}
        self._rule, self._marker = _continuation_rule(self._spec)

    @classmethod
    def from_file(cls, path: str, do_lower_case: bool | None = None) -> TokenizersTokenizer:
        try:
            with paths.open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or str(e)
            raise VocabError(f"{path}: cannot read tokenizer.json ({why})") from None
        return cls(text, do_lower_case, source=path)

    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def _assemble(self, a: TextPieces, b: TextPieces | None, max_seq_length: int | None):
        if b is not None and max_seq_length is not None and max_seq_length >= 3:
            len_a, len_b = truncate_pair_tokenizers(len(a.ids), len(b.ids), max_seq_length - 3)
            a, b = a.head(len_a), b.head(len_b)
        return super()._assemble(a, b, max_seq_length)

    # ---- tokenization
    @staticmethod
    def _to_pieces(text: str, enc) -> TextPieces:
        out = TextPieces(list(enc.tokens), list(enc.ids), [], [])
        word, previous = -1, object()
        for (b, e), w in zip(enc.offsets, enc.word_ids):
            while b < e and text[b].isspace():
                b += 1
            while e > b and text[e - 1].isspace():
                e -= 1
            if w is None or w != previous:
                word += 1
            previous = w
            out.offsets.append((b, e))
            out.word_ids.append(word)
        return out

    def _pieces(self, text: str) -> TextPieces:
        text = _as_text(text)
        return self._to_pieces(text, self._tok.encode(text, add_special_tokens=False))

    def _pieces_batch(self, texts: Sequence[str]) -> list[TextPieces]:
        texts = [_as_text(t) for t in texts]
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [self._to_pieces(t, e) for t, e in zip(texts, encs)]

    def tokenize(self, text: str) -> list[str]:
        return list(self._tok.encode(_as_text(text), add_special_tokens=False).tokens)

    def tokenize_batch(self, texts: Iterable[str]) -> list[list[str]]:
        encs = self._tok.encode_batch([_as_text(t) for t in texts], add_special_tokens=False)
        return [list(e.tokens) for e in encs]

    def tokenize_to_ids_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """Ids of each text's pieces (what the pre-training data writers use)."""
        encs = self._tok.encode_batch([_as_text(t) for t in texts], add_special_tokens=False)
        return [list(e.ids) for e in encs]

    # ---- the rest of the interface
    def is_continuation(self, token: str) -> bool:
        if token in self._specials or self._rule == "none":
            return False
        if self._rule == "prefix":
            return token.startswith(self._marker)
        return not token.startswith(self._marker)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The tokenizer.json's decoder; special tokens kept in place unless skipped, [PAD]
        always dropped."""
        ids = [int(i) for i in ids]
        self.convert_ids_to_tokens(ids)  # range check
        drop = self.special_ids if skip_special_tokens else {self.pad_id}
        return self._tok.decode([i for i in ids if i not in drop], skip_special_tokens=False)

    def save(self, directory: str) -> str:
        """Writes `tokenizer.json` into `directory` (truncation and padding off); returns it."""
        paths.makedirs(directory)
        path = paths.join(directory, TOKENIZER_FILENAME)
        with paths.open(path, "w", encoding="utf-8") as f:
            f.write(self._tok.to_str(pretty=True))
        return path


def train_bpe(lines: Iterable[str], vocab_size: int, lowercase: bool = False,
              min_frequency: int = 2, show_progress: bool = False):
    """A ByteLevel BPE `tokenizers.Tokenizer` (GPT-2/RoBERTa/ModernBERT style, no prefix space)
    trained on `lines`, with [PAD] [UNK] [CLS] [SEP] [MASK] as special tokens 0-4, all 256 byte
    symbols, a `Lowercase` normalizer when `lowercase`, and a `[CLS] $A [SEP] $B [SEP]`
    post-processor (so transformers reads its JSON as is). Save it with `.save(path)`."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    from bertjax.tokenization.train import TrainError

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    smallest = len(SPECIAL_TOKENS) + len(alphabet)
    if vocab_size < smallest:
        raise TrainError(f"--vocab_size={vocab_size}: a ByteLevel BPE vocabulary needs at least "
                         f"{smallest} entries (5 special tokens and 256 bytes)")
    tok = HFTokenizer(models.BPE(unk_token="[UNK]"))
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), initial_alphabet=alphabet,
                                  show_progress=show_progress)
    tok.train_from_iterator((_as_text(line) for line in lines), trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    return tok

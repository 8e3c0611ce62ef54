"""Tokenization for BERT: Google-exact WordPiece (with a fast path), SentencePiece, Hugging Face
`tokenizer.json` (ByteLevel BPE as in ModernBERT, via `tokenizers`), training.

  from bertjax.tokenization import load_tokenizer
  tok = load_tokenizer("path/to/vocab.txt")  # or a *.model, a tokenizer.json, or a directory
  enc = tok.encode("question", "context", max_seq_length=128)

Command line: `python -m bertjax.tokenization {train,tokenize,bench} --help`.
Never imports TensorFlow.
"""

from bertjax.tokenization.base import SPECIAL_TOKENS, Encoding, TextPieces, Tokenizer
from bertjax.tokenization.bpe import TokenizersTokenizer
from bertjax.tokenization.loading import load_tokenizer
from bertjax.tokenization.wordpiece import VocabError, WordPieceTokenizer, load_vocab

__all__ = [
    "SPECIAL_TOKENS",
    "Encoding",
    "TextPieces",
    "Tokenizer",
    "TokenizersTokenizer",
    "VocabError",
    "WordPieceTokenizer",
    "load_tokenizer",
    "load_vocab",
]

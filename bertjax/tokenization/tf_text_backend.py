"""Optional tensorflow-text backend for large WordPiece batches of routed-safe texts.

tensorflow-text (compiled, about 10x HF `tokenizers` on one core) implements BERT's
normalisation (FastBertNormalizer) and WordPiece with its own whitespace/punctuation split
(FastWordpieceTokenizer), but differs from the reference on some non-ASCII input (Greek final
sigma, Armenian ligature, vulgar fractions) and reports byte offsets. `is_safe` admits only the
texts on which it is verified identical (tests/tokenization/test_tokenization_tf_text.py): pure
ASCII without control characters (the reference drops them; \x0b \x0c \x1c-\x1f also split
Python words) and without "[" (a literal special token must not be split). On ASCII, lowercasing
is context free and keeps lengths, NFD and accent stripping change nothing, and byte offsets
equal character offsets, so only `str.lower()` precedes FastWordpieceTokenizer (faster than its
normaliser, whose offset mapping costs more than the tokenizer). Everything else stays on the
Python path, so the output is exactly the reference's.

Starting it costs seconds (importing TensorFlow, building the tokenizer), as much as the Python
path takes for millions of characters, so a tokenizer uses it only once its text so far has
paid for that (`start_chars`): predicting a thousand sentences never imports TensorFlow, and a
large corpus costs at most about what the faster engine alone would. BERTJAX_TF_TEXT=0: never.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
import warnings

from bertjax.tokenization.base import TextPieces

CHUNK = 2048  # texts per TensorFlow call: bounds the tensors' memory, amortises call overhead

# Characters of safe text the Python path tokenizes in about the time starting the backend
# takes: importing TensorFlow and building the tokenizer, or the build alone when TensorFlow
# is already imported (a tf.data or TFDS input). Measured by `make bench` (tokenization).
START_CHARS = 5_000_000
START_CHARS_IMPORTED = 500_000

# Control characters and "[": ASCII texts that need more than lower() + FastWordpieceTokenizer.
_ASCII_ODD = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\[]")


def is_safe(text) -> bool:
    """Whether the backend's output on `text` is verified identical to the reference."""
    return type(text) is str and text.isascii() and not _ASCII_ODD.search(text)


def start_chars() -> int:
    """Characters of safe text after which the backend is worth starting (see START_CHARS)."""
    return START_CHARS_IMPORTED if "tensorflow" in sys.modules else START_CHARS


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """tensorflow-text is installed and not disabled by BERTJAX_TF_TEXT=0 (nothing imported)."""
    if os.environ.get("BERTJAX_TF_TEXT", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        return importlib.util.find_spec("tensorflow_text") is not None
    except (ImportError, ValueError):
        return False


class FastWordpieceBackend:
    """tensorflow-text's FastWordpieceTokenizer (its own whitespace and punctuation split, then
    WordPiece) over a vocabulary, for safe texts only: lowercasing, the only normalisation an
    ASCII text needs, is done by `str.lower()` first. Raises whatever building it raises
    (callers fall back to the Python path)."""

    def __init__(self, vocab: list[str], do_lower_case: bool):
        import numpy as np

        from bertjax.tf_setup import import_tensorflow

        tf = import_tensorflow()  # off the accelerators JAX uses, and quiet
        import tensorflow_text as tf_text

        self._tf, self._np = tf, np
        self.do_lower_case = bool(do_lower_case)
        self.vocab = list(vocab)
        # A word's first piece never starts with "##" ("#" is punctuation, so no word does).
        self._continues = np.array([t.startswith("##") for t in self.vocab])
        self._tok = tf_text.FastWordpieceTokenizer(
            vocab=self.vocab, suffix_indicator="##", max_bytes_per_word=100,
            token_out_type=tf.int32, unknown_token="[UNK]", no_pretokenization=False)

    def _chunks(self, texts: list[str], with_offsets: bool):
        for c in range(0, len(texts), CHUNK):
            chunk = texts[c:c + CHUNK]
            if self.do_lower_case:
                chunk = [t.lower() for t in chunk]  # ASCII: context free, same length
            chunk = self._tf.constant(chunk)
            if with_offsets:
                yield self._tok.tokenize_with_offsets(chunk)
            else:
                yield self._tok.tokenize(chunk)

    def tokenize(self, texts: list[str], table: list | None = None) -> list[list]:
        """Ids of each text (`[n_texts][n_tokens]`), or `table[id]` when `table` is given."""
        out: list[list] = []
        for ragged in self._chunks(texts, False):
            flat = ragged.flat_values.numpy().tolist()
            if table is not None:
                flat = list(map(table.__getitem__, flat))
            splits = ragged.row_splits.numpy().tolist()
            out.extend(flat[a:b] for a, b in zip(splits, splits[1:]))
        return out

    def pieces(self, texts: list[str]) -> list[TextPieces]:
        """Tokens, ids, character offsets (bytes = characters in ASCII) and word ids."""
        np, out = self._np, []
        for ids, starts, ends in self._chunks(texts, True):
            flat_ids = ids.flat_values.numpy()
            splits = ids.row_splits.numpy()
            # Word index within its text: pieces without "##" seen so far in the text, minus 1.
            new_word = np.cumsum(~self._continues[flat_ids])
            before = np.concatenate([[0], new_word])[splits[:-1]]
            word_ids = (new_word - 1 - np.repeat(before, np.diff(splits))).tolist()
            flat_ids = flat_ids.tolist()
            tokens = list(map(self.vocab.__getitem__, flat_ids))
            offsets = list(zip(starts.flat_values.numpy().tolist(),
                               ends.flat_values.numpy().tolist()))
            splits = splits.tolist()
            out.extend(TextPieces(tokens[a:b], flat_ids[a:b], offsets[a:b], word_ids[a:b])
                       for a, b in zip(splits, splits[1:]))
        return out


def build(vocab: list[str], do_lower_case: bool) -> FastWordpieceBackend | None:
    """The backend, or None (with one warning) when tensorflow-text cannot be used."""
    try:
        return FastWordpieceBackend(vocab, do_lower_case)
    except Exception as e:  # noqa: BLE001 - any failure means: stay on the exact Python path
        warnings.warn(f"tensorflow-text unusable, WordPiece stays on the Python path: {e}",
                      RuntimeWarning, stacklevel=3)
        return None

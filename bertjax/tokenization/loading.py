"""`load_tokenizer`: one entry point for every vocabulary type."""

from __future__ import annotations

import json
import os

from bertjax import paths
from bertjax.tokenization.base import Tokenizer
from bertjax.tokenization.wordpiece import VocabError, WordPieceTokenizer

CONFIG_FILENAME = "tokenizer_config.json"
_TYPES = ("wordpiece", "sentencepiece")


def _read_config(path: str) -> dict:
    if not paths.isfile(path):
        return {}
    try:
        with paths.open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise VocabError(f"{path}: unreadable tokenizer config ({e})") from None
    if not isinstance(config, dict):
        raise VocabError(f"{path}: tokenizer config must be a JSON object")
    if config.get("type", "wordpiece") not in _TYPES:
        raise VocabError(f"{path}: field 'type' must be one of {', '.join(_TYPES)}, "
                         f"got {config.get('type')!r}")
    lower = config.get("do_lower_case")
    if lower is not None and not isinstance(lower, bool):
        raise VocabError(f"{path}: field 'do_lower_case' must be true or false, got {lower!r}")
    return config


def _find_model_file(directory: str) -> str:
    vocab = paths.join(directory, "vocab.txt")
    if paths.isfile(vocab):
        return vocab
    models = paths.glob(paths.join(directory, "*.model"))
    if len(models) == 1:
        return models[0]
    if len(models) > 1:
        raise VocabError(f"{directory}: several SentencePiece models ({', '.join(models)}); "
                         "pass the file itself")
    tokenizer_json = paths.join(directory, "tokenizer.json")
    if paths.isfile(tokenizer_json):
        return tokenizer_json
    raise VocabError(f"{directory}: no vocab.txt or *.model file, nor tokenizer.json, in this "
                     "directory")


def load_tokenizer(path: str, do_lower_case: bool | None = None) -> Tokenizer:
    """Tokenizer for a `vocab.txt` (WordPiece), a SentencePiece `*.model`, a Hugging Face
    `tokenizer.json` (any `*.json` file: `TokenizersTokenizer`), or a directory with one of them
    and optionally `tokenizer_config.json` ({"type", "do_lower_case"}). A directory holding
    several is read by the first of vocab.txt, *.model, tokenizer.json (a Hugging Face BERT
    directory, with both vocab.txt and tokenizer.json, stays WordPiece).

    do_lower_case=None: from tokenizer_config.json (in the directory, or beside the file) if it
    says, else True for WordPiece and False for SentencePiece. A tokenizer.json lower-cases
    exactly when its normalizer does: tokenizer_config.json is not consulted, and an explicit
    do_lower_case that disagrees is a VocabError.
    """
    path = os.fspath(path)
    if paths.isdir(path):
        config = _read_config(paths.join(path, CONFIG_FILENAME))
        model_file = _find_model_file(path)
    elif paths.exists(path):
        config = _read_config(paths.join(paths.dirname(path) or ".", CONFIG_FILENAME))
        model_file = path
    else:
        raise VocabError(f"{path}: no such vocabulary file or directory")
    if model_file.endswith(".json"):
        from bertjax.tokenization.bpe import TokenizersTokenizer

        return TokenizersTokenizer.from_file(model_file, do_lower_case)
    kind = "sentencepiece" if model_file.endswith(".model") else "wordpiece"
    if do_lower_case is None:
        do_lower_case = config.get("do_lower_case")
    if kind == "wordpiece":
        lower = True if do_lower_case is None else do_lower_case
        return WordPieceTokenizer.from_file(model_file, lower)
    from bertjax.tokenization.sentencepiece_tokenizer import SentencePieceTokenizer

    lower = False if do_lower_case is None else do_lower_case
    return SentencePieceTokenizer.from_file(model_file, lower)

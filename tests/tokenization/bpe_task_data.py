"""A ByteLevel BPE tokenizer.json (ModernBERT's kind: "Ġ" marks a word start, no prefix space,
so a text's first word has none), trained here by `bertjax.tokenization.bpe.train_bpe` on the
words of the generated SQuAD and tagging sets and some natural text (punctuation, accents,
CJK, emoji, contractions), and a tiny random ModernBERT checkpoint carrying it; used by the
SQuAD and token-classification BPE tests."""

import functools
import random

import squad_data
import tagging_data

NATURAL = [
    "Tom went to Paris in 1905, and he didn't come back until (about) 1920.",
    "The café in Zürich serves naïve coffee; it's well-known.",
    "Beijing University (北京大学) was founded in 1898.",
    "Emoji 😀 and symbols like €100 or 3.14 appear in text!",
    "New York's mayor said: \"We will rebuild.\"",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "The quick brown fox jumps over the lazy dog near the riverbank.",
]


def corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = list(NATURAL) * 4
    words = squad_data.VOCAB[5:] + tagging_data.VOCAB[5:]
    for _ in range(300):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))))
    for words_, _ in tagging_data.dataset(seed, 200):
        lines.append(" ".join(words_))
    return lines


@functools.cache
def tokenizer_json(vocab_size: int = 420) -> str:
    """The trained tokenizer's JSON text (small enough that most words split into several
    pieces)."""
    from bertjax.tokenization.bpe import train_bpe

    return train_bpe(corpus(), vocab_size).to_str()


def write_tokenizer_json(path, vocab_size: int = 420) -> str:
    path.write_text(tokenizer_json(vocab_size), encoding="utf-8")
    return str(path)


def bpe_tokenizer(vocab_size: int = 420):
    from bertjax.tokenization.bpe import TokenizersTokenizer

    return TokenizersTokenizer(tokenizer_json(vocab_size))


def write_modern_bpe_checkpoint(root, seed: int = 0, vocab_size: int = 420) -> str:
    """root/ckpt: a random ModernBertForMaskedLM (the modern_tiny shapes of
    modern_checkpoint.py) whose tokenizer is the BPE tokenizer.json; returns the directory."""
    import flax.linen as nn
    import jax
    import numpy as np
    from modern_checkpoint import modern_config

    from bertjax.checkpoint_dir import save_pretrained

    tokenizer = bpe_tokenizer(vocab_size)
    config = modern_config(vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_id,
                           bos_token_id=tokenizer.cls_id, eos_token_id=tokenizer.sep_id,
                           cls_token_id=tokenizer.cls_id, sep_token_id=tokenizer.sep_id)
    from bertjax.models.modern import ModernBertForMaskedLM

    ids = np.zeros((1, 4), np.int32)
    params = jax.jit(ModernBertForMaskedLM(config).init)(jax.random.key(seed), ids, ids)
    save_pretrained(root / "ckpt", config, nn.unbox(params["params"]), tokenizer)
    return str(root / "ckpt")

"""The tiny random ModernBERT checkpoints of the fine-tuning, conversion, serving and BPE tests:
the modern_tiny shapes (2 layers, 128 wide; layer 0 global, layer 1 local with a window of 8
tokens, so rows of the tests' lengths use it) saved by bertjax.checkpoint_dir.save_pretrained
with its MLM head, over either tokenizer:

- VOCAB, one WordPiece vocabulary holding the words of every generated task (conftest's
  keyword task, tagging_data, squad_data, embedding_data): write_modern_checkpoint;
- a ByteLevel BPE tokenizer.json (ModernBERT's kind: "Ġ" marks a word start, no prefix space,
  so a text's first word has none), trained by `bertjax.tokenization.bpe.train_bpe` on the words
  of the generated SQuAD and tagging sets and some natural text (punctuation, accents, CJK,
  emoji, contractions): bpe_tokenizer, write_modern_bpe_checkpoint;

and write_hf_modern, a random transformers ModernBERT over VOCAB.
"""

import functools
import random

import embedding_data
import squad_data
import tagging_data
from conftest import KEYWORD_VOCAB

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = list(dict.fromkeys(SPECIALS + KEYWORD_VOCAB + tagging_data.VOCAB + squad_data.VOCAB
                           + embedding_data.VOCAB))


def modern_config(**overrides):
    from bertjax.models.modernbert import ModernConfig

    fields = dict(vocab_size=len(VOCAB), local_attention=8, max_position_embeddings=512,
                  pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2,
                  sep_token_id=3)
    return ModernConfig.from_preset("modern_tiny", **{**fields, **overrides})


def write_modern_checkpoint(root, seed: int = 0, tokenizer=None, **overrides) -> str:
    """root/ckpt: a random ModernBertForMaskedLM (`modern_config(**overrides)`) and its
    vocabulary: VOCAB (written as root/vocab.txt), or `tokenizer` (a TokenizersTokenizer: its
    size and special ids set the config's); returns the directory."""
    import flax.linen as nn
    import jax
    import numpy as np

    from bertjax.checkpoint_dir import save_pretrained
    from bertjax.models.modernbert import ModernBertForMaskedLM

    if tokenizer is None:
        (root / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
        vocabulary = str(root / "vocab.txt")
    else:
        vocabulary = tokenizer
        overrides = dict(vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_id,
                         bos_token_id=tokenizer.cls_id, eos_token_id=tokenizer.sep_id,
                         cls_token_id=tokenizer.cls_id, sep_token_id=tokenizer.sep_id,
                         **overrides)
    config = modern_config(**overrides)
    ids = np.zeros((1, 4), np.int32)
    params = jax.jit(ModernBertForMaskedLM(config).init)(jax.random.key(seed), ids, ids)
    save_pretrained(root / "ckpt", config, nn.unbox(params["params"]), vocabulary)
    return str(root / "ckpt")


def wordpiece_tokenizer_json():
    """VOCAB as a `tokenizers` WordPiece tokenizer with BERT's normaliser, pre-tokenizer and
    [CLS] A [SEP] post-processor (what transformers 5 saves a BERT-style vocabulary as)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordPiece({t: i for i, t in enumerate(VOCAB)},
                                           unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def write_hf_modern(directory, cls_name: str = "ModernBertForMaskedLM", seed: int = 0,
                    **config_fields):
    """A random transformers ModernBERT of class `cls_name` (every weight perturbed, so no
    norm is the identity) saved with save_pretrained beside a tokenizer.json of VOCAB;
    returns the model (eval mode)."""
    import torch
    import transformers

    config = transformers.ModernBertConfig(
        vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=48, local_attention=8, pad_token_id=0, bos_token_id=2,
        eos_token_id=3, cls_token_id=2, sep_token_id=3, **config_fields)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=wordpiece_tokenizer_json(), unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]").save_pretrained(directory)
    return model


# ------------------------------------------------------------------------ the BPE tokenizer

NATURAL = [
    "Tom went to Paris in 1905, and he didn't come back until (about) 1920.",
    "The café in Zürich serves naïve coffee; it's well-known.",
    "Beijing University (北京大学) was founded in 1898.",
    "Emoji 😀 and symbols like €100 or 3.14 appear in text!",
    "New York's mayor said: \"We will rebuild.\"",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "The quick brown fox jumps over the lazy dog near the riverbank.",
]


def bpe_corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = list(NATURAL) * 4
    words = squad_data.VOCAB[5:] + tagging_data.VOCAB[5:]
    for _ in range(300):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))))
    for words_, _ in tagging_data.dataset(seed, 200):
        lines.append(" ".join(words_))
    return lines


@functools.cache
def bpe_tokenizer_json(vocab_size: int = 420) -> str:
    """The trained tokenizer's JSON text (small enough that most words split into several
    pieces)."""
    from bertjax.tokenization.bpe import train_bpe

    return train_bpe(bpe_corpus(), vocab_size).to_str()


def write_bpe_tokenizer_json(path, vocab_size: int = 420) -> str:
    path.write_text(bpe_tokenizer_json(vocab_size), encoding="utf-8")
    return str(path)


def bpe_tokenizer(vocab_size: int = 420):
    from bertjax.tokenization.bpe import TokenizersTokenizer

    return TokenizersTokenizer(bpe_tokenizer_json(vocab_size))


def write_modern_bpe_checkpoint(root, seed: int = 0, vocab_size: int = 420) -> str:
    """write_modern_checkpoint with the BPE tokenizer.json as its vocabulary."""
    return write_modern_checkpoint(root, seed, tokenizer=bpe_tokenizer(vocab_size))

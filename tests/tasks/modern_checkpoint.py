"""A tiny random ModernBERT checkpoint for the fine-tuning, conversion and serving tests: the
modern_tiny shapes (2 layers, 128 wide; layer 0 global, layer 1 local with a window of 8 tokens,
so rows of the tests' lengths use it) over one WordPiece vocabulary holding the words of every
generated task (conftest's keyword task, tagging_data, squad_data, embedding_data), saved by
bertjax.checkpoint_dir.save_pretrained with its MLM head."""

import embedding_data
import squad_data
import tagging_data
from conftest import KEYWORD_VOCAB

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = list(dict.fromkeys(SPECIALS + KEYWORD_VOCAB + tagging_data.VOCAB + squad_data.VOCAB
                           + embedding_data.VOCAB))


def modern_config(**overrides):
    from bertjax.models.modern import ModernConfig

    fields = dict(vocab_size=len(VOCAB), local_attention=8, max_position_embeddings=512,
                  pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2,
                  sep_token_id=3)
    return ModernConfig.from_preset("modern_tiny", **{**fields, **overrides})


def write_modern_checkpoint(root, seed: int = 0, **overrides) -> str:
    """root/ckpt: a random ModernBertForMaskedLM (`modern_config(**overrides)`) and VOCAB
    (root/vocab.txt); returns the directory."""
    import flax.linen as nn
    import jax
    import numpy as np

    from bertjax.checkpoint_dir import save_pretrained
    from bertjax.models.modern import ModernBertForMaskedLM

    (root / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    config = modern_config(**overrides)
    ids = np.zeros((1, 4), np.int32)
    params = jax.jit(ModernBertForMaskedLM(config).init)(jax.random.key(seed), ids, ids)
    save_pretrained(root / "ckpt", config, nn.unbox(params["params"]), str(root / "vocab.txt"))
    return str(root / "ckpt")

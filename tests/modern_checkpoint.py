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

"""Tiny sentence-transformers models built here, no network: a random transformers BERT (non-
trivial biases and LayerNorms) in Transformer, Pooling (and Normalize) modules, saved by
SentenceTransformer.save (transformers 5 keeps tokenizer.json, not vocab.txt)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")
st_modules = pytest.importorskip("sentence_transformers.sentence_transformer.modules")

L, H, A, FFN, P = 2, 32, 4, 37, 64
MAX_SEQ_LENGTH = 16  # below the position embeddings: a long sentence is cut there
WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "to", "house", "cafe", "big",
         "small", "red", "blue", "is", "was", "and", "quick", "brown", "fox", "jump", "over",
         "lazy", "run", "play", "##s", "##ed", "##ing", "##er", "##ly", ".", ",", "!", "?", "'",
         "query", "passage", "document", ":"]
TOKENS = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
          + [f"w{i}" for i in range(100 - 5 - len(WORDS))])
# A cased vocabulary: "Café" and "café" are different tokens, "cafe" a third.
CASED_TOKENS = TOKENS + ["Café", "café", "Cat", "The", "RED", "Dog"]


def save_sentence_transformer(root, mode="mean", normalize=False, *, tokens=TOKENS,
                              lower_case_vocab=True, max_seq_length=MAX_SEQ_LENGTH,
                              positions=P, do_lower_case=False, prompts=None,
                              default_prompt_name=None, include_prompt=True):
    """root/st: the BERT root/bert (vocabulary `tokens`, its tokenizer lower-casing where
    lower_case_vocab) as a SentenceTransformer with `mode` pooling; do_lower_case: its
    sentence_bert_config.json says so, as sentence-transformers 2 to 5 wrote it (6 writes a
    Lowercase step into tokenizer.json, which BertTokenizer drops on loading); prompts /
    default_prompt_name: config_sentence_transformers.json's."""
    bert_dir = root / "bert"
    bert_dir.mkdir()
    (bert_dir / "vocab.txt").write_text("".join(t + "\n" for t in tokens))
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(tokens), hidden_size=H, num_hidden_layers=L, num_attention_heads=A,
        intermediate_size=FFN, max_position_embeddings=positions, hidden_act="gelu")
    model = transformers.BertModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(bert_dir)
    transformers.BertTokenizer(str(bert_dir / "vocab.txt"), do_lower_case=lower_case_vocab
                               ).save_pretrained(bert_dir)
    modules = [st_modules.Transformer(str(bert_dir), max_seq_length=max_seq_length),
               st_modules.Pooling(H, pooling_mode=mode, include_prompt=include_prompt)]
    if normalize:
        modules.append(st_modules.Normalize())
    out = root / "st"
    st.SentenceTransformer(modules=modules, device="cpu", prompts=prompts,
                           default_prompt_name=default_prompt_name).save(str(out))
    if do_lower_case:
        sbert = json.loads((out / "sentence_bert_config.json").read_text())
        (out / "sentence_bert_config.json").write_text(json.dumps({**sbert,
                                                                   "do_lower_case": True}))
    return out


def reference(directory):
    """The SentenceTransformer of `directory`, on the CPU."""
    return st.SentenceTransformer(str(directory), device="cpu")


def assert_close(ours, theirs):
    """bertjax's vectors are sentence-transformers' within 1e-5."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)

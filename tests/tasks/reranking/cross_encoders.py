"""Tiny sentence-transformers CrossEncoders built here, no network: a random transformers
BertForSequenceClassification (non-trivial biases and LayerNorms) with one label, wrapped in
CrossEncoder and saved by it (transformers 5 keeps tokenizer.json, not vocab.txt)."""

import pytest
import reranking_data as data

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")

MAX_LENGTH = 16  # below the position embeddings: a long pair is cut there
PAIRS = [("topic1 word3", "word4 topic1 word9 word2"),
         ("word7", "topic3 word1"),
         ("topic5 word2 word2", "word0 word1 word2 word3 word4 word5 word6 word7 word8 word9 "
                                "word10 word11 word12 word13"),  # longer than MAX_LENGTH
         ("topic0", "topic0")]
ACTIVATIONS = {"sigmoid": torch.nn.Sigmoid, "identity": torch.nn.Identity}


def save_cross_encoder(root, activation=None, num_labels=1, max_length=MAX_LENGTH):
    """root/ce: a CrossEncoder of a random tiny BERT with data.VOCAB (activation: its
    activation_fn by name, None: CrossEncoder's default)."""
    hf = root / "hf"
    hf.mkdir(parents=True)
    (hf / "vocab.txt").write_text("".join(t + "\n" for t in data.VOCAB))
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(data.VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64, num_labels=num_labels)
    model = transformers.BertForSequenceClassification(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(hf)
    transformers.BertTokenizer(str(hf / "vocab.txt")).save_pretrained(hf)
    function = ACTIVATIONS[activation]() if activation else None
    out = root / "ce"
    st.CrossEncoder(str(hf), device="cpu", activation_fn=function,
                    max_length=max_length).save(str(out))
    return out


def reference(directory):
    """The CrossEncoder of `directory`, on the CPU."""
    return st.CrossEncoder(str(directory), device="cpu")

"""Head parity: bertjax's BertForTokenClassification written by the to_hf writer loads into
transformers' BertForTokenClassification with the same logits (1e-4), and reads back."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from etils import epath

from bertjax.convert.huggingface import read_hf_checkpoint, write_hf_checkpoint
from bertjax.models import BertConfig
from bertjax.models.tagging import BertForTokenClassification


@pytest.mark.slow
def test_token_classification_head_matches_transformers(tmp_path):
    import torch
    import transformers

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                                *(f"w{i}" for i in range(35))]) + "\n")
    config = BertConfig(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4,
                        intermediate_size=64, max_position_embeddings=64)
    model = BertForTokenClassification(config, 5)
    ids = np.zeros((1, 4), np.int32)
    params = nn.unbox(model.init(jax.random.key(0), ids, ids, ids)["params"])
    params = jax.tree.map(np.asarray, params)
    params["classifier"]["bias"] = np.linspace(-1, 1, 5).astype(np.float32)  # not zeros
    out = tmp_path / "hf"
    write_hf_checkpoint(out, config, params, epath.Path(vocab), do_lower_case=True,
                        architecture="BertForTokenClassification")
    hf = transformers.BertForTokenClassification.from_pretrained(str(out)).eval()
    assert hf.num_labels == 5
    rng = np.random.default_rng(0)
    input_ids = rng.integers(5, 40, (3, 12)).astype(np.int32)
    mask = np.ones_like(input_ids)
    mask[1, 7:] = 0
    segments = np.zeros_like(input_ids)
    segments[2, 6:] = 1
    ours = np.asarray(model.apply({"params": params}, input_ids, segments, mask))
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(input_ids, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long),
                    token_type_ids=torch.tensor(segments, dtype=torch.long)).logits.numpy()
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], theirs[real], atol=1e-4)
    # from_hf with the head: the classifier and the encoder come back unchanged.
    back, skipped = read_hf_checkpoint(out, config, heads=("classifier",))
    np.testing.assert_array_equal(back["classifier"]["kernel"], params["classifier"]["kernel"])
    np.testing.assert_array_equal(back["classifier"]["bias"], params["classifier"]["bias"])
    for a, b in zip(jax.tree.leaves({k: v for k, v in back["bert"].items() if k != "pooler"}),
                    jax.tree.leaves({k: v for k, v in params["bert"].items()
                                     if k != "pooler"})):
        np.testing.assert_array_equal(a, b)
    # Without asking for the head, reading is as before: the head is skipped, not imported.
    plain, skipped = read_hf_checkpoint(out, config)
    assert "classifier" not in plain and "classifier.weight" in skipped

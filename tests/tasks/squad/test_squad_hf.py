"""Head parity: bertjax's BertForQuestionAnswering written by the to_hf writer loads into
transformers' BertForQuestionAnswering with the same start/end logits (1e-4), and a Hugging
Face QA checkpoint reads back with its `qa_outputs` head."""

import flax.linen as nn
import jax
import numpy as np
from etils import epath

from bertjax.convert.huggingface import read_hf_checkpoint, write_hf_checkpoint
from bertjax.models import BertConfig
from bertjax.models.squad import BertForQuestionAnswering


def test_qa_head_matches_transformers_and_imports(tmp_path):
    import torch
    import transformers

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                                *(f"w{i}" for i in range(35))]) + "\n")
    config = BertConfig(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4,
                        intermediate_size=64, max_position_embeddings=64)
    model = BertForQuestionAnswering(config)
    ids = np.zeros((1, 4), np.int32)
    params = jax.tree.map(np.asarray, nn.unbox(model.init(jax.random.key(0), ids, ids,
                                                          ids)["params"]))
    params["qa_outputs"]["bias"] = np.array([0.3, -0.7], np.float32)  # not zeros
    out = tmp_path / "hf"
    write_hf_checkpoint(out, config, params, epath.Path(vocab), do_lower_case=True,
                        architecture="BertForQuestionAnswering")
    hf = transformers.BertForQuestionAnswering.from_pretrained(str(out)).eval()
    rng = np.random.default_rng(0)
    input_ids = rng.integers(5, 40, (3, 16)).astype(np.int32)
    mask = np.ones_like(input_ids)
    mask[1, 9:] = 0
    segments = np.zeros_like(input_ids)
    segments[:, 6:] = 1
    start, end = (np.asarray(x) for x in model.apply({"params": params}, input_ids, segments,
                                                     mask))
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(input_ids, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long),
                    token_type_ids=torch.tensor(segments, dtype=torch.long))
    real = mask.astype(bool)
    np.testing.assert_allclose(start[real], theirs.start_logits.numpy()[real], atol=1e-4)
    np.testing.assert_allclose(end[real], theirs.end_logits.numpy()[real], atol=1e-4)
    # A transformers-saved QA checkpoint (its own writer) imports with the head.
    saved = tmp_path / "hf_saved"
    hf.save_pretrained(str(saved))
    back, skipped = read_hf_checkpoint(saved, config, heads=("qa_outputs",))
    np.testing.assert_allclose(back["qa_outputs"]["kernel"], params["qa_outputs"]["kernel"])
    np.testing.assert_allclose(back["qa_outputs"]["bias"], params["qa_outputs"]["bias"])
    start2, end2 = model.apply({"params": {"bert": {**back["bert"], **(
        {"pooler": params["bert"]["pooler"]} if "pooler" in params["bert"] else {})},
        "qa_outputs": back["qa_outputs"]}}, input_ids, segments, mask)
    np.testing.assert_allclose(np.asarray(start2), start, atol=1e-6)
    np.testing.assert_allclose(np.asarray(end2), end, atol=1e-6)
    # Without asking for the head it is skipped, not imported.
    plain, skipped = read_hf_checkpoint(saved, config)
    assert "qa_outputs" not in plain and "qa_outputs.weight" in skipped

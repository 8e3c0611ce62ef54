"""bertjax.convert.modernbert against transformers itself: directories written by
transformers' save_pretrained (ModernBertForMaskedLM and ModernBertModel) read and written
back tensor for tensor; what bertjax writes loaded by transformers; every bad file named."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from bertjax.convert import modernbert as convert
from bertjax.convert.mapping import ConversionError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def hf_config():
    return transformers.ModernBertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
        intermediate_size=40, local_attention=8, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, cls_token_id=1, sep_token_id=2)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    torch.manual_seed(0)
    masked_lm = transformers.ModernBertForMaskedLM(hf_config()).eval()
    with torch.no_grad():
        for param in masked_lm.parameters():
            param.add_(0.1 * torch.randn_like(param))
    root = tmp_path_factory.mktemp("modernbert")
    masked_lm.save_pretrained(root / "mlm")
    masked_lm.model.save_pretrained(root / "encoder")
    return {"mlm": root / "mlm", "encoder": root / "encoder", "model": masked_lm}


@pytest.mark.parametrize("layout", ["mlm", "encoder"])
def test_round_trip_equals_the_saved_tensors(hf_dirs, layout):
    saved = load_file(str(hf_dirs[layout] / "model.safetensors"))
    config, params = convert.read_hf(hf_dirs[layout])
    assert ("head" in params) == (layout == "mlm")
    back = convert.to_hf_state_dict(config, params)
    assert back.keys() == saved.keys()
    for name, array in saved.items():
        np.testing.assert_array_equal(back[name], array, err_msg=name)


def test_layouts_of_the_fused_projections(hf_dirs):
    """Wqkv rows are q | k | v, each head-major; Wi rows the activated half, then the gate."""
    config, params = convert.read_hf(hf_dirs["mlm"])
    layer = hf_dirs["model"].model.layers[1]
    wqkv = layer.attn.Wqkv.weight.detach().numpy()
    kernel = params["model"]["layers_1"]["attn"]["wqkv"]["kernel"]  # [hidden, 3, heads, dim]
    head_dim = config.head_dim
    key_head_1 = wqkv[config.hidden_size + head_dim: config.hidden_size + 2 * head_dim]
    np.testing.assert_array_equal(kernel[:, 1, 1, :], key_head_1.T)
    wi = layer.mlp.Wi.weight.detach().numpy()
    np.testing.assert_array_equal(params["model"]["layers_1"]["mlp"]["wi"]["kernel"][:, 1],
                                  wi[config.intermediate_size:].T)


def test_written_checkpoint_loads_in_transformers(hf_dirs, tmp_path):
    config, params = convert.read_hf(hf_dirs["mlm"])
    convert.write_hf(tmp_path / "out", config, params)
    with pytest.raises(ConversionError, match="already exists"):
        convert.write_hf(tmp_path / "out", config, params)
    loaded, info = transformers.ModernBertForMaskedLM.from_pretrained(
        tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    original = hf_dirs["model"].state_dict()
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, original[name], rtol=0, atol=0, msg=name)
    assert loaded.config.layer_types == hf_dirs["model"].config.layer_types
    assert loaded.config.rope_parameters == hf_dirs["model"].config.rope_parameters


def _altered(hf_dirs, tmp_path, change):
    """A copy of the MLM directory whose tensors `change` edits in place."""
    tensors = load_file(str(hf_dirs["mlm"] / "model.safetensors"))
    change(tensors)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text((hf_dirs["mlm"] / "config.json").read_text())
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"), metadata={"format": "pt"})
    return tmp_path / "bad"


@pytest.mark.parametrize("change, words", [
    (lambda t: t.update({"classifier.weight": np.zeros((2, 32), np.float32)}),
     "holds both an MLM decoder (decoder.bias) and a classifier"),
    (lambda t: t.update({"pooler.dense.weight": np.zeros((32, 32), np.float32)}),
     "pooler.dense.weight are not parameters of ModernBertModel / ModernBertForMaskedLM"),
    (lambda t: t.pop("model.layers.2.attn_norm.weight"),
     "missing tensor model.layers.2.attn_norm.weight"),
    (lambda t: t.pop("head.norm.weight"), "missing tensor head.norm.weight"),
    (lambda t: t.update({"model.layers.0.mlp.Wi.weight": np.zeros((40, 32), np.float32)}),
     "model.layers.0.mlp.Wi.weight has shape (40, 32) but config.json implies (80, 32)"),
    (lambda t: t.update({"decoder.weight": np.zeros((100, 32), np.float32)}),
     "decoder.weight differs from model.embeddings.tok_embeddings.weight"),
], ids=["decoder and classifier", "unknown", "missing", "partial head", "shape",
        "untied decoder"])
def test_a_bad_file_is_named(hf_dirs, tmp_path, change, words):
    directory = _altered(hf_dirs, tmp_path, change)
    with pytest.raises(ConversionError) as caught:
        convert.read_hf(directory)
    assert words in str(caught.value)


def test_a_tied_decoder_copy_is_accepted(hf_dirs, tmp_path):
    directory = _altered(hf_dirs, tmp_path, lambda t: t.update(
        {"decoder.weight": t["model.embeddings.tok_embeddings.weight"].copy()}))
    _, params = convert.read_hf(directory)
    _, want = convert.read_hf(hf_dirs["mlm"])
    np.testing.assert_array_equal(params["model"]["embeddings"]["tok_embeddings"]["embedding"],
                                  want["model"]["embeddings"]["tok_embeddings"]["embedding"])


def test_an_unsupported_config_is_named(hf_dirs, tmp_path):
    values = json.loads((hf_dirs["mlm"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**values, "mlp_bias": True}))
    with pytest.raises(ConversionError, match=r"config.json: config.json mlp_bias=True"):
        convert.read_hf(tmp_path)

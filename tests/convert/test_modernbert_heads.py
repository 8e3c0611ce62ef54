"""bertjax's fine-tuning heads over a ModernBERT encoder against transformers' ModernBertFor*
classes: random transformers models (every weight perturbed, so no LayerNorm is the identity)
saved by transformers, read by bertjax.convert.modernbert, give the same logits from bertjax's
heads (float32, within 1e-5) on padded rows longer than the local window; written back, the
tensors are transformers' own and load into the same class."""

import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.convert import modernbert as convert
from bertjax.models.classification import BertForMultipleChoice, BertForSequenceClassification
from bertjax.models.modernbert import ModernConfig
from bertjax.models.squad import BertForQuestionAnswering
from bertjax.models.tagging import BertForTokenClassification

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NUM_LABELS = 3


def _hf_model(cls_name: str, pooling: str = "cls"):
    config = transformers.ModernBertConfig(
        vocab_size=60, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
        intermediate_size=40, local_attention=8, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, cls_token_id=1, sep_token_id=2, classifier_pooling=pooling,
        num_labels=2 if cls_name == "ModernBertForQuestionAnswering" else NUM_LABELS,
        attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


def _inputs(shape):
    """Ids and right-padded masks [*, seq] with rows of several lengths (one of 5 tokens, one
    full) beyond the local window of 8."""
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 60, shape).astype(np.int64)
    lengths = rng.integers(5, shape[-1] + 1, shape[:-1])
    lengths.flat[0] = shape[-1]
    mask = (np.arange(shape[-1]) < lengths[..., None]).astype(np.int64)
    return ids * mask, mask


def _read(model, tmp_path) -> tuple[ModernConfig, dict]:
    model.save_pretrained(tmp_path / "hf")
    return convert.read_hf(tmp_path / "hf")


def _same(ours, reference, mask=None):
    ours, reference = np.asarray(ours), reference.detach().numpy()
    if mask is not None:  # padded positions are not compared (nothing reads them)
        ours, reference = ours[mask.astype(bool)], reference[mask.astype(bool)]
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_sequence_classification_equals_transformers(tmp_path, pooling):
    model = _hf_model("ModernBertForSequenceClassification", pooling)
    config, params = _read(model, tmp_path)
    assert set(params) == {"model", "head", "classifier"}
    ids, mask = _inputs((3, 20))
    ours = BertForSequenceClassification(config, NUM_LABELS, classifier_pooling=pooling).apply(
        {"params": params}, jnp.asarray(ids), None, jnp.asarray(mask))
    with torch.no_grad():
        reference = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    _same(ours, reference)


def test_token_classification_equals_transformers(tmp_path):
    model = _hf_model("ModernBertForTokenClassification")
    config, params = _read(model, tmp_path)
    ids, mask = _inputs((3, 20))
    ours = BertForTokenClassification(config, NUM_LABELS).apply(
        {"params": params}, jnp.asarray(ids), None, jnp.asarray(mask))
    with torch.no_grad():
        reference = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    _same(ours, reference, mask)


def test_question_answering_equals_transformers(tmp_path):
    model = _hf_model("ModernBertForQuestionAnswering")
    config, params = _read(model, tmp_path)
    ids, mask = _inputs((3, 20))
    start, end = BertForQuestionAnswering(config).apply(
        {"params": params}, jnp.asarray(ids), None, jnp.asarray(mask))
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    _same(start, out.start_logits, mask)
    _same(end, out.end_logits, mask)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_multiple_choice_equals_transformers(tmp_path, pooling):
    model = _hf_model("ModernBertForMultipleChoice", pooling)
    config, params = _read(model, tmp_path)
    assert params["classifier"]["kernel"].shape == (32, 1)
    ids, mask = _inputs((2, 3, 20))
    ours = BertForMultipleChoice(config, classifier_pooling=pooling).apply(
        {"params": params}, jnp.asarray(ids), None, jnp.asarray(mask))
    with torch.no_grad():
        reference = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    _same(ours, reference)


@pytest.mark.parametrize("cls_name", ["ModernBertForSequenceClassification",
                                      "ModernBertForTokenClassification",
                                      "ModernBertForQuestionAnswering",
                                      "ModernBertForMultipleChoice"])
def test_written_head_is_the_transformers_model(tmp_path, cls_name):
    """read → write_hf: transformers' own tensors, loaded without a missing or extra key."""
    model = _hf_model(cls_name)
    config, params = _read(model, tmp_path)
    convert.write_hf(tmp_path / "out", config, params, architecture=cls_name,
                     extra_config={"classifier_pooling": "cls"})
    loaded, info = getattr(transformers, cls_name).from_pretrained(
        tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    if cls_name != "ModernBertForMultipleChoice":  # its classifier has one output
        assert loaded.config.id2label == model.config.id2label
    original = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, original[name], rtol=0, atol=0, msg=name)


def test_a_modern_head_refuses_bert_only_options():
    from bertjax.errors import ConfigError

    config = ModernConfig.from_preset("modern_tiny", vocab_size=40, pad_token_id=0)
    ids = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ConfigError, match="config.task.bilstm_units=8"):
        BertForSequenceClassification(config, 2, bilstm_units=8).init(
            __import__("jax").random.key(0), ids)
    with pytest.raises(ConfigError, match="config.task.classifier_pooling='max'"):
        BertForSequenceClassification(config, 2, classifier_pooling="max").init(
            __import__("jax").random.key(0), ids)

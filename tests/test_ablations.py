"""The paper's ablations (Sec. 5, App. C): the left-to-right objective, the masking mixes of
Table 8, the "+ BiLSTM" head, and the `bertjax.ablations` runner."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from bertjax.errors import ConfigError
from bertjax.models import BertConfig, BertForPreTraining
from bertjax.tasks import pretraining
from bertjax.train import configs
from data_pipeline import masking

TINY = dict(vocab_size=97, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_dropout_prob=0.0)


def packed_batch(rng, batch=2, seq=16, vocab=97):
    """Unmasked packed rows: two examples per row, then padding."""
    ids = rng.integers(5, vocab, (batch, seq)).astype(np.int32)
    packing = np.zeros((batch, seq), np.int32)
    packing[:, :7], packing[:, 7:13] = 1, 2
    mask = (packing > 0).astype(np.int32)
    ids = ids * mask
    return {"input_ids": ids, "input_mask": mask, "segment_ids": np.zeros_like(ids),
            "packing_ids": packing}


def ltr_job_config(**model):
    config = ml_collections.ConfigDict(dict(
        objective="ltr", model=dict(TINY, **model),
        train=dict(nsp_weight=1.0), masking=dict(mask=0.8, same=0.1, random=0.1)))
    return config


# ------------------------------------------------------------------------------------ LTR


def test_ltr_pretraining_outputs_at_earlier_positions_ignore_later_tokens():
    config = ltr_job_config()
    assert configs.packing_enabled(config) and configs.objective(config) == "ltr"
    model = BertForPreTraining(BertConfig(**TINY, causal=True))
    params = pretraining.init_params(model, jax.random.PRNGKey(0))
    batch = packed_batch(np.random.default_rng(0))
    batch = dict(batch, **pretraining.next_token_targets(jax.tree.map(jnp.asarray, batch)))

    @jax.jit
    def logits(b):
        return pretraining.model_outputs(model, params, b, packed=True)["mlm_logits"]

    base = np.asarray(logits(batch))
    for j in (1, 5, 9, 12):
        changed = dict(batch, input_ids=batch["input_ids"].copy())
        changed["input_ids"][:, j] = (changed["input_ids"][:, j] + 7) % 97
        out = np.asarray(logits(changed))
        # Position p's logits predict token p + 1 from tokens 0..p.
        np.testing.assert_array_equal(out[:, :j], base[:, :j])
        assert np.abs(out[:, j:] - base[:, j:]).max() > 1e-4  # the change is seen from j on


def test_ltr_loss_equals_numpy_next_token_cross_entropy():
    config = ltr_job_config(dtype="float64", param_dtype="float64")
    jax.config.update("jax_enable_x64", True)
    try:
        model = BertForPreTraining(configs.resolve_model_config(
            dict(config.model, causal=True)))
        params = pretraining.init_params(model, jax.random.PRNGKey(1))
        batch = jax.tree.map(jnp.asarray, packed_batch(np.random.default_rng(1)))
        loss, metrics = pretraining.loss_fn(params, batch, None, model=model, nsp_weight=1.0,
                                            packed=True, ltr=True)
        # Reference: logits at every position, then NumPy float64 next-token NLL within each
        # packed example.
        seq = batch["input_ids"].shape[1]
        every = jnp.broadcast_to(jnp.arange(seq), batch["input_ids"].shape)
        logits = np.asarray(model.apply({"params": params}, batch["input_ids"],
                                        batch["segment_ids"], batch["input_mask"], every,
                                        packing_ids=batch["packing_ids"])["mlm_logits"],
                            np.float64)
    finally:
        jax.config.update("jax_enable_x64", False)
    ids, packing = np.asarray(batch["input_ids"]), np.asarray(batch["packing_ids"])
    nll = []
    for b in range(ids.shape[0]):
        for p in range(seq - 1):
            if packing[b, p] > 0 and packing[b, p + 1] == packing[b, p]:
                row = logits[b, p] - logits[b, p].max()
                log_probs = row - np.log(np.exp(row).sum())
                nll.append(-log_probs[ids[b, p + 1]])
    assert len(nll) == 2 * (6 + 5)  # examples of 7 and 6 tokens: 6 + 5 targets a row
    expected = np.sum(nll) / (len(nll) + 1e-5)  # the reference's denominator
    # The loss is summed in float32 (pretraining_loss), the logits are float64.
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["mlm_loss"]), expected, rtol=1e-6)


def test_ltr_checkpoint_fine_tunes_with_causal_attention(tmp_path):
    from bertjax.pretrained import save_pretrained
    from bertjax.tasks.base import load_pretrained_model
    from bertjax.tasks.squad import BertForQuestionAnswering

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                               + [f"w{i}" for i in range(92)]) + "\n")
    model_cfg = BertConfig(**TINY, causal=True)
    params = pretraining.init_params(BertForPreTraining(model_cfg), jax.random.PRNGKey(2))
    save_pretrained(tmp_path / "export", model_cfg, params, str(vocab))
    # A fine-tuning config as experiments/squad.py writes it (config.model overrides).
    config = ml_collections.ConfigDict(dict(
        init_checkpoint=str(tmp_path / "export"),
        model=dict(dtype="auto", hidden_dropout_prob=0.1, attention_dropout_prob=0.1)))
    loaded_cfg, loaded, _ = load_pretrained_model(config)
    assert loaded_cfg.causal
    qa = BertForQuestionAnswering(loaded_cfg)
    qa_params = qa.init(jax.random.PRNGKey(3), *(jnp.zeros((1, 8), jnp.int32),) * 3)["params"]
    qa_params = dict(qa_params, bert=loaded["bert"])
    batch = packed_batch(np.random.default_rng(3))
    args = (batch["segment_ids"], batch["input_mask"])
    start, end = qa.apply({"params": qa_params}, batch["input_ids"], *args)
    for j in (2, 8):
        ids = batch["input_ids"].copy()
        ids[:, j] = (ids[:, j] + 11) % 97
        start2, end2 = qa.apply({"params": qa_params}, ids, *args)
        np.testing.assert_array_equal(np.asarray(start2)[:, :j], np.asarray(start)[:, :j])
        np.testing.assert_array_equal(np.asarray(end2)[:, :j], np.asarray(end)[:, :j])
        assert np.abs(np.asarray(start2)[:, j] - np.asarray(start)[:, j]).max() > 1e-6


# ------------------------------------------------------------------------- masking mixes

TABLE8_MIXES = [(0.8, 0.1, 0.1), (1.0, 0.0, 0.0), (0.8, 0.0, 0.2), (0.8, 0.2, 0.0),
                (0.0, 0.2, 0.8), (0.0, 0.0, 1.0)]
VOCAB = 5000  # random replacements hit the original token 1 in ~5000 times


def mix_config(mix):
    return masking.MaskingConfig(max_predictions=128, vocab_size=VOCAB, mask_id=4,
                                 special_ids=(0, 1, 2, 3, 4), masked_lm_prob=0.5, mix=mix)


def observed_shares(original, masked, positions, weights, mask_id):
    """(MASK, SAME, RANDOM) shares of the predicted positions, and how many there were."""
    rows = np.nonzero(weights > 0)
    pos = positions[rows]
    before, after = original[rows[0], pos], masked[rows[0], pos]
    n = len(pos)
    return (np.sum(after == mask_id) / n, np.sum(after == before) / n,
            np.sum((after != mask_id) & (after != before)) / n), n


@pytest.mark.parametrize("mix", TABLE8_MIXES, ids=lambda m: "/".join(f"{x:.0%}" for x in m))
def test_masking_mix_shares_static_and_dynamic(mix):
    import tensorflow as tf

    cfg = mix_config(mix)
    rng = np.random.default_rng(0)
    ids = rng.integers(5, VOCAB, (1000, 256)).astype(np.int32)
    lengths = np.full(1000, 256)
    out, positions, _, counts = masking.mask_batch(ids, lengths, cfg, rng)
    weights = (np.arange(128) < counts[:, None]).astype(np.float32)
    static, n = observed_shares(ids, out, positions, weights, cfg.mask_id)
    assert n >= 100_000
    np.testing.assert_allclose(static, mix, atol=0.01)

    batch = masking.mask_batch_tf(tf.constant(ids), tf.ones_like(tf.constant(ids)), cfg,
                                  tf.constant([7, 0], tf.int64))
    dynamic, n = observed_shares(ids, batch["input_ids"].numpy(),
                                 batch["masked_lm_positions"].numpy(),
                                 batch["masked_lm_weights"].numpy(), cfg.mask_id)
    assert n >= 100_000
    np.testing.assert_allclose(dynamic, mix, atol=0.01)


def test_masking_mix_is_validated():
    config = ml_collections.ConfigDict(dict(masking=dict(mask=0.8, same=0.1, random=0.2)))
    with pytest.raises(ConfigError, match=r"config.masking.mask/same/random .* sum to 1.1"):
        configs.masking_mix(config)
    config.masking.update(mask=1.2, same=-0.1, random=-0.1)
    with pytest.raises(ConfigError, match=r"config.masking.mask=1.2 is not in \[0, 1\]"):
        configs.masking_mix(config)
    with pytest.raises(ValueError, match="sum to"):
        masking.MaskingConfig(max_predictions=2, vocab_size=10, mask_id=4, special_ids=(0,),
                              mix=(0.5, 0.5, 0.5))
    with pytest.raises(ConfigError, match="config.objective='gpt'"):
        configs.objective(ml_collections.ConfigDict(dict(objective="gpt")))

"""The modern pre-training recipe's optimizer pieces against independent references:
the warmup-stable-decay schedule, StableAdamW (a float64 NumPy implementation of Wortsman et
al., 2023, Algorithm 2), weight decay off norms and biases for both architectures, and the
model FLOPs of local attention counted pair by pair."""

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from bertjax.errors import ConfigError
from bertjax.models.modernbert import ModernConfig
from bertjax.models.modernbert import flops as modern_flops
from bertjax.train.optimizer import (
    learning_rate_schedule,
    make_optimizer,
    scale_by_stable_adamw,
    weight_decay_mask,
)


@pytest.mark.parametrize("shape", ["linear", "1-sqrt"])
def test_wsd_warms_up_holds_the_peak_and_decays_to_zero(shape):
    peak, warmup, total, decay = 8e-4, 10, 100, 30
    schedule = learning_rate_schedule(peak, warmup, total, "wsd", decay, shape)
    for step in range(total + 5):
        if step < warmup:
            want = peak * step / warmup
        elif step < total - decay:
            want = peak
        else:
            done = min((step - (total - decay)) / decay, 1.0)
            want = peak * (1 - (np.sqrt(done) if shape == "1-sqrt" else done))
        assert float(schedule(step)) == pytest.approx(want, rel=1e-6, abs=1e-12), step


def test_wsd_without_decay_stays_at_the_peak_and_bad_decay_steps_name_the_field():
    schedule = learning_rate_schedule(1e-3, 5, 50, "wsd", 0)
    assert float(schedule(49)) == pytest.approx(1e-3)
    with pytest.raises(ConfigError, match="optimizer.decay_steps=60"):
        learning_rate_schedule(1e-3, 5, 50, "wsd", 60)
    with pytest.raises(ConfigError, match="optimizer.decay_shape='cosine'"):
        learning_rate_schedule(1e-3, 5, 50, "wsd", 10, "cosine")


def stable_adamw_reference(params, grads, lr, b1, b2, eps, wd, decay):
    """StableAdamW in float64 NumPy: per tensor, the learning rate divided by
    max(1, sqrt(mean(g² / max(v̂, eps²)))), the decoupled decay scaled the same way."""
    m = {k: np.zeros_like(p) for k, p in params.items()}
    v = {k: np.zeros_like(p) for k, p in params.items()}
    params = {k: p.copy() for k, p in params.items()}
    for t, g in enumerate(grads, start=1):
        for k in params:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            m_hat, v_hat = m[k] / (1 - b1 ** t), v[k] / (1 - b2 ** t)
            rms = np.sqrt(np.mean(g[k] ** 2 / np.maximum(v_hat, eps ** 2)))
            step_lr = lr / max(1.0, rms)
            update = m_hat / (np.sqrt(v_hat) + eps) + (wd * params[k] if decay[k] else 0.0)
            params[k] = params[k] - step_lr * update
    return params


def test_stable_adamw_matches_the_float64_reference_and_clips_a_gradient_spike():
    r = np.random.default_rng(0)
    params = {"kernel": r.normal(size=(4, 3)), "norm": r.normal(size=(3,))}
    grads = [{k: r.normal(size=p.shape) for k, p in params.items()} for _ in range(6)]
    grads[4]["kernel"] *= 50.0  # a spike: its update must be clipped, not 50x larger
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.98, 1e-6, 0.1
    decay = {"kernel": True, "norm": False}
    want = stable_adamw_reference(params, grads, lr, b1, b2, eps, wd, decay)

    tx = scale_by_stable_adamw(b1, b2, eps, wd, mask=lambda p: {k: decay[k] for k in p})
    p32 = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    state = tx.init(p32)
    for g in grads:
        updates, state = tx.update({k: jnp.asarray(v, jnp.float32) for k, v in g.items()},
                                   state, p32)
        p32 = {k: p32[k] - lr * updates[k] for k in p32}
    for k in params:
        np.testing.assert_allclose(np.asarray(p32[k]), want[k], rtol=2e-5, atol=2e-6)

    # Without the clipping the spike's step is several times larger: the test can tell.
    def rms(t):
        v_hat = sum((1 - b2) * b2 ** (t - i) * grads[i - 1]["kernel"] ** 2
                    for i in range(1, t + 1)) / (1 - b2 ** t)
        return np.sqrt(np.mean(grads[t - 1]["kernel"] ** 2 / v_hat))
    assert rms(5) > 2.0


def test_make_optimizer_builds_stable_adamw_with_the_wsd_schedule():
    opt = ml_collections.ConfigDict(dict(
        name="stable_adamw", learning_rate=1e-3, schedule="wsd", weight_decay=1e-5, b1=0.9,
        b2=0.98, eps=1e-6, clip_norm=0.0, warmup_steps=2, decay_steps=4,
        decay_shape="1-sqrt"))
    tx, schedule = make_optimizer(opt, total_steps=10)
    assert float(schedule(5)) == pytest.approx(1e-3)
    assert float(schedule(8)) == pytest.approx(1e-3 * (1 - np.sqrt(0.5)))
    params = {"w": jnp.ones((2, 2))}
    updates, _ = tx.update({"w": jnp.ones((2, 2))}, tx.init(params), params)
    assert np.all(np.isfinite(np.asarray(updates["w"])))


def test_weight_decay_skips_norms_and_biases_of_both_architectures():
    flat = {
        ("model", "embeddings", "norm", "scale"): False,
        ("model", "layers_1", "attn_norm", "scale"): False,
        ("model", "final_norm", "scale"): False,
        ("head", "norm", "scale"): False,
        ("decoder_bias",): False,
        ("model", "layers_1", "attn", "wqkv", "kernel"): True,
        ("model", "embeddings", "tok_embeddings", "embedding"): True,
        ("bert", "encoder", "layer_0", "attention_output_layer_norm", "scale"): False,
        ("bert", "encoder", "layer_0", "intermediate", "bias"): False,
        ("bert", "encoder", "layer_0", "intermediate", "kernel"): True,
        ("mlm", "output_bias"): False,
    }
    params = flax.traverse_util.unflatten_dict({k: 0.0 for k in flat})
    got = flax.traverse_util.flatten_dict(weight_decay_mask(params))
    assert got == flat


@pytest.mark.parametrize("seq_len,radius", [(1, 3), (7, 3), (10, 3), (200, 64), (129, 64)])
def test_window_keys_counts_the_pairs_of_the_dense_local_mask(seq_len, radius):
    index = np.arange(seq_len)
    assert modern_flops.window_keys(seq_len, radius) == int(
        (np.abs(index[:, None] - index[None, :]) <= radius).sum())
    assert modern_flops.window_keys(seq_len, None) == seq_len * seq_len


def test_modern_flops_equal_xla_count_of_an_all_global_model():
    """With every layer global (no window to skip), the analytic matmul count is XLA's own
    count of the forward pass within the share of elementwise work."""
    from bertjax.models.modernbert import ModernBertForMaskedLM

    cfg = ModernConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2,
                       intermediate_size=96, global_attn_every_n_layers=1,
                       attention_impl="einsum", pad_token_id=0)
    seq, preds = 128, 16
    model = ModernBertForMaskedLM(cfg)
    ids = jnp.ones((1, seq), jnp.int32)
    positions = jnp.zeros((1, preds), jnp.int32)
    params = model.init(jax.random.key(0), ids, ids, positions)
    cost = jax.jit(lambda p: model.apply(p, ids, ids, positions)).lower(params).compile()
    xla = cost.cost_analysis()["flops"]
    ours = modern_flops.forward_flops(cfg, seq, preds)
    # Matmuls only: never above XLA's count, which adds the elementwise work.
    assert 0.85 * xla < ours <= xla, (ours, xla)
    # Local layers count their window only: fewer attention FLOPs than all-global.
    local = ModernConfig.from_dict(
        {**cfg.to_dict(), "global_attn_every_n_layers": 2, "local_attention": 32})
    saved = (modern_flops.attention_flops(local, seq, all_global=True)
             - modern_flops.attention_flops(local, seq))
    assert saved == 4 * 64 * (seq * seq - modern_flops.window_keys(seq, 16))


def test_dry_run_reports_what_the_local_layers_save_per_sequence_length():
    from bertjax.aot.report import local_attention_lines
    from bertjax.tasks.pretraining import job as job_lib
    from experiments import pretrain

    config = pretrain.get_config("modern_base")
    config.model.dtype = "bfloat16"
    lines = local_attention_lines(job_lib.make_job(config))
    assert "14 of 22 layers, window 64 each side" in lines[0]
    # Independently: 14 local layers of 2r + 1 = 129 keys per query (less the ends) instead of
    # all 8,192; 4·H FLOPs per query-key pair forward, x3 for training.
    pairs = 8192 * 129 - 64 * 65
    line = next(x for x in lines if x.strip().startswith("8192 tokens"))
    local = 3 * 4 * 768 * (8 * 8192 * 8192 + 14 * pairs)
    dense = 3 * 4 * 768 * 22 * 8192 * 8192
    assert f"attention {local / 1e9:,.1f} GFLOP instead of {dense / 1e9:,.1f}" in line, line
    bert = pretrain.get_config("tiny")
    bert.phases.phase1.data = bert.phases.phase2.data = "synthetic"
    assert local_attention_lines(job_lib.make_job(bert)) == []

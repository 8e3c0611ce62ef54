"""The BERT modules against an independent float64 NumPy forward pass, and their invariants."""

import functools

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import erf

from bertjax.models import BertConfig, BertForPreTraining, BertModel
from bertjax.models.bert.pretraining import pretraining_loss
from bertjax.models.kernels import attention as attn_lib

SMALL = dict(vocab_size=97, hidden_size=16, num_heads=4, intermediate_size=24,
             max_position_embeddings=32, num_layers=2)


def small_config(**overrides):
    return BertConfig(**{**SMALL, **overrides})


def perturbed_params(model, rng, *args, scale=0.1):
    """Initialised parameters plus noise, so that zero biases and unit LayerNorm scales are
    exercised too."""
    params = nn.unbox(model.init(rng, *args)["params"])
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(123), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, leaves)


def random_batch(rng, batch, seq, vocab, num_masked):
    r = np.random.default_rng(rng)
    ids = r.integers(0, vocab, (batch, seq)).astype(np.int32)
    segments = (np.arange(seq)[None] >= r.integers(1, seq, (batch, 1))).astype(np.int32)
    lengths = r.integers(seq // 2, seq + 1, batch)
    lengths[0] = seq
    mask = (np.arange(seq)[None] < lengths[:, None]).astype(np.int32)
    positions = np.stack([r.choice(n, num_masked, replace=False) for n in lengths])
    return ids, segments, mask, positions.astype(np.int32)


# ---------------------------------------------------------------------------------------------
# Independent float64 reference, written from the paper's equations.


def np_layer_norm(x, p, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def np_gelu(x):
    return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))


def np_softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def np_bert_for_pretraining(p, cfg, ids, segments, mask, positions):
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    bert, eps = p["bert"], cfg.layer_norm_eps
    emb = bert["embeddings"]
    seq = ids.shape[1]
    x = (emb["word_embeddings"]["embedding"][ids]
         + emb["position_embeddings"]["embedding"][np.arange(seq)][None]
         + emb["token_type_embeddings"]["embedding"][segments])
    x = np_layer_norm(x, emb["layer_norm"], eps)
    for i in range(cfg.num_layers):
        lp = bert["encoder"][f"layer_{i}"]
        att = lp["attention"]
        q, k, v = (np.einsum("bsh,hnd->bsnd", x, att[n]["kernel"]) + att[n]["bias"]
                   for n in ("query", "key", "value"))
        scores = np.einsum("bqnd,bknd->bnqk", q, k) / np.sqrt(cfg.head_dim)
        scores = np.where(mask[:, None, None, :] > 0, scores, -np.inf)
        context = np.einsum("bnqk,bknd->bqnd", np_softmax(scores), v)
        attended = np.einsum("bqnd,nde->bqe", context, att["output"]["kernel"])
        x = np_layer_norm(x + attended + att["output"]["bias"], lp["attention_layer_norm"], eps)
        h = np_gelu(x @ lp["intermediate"]["kernel"] + lp["intermediate"]["bias"])
        h = h @ lp["output"]["kernel"] + lp["output"]["bias"]
        x = np_layer_norm(x + h, lp["output_layer_norm"], eps)
    pooled = np.tanh(x[:, 0] @ bert["pooler"]["dense"]["kernel"] + bert["pooler"]["dense"]["bias"])
    masked = x[np.arange(x.shape[0])[:, None], positions]
    mlm = p["mlm"]
    t = np_gelu(masked @ mlm["transform"]["kernel"] + mlm["transform"]["bias"])
    t = np_layer_norm(t, mlm["transform_layer_norm"], eps)
    mlm_logits = t @ emb["word_embeddings"]["embedding"].T + mlm["output_bias"]
    nsp_logits = pooled @ p["nsp"]["kernel"] + p["nsp"]["bias"]
    return x, pooled, mlm_logits, nsp_logits


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-6), ("float32", 1e-4)])
def test_forward_matches_float64_numpy_reference(dtype, tol):
    cfg = small_config(dtype=dtype, param_dtype=dtype)
    ids, segments, mask, positions = random_batch(0, 3, 12, cfg.vocab_size, 4)
    with jax.enable_x64(dtype == "float64"):
        model = BertForPreTraining(cfg)
        params = perturbed_params(model, jax.random.key(0), ids, segments, mask, positions)
        out = model.apply({"params": params}, ids, segments, mask, positions)
        base = BertModel(cfg).apply({"params": params["bert"]}, ids, segments, mask)
        ref_seq, ref_pooled, ref_mlm, ref_nsp = np_bert_for_pretraining(
            params, cfg, ids, segments, mask, positions
        )
    real = mask.astype(bool)  # padding positions are not defined outputs
    np.testing.assert_allclose(np.asarray(base["sequence_output"])[real], ref_seq[real],
                               atol=tol, rtol=tol)
    np.testing.assert_allclose(base["pooled_output"], ref_pooled, atol=tol, rtol=tol)
    np.testing.assert_allclose(out["mlm_logits"], ref_mlm, atol=tol, rtol=tol)
    np.testing.assert_allclose(out["nsp_logits"], ref_nsp, atol=tol, rtol=tol)


def _apply_bert(cfg, params, ids, segments, mask, **kw):
    return BertModel(cfg).apply({"params": params}, ids, segments, mask, **kw)


@pytest.fixture(scope="module")
def small_model():
    cfg = small_config()
    ids, segments, mask, _ = random_batch(1, 2, 16, cfg.vocab_size, 3)
    params = perturbed_params(BertModel(cfg), jax.random.key(1), ids, segments, mask)
    return cfg, params


def test_appending_padding_leaves_real_token_outputs_unchanged(small_model):
    cfg, params = small_model
    ids, segments, _, _ = random_batch(2, 2, 10, cfg.vocab_size, 3)
    alone = _apply_bert(cfg, params, ids, segments, np.ones_like(ids))
    pad = 6
    padded_ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=0)
    padded_segments = np.pad(segments, ((0, 0), (0, pad)))
    padded_mask = np.pad(np.ones_like(ids), ((0, 0), (0, pad)))
    padded = _apply_bert(cfg, params, padded_ids, padded_segments, padded_mask)
    np.testing.assert_allclose(padded["sequence_output"][:, :10], alone["sequence_output"],
                               atol=1e-5)
    np.testing.assert_allclose(padded["pooled_output"], alone["pooled_output"], atol=1e-5)


@pytest.mark.parametrize("attention_impl", ["einsum", "xla"])
def test_packed_examples_equal_each_example_alone(small_model, attention_impl):
    cfg, params = small_model
    cfg = BertConfig(**{**cfg.to_dict(), "attention_impl": attention_impl})
    r = np.random.default_rng(3)
    a = r.integers(0, cfg.vocab_size, 6).astype(np.int32)
    b = r.integers(0, cfg.vocab_size, 7).astype(np.int32)
    seg_a = np.array([0, 0, 0, 1, 1, 1], np.int32)
    seg_b = np.array([0, 0, 1, 1, 1, 1, 1], np.int32)
    row_len = 16
    packed_ids = np.zeros((1, row_len), np.int32)
    packed_ids[0, :13] = np.concatenate([a, b])
    packed_segments = np.zeros((1, row_len), np.int32)
    packed_segments[0, :13] = np.concatenate([seg_a, seg_b])
    packing_ids = np.array([[1] * 6 + [2] * 7 + [0] * 3], np.int32)
    packed_mask = (packing_ids > 0).astype(np.int32)
    packed = _apply_bert(cfg, params, packed_ids, packed_segments, packed_mask,
                         packing_ids=packing_ids)["sequence_output"][0]
    for tokens, segs, start in ((a, seg_a, 0), (b, seg_b, 6)):
        ones = np.ones((1, len(tokens)), np.int32)
        alone = _apply_bert(cfg, params, tokens[None], segs[None], ones)
        np.testing.assert_allclose(packed[start:start + len(tokens)], alone["sequence_output"][0],
                                   atol=1e-5)


def test_mlm_logits_at_masked_positions_equal_full_sequence_logits():
    cfg = small_config()
    ids, segments, mask, positions = random_batch(4, 3, 12, cfg.vocab_size, 5)
    model = BertForPreTraining(cfg)
    params = perturbed_params(model, jax.random.key(2), ids, segments, mask, positions)
    every_position = np.broadcast_to(np.arange(12, dtype=np.int32), (3, 12))
    full = model.apply({"params": params}, ids, segments, mask, every_position)["mlm_logits"]
    gathered = model.apply({"params": params}, ids, segments, mask, positions)["mlm_logits"]
    expected = np.take_along_axis(np.asarray(full), positions[..., None], axis=1)
    np.testing.assert_allclose(gathered, expected, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_dot_product_attention_path_equals_einsum_path(small_model, causal, packed):
    cfg, params = small_model
    ids, segments, mask, _ = random_batch(5, 2, 16, cfg.vocab_size, 3)
    kw = {}
    if packed:
        kw["packing_ids"] = np.where(mask > 0, 1 + (np.arange(16)[None] >= 7), 0).astype(np.int32)
    outs = {}
    for impl in ("einsum", "xla", "auto"):
        c = BertConfig(**{**cfg.to_dict(), "attention_impl": impl, "causal": causal})
        outs[impl] = _apply_bert(c, params, ids, segments, mask, **kw)["sequence_output"]
    real = mask.astype(bool)
    for impl in ("xla", "auto"):
        np.testing.assert_allclose(np.asarray(outs[impl])[real], np.asarray(outs["einsum"])[real],
                                   atol=1e-5)


@pytest.mark.parametrize("attention_impl,causal,packed,remat", [
    ("einsum", False, False, "none"), ("xla", False, False, "none"),
    ("einsum", True, False, "none"), ("xla", False, True, "none"), ("einsum", False, False, "full"),
])
def test_pooled_only_equals_the_full_final_layer_in_values_and_gradients(
        small_model, attention_impl, causal, packed, remat):
    """The final layer computed for the pooled token alone ([CLS], or a causal model's last
    real token) gives that token's full-sequence vector, pooled output and gradients."""
    cfg, params = small_model
    cfg = BertConfig(**{**cfg.to_dict(), "attention_impl": attention_impl, "causal": causal,
                        "remat_policy": remat})
    ids, segments, mask, _ = random_batch(8, 3, 16, cfg.vocab_size, 3)
    kw = {}
    if packed:
        kw["packing_ids"] = np.where(mask > 0, 1 + (np.arange(16)[None] >= 7), 0).astype(np.int32)
    index = mask.sum(-1) - 1 if causal else np.zeros(3, int)

    def pooled(p, only):
        out = _apply_bert(cfg, p, ids, segments, mask, pooled_only=only, **kw)
        return out["pooled_output"], out["sequence_output"]

    full_pooled, full_seq = pooled(params, False)
    one_pooled, one_seq = pooled(params, True)
    assert one_seq.shape == (3, 1, cfg.hidden_size)
    np.testing.assert_allclose(one_seq[:, 0], np.asarray(full_seq)[np.arange(3), index], atol=1e-5)
    np.testing.assert_allclose(one_pooled, full_pooled, atol=1e-5)
    weights = jax.random.normal(jax.random.key(4), full_pooled.shape)
    grads = [jax.grad(lambda p, o=only: jnp.sum(pooled(p, o)[0] * weights))(params)
             for only in (False, True)]
    flat = [flax.traverse_util.flatten_dict(g) for g in grads]
    for path, g in flat[0].items():
        np.testing.assert_allclose(flat[1][path], g, atol=1e-5, err_msg=str(path))


def test_causal_mask_hides_later_tokens(small_model):
    cfg, params = small_model
    cfg = BertConfig(**{**cfg.to_dict(), "causal": True})
    ids, segments, _, _ = random_batch(6, 1, 12, cfg.vocab_size, 3)
    changed = ids.copy()
    changed[0, 8:] = (changed[0, 8:] + 1) % cfg.vocab_size
    ones = np.ones_like(ids)
    before = _apply_bert(cfg, params, ids, segments, ones)["sequence_output"]
    after = _apply_bert(cfg, params, changed, segments, ones)["sequence_output"]
    np.testing.assert_allclose(after[0, :8], before[0, :8], atol=1e-6)
    assert not np.allclose(after[0, 8:], before[0, 8:], atol=1e-3)


def stack_layers(params, num_layers):
    """Unrolled `layer_i` parameters → the scanned layout (leading `layers` axis)."""
    params = flax.core.unfreeze(params)
    encoder = params["bert"]["encoder"] if "bert" in params else params["encoder"]
    layers = [encoder.pop(f"layer_{i}") for i in range(num_layers)]
    encoder["layers"] = {"layer": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}
    return params


@pytest.mark.slow
@pytest.mark.parametrize("remat_policy", ["none", "full", "dots"])
@pytest.mark.extended
def test_scan_and_remat_give_the_same_outputs_and_gradients(remat_policy):
    cfg = small_config(hidden_dropout_prob=0.0, attention_dropout_prob=0.0)
    ids, segments, mask, positions = random_batch(7, 2, 12, cfg.vocab_size, 3)
    model = BertForPreTraining(cfg)
    params = perturbed_params(model, jax.random.key(3), ids, segments, mask, positions)
    batch = dict(masked_lm_ids=ids[:, :3], masked_lm_weights=np.ones((2, 3), np.float32),
                 next_sentence_labels=np.array([0, 1]))

    def loss_and_grads(m, p):
        def loss_fn(p):
            out = m.apply({"params": p}, ids, segments, mask, positions, deterministic=False,
                          rngs={"dropout": jax.random.key(0)})
            return pretraining_loss(out, batch)[0]
        return jax.value_and_grad(loss_fn)(p)

    loss, grads = loss_and_grads(model, params)
    scanned_cfg = BertConfig(**{**cfg.to_dict(), "scan_layers": True, "remat_policy": remat_policy})
    scan_loss, scan_grads = loss_and_grads(BertForPreTraining(scanned_cfg),
                                           stack_layers(params, cfg.num_layers))
    np.testing.assert_allclose(scan_loss, loss, rtol=1e-6)
    expected = stack_layers(grads, cfg.num_layers)
    for (path, g), (_, e) in zip(flax.traverse_util.flatten_dict(scan_grads).items(),
                                 flax.traverse_util.flatten_dict(expected).items()):
        np.testing.assert_allclose(g, e, atol=1e-6, err_msg=str(path))


def test_all_hidden_states_are_returned_in_layer_order(small_model):
    cfg, params = small_model
    ids, segments, mask, _ = random_batch(8, 2, 10, cfg.vocab_size, 3)
    out = _apply_bert(cfg, params, ids, segments, mask, return_all_layers=True)
    assert out["hidden_states"].shape == (cfg.num_layers + 1, 2, 10, cfg.hidden_size)
    np.testing.assert_array_equal(out["hidden_states"][-1], out["sequence_output"])
    scanned = BertConfig(**{**cfg.to_dict(), "scan_layers": True})
    scan_out = _apply_bert(scanned, stack_layers({"bert": params}, cfg.num_layers)["bert"],
                           ids, segments, mask, return_all_layers=True)
    np.testing.assert_allclose(scan_out["hidden_states"], out["hidden_states"], atol=1e-5)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_every_parameter_has_logical_axis_names(scan_layers):
    cfg = small_config(scan_layers=scan_layers)
    ids = jnp.zeros((1, 4), jnp.int32)
    boxed = jax.eval_shape(BertForPreTraining(cfg).init, jax.random.key(0), ids, ids, ids,
                           ids[:, :1])
    flat = flax.traverse_util.flatten_dict(boxed["params"])
    assert len(flat) > 20
    for path, leaf in flat.items():
        assert isinstance(leaf, nn.LogicallyPartitioned), path
        assert len(leaf.names) == len(leaf.value.shape), path
        assert any(name is not None for name in leaf.names), path
        stacked = scan_layers and path[:2] == ("bert", "encoder")
        assert (leaf.names[0] == "layers") == stacked, path


def test_initialisation_is_truncated_normal_with_untruncated_stddev():
    # TF's truncated_normal_initializer(0.02): samples within ±2σ of a N(0, 0.02²), whose
    # standard deviation after truncation is 0.02 × 0.8796.
    cfg = BertConfig.from_preset("tiny")
    ids = jnp.zeros((1, 4), jnp.int32)
    params = nn.unbox(BertModel(cfg).init(jax.random.key(0), ids)["params"])
    table = np.asarray(params["embeddings"]["word_embeddings"]["embedding"])
    assert np.abs(table).max() <= 2 * 0.02 + 1e-7
    np.testing.assert_allclose(table.std(), 0.02 * 0.879626, rtol=5e-3)
    np.testing.assert_allclose(table.mean(), 0.0, atol=1e-4)


def test_pretraining_loss_matches_numpy():
    r = np.random.default_rng(0)
    mlm_logits = r.normal(size=(3, 4, 11)).astype(np.float32)
    nsp_logits = r.normal(size=(3, 2)).astype(np.float32)
    ids = r.integers(0, 11, (3, 4))
    weights = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], np.float32)
    labels = np.array([[0], [1], [1]])
    loss, metrics = pretraining_loss(
        {"mlm_logits": mlm_logits, "nsp_logits": nsp_logits},
        dict(masked_lm_ids=ids, masked_lm_weights=weights, next_sentence_labels=labels),
    )

    def log_softmax(x):
        x = x.astype(np.float64)
        shifted = x - x.max(-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

    nll = -np.take_along_axis(log_softmax(mlm_logits), ids[..., None], -1)[..., 0]
    mlm = (nll * weights).sum() / (weights.sum() + 1e-5)
    nsp = -np.take_along_axis(log_softmax(nsp_logits), labels, -1).mean()
    acc = ((mlm_logits.argmax(-1) == ids) * weights).sum() / weights.sum()
    np.testing.assert_allclose(metrics["mlm_loss"], mlm, rtol=1e-5)
    np.testing.assert_allclose(metrics["nsp_loss"], nsp, rtol=1e-5)
    np.testing.assert_allclose(metrics["mlm_accuracy"], acc, rtol=1e-6)
    np.testing.assert_allclose(loss, mlm + nsp, rtol=1e-5)


def _softmax_dropout_attention(query, key, value, mask, keep=None, keep_prob=1.0):
    """The textbook order, as the paper's code has it: softmax, dropout on the normalised
    probabilities (scaled by 1 / keep probability), then probabilities · values."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(query.shape[-1])
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    probs = jax.nn.softmax(logits, axis=-1)
    if keep is not None:
        probs = jnp.where(keep, probs / keep_prob, 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, value)


def _attention_inputs(seed=0, batch=2, seq=8, heads=3, head_dim=4):
    q, k, v = (jax.random.normal(r, (batch, seq, heads, head_dim)) * 2.0
               for r in jax.random.split(jax.random.key(seed), 3))
    input_mask = (np.arange(seq)[None] < np.array([seq, seq - 3])[:, None]).astype(np.int32)
    return q, k, v, attn_lib.attention_mask(jnp.asarray(input_mask))


def _value_and_grads(fn, q, k, v):
    """(fn(q, k, v) [batch, seq, heads, head_dim], its vector-Jacobian product with a fixed
    random cotangent for q, k and v)."""
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(jax.random.normal(jax.random.key(9), out.shape))


def test_einsum_attention_without_dropout_equals_softmax_attention():
    """Division after probabilities · values: same values and gradients as softmax first."""
    q, k, v, mask = _attention_inputs()
    got = _value_and_grads(lambda *a: attn_lib.einsum_attention(*a, mask), q, k, v)
    want = _value_and_grads(lambda *a: _softmax_dropout_attention(*a, mask), q, k, v)
    np.testing.assert_allclose(got[0], want[0], atol=1e-6 * np.abs(want[0]).max())
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, atol=2e-6 * np.abs(w).max())


def test_einsum_attention_with_dropout_equals_dropout_on_probabilities():
    """The keep mask on the unnormalised weights, 1 / keep folded into the division: equal to
    dropout on the normalised probabilities with the same mask (values and gradients)."""
    q, k, v, mask = _attention_inputs(seed=1)
    shape = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    keep = jax.random.bernoulli(jax.random.key(5), 0.7, shape)
    got = _value_and_grads(
        lambda *a: attn_lib.einsum_attention(*a, mask, lambda s: (keep, 0.7)), q, k, v)
    want = _value_and_grads(
        lambda *a: _softmax_dropout_attention(*a, mask, keep, 0.7), q, k, v)
    np.testing.assert_allclose(got[0], want[0], atol=1e-6 * np.abs(want[0]).max())
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, atol=2e-6 * np.abs(w).max())
    # The mask took effect: without dropout the output is another.
    assert not np.allclose(got[0], attn_lib.einsum_attention(q, k, v, mask), atol=1e-3)


@pytest.mark.parametrize("with_dropout", [False, True])
def test_heads_first_attention_equals_softmax_attention(with_dropout):
    """The [batch, heads, seq, head_dim] arrangement (CPU inference): the textbook values and
    gradients, with and without a keep mask."""
    q, k, v, mask = _attention_inputs(seed=3)
    keep = jax.random.bernoulli(jax.random.key(6), 0.8, (q.shape[0], q.shape[2], 8, 8))
    dropout = (lambda s: (keep, 0.8)) if with_dropout else None
    got = _value_and_grads(
        lambda *a: attn_lib.einsum_attention(*a, mask, dropout, heads_first=True), q, k, v)
    want = _value_and_grads(lambda *a: _softmax_dropout_attention(
        *a, mask, *((keep, 0.8) if with_dropout else ())), q, k, v)
    np.testing.assert_allclose(got[0], want[0], atol=1e-6 * np.abs(want[0]).max())
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, atol=2e-6 * np.abs(w).max())


def test_fused_attention_is_heads_first_on_cpu_and_dot_product_attention_elsewhere():
    """`auto` picks its attention when lowering: the heads-first einsum for CPU (the same bits
    under jit), jax.nn.dot_product_attention for TPU (a --dry_run --topology compile)."""
    q, k, v, mask = _attention_inputs(seed=4)
    fused = jax.jit(attn_lib.fused_attention)
    np.testing.assert_array_equal(
        fused(q, k, v, mask),
        jax.jit(functools.partial(attn_lib.einsum_attention, heads_first=True))(q, k, v, mask))
    heads_first = "stablehlo.transpose %arg0, dims = [0, 2, 1, 3]"
    for platform, expected in (("cpu", True), ("tpu", False)):
        text = fused.trace(q, k, v, mask).lower(lowering_platforms=(platform,)).as_text()
        assert (heads_first in text) == expected, platform


def test_einsum_attention_bfloat16_is_close_to_float32():
    q, k, v, mask = _attention_inputs(seed=2)
    ref = attn_lib.einsum_attention(q, k, v, mask)
    low = attn_lib.einsum_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), mask)
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(low.astype(jnp.float32), ref, atol=0.05 * np.abs(ref).max())


def dot_flops(jaxpr) -> int:
    """2 · output elements · contracted size, summed over a jaxpr's dot_generals (nested
    jaxprs included; of a cond's branches, such as the per-platform attention, the
    largest)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            total += max(dot_flops(branch.jaxpr) for branch in eqn.params["branches"])
            continue
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(
                np.prod([lhs[d] for d in contract]))
        for sub in jax.core.jaxprs_in_params(eqn.params):
            total += dot_flops(sub)
    return total


def test_pooled_only_flop_count_matches_the_traced_forward():
    """bert_flops.forward_flops(pooled_only=True) counts the matmuls the final layer
    still runs: equal to the traced forward's dot_generals, less the pooler's."""
    from bertjax.models.bert import flops as bert_flops

    cfg = small_config(hidden_size=64, intermediate_size=256, num_heads=4)
    batch, seq = 2, 32
    ids = np.ones((batch, seq), np.int32)
    params = BertModel(cfg).init(jax.random.key(0), ids)["params"]
    pooler = 2 * batch * cfg.hidden_size ** 2
    for only in (False, True):
        jaxpr = jax.make_jaxpr(lambda p, o=only: BertModel(cfg).apply(
            {"params": p}, ids, pooled_only=o)["pooled_output"])(params).jaxpr
        expected = batch * bert_flops.forward_flops(cfg, seq, 0, pooled_only=only)
        assert dot_flops(jaxpr) - pooler == expected, only


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dots_remat_saves_every_dense_output_and_recomputes_only_attention(dtype):
    """remat "dots": the gradient runs each projection / FFN matmul once (its output is
    saved), recomputing only the attention score and probs·values products; "full" runs
    them all again. In bf16 the dense layer is a custom VJP, which the plain dot-saving
    policy cannot see (phase 2's `dots` once compiled exactly like `full`)."""
    cfg = small_config(dtype=dtype, attention_impl="einsum", hidden_dropout_prob=0.0,
                       attention_dropout_prob=0.0)
    ids, segments, mask, _ = random_batch(4, 2, 8, cfg.vocab_size, 2)

    def matmuls(policy):
        model = BertModel(BertConfig(**{**cfg.to_dict(), "remat_policy": policy}))
        params = model.init(jax.random.key(0), ids, segments, mask)

        def loss(p):
            out = model.apply(p, ids, segments, mask)
            return jnp.sum(out["sequence_output"].astype(jnp.float32) ** 2)
        return str(jax.make_jaxpr(jax.grad(loss))(params)).count("dot_general")

    none, full, dots = matmuls("none"), matmuls("full"), matmuls("dots")
    # Per layer: 6 dense matmuls (q, k, v, output, intermediate, FFN output) and 2 attention
    # products; their recomputation is what each policy adds to the no-remat gradient.
    assert full - none == cfg.num_layers * 8
    assert dots - none == cfg.num_layers * 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_softmax_cross_entropy_and_its_gradient_against_float64(dtype):
    """The fused MLM loss: −log softmax[label] and its gradient softmax − one-hot (times the
    incoming gradient), against NumPy in float64 on the same (rounded) logits."""
    from bertjax.models.bert.pretraining import softmax_cross_entropy

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 4, (3, 5, 97)), dtype)
    labels = jnp.asarray(rng.integers(0, 97, (3, 5)), jnp.int32)
    weights = jnp.asarray(rng.uniform(0, 2, (3, 5)), jnp.float32)
    nll, vjp = jax.vjp(lambda x: softmax_cross_entropy(x, labels), logits)
    (grad,) = vjp(weights)

    x = np.asarray(logits, np.float64)
    log_probs = x - x.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, np.asarray(labels)[..., None], -1)[..., 0]
    one_hot = np.eye(97)[np.asarray(labels)]
    expected_grad = (np.exp(log_probs) - one_hot) * np.asarray(weights)[..., None]
    assert nll.dtype == jnp.float32 and grad.dtype == dtype
    np.testing.assert_allclose(nll, expected, rtol=1e-6, atol=1e-6)
    tolerance = 1e-6 if dtype == jnp.float32 else 2 ** -8
    np.testing.assert_allclose(np.asarray(grad, np.float64), expected_grad, atol=tolerance)


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 2e-6), (jnp.bfloat16, 0.0)])
def test_gelu_and_its_gradient_equal_float64_erf_rounded_once(dtype, atol):
    """layers.gelu (the FFN's exact GELU, a custom VJP that keeps only its input for the
    backward pass) against x·Φ(x) and Φ(x) + x·φ(x) in float64: within float32 rounding, and
    in bfloat16 the float64 value rounded once."""
    from bertjax.models.layers import gelu

    x64 = np.concatenate([np.linspace(-9, 9, 4001), [0.0, -1e-3, 1e-3, -30.0, 30.0]])
    x = jnp.asarray(x64, dtype)
    exact = np.asarray(x, np.float64)  # the inputs as the dtype holds them
    value = np_gelu(exact)
    slope = 0.5 * (1 + erf(exact / np.sqrt(2))) + exact * np.exp(-exact ** 2 / 2) / np.sqrt(
        2 * np.pi)
    got = np.asarray(gelu(x), np.float64)
    grad = np.asarray(jax.grad(lambda v: jnp.sum(gelu(v).astype(jnp.float32)))(x), np.float64)
    if dtype == jnp.bfloat16:
        # 1 + erf in float32 cancels below x ≈ -4 (Φ < 3e-5): there the error is absolute,
        # ~1e-7 · |x|, as jax.nn.gelu's; elsewhere the float32 value rounds to the bfloat16 nearest
        # the float64 one, or near a tie to its neighbour.
        body = exact > -4
        for ours, want in ((got, value), (grad, slope)):
            rounded = np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64)
            assert np.mean(ours[body] == rounded[body]) > 0.99
            assert np.all(np.abs(ours - want) <= np.abs(want) * 2.0 ** -8
                          + 1e-7 * (1 + np.abs(exact)))
    else:
        np.testing.assert_allclose(got, value, atol=atol, rtol=2e-6)
        np.testing.assert_allclose(grad, slope, atol=atol, rtol=2e-6)

"""bertjax's ModernBERT (bertjax.models.modernbert) against transformers' ModernBertModel /
ModernBertForMaskedLM, the independent reference: a small random model built and saved by
transformers, converted, and run on both sides (float32, eval mode, eager attention) at lengths
below, at and above the local window, with padded rows; the masks against their definition
and against transformers' own; packed rows against each document alone; the presets'
parameter counts against transformers'; the config's checks and its config.json mapping."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.convert import modernbert as convert
from bertjax.errors import ConfigError
from bertjax.models import modernbert as modern
from bertjax.models.modernbert import ModernBertForMaskedLM, ModernBertModel, ModernConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V, H, L, A, FFN = 100, 64, 4, 4, 96
WINDOW = 8  # local layers see ±4 tokens: windows bind at the short lengths tested
TOL = 1e-5


def hf_config(**overrides):
    return transformers.ModernBertConfig(
        vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=A,
        intermediate_size=FFN, local_attention=WINDOW, global_attn_every_n_layers=3,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2, attn_implementation="eager", **overrides)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    model = transformers.ModernBertForMaskedLM(hf_config()).eval()
    with torch.no_grad():  # norms away from 1, embeddings and kernels away from their init
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module")
def converted(hf_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("modernbert") / "mlm"
    hf_model.save_pretrained(directory)
    return convert.read_hf(directory)


def padded_batch(length: int, seed: int = 0):
    """ids [3, length]; mask: a full row, a half-padded row, a row of one real token."""
    rng = np.random.default_rng(seed + length)
    ids = rng.integers(3, V, (3, length))
    mask = np.ones((3, length), np.int64)
    mask[1, (length + 1) // 2:] = 0
    mask[2, 1:] = 0
    return ids, mask


def hf_outputs(model, ids, mask):
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
        logits = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    return hidden.last_hidden_state.numpy(), logits.numpy()


def bertjax_outputs(config, params, ids, mask, **kw):
    hidden = ModernBertModel(config).apply({"params": params["model"]}, jnp.asarray(ids),
                                           None if mask is None else jnp.asarray(mask), **kw)
    logits = ModernBertForMaskedLM(config).apply(
        {"params": params}, jnp.asarray(ids), None if mask is None else jnp.asarray(mask), **kw)
    return np.asarray(hidden), np.asarray(logits)


@pytest.mark.parametrize("length", [5, 8, 9, 33])  # < window, = window, = its span 2·4+1, >>
def test_matches_transformers(hf_model, converted, length):
    config, params = converted
    ids, mask = padded_batch(length)
    want_hidden, want_logits = hf_outputs(hf_model, ids, mask)
    hidden, logits = bertjax_outputs(config, params, ids, mask)
    real = mask.astype(bool)  # padded positions are never read
    hidden_diff = np.abs(hidden - want_hidden)[real].max()
    logits_diff = np.abs(logits - want_logits)[real].max()
    print(f"length {length}: max |Δ| hidden {hidden_diff:.2e}, logits {logits_diff:.2e}")
    assert hidden_diff < TOL and logits_diff < TOL
    assert np.abs(want_logits[real]).max() > 1.0  # not a comparison of near-zeros


def test_matches_transformers_without_mask(hf_model, converted):
    config, params = converted
    ids, _ = padded_batch(20, seed=1)
    with torch.no_grad():
        want = hf_model(input_ids=torch.tensor(ids)).logits.numpy()
    _, logits = bertjax_outputs(config, params, ids, None)
    assert np.abs(logits - want).max() < TOL


def test_masked_positions_are_those_rows_of_the_logits(converted):
    config, params = converted
    ids, mask = padded_batch(12)
    positions = jnp.asarray([[0, 5, 11], [1, 2, 3], [0, 0, 0]])
    model = ModernBertForMaskedLM(config)
    full = model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask))
    picked = model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask), positions)
    np.testing.assert_allclose(picked, np.take_along_axis(full, positions[..., None], 1),
                               atol=1e-6)


@pytest.mark.parametrize("change", [dict(local_attention=WINDOW + 2),
                                    dict(global_attn_every_n_layers=2),
                                    dict(global_rope_theta=10_000.0)])
def test_parity_is_sensitive_to_window_layers_and_theta(hf_model, converted, change):
    """What the parity test above would catch: the window one token wider on each side, the
    global layers elsewhere, or one theta for both kinds of layer each move the outputs."""
    config, params = converted
    ids, mask = padded_batch(33)
    want, _ = hf_outputs(hf_model, ids, mask)
    hidden, _ = bertjax_outputs(dataclasses.replace(config, **change), params, ids, mask)
    assert np.abs(hidden - want)[mask.astype(bool)].max() > 1e-3


# ---------------------------------------------------------------------------------------------
# Masks


def reference_mask(input_mask, packing_ids, local: bool, radius: int) -> np.ndarray:
    """[batch, 1, q, k] from the definition, one pair at a time."""
    batch, seq = input_mask.shape
    out = np.zeros((batch, 1, seq, seq), bool)
    for b in range(batch):
        for q in range(seq):
            for k in range(seq):
                out[b, 0, q, k] = (input_mask[b, k] == 1
                                   and packing_ids[b, q] == packing_ids[b, k]
                                   and (not local or abs(q - k) <= radius))
    return out


@pytest.mark.parametrize("radius", [0, 1, 4])
def test_masks_equal_their_definition(radius):
    rng = np.random.default_rng(radius)
    seq = 14
    packing = np.sort(rng.integers(1, 4, (3, seq)), axis=1)
    input_mask = np.ones((3, seq), np.int64)
    input_mask[0, 10:] = 0
    input_mask[2, 5:] = 0
    packing[input_mask == 0] = 0
    masks = modern.attention_masks(jnp.asarray(input_mask), jnp.asarray(packing), seq, radius)
    for kind, local in ((modern.GLOBAL, False), (modern.LOCAL, True)):
        got = np.broadcast_to(np.asarray(masks[kind]), (3, 1, seq, seq))
        np.testing.assert_array_equal(got, reference_mask(input_mask, packing, local, radius))


def test_masks_equal_transformers():
    """transformers' sdpa masks for padded rows (what its eager path adds as 0 / -inf)."""
    from transformers.masking_utils import (
        create_bidirectional_mask,
        create_bidirectional_sliding_window_mask,
    )

    cfg = hf_config()
    cfg._attn_implementation = "sdpa"
    seq = 17
    _, input_mask = padded_batch(seq)
    kw = dict(config=cfg, inputs_embeds=torch.zeros(3, seq, H),
              attention_mask=torch.tensor(input_mask), allow_is_bidirectional_skip=False)
    theirs = {modern.GLOBAL: create_bidirectional_mask(**kw).numpy(),
              modern.LOCAL: create_bidirectional_sliding_window_mask(**kw).numpy()}
    ours = modern.attention_masks(jnp.asarray(input_mask), None, seq, WINDOW // 2)
    for kind in theirs:
        np.testing.assert_array_equal(np.broadcast_to(np.asarray(ours[kind]), (3, 1, seq, seq)),
                                      theirs[kind])


# ---------------------------------------------------------------------------------------------
# Packing


def test_packed_documents_equal_each_alone(converted):
    """Two documents in one row (then padding) give each document's hidden states and logits
    as that document alone: attention stays in the document, positions restart."""
    config, params = converted
    rng = np.random.default_rng(7)
    first, second = rng.integers(3, V, 13), rng.integers(3, V, 6)  # 13 > the window's span
    row = np.concatenate([first, second, [0, 0]])[None]
    packing = np.array([[1] * 13 + [2] * 6 + [0] * 2])
    mask = (packing > 0).astype(np.int64)
    packed = bertjax_outputs(config, params, row, mask, packing_ids=jnp.asarray(packing))
    for doc, span in ((first, slice(0, 13)), (second, slice(13, 19))):
        alone = bertjax_outputs(config, params, doc[None], np.ones((1, len(doc)), np.int64))
        for got, want in zip(packed, alone):
            np.testing.assert_allclose(got[:, span], want, atol=TOL, rtol=0)


# ---------------------------------------------------------------------------------------------
# The fused ("xla") attention path against the einsum reference


def packed_batch():
    """Two rows: three documents then padding; two documents, the first longer than the
    window's span, then padding; with their packing ids and mask."""
    rng = np.random.default_rng(11)
    packing = np.array([[1] * 5 + [2] * 12 + [3] * 3 + [0] * 4,
                        [1] * 14 + [2] * 7 + [0] * 3])
    return rng.integers(3, V, packing.shape), (packing > 0).astype(np.int64), packing


def xla_batches():
    """(name, ids, mask, packing ids) at lengths below / at / above the window, right-padded
    rows, a row padded elsewhere (the key-mask branch), and packed rows."""
    for length in (5, 8, 9, 33):
        ids, mask = padded_batch(length)
        yield f"padded {length}", ids, mask, None
    ids, mask = padded_batch(21, seed=3)
    mask[0, :6] = 0  # left padding and a hole: not right-padded
    mask[1, 2] = 0
    yield "padded elsewhere 21", ids, mask, None
    yield "unpadded 12", padded_batch(12, seed=4)[0], None, None
    yield "packed 24", *packed_batch()


def test_xla_path_equals_einsum(converted):
    """Hidden states and MLM logits of attention_impl "xla" equal the einsum path's at every
    position (padded queries included: both average the values where no key is left)."""
    config, params = converted
    einsum = dataclasses.replace(config, attention_impl="einsum")
    xla = dataclasses.replace(config, attention_impl="xla")
    for name, ids, mask, packing in xla_batches():
        kw = {} if packing is None else dict(packing_ids=jnp.asarray(packing))
        want = bertjax_outputs(einsum, params, ids, mask, **kw)
        got = bertjax_outputs(xla, params, ids, mask, **kw)
        hidden_diff, logits_diff = (float(np.abs(g - w).max()) for g, w in zip(got, want))
        print(f"{name}: max |Δ| hidden {hidden_diff:.2e}, logits {logits_diff:.2e}")
        assert np.all(np.isfinite(got[0])) and np.all(np.isfinite(got[1]))
        assert hidden_diff < TOL and logits_diff < TOL


def test_xla_path_gradients_equal_einsum(converted):
    """Gradients w.r.t. every parameter of a masked-LM loss on the real positions, padded and
    packed rows: equal on both paths, and finite (the padded queries leak no NaN)."""
    config, params = converted
    for name, ids, mask, packing in (("padded 33", *padded_batch(33), None),
                                     ("packed 24", *packed_batch())):
        targets = jnp.asarray(np.random.default_rng(5).integers(3, V, ids.shape))
        kw = {} if packing is None else dict(packing_ids=jnp.asarray(packing))

        def loss(p, impl, ids=ids, mask=mask, targets=targets, kw=kw):
            model = ModernBertForMaskedLM(dataclasses.replace(config, attention_impl=impl))
            logits = model.apply({"params": p}, jnp.asarray(ids), jnp.asarray(mask), **kw)
            nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)
            return jnp.sum(nll[..., 0] * mask) / mask.sum()

        want = jax.grad(loss)(params, "einsum")
        got = jax.grad(loss)(params, "xla")
        diffs = [float(np.abs(g - w).max()) for g, w in zip(jax.tree_util.tree_leaves(got),
                                                             jax.tree_util.tree_leaves(want))]
        scale = max(float(np.abs(w).max()) for w in jax.tree_util.tree_leaves(want))
        print(f"{name}: max |Δ grad| {max(diffs):.2e} (largest gradient {scale:.2e})")
        assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(got))
        assert max(diffs) < TOL and scale > 1e-3


def test_attention_impl_auto_and_dropout(converted):
    """"auto" on this CPU is the einsum path; "xla" refuses attention dropout in training,
    "auto" applies it (on the einsum path)."""
    config, params = converted
    ids, mask = padded_batch(9)
    auto = bertjax_outputs(config, params, ids, mask)
    einsum = bertjax_outputs(dataclasses.replace(config, attention_impl="einsum"), params,
                             ids, mask)
    np.testing.assert_array_equal(auto[1], einsum[1])
    rngs = {"dropout": jax.random.PRNGKey(0)}
    for impl in ("auto", "xla"):
        model = ModernBertForMaskedLM(dataclasses.replace(
            config, attention_impl=impl, attention_dropout=0.1))
        run = functools.partial(model.apply, {"params": params}, jnp.asarray(ids),
                                jnp.asarray(mask), deterministic=False, rngs=rngs)
        if impl == "auto":
            assert np.all(np.isfinite(run()))
        else:
            with pytest.raises(ConfigError, match="cannot apply attention dropout"):
                run()


# ---------------------------------------------------------------------------------------------
# Parameters and training


@pytest.mark.parametrize("preset", ["modern_base", "modern_large"])
def test_parameter_counts_equal_transformers(preset):
    config = ModernConfig.from_preset(preset)
    hf = transformers.ModernBertConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        intermediate_size=config.intermediate_size)
    with torch.device("meta"):  # shapes only: nothing allocated or initialised
        counts = {masked_lm: sum(p.numel() for p in cls(hf).parameters())
                  for masked_lm, cls in ((True, transformers.ModernBertForMaskedLM),
                                         (False, transformers.ModernBertModel))}
    shapes = jax.eval_shape(lambda: nn.unbox(ModernBertForMaskedLM(config).init(
        jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32))["params"]))
    ours = sum(x.size for x in jax.tree_util.tree_leaves(shapes))
    print(f"{preset}: MLM {counts[True]:,}, encoder {counts[False]:,}")
    assert modern.num_params(config) == counts[True] == ours
    assert modern.num_params(config, masked_lm=False) == counts[False]
    assert ours - sum(x.size for x in jax.tree_util.tree_leaves(shapes["model"])) == (
        counts[True] - counts[False])


def test_init_axes_and_training_step():
    """Every parameter carries logical axes and gets a gradient; dropout acts in training."""
    config = ModernConfig(vocab_size=V, hidden_size=32, num_layers=3, num_heads=2,
                          intermediate_size=48, local_attention=4, pad_token_id=0,
                          embedding_dropout=0.1, attention_dropout=0.1, mlp_dropout=0.1)
    model = ModernBertForMaskedLM(config)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, V, (2, 10)))
    mask = jnp.ones((2, 10), jnp.int32).at[1, 6:].set(0)
    boxed = model.init(jax.random.PRNGKey(0), ids, mask)["params"]
    axes = jax.tree_util.tree_leaves(nn.get_partition_spec(boxed),
                                     is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert len(axes) == len(jax.tree_util.tree_leaves(boxed))
    assert all(any(name is not None for name in spec) for spec in axes)
    params = nn.unbox(boxed)
    assert params["model"]["layers_0"].keys() == {"attn", "mlp", "mlp_norm"}

    def loss(p, rng):
        logits = model.apply({"params": p}, ids, mask, deterministic=False,
                             rngs={"dropout": rng})
        return jnp.mean(jax.nn.log_softmax(logits)[..., 5])

    eval_logits = model.apply({"params": params}, ids, mask)
    train_logits = model.apply({"params": params}, ids, mask, deterministic=False,
                               rngs={"dropout": jax.random.PRNGKey(1)})
    assert np.all(np.isfinite(train_logits)) and not np.allclose(train_logits, eval_logits)
    grads = jax.grad(loss)(params, jax.random.PRNGKey(2))
    assert all(np.all(np.isfinite(g)) and np.any(g != 0)
               for g in jax.tree_util.tree_leaves(grads))


# ---------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize("field, value, words", [
    ("num_layers", 0, "model.num_layers=0"),
    ("num_heads", 5, "model.hidden_size=768 is not divisible by model.num_heads=5"),
    ("num_heads", 256, "odd head_dim 3"),
    ("local_attention", 1.5, "model.local_attention=1.5"),
    ("mlp_dropout", 1.0, "model.mlp_dropout=1.0"),
    ("global_rope_theta", 0, "model.global_rope_theta=0"),
    ("hidden_act", "swiglu", "model.hidden_act='swiglu'"),
    ("pad_token_id", 50368, "model.pad_token_id=50368"),
    ("dtype", "int8", "model.dtype='int8'"),
    ("attention_impl", "flash", "model.attention_impl='flash' is not one of"),
])
def test_config_rejects_a_bad_field_in_one_line(field, value, words):
    with pytest.raises(ConfigError) as caught:
        ModernConfig(**{field: value})
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_config_dict_round_trip_and_presets():
    config = ModernConfig.from_preset("modern_large", dtype="bfloat16")
    assert ModernConfig.from_dict(config.to_dict()) == config
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (28, 1024, 2624)
    assert ModernConfig.from_preset("modern_base") == ModernConfig()
    with pytest.raises(ConfigError, match="unknown model config field"):
        ModernConfig.from_dict({"hidden": 3})
    with pytest.raises(ConfigError, match="unknown model preset"):
        ModernConfig.from_preset("modern_huge")


def test_config_json_both_ways_through_transformers():
    config = ModernConfig(vocab_size=V, hidden_size=H, num_layers=7, num_heads=A,
                          intermediate_size=FFN, global_attn_every_n_layers=4,
                          global_rope_theta=80_000.0, local_rope_theta=5_000.0,
                          local_attention=16, hidden_act="gelu_tanh", pad_token_id=0,
                          bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    hf = transformers.ModernBertConfig(**config.to_hf())
    assert hf.layer_types == ["full_attention", "sliding_attention", "sliding_attention",
                              "sliding_attention", "full_attention", "sliding_attention",
                              "sliding_attention"]
    assert hf.rope_parameters["full_attention"]["rope_theta"] == 80_000.0
    assert hf.rope_parameters["sliding_attention"]["rope_theta"] == 5_000.0
    assert hf.sliding_window == 8 and hf.hidden_activation == "gelu_pytorch_tanh"
    assert ModernConfig.from_hf(hf.to_dict()) == config


def test_config_from_the_first_config_json_format():
    """answerdotai/ModernBERT-base's config.json as published (before `layer_types` and
    `rope_parameters`)."""
    published = {
        "architectures": ["ModernBertForMaskedLM"], "model_type": "modernbert",
        "vocab_size": 50368, "hidden_size": 768, "num_hidden_layers": 22,
        "num_attention_heads": 12, "intermediate_size": 1152, "hidden_activation": "gelu",
        "max_position_embeddings": 8192, "norm_eps": 1e-05, "norm_bias": False,
        "global_rope_theta": 160000.0, "local_rope_theta": 10000.0, "local_attention": 128,
        "global_attn_every_n_layers": 3, "attention_bias": False, "mlp_bias": False,
        "decoder_bias": True, "classifier_activation": "gelu", "classifier_bias": False,
        "pad_token_id": 50283, "bos_token_id": 50281, "eos_token_id": 50282,
        "cls_token_id": 50281, "sep_token_id": 50282, "embedding_dropout": 0.0,
        "attention_dropout": 0.0, "mlp_dropout": 0.0, "initializer_range": 0.02,
        "initializer_cutoff_factor": 2.0, "position_embedding_type": "absolute",
    }
    assert ModernConfig.from_hf(published) == ModernConfig.from_preset("modern_base")


@pytest.mark.parametrize("change, words", [
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(norm_bias=True), "norm_bias=True"),
    (dict(tie_word_embeddings=False), "tie_word_embeddings"),
    (dict(layer_types=["full_attention", "sliding_attention", "full_attention",
                       "full_attention"]), "not global attention every n-th layer"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1.0}}),
     "rope_parameters.full_attention.rope_type='yarn'"),
    (dict(hidden_activation="swish_glu"), "hidden_activation='swish_glu'"),
    (dict(model_type="bert"), "model_type='bert'"),
])
def test_config_from_hf_rejects_what_it_does_not_compute(change, words):
    values = {**ModernConfig(vocab_size=V, hidden_size=H, num_layers=L, num_heads=A,
                             intermediate_size=FFN, pad_token_id=0).to_hf(), **change}
    with pytest.raises(ConfigError) as caught:
        ModernConfig.from_hf(values)
    assert words in str(caught.value) and "\n" not in str(caught.value)

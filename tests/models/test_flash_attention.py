"""attention_impl "flash" (this project's Pallas TPU kernel,
bertjax/models/kernels/dropout_attention.py, and its GPU kernels, dropout_attention_gpu.py)
and "flash_jax" (JAX's Pallas flash kernels), interpreted on CPU, against the einsum path; the
kernels' cost estimates against counts read off the kernels themselves."""

import dataclasses
import functools
import importlib.util
import math

import flax.linen as nn
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_python

from bertjax.models import BertConfig, BertModel
from bertjax.models.bert.config import ConfigError
from bertjax.models.kernels import attention as attn_lib
from bertjax.models.kernels import dropout_attention as dropout
from bertjax.models.kernels import dropout_hash
from bertjax.models.kernels import flash_attention as flash


def _inputs(rng, batch, seq, heads, head_dim):
    keys = jax.random.split(jax.random.key(rng), 4)
    return [jax.random.normal(k, (batch, seq, heads, head_dim), jnp.float32) for k in keys]


def _loss_and_grads(attend, q, k, v, weights, real):
    """Σ attend(q, k, v) · weights over real query rows, and its gradient in q, k, v."""
    def loss(q, k, v):
        return jnp.sum(attend(q, k, v) * weights * real[:, :, None, None])
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)


CASES = {  # name: (padding, packing, causal, head_dim)
    "padding": (True, False, False, 64),
    "packing": (True, True, False, 64),
    "causal": (True, False, True, 64),
    "all, head_dim 32": (True, True, True, 32),
}


def _packed(x):
    """[batch, seq, heads, head_dim] → [batch, seq, heads·head_dim]: `flash`'s layout."""
    return x.reshape(*x.shape[:2], -1)


def _heads(x, heads):
    return x.reshape(*x.shape[:2], heads, -1)


def _fused(q, k, v):
    """[batch, seq, heads, head_dim] each → `dropout_attention`'s [batch, seq, 3·heads·head_dim]."""
    return dropout.fuse_qkv(*(_packed(x) for x in (q, k, v)), q.shape[2])


def _no_bias(q):
    """A zero q/k/v bias for [batch, seq, heads, head_dim] inputs: [3·heads·head_dim]."""
    return jnp.zeros((3 * q.shape[2] * q.shape[3],), q.dtype)


IMPLS = {  # attention_impl: the attention function (segments, causal) of bert.SelfAttention
    "flash": lambda q, k, v, segments, causal: _heads(dropout.dropout_attention(
        _fused(q, k, v), _no_bias(q), segments, jnp.zeros((1,), jnp.int32), 0.0, q.shape[2],
        causal),
        q.shape[2]),
    "flash_jax": flash.flash_attention,
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES)
def test_flash_equals_einsum_values_and_gradients(case, impl):
    padding, packing, causal, head_dim = CASES[case]
    batch, seq, heads = 2, 40, 2  # seq not a multiple of 128: padded for the kernels
    q, k, v, weights = _inputs(0, batch, seq, heads, head_dim)
    lengths = np.array([31, seq]) if padding else np.array([seq, seq])
    input_mask = jnp.asarray(np.arange(seq)[None] < lengths[:, None], jnp.int32)
    packing_ids = None
    if packing:  # two examples per row, 0 on padding as the data pipeline writes them
        packing_ids = jnp.where(input_mask > 0, 1 + (jnp.arange(seq)[None] >= 13), 0)
    mask = attn_lib.attention_mask(input_mask, packing_ids, causal=causal, seq_len=seq)
    segments = flash.segment_ids(input_mask, packing_ids, (batch, seq))
    real = input_mask.astype(jnp.float32)

    expected = _loss_and_grads(lambda q, k, v: attn_lib.einsum_attention(q, k, v, mask),
                               q, k, v, weights, real)
    attend = IMPLS[impl]
    got = _loss_and_grads(lambda q, k, v: attend(q, k, v, segments, causal),
                          q, k, v, weights, real)
    out = attend(q, k, v, segments, causal)
    reference = attn_lib.einsum_attention(q, k, v, mask)
    assert bool(jnp.all(jnp.isfinite(out)))  # padded rows too: never a fully masked row
    rows = np.asarray(input_mask, bool)
    np.testing.assert_allclose(np.asarray(out)[rows], np.asarray(reference)[rows], atol=2e-5)
    for name, a, b in zip(("loss", "dq", "dk", "dv"), jax.tree.leaves(got),
                          jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_padded_row_stays_finite(impl):
    q, k, v, _ = _inputs(1, 2, 16, 1, 32)
    input_mask = jnp.asarray([[1] * 16, [0] * 16], jnp.int32)
    segments = flash.segment_ids(input_mask, None, (2, 16))
    out, grads = jax.value_and_grad(
        lambda q: IMPLS[impl](q, k, v, segments, False).sum())(q)
    assert bool(jnp.isfinite(out)) and bool(jnp.all(jnp.isfinite(grads)))


@pytest.mark.parametrize("impl,causal", [("flash", False), ("flash", True),
                                         ("flash_jax", False)])
def test_bert_model_flash_equals_einsum(impl, causal):
    cfg = dict(vocab_size=53, hidden_size=64, num_heads=2, intermediate_size=96, num_layers=2,
               max_position_embeddings=32, hidden_dropout_prob=0.0, attention_dropout_prob=0.0,
               causal=causal)
    batch, seq = 2, 24
    r = np.random.default_rng(3)
    ids = jnp.asarray(r.integers(0, 53, (batch, seq)), jnp.int32)
    types = jnp.asarray(np.arange(seq)[None] >= np.array([[9], [14]]), jnp.int32)
    input_mask = jnp.asarray(np.arange(seq)[None] < np.array([[seq], [17]]), jnp.int32)
    packing = jnp.where(input_mask > 0, 1 + (jnp.arange(seq)[None] >= 11), 0)
    weights = jax.random.normal(jax.random.key(4), (batch, seq, 64))
    real = input_mask.astype(jnp.float32)[..., None]
    einsum_model = BertModel(BertConfig(**cfg, attention_impl="einsum"))
    params = nn.unbox(einsum_model.init(jax.random.key(0), ids, types, input_mask)["params"])

    def run(impl):
        model = BertModel(BertConfig(**cfg, attention_impl=impl))

        def loss(params):
            out = model.apply({"params": params}, ids, types, input_mask, packing_ids=packing)
            return (jnp.sum(out["sequence_output"] * weights * real)
                    + jnp.sum(out["pooled_output"])), out["sequence_output"]

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (loss_e, seq_e), grads_e = run("einsum")
    (loss_f, seq_f), grads_f = run(impl)
    rows = np.asarray(input_mask, bool)
    np.testing.assert_allclose(np.asarray(seq_f)[rows], np.asarray(seq_e)[rows], atol=2e-5)
    np.testing.assert_allclose(loss_f, loss_e, rtol=1e-5)
    for path, a in jax.tree_util.tree_leaves_with_path(grads_f):
        b = dict(jax.tree_util.tree_leaves_with_path(grads_e))[path]
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4,
                                   err_msg=jax.tree_util.keystr(path))


def test_flash_jax_with_attention_dropout_is_a_config_error():
    with pytest.raises(ConfigError, match="model.attention_dropout_prob=0.1"):
        BertConfig(attention_impl="flash_jax", attention_dropout_prob=0.1)


def test_flash_takes_heads_that_fill_128_lane_tiles():
    """`flash` puts 128 // head_dim heads side by side in a tile: every preset's heads do
    (BERT-base: 2 of 64 per tile), 3 heads of 64 do not (a config error, not a TPU compile
    failure), one head of 64 is the whole row."""
    from bertjax.models.bert.config import PRESETS
    from bertjax.models.kernels.flash_attention import heads_per_tile

    for name in PRESETS:
        cfg = BertConfig.from_preset(name, attention_impl="flash")
        assert heads_per_tile(cfg.num_heads, cfg.head_dim) * cfg.head_dim % 128 == 0, name
    with pytest.raises(ConfigError, match="head_dim 64, 3 heads"):
        BertConfig(hidden_size=192, num_heads=3, attention_impl="flash")
    BertConfig(hidden_size=64, num_heads=1, intermediate_size=256, attention_impl="flash")


def _runs_kernels(model, ids, training: bool) -> bool:
    """Whether the traced training step (forward and gradient) of `model` calls Pallas."""
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, ids, ids))

    def loss(params):
        out = model.apply(params, ids, ids, ids, deterministic=not training,
                          rngs={"dropout": jax.random.key(1)})
        return jnp.sum(out["sequence_output"])

    return "pallas_call" in str(jax.make_jaxpr(jax.grad(loss))(params))


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu (pip install -e '.[tpu]') is not installed")
def test_auto_attention_is_the_flash_kernels_where_traced_for_tpus():
    """The default ("auto") runs the flash kernels in a step traced for a TPU mesh (also a slice
    compiled on this CPU host), with attention dropout drawn inside them; on a CPU mesh, or
    without one here, the einsum path; a model whose heads do not fill the kernels' tiles
    stays on einsum everywhere. The parameters are the same either way."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from bertjax.aot import topology

    tpu = topology.devices(topology.parse("v5p-8"))
    on = {"tpu": NamedSharding(Mesh(np.array(tpu), ("data",)), PartitionSpec("data")),
          "cpu": NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)),
                               PartitionSpec("data"))}
    ids = jnp.ones((4, 128), jnp.int32)
    fits = BertConfig(vocab_size=64, hidden_size=128, num_heads=2, intermediate_size=64,
                      num_layers=1, max_position_embeddings=128, attention_dropout_prob=0.1)
    odd = dataclasses.replace(fits, hidden_size=192, num_heads=3)  # 3 heads of 64
    assert fits.attention_impl == "auto" and not odd.heads_fill_tiles
    for training in (True, False):
        with flash.sharded_like(on["tpu"]):
            assert _runs_kernels(BertModel(fits), ids, training)
            assert not _runs_kernels(BertModel(odd), ids, training)
        with flash.sharded_like(on["cpu"]):
            assert not _runs_kernels(BertModel(fits), ids, training)
        assert not _runs_kernels(BertModel(fits), ids, training)
    assert attn_lib.attention_path(fits, True, "tpu") == "flash (Pallas TPU)"
    assert attn_lib.attention_path(fits, True, "cpu") == "einsum (dropout)"
    assert attn_lib.attention_path(odd, True, "tpu") == "einsum (dropout)"
    shapes = {impl: jax.tree.map(lambda x: (x.shape, x.dtype), jax.eval_shape(
        lambda impl=impl: BertModel(dataclasses.replace(fits, attention_impl=impl)).init(
            jax.random.key(0), ids, ids, ids))) for impl in ("einsum", "flash")}
    assert shapes["einsum"] == shapes["flash"]


def test_bert_model_flash_applies_attention_dropout_in_training():
    cfg = BertConfig(vocab_size=53, hidden_size=64, num_heads=2, intermediate_size=96,
                     num_layers=1, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_dropout_prob=0.3, attention_impl="flash")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 53, (2, 16)), jnp.int32)
    model = BertModel(cfg)
    params = model.init(jax.random.key(0), ids)["params"]

    @functools.partial(jax.jit, static_argnums=1)
    def run(seed, deterministic=False):
        return model.apply({"params": params}, ids, deterministic=deterministic,
                           rngs={"dropout": jax.random.key(seed)})["sequence_output"]

    np.testing.assert_array_equal(run(1), run(1))
    assert not np.allclose(run(1), run(2))
    without = BertModel(BertConfig(**{**cfg.to_dict(), "attention_dropout_prob": 0.0}))
    np.testing.assert_allclose(run(1, True),
                               jax.jit(without.apply)({"params": params}, ids)["sequence_output"],
                               atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Cost estimates


def _pallas_calls(jaxpr):
    """Every pallas_call equation in a jaxpr, nested ones included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
        for sub in jex.jaxprs_in_params(eqn.params):
            found += _pallas_calls(sub)
    return found


def _kernel_counts(jaxpr):
    """(matmul FLOPs, exp elements) of one kernel invocation, read off its jaxpr: 2·M·N·K per
    dot_general, scan bodies times their length, a cond by its costliest branch."""
    flops = exps = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            flops += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
        elif name == "exp":
            exps += math.prod(eqn.outvars[0].aval.shape)
        elif name == "cond":
            branch = max(_kernel_counts(b.jaxpr) for b in eqn.params["branches"])
            flops, exps = flops + branch[0], exps + branch[1]
        else:
            for sub in jex.jaxprs_in_params(eqn.params):
                f, e = _kernel_counts(sub)
                times = eqn.params.get("length", 1) if name == "scan" else 1
                flops, exps = flops + times * f, exps + times * e
    return flops, exps


def _nbytes(avals):
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in avals)


@pytest.mark.parametrize("dtype,seq", [(jnp.float32, 128), (jnp.bfloat16, 256)])
def test_cost_estimates_match_the_kernels(dtype, seq):
    batch, heads, head_dim = 2, 3, 64
    q = jnp.ones((batch, heads, seq, head_dim), dtype)
    segments = jnp.zeros((batch, seq), jnp.int32)

    def loss(q, k, v):
        return flash._flash(q, k, v, segments, False, 0.125).astype(jnp.float32).sum()

    calls = _pallas_calls(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, q, q).jaxpr)
    by_kernel = {eqn.params["jaxpr"].debug_info.func_name: eqn for eqn in calls}
    assert set(by_kernel) == {"_flash_attention_kernel", "_flash_attention_dkv_kernel",
                              "_flash_attention_dq_kernel"}
    shape = flash.Shape(batch, heads, seq, head_dim, q.dtype.itemsize)
    forward = flash.forward_cost(shape)
    dkv, dq = flash.backward_costs(shape)
    scores = batch * heads * seq * seq
    expected = {"_flash_attention_kernel": (forward, flash.FORWARD_ELEMENTWISE),
                "_flash_attention_dkv_kernel": (dkv, flash.BACKWARD_ELEMENTWISE),
                "_flash_attention_dq_kernel": (dq, flash.BACKWARD_ELEMENTWISE)}
    for name, eqn in by_kernel.items():
        cost, elementwise = expected[name]
        assert eqn.params["cost_estimate"] == cost, name  # what the compiled kernel carries
        steps = math.prod(eqn.params["grid_mapping"].grid)
        flops, exps = _kernel_counts(eqn.params["jaxpr"])
        assert cost.flops == steps * flops + elementwise * scores, name
        assert cost.transcendentals == steps * exps == scores, name
        # Every block is fetched once, the segment ids once per batch row (their index does
        # not change across heads), but dq's key ids once per head when it walks key blocks.
        operands = [v.aval for v in eqn.invars] + [v.aval for v in eqn.outvars]
        key_ids = eqn.invars[4].aval
        assert key_ids.shape == (batch, 8, seq)
        again = (heads - 1) * _nbytes([key_ids]) if "dq" in name and seq > 128 else 0
        assert cost.bytes_accessed == _nbytes(operands) + again, name


def test_forward_estimate_equals_the_shipped_one():
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

    batch, heads, seq, head_dim = 2, 3, 128, 64
    q = jnp.ones((batch, heads, seq, head_dim), jnp.float32)
    ids = tpu_flash.SegmentIds(jnp.zeros((batch, seq), jnp.int32),
                               jnp.zeros((batch, seq), jnp.int32))
    blocks = flash.block_sizes(seq)
    with flash._interpret(True):
        jaxpr = jax.make_jaxpr(lambda q: tpu_flash._flash_attention_impl(
            q, q, q, None, ids, True, False, 0.125, blocks.block_b, blocks.block_q,
            blocks.block_k_major, blocks.block_k, False))(q)
    (eqn,) = _pallas_calls(jaxpr.jaxpr)
    shipped = eqn.params["cost_estimate"]
    assert shipped == flash.forward_cost(flash.Shape(batch, heads, seq, head_dim, 4))


# ---------------------------------------------------------------------------------------------
# Kernel or interpreter: decided by what the step is lowered for


def _attention_loss(attend, q, k, v, segments):
    return attend(q, k, v, segments, False).astype(jnp.float32).sum()


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu (pip install -e '.[tpu]') is not installed")
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache")
@pytest.mark.parametrize("impl,kernels", [("flash", 2), ("flash_jax", 3)])
def test_tpu_compile_holds_the_mosaic_kernels_and_cpu_the_interpreter(impl, kernels):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from bertjax.aot import topology

    devices = topology.devices(topology.parse("v5p-8"))  # 4 chips, on this CPU host
    rows = NamedSharding(Mesh(np.array(devices), ("data",)), PartitionSpec("data"))
    spec = jax.ShapeDtypeStruct((8, 128, 2, 64), jnp.bfloat16, sharding=rows)
    segments = jax.ShapeDtypeStruct((8, 128), jnp.int32, sharding=rows)
    step = jax.jit(jax.grad(functools.partial(_attention_loss, IMPLS[impl]), (0, 1, 2)))
    with flash.sharded_like(rows):  # as jit_train_step does: the kernels run per batch shard
        tpu = step.lower(spec, spec, spec, segments).compile().as_text()
    cpu = step.lower(*(jax.ShapeDtypeStruct(s.shape, s.dtype)
                       for s in (spec, spec, spec, segments))).compile().as_text()
    # flash: forward and backward kernels; flash_jax: forward, dk/dv and dq kernels
    assert tpu.count('custom_call_target="tpu_custom_call"') == kernels
    assert "tpu_custom_call" not in cpu


# ---------------------------------------------------------------------------------------------
# Attention dropout inside the kernel (bertjax.models.kernels.dropout_attention)


def test_keep_mask_rate_and_independence():
    rate, shape = 0.1, (4, 3, 128, 128)
    keep = np.asarray(dropout_hash.keep_mask(jnp.int32(7), shape, rate))
    kept = dropout_hash.keep_probability(rate)
    n = keep.size
    assert abs(keep.mean() - kept) < 5 * math.sqrt(kept * (1 - kept) / n)
    # Rows, heads and seeds draw independently: two masks agree where both keep or both drop.
    agree = kept ** 2 + (1 - kept) ** 2
    other_seed = np.asarray(dropout_hash.keep_mask(jnp.int32(8), shape, rate))
    for a, b in ((keep[0, 0], keep[0, 1]), (keep[0, 0], keep[1, 0]), (keep, other_seed),
                 (keep[0, 0, :-1], keep[0, 0, 1:]), (keep[0, 0, :, :-1], keep[0, 0, :, 1:])):
        tolerance = 5 * math.sqrt(agree * (1 - agree) / a.size)
        assert abs((a == b).mean() - agree) < tolerance


def test_dropout_scales_kept_probabilities_by_one_over_keep():
    """Uniform attention over n real keys with values 1: each output is kept/(n·keep), whose
    mean over every row and head is 1 (a statistical check of the 1/keep scaling)."""
    batch, heads, seq, rate = 4, 4, 128, 0.25
    q = jnp.zeros((batch, seq, heads, 64), jnp.float32)  # equal scores: uniform softmax
    v = jnp.ones_like(q)
    segments = jnp.zeros((batch, seq), jnp.int32)
    out = dropout.dropout_attention(_fused(q, q, v), _no_bias(q), segments,
                                    jnp.array([3], jnp.int32), rate, heads)
    kept = dropout_hash.keep_probability(rate)
    sd = math.sqrt((1 - kept) / (kept * seq)) / math.sqrt(batch * heads * seq)
    assert abs(float(out.mean()) - 1.0) < 5 * sd
    assert float(out.min()) < 1.0 < float(out.max())  # rows do differ: masks are applied


def _gpu_kernels_interpreted(call, gpu_call, static, *args):
    """dropout_attention's platform switch taking the GPU (Triton) kernels, interpreted."""
    return gpu_call(static, True, *args)


@pytest.mark.parametrize("platform,causal,rate,seq", [
    (platform, causal, rate, 128) for platform in ("tpu", "gpu")
    for causal, rate in ((False, 0.1), (True, 0.1), (False, 0.0))] + [("gpu", False, 0.1, 384)])
def test_dropout_kernel_equals_einsum_with_the_same_mask(platform, causal, rate, seq,
                                                         monkeypatch):
    """Values and q/k/v gradients against einsum_attention given the kernel's own mask
    (`keep_mask`): forward and backward draw that same mask and scale by 1/keep. The GPU
    kernels (dropout_attention_gpu.py) behind the same switch draw the same mask; at 384
    tokens they run padded to 512."""
    if platform == "gpu":
        monkeypatch.setattr(dropout, "_on_platform", _gpu_kernels_interpreted)
    batch, heads, head_dim = 2, 2, 64
    q, k, v, weights = _inputs(5, batch, seq, heads, head_dim)
    input_mask = jnp.asarray(np.arange(seq)[None] < np.array([[100], [seq]]), jnp.int32)
    segments = flash.segment_ids(input_mask, None, (batch, seq))
    mask = attn_lib.attention_mask(input_mask, None, causal=causal, seq_len=seq)
    seed = jnp.array([12345], jnp.int32)
    keep = dropout_hash.keep_mask(seed[0], (batch, heads, seq, seq), rate)
    static = dropout.Static(causal, head_dim ** -0.5, rate, heads, head_dim)
    real = input_mask.astype(jnp.float32)

    def kernel(q, k, v):  # the kernels' layout: each token's heads side by side
        return _heads(dropout._attend(seed, _fused(q, k, v), _no_bias(q), segments, static),
                      heads)

    def reference(q, k, v):
        return attn_lib.einsum_attention(
            q, k, v, mask, lambda shape: (keep, dropout_hash.keep_probability(rate)))

    got = _loss_and_grads(kernel, q, k, v, weights, real)
    expected = _loss_and_grads(reference, q, k, v, weights, real)
    for name, a, b in zip(("loss", "dq", "dk", "dv"), jax.tree.leaves(got),
                          jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_the_kernels_add_the_bias_and_sum_its_gradient(platform, monkeypatch):
    """The q/k/v bias the kernels add: values and the qkv gradient equal those with the bias
    added beforehand (and none given), and the bias gradient is the qkv gradient summed over
    rows and tokens (the kernels' sums per grid step of 2 rows, added up; the GPU kernels
    behind the same switch)."""
    if platform == "gpu":
        monkeypatch.setattr(dropout, "_on_platform", _gpu_kernels_interpreted)
    batch, heads, seq, head_dim, rate = 4, 4, 128, 32, 0.1
    q, k, v, _ = _inputs(3, batch, seq, heads, head_dim)
    qkv = _fused(q, k, v)
    bias = jax.random.normal(jax.random.key(4), (3 * heads * head_dim,), jnp.float32)
    weights = jax.random.normal(jax.random.key(5), (batch, seq, heads * head_dim))
    input_mask = jnp.asarray(np.arange(seq)[None] < np.array([[seq], [90], [seq], [17]]))
    segments = flash.segment_ids(input_mask, None, (batch, seq))
    static = dropout.Static(False, head_dim ** -0.5, rate, heads, head_dim, rows=2)
    seed = jnp.array([31], jnp.int32)

    def loss(qkv, bias):
        return jnp.sum(dropout._attend(seed, qkv, bias, segments, static) * weights)

    value, (d_qkv, d_bias) = jax.jit(jax.value_and_grad(loss, (0, 1)))(qkv, bias)
    want, want_d_qkv = jax.jit(jax.value_and_grad(loss))(qkv + bias, jnp.zeros_like(bias))
    np.testing.assert_allclose(value, want, rtol=1e-5)
    np.testing.assert_allclose(d_qkv, want_d_qkv, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(d_bias, want_d_qkv.sum((0, 1)), atol=1e-4, rtol=1e-5)
    assert float(jnp.abs(d_bias).max()) > 1.0  # a gradient that is there to compare


SHARDED_SCRIPT = r"""
import flax.linen as nn, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from bertjax.models.kernels import dropout_attention as dropout, flash_attention as flash

batch, seq, heads, head_dim = 8, 128, 4, 32
keys = jax.random.split(jax.random.key(0), 3)
qkv = jax.random.normal(keys[0], (batch, seq, 3 * heads * head_dim))
bias = jax.random.normal(keys[1], (3 * heads * head_dim,))
weights = jax.random.normal(keys[2], (batch, seq, heads * head_dim))
segments = jnp.zeros((batch, seq), jnp.int32)
seed = jnp.array([5], jnp.int32)

def loss(qkv, bias):
    out = dropout.dropout_attention(qkv, bias, segments, seed, 0.0, heads)
    return jnp.sum(out * weights)

grads = jax.jit(jax.grad(loss, (0, 1)))
want = grads(qkv, bias)
rows = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
with flash.sharded_like(rows):  # the kernels per batch shard: the bias's gradient summed
    got = grads(jax.device_put(qkv, rows), bias)

def replicas(qkv, bias):  # the bfloat16 gradient reduction's vmap over the data axis
    split = qkv.reshape(4, batch // 4, *qkv.shape[1:])
    def one(qkv, segments, weights):
        out = dropout.dropout_attention(qkv, bias, segments, seed, 0.0, heads)
        return jnp.sum(out * weights)
    per = jax.vmap(jax.grad(one, (0,)), spmd_axis_name="data")(
        split, segments.reshape(4, -1, seq), weights.reshape(4, -1, seq, weights.shape[-1]))
    return per[0].reshape(qkv.shape)

with flash.sharded_like(rows), nn.logical_axis_rules((("batch", None),)):
    vmapped = jax.jit(replicas)(jax.device_put(qkv, rows), bias)
for a, b in zip(got + (vmapped,), want + want[:1]):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)
print("SHARDED_OK")
"""


@pytest.mark.slow
def test_kernels_per_batch_shard_give_the_whole_batch_gradients():
    """On 4 CPU devices: the kernels run per batch shard (`sharded_like`), the bias given whole
    to each, and the gradients equal the unsharded ones, also inside a vmap over the data
    axis (`spmd_axis_name`, as the bfloat16 gradient reduction runs its replicas)."""
    proc = run_python(["-c", SHARDED_SCRIPT],
                      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert "SHARDED_OK" in proc.stdout, proc.stdout + proc.stderr


def test_gpu_kernels_handle_packed_rows_like_the_tpu_kernel(monkeypatch):
    """Packed rows (several examples a row, block-diagonal attention) with dropout: the GPU
    kernels' values and gradients equal the TPU kernel's (both interpreted), the same mask
    drawn from the same seed."""
    batch, heads, seq, head_dim, rate = 2, 2, 128, 32, 0.2
    q, k, v, weights = _inputs(9, batch, seq, heads, head_dim)
    packing = jnp.asarray(np.repeat([[0, 1, 2, 3]], batch, 0).repeat(seq // 4, 1), jnp.int32)
    segments = flash.segment_ids(jnp.ones((batch, seq), jnp.int32), packing, (batch, seq))
    static = dropout.Static(False, head_dim ** -0.5, rate, heads, head_dim)
    seed = jnp.array([77], jnp.int32)

    def kernel(q, k, v):
        return _heads(dropout._attend(seed, _fused(q, k, v), _no_bias(q), segments, static),
                      heads)

    real = jnp.ones((batch, seq), jnp.float32)
    tpu = _loss_and_grads(kernel, q, k, v, weights, real)
    monkeypatch.setattr(dropout, "_on_platform", _gpu_kernels_interpreted)
    gpu = _loss_and_grads(kernel, q, k, v, weights, real)
    for name, a, b in zip(("loss", "dq", "dk", "dv"), jax.tree.leaves(gpu),
                          jax.tree.leaves(tpu)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("heads", [3, 4])  # head groups of one and of two heads
def test_dropout_cost_estimates_match_the_kernels(heads):
    batch, seq, head_dim = 2, 128, 64
    q = jnp.ones((batch, seq, heads * head_dim), jnp.bfloat16)
    segments = jnp.zeros((batch, seq), jnp.int32)
    static = dropout.Static(False, 0.125, 0.1, heads, head_dim)

    def loss(qkv, bias):
        out = dropout._attend(jnp.array([1], jnp.int32), qkv, bias, segments, static)
        return out.astype(jnp.float32).sum()

    qkv = dropout.fuse_qkv(q, q, q, heads)
    bias = jnp.zeros((3 * heads * head_dim,), jnp.bfloat16)
    calls = _pallas_calls(jax.make_jaxpr(jax.grad(loss, (0, 1)))(qkv, bias).jaxpr)
    by_kernel = {eqn.params["jaxpr"].debug_info.func_name: eqn for eqn in calls}
    shape = flash.Shape(batch, heads, seq, head_dim, 2)
    expected = {"_forward_kernel": (dropout.forward_cost(shape, static), 1),
                "_backward_kernel": (dropout.backward_cost(shape, static), 2)}
    # The GPU kernels (dropout_attention_gpu.py) sit beside them behind the platform switch.
    assert set(by_kernel) == set(expected) | {"_forward_gpu_kernel", "_dq_gpu_kernel",
                                              "_dkv_gpu_kernel"}
    scores = batch * heads * seq * seq
    for name, (cost, passes) in expected.items():
        eqn = by_kernel[name]
        assert eqn.params["cost_estimate"] == cost, name
        steps = math.prod(eqn.params["grid_mapping"].grid)
        flops, exps = _kernel_counts(eqn.params["jaxpr"])
        assert cost.flops == steps * flops + passes * dropout.ELEMENTWISE * scores, name
        assert cost.transcendentals == steps * exps == scores, name
        # Every block is fetched once (the segment ids' index does not change across heads).
        operands = [v.aval for v in eqn.invars[1:]] + [v.aval for v in eqn.outvars]
        assert cost.bytes_accessed == _nbytes(operands), name

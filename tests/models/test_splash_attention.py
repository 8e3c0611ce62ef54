"""attention_impl "splash" (our block-sparse Pallas TPU kernels, bertjax/models/
splash_attention.py), interpreted on CPU, against the einsum path under ModernBERT's masks:
values and gradients of global and local layers with padded and packed rows, at lengths below,
at and above the window and off the block multiple, and with blocks skipped by documents; a
whole ModernBertModel; and the sparsity itself: a local layer's chunks read their window's keys
and few more, a global layer's per-row tables keep exactly the block pairs the dense mask needs,
and the cost estimates count the scores computed."""

import dataclasses
import importlib.util

import flax.linen as nn
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.errors import ConfigError
from bertjax.models import modernbert as modern
from bertjax.models.kernels import attention as attn_lib
from bertjax.models.kernels import flash_attention as flash
from bertjax.models.kernels import splash_attention as splash
from bertjax.models.modernbert import ModernBertModel, ModernConfig

TOL = 1e-5


def _inputs(seed, batch, seq, heads, head_dim):
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(k, (batch, seq, heads, head_dim), jnp.float32) for k in keys]


def _splash(q, k, v, input_mask, packing_ids, radius, rope=None):
    """splash_attention on q, k, v [batch, seq, heads, head_dim] (or flat, heads given by the
    rope tables' caller: 2), fused as the model's projection writes them → q's shape."""
    shape = q.shape
    heads = shape[2] if q.ndim == 4 else 2
    qkv = jnp.concatenate([x.reshape(*shape[:2], -1) for x in (q, k, v)], axis=-1)
    out = splash.splash_attention(qkv, input_mask, packing_ids, radius, heads, rope)
    return out.reshape(shape)


def _reference(q, k, v, input_mask, packing_ids, radius):
    """einsum_attention under the dense mask ModernBertModel builds for this layer type."""
    masks = modern.attention_masks(input_mask, packing_ids, q.shape[1],
                                   0 if radius is None else radius)
    mask = masks[modern.GLOBAL if radius is None else modern.LOCAL]
    return attn_lib.einsum_attention(q, k, v, mask)


CASES = {  # name: (seq, radius, lengths of the two rows, documents per row or None)
    # 200 → one block of 256 (100 padding tokens); a row with one real token
    "global, padded": (200, None, (200, 1), None),
    "global, packed": (200, None, (200, 170), 3),
    # 300 → 3 blocks of 128: with radius 40, blocks (0, 2) and (2, 0) are skipped
    "local, above the window, padded": (300, 40, (300, 211), None),
    "local, below the window": (50, 40, (50, 37), None),  # window 81 > 50 tokens
    "local, at the window": (81, 40, (81, 81), None),
    "local, packed": (300, 40, (300, 260), 4),  # documents shorter and longer than 81
    # 600 → 5 blocks of 128: each chunk reads 224 keys, shifted into the row at its ends
    "local, packed, 5 blocks": (600, 40, (600, 555), 3),
    # the window wider than a block of 128: the backward's accumulators zeroed and written once
    # per row, not a block at a time
    "local, wider than a block": (384, 200, (384, 300), 2),
}


@pytest.mark.parametrize("case", CASES)
def test_splash_equals_einsum_values_and_gradients(case):
    seq, radius, lengths, documents = CASES[case]
    batch, heads, head_dim = 2, 2, 32
    q, k, v, weights = _inputs(len(case), batch, seq, heads, head_dim)
    input_mask = jnp.asarray(np.arange(seq)[None] < np.array(lengths)[:, None], jnp.int32)
    packing_ids = None
    if documents:  # 1, 2, ... by position, 0 on padding as the data pipeline writes them
        cuts = np.sort(np.random.default_rng(seq).choice(np.arange(5, seq - 5), documents - 1,
                                                         replace=False))
        doc = 1 + np.searchsorted(cuts, np.arange(seq), side="right")
        packing_ids = jnp.where(input_mask > 0, jnp.asarray(doc)[None], 0)
    cotangent = weights * input_mask.astype(jnp.float32)[:, :, None, None]

    def value_and_grads(q, k, v, splash_path):
        attend = _splash if splash_path else _reference
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, input_mask, packing_ids, radius),
                           q, k, v)
        return out, vjp(cotangent)  # the gradients of Σ out · cotangent: real query rows only

    (got_out, got), (want_out, want) = (jax.jit(value_and_grads, static_argnums=3)(
        q, k, v, splash_path) for splash_path in (True, False))
    assert bool(jnp.all(jnp.isfinite(got_out)))  # padding rows too: no row is empty
    rows = np.asarray(input_mask, bool)  # padding rows differ by design
    np.testing.assert_allclose(np.asarray(got_out)[rows], np.asarray(want_out)[rows],
                               atol=TOL, rtol=0)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert bool(jnp.all(jnp.isfinite(a))), name
        np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL, err_msg=name)


def test_modern_model_splash_equals_einsum():
    """A small ModernBertModel (a global layer, then a local one of radius 4) on padded,
    packed rows: the same hidden states on real tokens and the same parameter gradients."""
    base = ModernConfig(vocab_size=50, hidden_size=64, num_layers=2, num_heads=4,
                        intermediate_size=96, local_attention=8, global_attn_every_n_layers=2,
                        max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, cls_token_id=1, sep_token_id=2)
    batch, seq = 2, 40
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, 50, (batch, seq)), jnp.int32)
    input_mask = jnp.asarray(np.arange(seq)[None] < np.array([[seq], [29]]), jnp.int32)
    packing = jnp.where(input_mask > 0, 1 + (jnp.arange(seq)[None] >= 17), 0)
    weights = jax.random.normal(jax.random.key(1), (batch, seq, 64))
    real = input_mask.astype(jnp.float32)[..., None]
    init = ModernBertModel(dataclasses.replace(base, attention_impl="einsum")).init
    params = nn.unbox(jax.jit(init)(jax.random.key(0), ids, input_mask,
                                    packing_ids=packing)["params"])

    def run(impl):
        model = ModernBertModel(dataclasses.replace(base, attention_impl=impl))

        def loss(params):
            out = model.apply({"params": params}, ids, input_mask, packing_ids=packing)
            return jnp.sum(out * weights * real), out

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (loss_e, out_e), grads_e = run("einsum")
    (loss_s, out_s), grads_s = run("splash")
    rows = np.asarray(input_mask, bool)
    np.testing.assert_allclose(np.asarray(out_s)[rows], np.asarray(out_e)[rows], atol=TOL)
    np.testing.assert_allclose(loss_s, loss_e, rtol=TOL)
    want = dict(jax.tree_util.tree_leaves_with_path(grads_e))
    for path, a in jax.tree_util.tree_leaves_with_path(grads_s):
        np.testing.assert_allclose(a, want[path], atol=TOL, rtol=1e-4,
                                   err_msg=jax.tree_util.keystr(path))


def test_splash_refuses_attention_dropout():
    cfg = ModernConfig(vocab_size=50, hidden_size=32, num_layers=1, num_heads=2,
                       intermediate_size=48, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       cls_token_id=1, sep_token_id=2, attention_dropout=0.1,
                       attention_impl="splash")
    ids = jnp.ones((1, 8), jnp.int32)
    model = ModernBertModel(cfg)
    variables = jax.eval_shape(model.init, jax.random.key(0), ids)  # traced, nothing run
    with pytest.raises(ConfigError, match="cannot apply attention dropout"):
        jax.eval_shape(lambda variables: model.apply(variables, ids, deterministic=False,
                                                     rngs={"dropout": jax.random.key(1)}),
                       variables)


# ---------------------------------------------------------------------------------------------
# Block sparsity


def band(seq, block, radius):
    """[q blocks, k blocks] bool: some query of block i is within `radius` of some key of
    block j, i.e. the blocks' intervals, the key block widened by the radius, overlap."""
    start = np.arange(seq // block) * block
    end = start + block - 1
    return (start[None, :] - radius <= end[:, None]) & (end[None, :] + radius >= start[:, None])


@pytest.mark.parametrize("seq,radius", [(8192, 64), (1024, 64), (2048, 300), (640, 40),
                                        (384, 40), (384, 200)])
def test_local_chunks_read_their_whole_window_and_little_else(seq, radius):
    """A local layer's chunk of 128 queries reads `span` keys: 16-aligned (bf16's sublane
    tile), inside the row, holding the window of every query of the chunk; at 8,192 tokens
    with radius 64, 256 per query, a sixth of what the band of blocks of 512 computed."""
    static = splash.Static(seq, splash.block_size(seq), radius)
    span = static.span
    assert span == min(128 + 2 * 16 * -(-radius // 16), seq)
    for first in range(0, seq, 128):
        start = int(static.span_start(jnp.int32(first)))
        assert start % 16 == 0 and 0 <= start and start + span <= seq
        assert start <= max(first - radius, 0)
        assert start + span >= min(first + 128 + radius, seq)
    assert splash.computed_scores(static, 1) == seq * span
    if seq == 8192:
        walked_by_the_band = int(band(seq, 512, radius).sum()) * 512 * 512
        assert span == 256 and seq * span * 5 < walked_by_the_band
    full = splash.Static(seq, splash.block_size(seq), None)
    assert splash.computed_scores(full, 1) == seq * seq


def _packed_segments(rng, batch, seq, documents, lengths):
    """[batch, seq] segments as the kernels see them: documents 1..n cut at random, PAD on
    each row's padding (after lengths[row] tokens)."""
    rows = []
    for length in lengths:
        cuts = np.sort(rng.choice(np.arange(1, length), documents - 1, replace=False))
        doc = 1 + np.searchsorted(cuts, np.arange(seq), side="right")
        rows.append(np.where(np.arange(seq) < length, doc, splash.PAD))
    return np.stack(rows).astype(np.int32)


def test_block_table_skips_the_blocks_no_pair_needs():
    """A global layer's walked block is live iff some query of the grid's block and some key
    of it share a document (padding: its own), from the dense mask; a dead step repeats a live
    step's block (nothing new is fetched)."""
    seq, block = 1024, 128
    static = splash.Static(seq, block, None)
    segments = _packed_segments(np.random.default_rng(0), 3, seq, 9, (1024, 700, 130))
    aligned = 1 + np.arange(seq) // (2 * block)  # documents of two blocks each
    segments = np.concatenate([segments, aligned[None].astype(np.int32)])
    index, live = (np.asarray(x) for x in splash.block_table(jnp.asarray(segments), static))
    blocks = seq // block
    assert index.shape == live.shape == (4, blocks, blocks)
    for row in range(4):
        needed = segments[row][:, None] == segments[row][None]
        needed = needed.reshape(blocks, block, blocks, block).any(axis=(1, 3))
        np.testing.assert_array_equal(live[row] > 0, needed, err_msg=f"row {row}")
        for i in range(blocks):
            assert set(index[row, i]) <= set(np.flatnonzero(live[row, i]))
            assert np.all(np.diff(index[row, i]) >= 0)
    # On the aligned row, every pair of blocks in different documents is skipped.
    first_tokens = aligned[np.arange(blocks) * block]
    assert int((live[3] == 0).sum()) == int((first_tokens[:, None] != first_tokens).sum()) > 0


def test_packed_rows_skip_blocks_and_keep_the_einsum_values():
    """Rows of several documents whose blocks are partly skipped (global and local layers):
    values and gradients equal einsum's, and the tables mark dead blocks."""
    seq, heads, head_dim = 640, 2, 32
    rng = np.random.default_rng(7)
    segments = _packed_segments(rng, 2, seq, 5, (640, 400))
    input_mask = jnp.asarray(segments != splash.PAD, jnp.int32)
    packing_ids = jnp.where(input_mask > 0, jnp.asarray(segments), 0)
    q, k, v, weights = _inputs(3, 2, seq, heads, head_dim)
    cotangent = weights * input_mask.astype(jnp.float32)[:, :, None, None]
    _, live = splash.block_table(jnp.asarray(segments), splash.Static(seq, 128, None))
    assert int((np.asarray(live) == 0).sum()) > 0
    for radius in (None, 40):

        def value_and_grads(q, k, v, attend, radius=radius):
            out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, input_mask, packing_ids, radius),
                               q, k, v)
            return out, vjp(cotangent)

        (got_out, got), (want_out, want) = (value_and_grads(q, k, v, attend)
                                            for attend in (_splash, _reference))
        rows = np.asarray(input_mask, bool)
        np.testing.assert_allclose(np.asarray(got_out)[rows], np.asarray(want_out)[rows],
                                   atol=TOL, rtol=0)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL, err_msg=f"{name} {radius}")


def _pallas_calls(jaxpr):
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
        for sub in jex.jaxprs_in_params(eqn.params):
            found += _pallas_calls(sub)
    return found


@pytest.mark.parametrize("radius", [64, None])
def test_cost_estimates_count_the_computed_scores(radius):
    """The kernels' cost estimates count the scores computed: at 2,048 tokens with radius 64,
    256 keys per query (a chunk of 128 and 64 on each side), globally all 2,048; the matmuls
    (forward 2, backward 5) on the 2 heads' 128-lane tile, except a global layer's after the
    scores, on one head's 64 rows; di's kernel a product and a sum per element of o; the rope
    kernels' per element of q and k."""
    batch, seq, heads, head_dim = 2, 2048, 2, 64
    q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

    def step(q, k, v, mask):
        return jax.grad(lambda q, k, v: jnp.sum(_splash(
            q, k, v, mask, None, radius).astype(jnp.float32)), (0, 1, 2))(q, k, v)

    calls = _pallas_calls(jax.make_jaxpr(step)(q, q, q, mask).jaxpr)
    computed = batch * heads * seq * (seq if radius is None else 256)
    flops = {}
    for eqn in calls:  # each kernel twice: the TPU branch and the interpreted one
        name = eqn.params["jaxpr"].debug_info.func_name
        kind = next(k for k in ("fwd", "bwd", "di", "rope") if f"_{k}" in name)
        flops.setdefault(kind, set()).add(eqn.params["cost_estimate"].flops)
    # matmuls per score: (on both heads' lanes, on one head's rows)
    kernels = {"fwd": (1, 1), "bwd": (2, 3)}
    assert set(flops) == set(kernels) | {"di", "rope"}
    for kind, (wide, after) in kernels.items():
        elementwise = flash.FORWARD_ELEMENTWISE if kind == "fwd" else flash.BACKWARD_ELEMENTWISE
        if radius is not None:
            elementwise += splash.WINDOW_ELEMENTWISE
        heads_after = 1 if radius is None else 2
        want = (2 * computed * head_dim * (2 * wide + heads_after * after)
                + elementwise * computed)
        assert flops[kind] == {want}, kind
    assert flops["di"] == {2 * batch * seq * heads * head_dim}  # o·do summed per head
    # q and k rotated and scaled once, and back (the same work each way)
    assert flops["rope"] == {splash.ROPE_ELEMENTWISE * 2 * batch * seq * heads * head_dim}


@pytest.mark.parametrize("radius", [None, 40])
def test_rope_inside_the_kernels_equals_rotating_first(radius):
    """rope=(cos, sin): the kernels rotate q and k tile by tile (and the gradients back);
    values and gradients equal `modern.apply_rope` then einsum, on packed rows of 2 heads
    side by side in each tile, positions restarting per document."""
    seq, heads, head_dim = 300, 2, 32
    segments = _packed_segments(np.random.default_rng(5), 2, seq, 3, (300, 230))
    input_mask = jnp.asarray(segments != splash.PAD, jnp.int32)
    packing_ids = jnp.where(input_mask > 0, jnp.asarray(segments), 0)
    positions = attn_lib.positions_from_packing(packing_ids)
    cos, sin = modern.rope_tables(positions, heads, head_dim, 10_000.0)
    q, k, v, weights = (x.reshape(2, seq, heads * head_dim)
                        for x in _inputs(11, 2, seq, heads, head_dim))
    cotangent = weights * input_mask.astype(jnp.float32)[:, :, None]

    def kernels(q, k, v):
        return _splash(q, k, v, input_mask, packing_ids, radius, rope=(cos, sin))

    def reference(q, k, v):
        q, k = (modern.apply_rope(x, cos, sin, head_dim) for x in (q, k))
        q, k, v = (x.reshape(2, seq, heads, head_dim) for x in (q, k, v))
        return _reference(q, k, v, input_mask, packing_ids, radius).reshape(2, seq, -1)

    (got_out, got), (want_out, want) = (
        (lambda out_vjp: (out_vjp[0], out_vjp[1](cotangent)))(jax.vjp(f, q, k, v))
        for f in (kernels, reference))
    rows = np.asarray(input_mask, bool)
    np.testing.assert_allclose(np.asarray(got_out)[rows], np.asarray(want_out)[rows],
                               atol=TOL, rtol=0)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL, err_msg=name)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu (pip install -e '.[tpu]') is not installed")
def test_the_kernels_keep_to_the_chips_vmem():
    """`fits` as libtpu's compiles of the kernels for one chip showed: on a v4 (16 MiB of
    VMEM) a local layer's whole rows compile at 2,048 tokens and run out at 4,096; v5p (64
    MiB), v5e and v6e (128) take 8,192; a global layer's accumulators fit a v4 at 8,192, not
    at 16,384; a chip not known (a CPU) is not refused. Traced for a v4 slice at 16,384
    tokens, "auto" runs the local layer on the kernels, in pieces, and the global one on the
    xla path, where a v5p slice runs both on the kernels; "splash" refuses the global layer
    with an error naming the flag."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from bertjax.aot import topology

    assert splash.fits(2048, True, "TPU v4") and not splash.fits(4096, True, "TPU v4")
    assert splash.fits(8192, False, "TPU v4") and not splash.fits(16384, False, "TPU v4")
    for kind in ("TPU v5", "TPU v5 lite", "TPU v6 lite", "cpu"):
        assert splash.fits(8192, True, kind) and splash.fits(8192, False, kind)
    cfg = ModernConfig(vocab_size=50, hidden_size=128, num_layers=2, num_heads=2,
                       intermediate_size=64, local_attention=128, global_attn_every_n_layers=2,
                       max_position_embeddings=16384, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2, cls_token_id=1, sep_token_id=2)
    ids = jnp.ones((4, 16384), jnp.int32)

    def kernels(model, slice_):
        mesh = Mesh(np.array(topology.devices(topology.parse(slice_))), ("data",))
        with flash.sharded_like(NamedSharding(mesh, PartitionSpec("data"))):
            params = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, ids))
            return str(jax.make_jaxpr(lambda p: model.apply(p, ids, ids))(params)).count(
                "splash_fwd")

    on_v5p, on_v4 = (kernels(ModernBertModel(cfg), s) for s in ("v5p-8", "v4-8"))
    assert on_v5p == 2 * on_v4 > 0  # both layers' kernels, then the local layer's alone
    with pytest.raises(ConfigError, match="attention_impl='splash'.*TPU v4"):
        kernels(ModernBertModel(dataclasses.replace(cfg, attention_impl="splash")), "v4-8")


def test_a_local_layer_past_the_vmem_runs_in_pieces_with_the_einsum_values(monkeypatch):
    """Where a local layer's rows do not fit (here: over 384 tokens), the rows are attended
    in pieces widened by the window's reach (pieces of 128 and 128 tokens each side), with the
    einsum path's values and gradients on padded, packed rows."""
    monkeypatch.setattr(splash, "fits", lambda seq, local, kind=None: seq <= 384)
    seq, radius = 600, 40
    segments = _packed_segments(np.random.default_rng(3), 2, seq, 4, (600, 470))
    input_mask = jnp.asarray(segments != splash.PAD, jnp.int32)
    packing_ids = jnp.where(input_mask > 0, jnp.asarray(segments), 0)
    q, k, v, weights = _inputs(4, 2, seq, 2, 32)
    cotangent = weights * input_mask.astype(jnp.float32)[:, :, None, None]

    def value_and_grads(attend):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, input_mask, packing_ids, radius),
                           q, k, v)
        return out, vjp(cotangent)

    (got_out, got), (want_out, want) = (value_and_grads(a) for a in (_splash, _reference))
    rows = np.asarray(input_mask, bool)
    np.testing.assert_allclose(np.asarray(got_out)[rows], np.asarray(want_out)[rows], atol=TOL)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL, err_msg=name)

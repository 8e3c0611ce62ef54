"""Optimizer, schedule, train step and sharding."""

import jax
import numpy as np
import optax
import pytest
from conftest import run_python
from tiny_pretraining import make_step, synthetic_batch, tiny_config

from bertjax.models import BertConfig, BertForPreTraining
from bertjax.models.bert.config import ConfigError
from bertjax.tasks import pretraining
from bertjax.tasks.pretraining import rules
from bertjax.train import configs
from bertjax.train import sharding as sharding_lib
from bertjax.train import step as step_lib
from bertjax.train.optimizer import learning_rate_schedule, make_optimizer, weight_decay_mask
from experiments import pretrain as pretrain_experiment


def optimizer_config(**overrides):
    config = pretrain_experiment.get_config("tiny").optimizer
    for k, v in overrides.items():
        config[k] = v
    return config


def test_reference_schedule_decays_from_step_zero():
    schedule = learning_rate_schedule(1e-4, warmup_steps=100, total_steps=1000, kind="reference")
    assert float(schedule(0)) == 0.0
    np.testing.assert_allclose(schedule(50), 0.5e-4, rtol=1e-6)
    # Right after warmup the reference gives peak·(1 - warmup/total), not the peak.
    np.testing.assert_allclose(schedule(100), 1e-4 * 0.9, rtol=1e-6)
    np.testing.assert_allclose(schedule(550), 1e-4 * 0.45, rtol=1e-6)
    assert float(schedule(1000)) == 0.0 and float(schedule(2000)) == 0.0


def test_from_peak_schedule():
    schedule = learning_rate_schedule(1e-4, warmup_steps=100, total_steps=1100, kind="from_peak")
    np.testing.assert_allclose(schedule(100), 1e-4, rtol=1e-6)
    np.testing.assert_allclose(schedule(600), 0.5e-4, rtol=1e-6)
    assert float(schedule(1100)) == 0.0


def test_weight_decay_mask_skips_layer_norm_and_biases():
    cfg = BertConfig.from_preset("tiny", num_layers=1)
    params = pretraining.init_params(BertForPreTraining(cfg), jax.random.key(0))
    import flax
    flat = flax.traverse_util.flatten_dict(weight_decay_mask(params))
    decayed = {"/".join(k) for k, v in flat.items() if v}
    skipped = {"/".join(k) for k, v in flat.items() if not v}
    assert "bert/embeddings/word_embeddings/embedding" in decayed
    assert "bert/encoder/layer_0/attention/query/kernel" in decayed
    assert "bert/encoder/layer_0/attention/query/bias" in skipped
    assert "bert/embeddings/layer_norm/scale" in skipped
    assert "mlm/output_bias" in skipped
    assert all(k.endswith(("kernel", "embedding")) for k in decayed)


def test_bert_adamw_matches_the_reference_update_rule():
    """Adam without bias correction + decoupled decay, written out in NumPy."""
    cfg = optimizer_config(learning_rate=1e-2, warmup_steps=2, clip_norm=0.0)
    tx, schedule = make_optimizer(cfg, total_steps=10)
    params = {"dense": {"kernel": np.ones((2, 3), np.float32), "bias": np.ones(3, np.float32)},
              "layer_norm": {"scale": np.ones(3, np.float32)}}
    state = tx.init(params)
    r = np.random.default_rng(0)
    ref = {k: {n: v.astype(np.float64) for n, v in d.items()} for k, d in params.items()}
    m = {k: {n: np.zeros_like(v) for n, v in d.items()} for k, d in ref.items()}
    v2 = {k: {n: np.zeros_like(v) for n, v in d.items()} for k, d in ref.items()}
    for step in range(5):
        grads = {k: {n: r.normal(size=v.shape).astype(np.float32) for n, v in d.items()}
                 for k, d in params.items()}
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        lr = 1e-2 * step / 2 if step < 2 else 1e-2 * (1 - step / 10)
        for k in ref:
            for n in ref[k]:
                g = grads[k][n].astype(np.float64)
                m[k][n] = 0.9 * m[k][n] + 0.1 * g
                v2[k][n] = 0.999 * v2[k][n] + 0.001 * g * g
                update = m[k][n] / (np.sqrt(v2[k][n]) + 1e-6)
                if n == "kernel":
                    update = update + 0.01 * ref[k][n]
                ref[k][n] = ref[k][n] - lr * update
    for k in ref:
        for n in ref[k]:
            np.testing.assert_allclose(params[k][n], ref[k][n], rtol=1e-5, atol=1e-6)


def test_unknown_optimizer_is_a_config_error():
    with pytest.raises(ConfigError, match="optimizer.name"):
        make_optimizer(optimizer_config(name="sgdd"), total_steps=10)


def test_mesh_shape_fills_and_rejects_mismatches():
    assert sharding_lib.mesh_shape({"data": -1, "fsdp": 2, "tensor": 1}, 8) == (4, 2, 1)
    with pytest.raises(ConfigError, match="config.mesh"):
        sharding_lib.mesh_shape({"data": 3, "fsdp": 1, "tensor": 1}, 8)
    with pytest.raises(ConfigError, match="unknown axes"):
        sharding_lib.mesh_shape({"model": 2}, 8)


@pytest.mark.parametrize("impl", step_lib.RNG_IMPLS)
def test_rng_impl_sets_the_dropout_key_and_not_the_params(impl):
    """The dropout base key is of config.rng_impl, derived from the seed; params are not."""
    cfg = BertConfig.from_preset("tiny", num_layers=1, vocab_size=64)
    init, _ = pretraining.step_fns(BertForPreTraining(cfg))
    tx, _ = make_optimizer(optimizer_config(), total_steps=10)
    mesh = sharding_lib.make_mesh(pretrain_experiment.get_config("tiny").mesh)
    rules = pretrain_experiment.get_config("tiny").logical_axis_rules
    abstract, shardings = step_lib.state_shardings(init, tx, mesh, rules, impl)
    state = step_lib.create_train_state(init, tx, jax.random.key(7), shardings, impl)
    assert state.rng.dtype == jax.random.key(0, impl=impl).dtype == abstract.rng.dtype
    reference = step_lib.create_train_state(init, tx, jax.random.key(7), shardings)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(reference.params)):
        np.testing.assert_array_equal(a, b)
    other = step_lib.create_train_state(init, tx, jax.random.key(8), shardings, impl)
    assert not np.array_equal(jax.random.key_data(state.rng), jax.random.key_data(other.rng))


def test_unknown_rng_impl_is_a_config_error():
    config = pretrain_experiment.get_config("tiny")
    config.rng_impl = "philox"
    with pytest.raises(ConfigError, match="config.rng_impl='philox'"):
        configs.rng_impl(config)


@pytest.mark.slow
def test_train_step_fits_a_fixed_batch():
    config = tiny_config()
    config.optimizer.learning_rate = 1e-3  # 5e-3 oscillates on one repeated batch
    state, step = make_step(config)
    batch = synthetic_batch(BertConfig.from_dict(config.model), 8, 16, 4)
    losses = []
    for _ in range(30):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert int(state.step) == 30
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.5 * losses[0], losses
    assert float(metrics["grad_norm"]) > 0 and float(metrics["learning_rate"]) > 0


@pytest.mark.slow
def test_gradient_accumulation_equals_the_full_batch_step():
    config = tiny_config(hidden_dropout_prob=0.0, attention_dropout_prob=0.0)
    batch = synthetic_batch(BertConfig.from_dict(config.model), 8, 16, 4)
    full_state, full_step = make_step(config)
    accum_state, accum_step = make_step(config, grad_accum_steps=4)
    full_state, full_metrics = full_step(full_state, batch)
    accum_state, accum_metrics = accum_step(accum_state, batch)
    np.testing.assert_allclose(accum_metrics["grad_norm"], full_metrics["grad_norm"], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(accum_state.params), jax.tree.leaves(full_state.params)):
        np.testing.assert_allclose(a, b, atol=1e-6)


SHARDED_SCRIPT = r"""
import jax, numpy as np
from tiny_pretraining import tiny_config, make_step, synthetic_batch
from bertjax.models import BertConfig
from bertjax.train import sharding as sharding_lib
results = {}
for mesh_sizes in ({"data": 1, "fsdp": 1, "tensor": 1}, {"data": 2, "fsdp": 1, "tensor": 2},
                   {"data": 1, "fsdp": 2, "tensor": 2}):
    config = tiny_config(hidden_dropout_prob=0.0, attention_dropout_prob=0.0)
    mesh = sharding_lib.make_mesh(mesh_sizes, jax.devices()[: np.prod(list(mesh_sizes.values()))])
    state, step = make_step(config, mesh=mesh)
    batch = synthetic_batch(BertConfig.from_dict(config.model), 8, 16, 4)
    for _ in range(3):
        state, metrics = step(state, batch)
    kernel = state.params["bert"]["encoder"]["layer_0"]["intermediate"]["kernel"]
    results[str(mesh_sizes)] = (float(metrics["loss"]), str(kernel.sharding.spec))
print(results)
losses = [v[0] for v in results.values()]
assert np.allclose(losses, losses[0], rtol=1e-4), results
specs = [v[1] for v in results.values()]
assert "tensor" in specs[1] and "fsdp" in specs[2], specs
print("SHARDED_OK")
"""


@pytest.mark.slow
@pytest.mark.extended
def test_sharded_training_over_a_4_device_mesh_matches_one_device():
    proc = run_python(["-c", SHARDED_SCRIPT],
                      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert "SHARDED_OK" in proc.stdout, proc.stdout + proc.stderr


FSDP_SCRIPT = r"""
import re
import jax, numpy as np
from bertjax.tasks.pretraining import PretrainingJob
from bertjax.aot import measure as aot_measure
from experiments import pretrain

PER_DEVICE, SEQ = 8, 128
results = {}
for mesh in ((4, 1, 1), (1, 4, 1)):  # data parallel, FSDP: the same batch per device
    config = pretrain.get_config("tiny")
    config.model.update(dtype="bfloat16", hidden_dropout_prob=0.0, attention_dropout_prob=0.0,
                        vocab_size=512)
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
    config.train.batch_size = PER_DEVICE * 4
    job = PretrainingJob(config, make_input=None)
    step = aot_measure.Step.build(job, config, jax.devices())
    stage = job.stages[0]
    compiled = step.train_steps[stage.name].lower(step.abstract_state, stage.batch_spec).compile()
    # Collectives whose result is a [global batch, seq, ...] activation.
    whole = re.findall(rf"= \w+\[{config.train.batch_size},{SEQ},[^\]]*\]\S* "
                       r"(all-gather|all-reduce)(?:-start)?\(", compiled.as_text())
    results[mesh] = (compiled.memory_analysis().temp_size_in_bytes, step.state_bytes, whole)
print(results)
(dp_temp, dp_state, dp_whole), (fsdp_temp, fsdp_state, fsdp_whole) = results.values()
assert fsdp_temp <= dp_temp, results  # activations no larger than data parallelism's
assert fsdp_state <= dp_state / 3, results  # params and moments split over the 4 devices
assert not fsdp_whole and not dp_whole, results
print("FSDP_OK")
"""


def test_fsdp_shards_the_activations_like_data_parallelism():
    """At the same batch per device, FSDP's train step needs no more temporaries than data
    parallelism's and gathers no [batch, seq, ...] activation over the global batch, while its
    parameters and moments are split over the fsdp axis (4 CPU devices)."""
    proc = run_python(["-c", FSDP_SCRIPT],
                      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert "FSDP_OK" in proc.stdout, proc.stdout + proc.stderr


BF16_REDUCE_SCRIPT = r"""
import functools, re
import jax, jax.numpy as jnp, numpy as np
from tiny_pretraining import tiny_config, synthetic_batch
from bertjax.models import BertConfig, BertForPreTraining
from bertjax.tasks import pretraining
from bertjax.train import sharding as sharding_lib, step as step_lib
from bertjax.train.optimizer import make_optimizer

config = tiny_config(hidden_dropout_prob=0.0, attention_dropout_prob=0.0)
config.mesh.data = 4
cfg = BertConfig.from_dict(config.model)
init, loss = pretraining.step_fns(BertForPreTraining(cfg))
denominators = functools.partial(pretraining.loss_denominators, packed=False)
mesh = sharding_lib.make_mesh(config.mesh)
rules = config.logical_axis_rules
tx, schedule = make_optimizer(config.optimizer, 10)
_, shardings = step_lib.state_shardings(init, tx, mesh, rules)
state = step_lib.create_train_state(init, tx, jax.random.key(0), shardings)
batch_sharding = sharding_lib.batch_sharding(mesh, rules)
batch = jax.device_put(synthetic_batch(cfg, 16, 16, 4), batch_sharding)
rng = jax.random.key(1)

def grads_with(fn):
    f = functools.partial(fn, loss_fn=loss, denominators=denominators)
    jitted = jax.jit(sharding_lib.with_rules(f, mesh, rules))
    return jitted(state.params, batch, rng)[0], jitted.lower(state.params, batch, rng).compile()

exact, exact_compiled = grads_with(step_lib.gradients)
reduced, reduced_compiled = grads_with(step_lib.bf16_reduced_gradients)

# Independent reference: each replica's share of the batch's gradient on one device, then the
# bound of rounding 4 addends to bfloat16 and summing them in bfloat16.
totals = denominators(batch)
share = jax.jit(jax.grad(lambda p, b: loss(p, b, rng, denominators=totals)[0]))
host = jax.device_get(batch)
parts = [share(jax.device_get(state.params), {k: v[4 * i:4 * i + 4] for k, v in host.items()})
         for i in range(4)]
eps = 2.0 ** -8  # bfloat16's relative rounding error bound (8 significand bits)
for e, r, *ps in zip(*(jax.tree.leaves(t) for t in (exact, reduced, *parts))):
    e, r = np.asarray(e), np.asarray(r)
    scale = sum(np.abs(np.asarray(p)) for p in ps)
    np.testing.assert_allclose(sum(np.asarray(p) for p in ps), e, rtol=1e-5, atol=1e-6)
    assert np.all(np.abs(r - e) <= 8 * eps * scale + 1e-9), float(np.max(np.abs(r - e)))
assert any(not np.array_equal(e, r)
           for e, r in zip(jax.tree.leaves(exact), jax.tree.leaves(reduced)))

def all_reduce_types(compiled):
    heads = re.findall(r"= (\(?[^=]*?) all-reduce(?:-start)?\(", compiled.as_text())
    return set(re.findall(r"\b(bf16|f32)\[", " ".join(heads)))
assert all_reduce_types(exact_compiled) == {"f32"}, all_reduce_types(exact_compiled)
# Every parameter's [data, ...] replica gradients are summed in bfloat16 (XLA:CPU then widens
# that all-reduce to float32; the TPU compiler keeps it: tests/aot/test_aot_tpu.py).
lowered = jax.jit(sharding_lib.with_rules(functools.partial(
    step_lib.bf16_reduced_gradients, loss_fn=loss, denominators=denominators), mesh, rules)
    ).lower(state.params, batch, rng).as_text()
bf16_sums = re.findall(r"stablehlo.reduce\(.*across dimensions = \[0\] : "
                       r"\(tensor<4x[0-9x]*bf16>", lowered)
assert len(bf16_sums) == len(jax.tree.leaves(state.params)), len(bf16_sums)

# The default train step is the float32 one, program for program.
def step_text(**kw):
    step = step_lib.jit_train_step(loss, tx, schedule, shardings, batch_sharding,
                                   denominators=denominators, rules=rules, **kw)
    return step.lower(state, batch).as_text()
assert step_text() == step_text(grad_reduce_dtype="float32")
assert step_text() != step_text(grad_reduce_dtype="bfloat16")
print("BF16_REDUCE_OK")
"""


def test_bf16_gradient_reduction_rounds_only_the_replica_sum():
    """grad_reduce_dtype: float32 (default) is the unchanged step; bfloat16 all-reduces the
    data-parallel replicas' gradients in bfloat16, within bfloat16 rounding of the float32
    gradient (4 CPU devices, data=4)."""
    proc = run_python(["-c", BF16_REDUCE_SCRIPT],
                      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert "BF16_REDUCE_OK" in proc.stdout, proc.stdout + proc.stderr


def test_a_phase_remat_policy_applies_to_that_phase_alone():
    """phase2.remat_policy="full": phase 2's loss rematerialises (a remat in its gradient's
    jaxpr), phase 1 keeps the job's loss, and both give the same loss and gradients."""
    from bertjax.tasks.pretraining import PretrainingJob

    config = tiny_config()
    config.phases.phase2.remat_policy = "full"
    job = PretrainingJob(config, make_input=None)
    one, two = job.stages
    assert one.loss is None and two.loss is not None
    params = step_lib.initial_params(job.init_params, jax.random.key(0))
    batch = synthetic_batch(BertConfig.from_dict(config.model), 4, 16, 4)
    rng = jax.random.key(1)

    def grad(loss):
        return jax.value_and_grad(lambda p: loss(p, batch, rng)[0])

    assert "remat" in str(jax.make_jaxpr(grad(two.loss))(params))
    assert "remat" not in str(jax.make_jaxpr(grad(job.loss))(params))
    (value, grads), (ref_value, ref_grads) = grad(two.loss)(params), grad(job.loss)(params)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    steps = step_lib.stage_train_steps(job, *make_optimizer(config.optimizer, 10), None, None)
    assert steps["phase1"] is not steps["phase2"]


def test_unknown_phase_remat_policy_is_a_config_error():
    config = tiny_config()
    config.phases.phase2.remat_policy = "some"
    with pytest.raises(ConfigError, match="config.phases.phase2.remat_policy='some'"):
        rules.plan_phases(config)


def test_an_axis_its_mesh_axes_do_not_divide_is_left_whole():
    """A 30,522-word table over 4-way tensor parallelism: the vocab axis stays whole (jit
    arguments must split evenly), every other axis keeps its split."""
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

    mesh = AbstractMesh((2, 4), ("data", "tensor"))
    sharding = NamedSharding(mesh, PartitionSpec("tensor", "data"))
    cases = {(30522, 1024): [None, "data"], (30528, 1024): ["tensor", "data"],
             (30522, 1023): [None, None]}
    for shape, expected in cases.items():
        out = step_lib.divisible_sharding(jax.ShapeDtypeStruct(shape, np.float32), sharding)
        assert list(out.spec) == expected, shape


SHARDED_OPTIMIZER_SCRIPT = r"""
import jax, numpy as np
from tiny_pretraining import tiny_config, synthetic_batch
from bertjax.models import BertConfig, BertForPreTraining
from bertjax.tasks import pretraining
from bertjax.train import sharding as sharding_lib, step as step_lib
from bertjax.train.optimizer import make_optimizer

config = tiny_config(hidden_dropout_prob=0.0, attention_dropout_prob=0.0)
config.mesh.data = 4
cfg = BertConfig.from_dict(config.model)
init, loss = pretraining.step_fns(BertForPreTraining(cfg))
mesh = sharding_lib.make_mesh(config.mesh)
rules = config.logical_axis_rules
tx, schedule = make_optimizer(config.optimizer, 10)
batch_sharding = sharding_lib.batch_sharding(mesh, rules)
batch = jax.device_put(synthetic_batch(cfg, 16, 16, 4), batch_sharding)
runs = {}
for shard in (False, True):
    abstract, shardings = step_lib.state_shardings(init, tx, mesh, rules,
                                                   shard_optimizer=shard)
    state = step_lib.create_train_state(init, tx, jax.random.key(0), shardings)
    step = step_lib.jit_train_step(loss, tx, schedule, shardings, batch_sharding, rules=rules)
    for _ in range(3):
        state, metrics = step(state, batch)
    runs[shard] = (jax.device_get(state), shardings)

(plain, plain_shardings), (sharded, shardings) = runs[False], runs[True]
# The gradients are constrained to the moments' layout only where it differs from the params'.
assert step_lib.gradient_shardings(plain_shardings) is None
assert step_lib.gradient_shardings(shardings) is not None
# The same training, to float32 summation order: params and both moments.
for a, b in zip(*(jax.tree.leaves((s.params, s.opt_state)) for s in (plain, sharded))):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               rtol=1e-5, atol=1e-7)
# Every moment whose leading axis 4 divides is split over `data` there; params are not.
moments = list(zip(jax.tree.leaves(plain.opt_state), jax.tree.leaves(shardings.opt_state)))
assert sum(a.ndim > 0 and a.shape[0] % 4 == 0 for a, _ in moments) >= len(moments) // 2
for a, s in moments:
    assert ("data" in str(s.spec[:1])) == (a.ndim > 0 and a.shape[0] % 4 == 0), (a.shape, s)
assert not any("data" in str(s.spec) for s in jax.tree.leaves(shardings.params))
# Each device holds about a quarter of the moments (the TPU compiler's collectives for it:
# tests/aot/test_aot_tpu.py).
def per_device(tree, shardings):
    return sum(np.prod(s.shard_shape(a.shape)) for a, s in
               zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))
held = per_device(sharded.opt_state, shardings.opt_state)
assert held < 0.3 * per_device(plain.opt_state, plain_shardings.opt_state), held
print("SHARDED_OPTIMIZER_OK")
"""


def test_a_sharded_optimizer_state_trains_the_same_and_splits_the_moments():
    """shard_optimizer: Adam's moments split over the 4 data-parallel CPU devices; three steps
    give the same parameters and moments as the replicated optimizer state."""
    proc = run_python(["-c", SHARDED_OPTIMIZER_SCRIPT],
                      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert "SHARDED_OPTIMIZER_OK" in proc.stdout, proc.stdout + proc.stderr

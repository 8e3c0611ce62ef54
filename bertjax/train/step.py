"""Train state, its sharded initialisation, and the train step shared by every job.

A job gives two pure functions:
  init_params(rng) -> boxed params (`nn.LogicallyPartitioned` leaves: their logical axis names
    fix the sharding), e.g. `lambda rng: model.init(rng, ids)["params"]`;
  loss_fn(params, batch, rng, denominators=None) -> (loss [] float32, metrics {name: []});
    `rng` is the dropout key of the step (None for a deterministic pass);
and optionally a third:
  denominators(batch) -> {term: [] float32}, the normalisers of the loss's weighted means over
    a batch (e.g. the sum of the masked-LM weights); they depend on the batch, not the params.
    `loss_fn(..., denominators=d)` divides by `d` instead of its batch's own normalisers
    (None: its own, today's numbers bit for bit).
Pre-training's MLM + NSP loss is one such loss (bertjax/tasks/pretraining/objective.py), fine-tuning
heads are others (bertjax/tasks/).

Gradient accumulation (grad_accum_steps = k > 1) splits the global batch into k micro-batches.
With `denominators`, they are computed once over the global batch, each micro-batch's loss,
metrics and gradient are then its share of the global batch's, and the step sums the shares:
k micro-batches of B / k make one batch of B (up to float32 rounding), however unevenly the
real predictions, labels or filler rows fall. Without it the step averages the k micro-batch
means (weight 1 / k), which equals one batch of B only when every micro-batch weighs the same
(e.g. the same number of masked-LM predictions), and every metric must then be such a share.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bertjax.train import sharding as sharding_lib

Batch = dict[str, jax.Array]
InitFn = Callable[[jax.Array], Any]
Denominators = dict[str, jax.Array]
# (params, batch, rng[, denominators]) -> (loss, metrics)
LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
DenominatorsFn = Callable[[Batch], Denominators]


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # [] int32, the global step
    params: Any
    opt_state: Any
    rng: jax.Array  # [] typed dropout base key (config.rng_impl); each step folds in `step`


# Dropout keys: "threefry2x32" is JAX's counter-based hash (identical bits on every backend and
# sharding); "rbg" and "unsafe_rbg" use XLA's RngBitGenerator (the TPU's hardware generator),
# deterministic for a given compiled program and key, so a resumed run repeats its masks.
RNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
DEFAULT_RNG_IMPL = "threefry2x32"
# config.train.grad_reduce_dtype when a config has none (jit_train_step).
DEFAULT_GRAD_REDUCE_DTYPE = "float32"


def initial_params(init_params: InitFn, rng):
    """The (unboxed) params a run seeded with `rng` (a threefry key) starts from."""
    params_rng, _ = jax.random.split(rng)
    return nn.unbox(init_params(params_rng))


def dropout_base_key(rng, rng_impl: str = DEFAULT_RNG_IMPL) -> jax.Array:
    """The dropout base key ([] typed key of `rng_impl`) of a run seeded with the threefry key
    `rng`; the parameters (`initial_params`) do not depend on `rng_impl`."""
    _, key = jax.random.split(rng)
    if rng_impl == "threefry2x32":
        return jax.random.wrap_key_data(jax.random.key_data(key), impl=rng_impl)
    words = jax.random.key_data(jax.random.key(0, impl=rng_impl)).shape
    return jax.random.wrap_key_data(jax.random.bits(key, words, jnp.uint32), impl=rng_impl)


def _init_state(init_params: InitFn, tx, rng_impl: str, rng) -> TrainState:
    params = initial_params(init_params, rng)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      rng=dropout_base_key(rng, rng_impl))


def state_shardings(init_params: InitFn, tx, mesh: Mesh, rules,
                    rng_impl: str = DEFAULT_RNG_IMPL, shard_optimizer: bool = False
                    ) -> tuple[TrainState, TrainState]:
    """(abstract state, NamedShardings of the state) without allocating anything.

    shard_optimizer: the optimizer's moments split over the `data` axis too (`over_data`), so
    that each data-parallel replica updates its share of the parameters; the train step then
    reduce-scatters the gradients and all-gathers the new parameters, the same bytes as the
    all-reduce it replaces (see `train_step`)."""
    boxed = jax.eval_shape(init_params, jax.random.key(0))
    param_specs = nn.get_partition_spec(boxed)
    abstract = jax.eval_shape(functools.partial(_init_state, init_params, tx, rng_impl),
                              jax.random.key(0))
    opt_specs = optax.tree_map_params(
        tx,
        lambda _, spec: spec,
        abstract.opt_state,
        param_specs,
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    specs = TrainState(
        step=PartitionSpec(), params=param_specs, opt_state=opt_specs, rng=PartitionSpec()
    )
    shardings = nn.logical_to_mesh_sharding(specs, mesh, sharding_lib.as_rules(rules))
    shardings = jax.tree.map(divisible_sharding, abstract, shardings)
    if shard_optimizer:
        shardings = shardings.replace(opt_state=jax.tree.map(over_data, abstract.opt_state,
                                                             shardings.opt_state))
    return abstract, shardings


def over_data(array: jax.ShapeDtypeStruct, sharding: NamedSharding) -> NamedSharding:
    """`sharding` with the array's leading axis split over the `data` mesh axis as well, where
    `data` (times the axes already splitting it) divides it; else as it was (a scalar; the
    30,522-word embedding table, whose other axis split would relayout it every step)."""
    sizes = dict(sharding.mesh.shape)
    if (array.ndim == 0 or sizes.get("data", 1) == 1
            or any("data" in _mesh_axes(entry) for entry in sharding.spec)):
        return sharding
    spec = list(sharding.spec) + [None] * (array.ndim - len(sharding.spec))
    names = _mesh_axes(spec[0])
    if array.shape[0] % (sizes["data"] * math.prod(sizes[n] for n in names)):
        return sharding
    spec[0] = ("data",) + names
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def gradient_shardings(state_sharding: TrainState) -> Any | None:
    """The shardings of the optimizer's first parameter-shaped state (Adam's first moment),
    which the gradients are given before the update, where they differ from the parameters'
    (`over_data`); else None: a constraint that changes nothing still changes the TPU
    compiler's choices (the flash projections' bias gradients became slower reductions)."""
    if not isinstance(state_sharding, TrainState):
        return None
    structure = jax.tree.structure(state_sharding.params)

    def find(tree):
        if jax.tree.structure(tree) == structure:
            return tree
        children = tree.values() if isinstance(tree, dict) else (
            tree if isinstance(tree, tuple | list) else ())
        return next((found for child in children if (found := find(child)) is not None), None)

    moments = find(state_sharding.opt_state)
    same = moments is None or all(a.spec == b.spec for a, b in zip(
        jax.tree.leaves(moments), jax.tree.leaves(state_sharding.params)))
    return None if same else moments


def divisible_sharding(array: jax.ShapeDtypeStruct, sharding: NamedSharding) -> NamedSharding:
    """`sharding` with each array axis left whole where its mesh axes do not divide it (e.g. a
    30,522-word vocabulary over 4-way tensor parallelism): arguments must split evenly."""
    spec = list(sharding.spec) + [None] * (array.ndim - len(sharding.spec))
    for axis, names in enumerate(spec):
        if array.shape[axis] % math.prod(sharding.mesh.shape[n] for n in _mesh_axes(names)):
            spec[axis] = None
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def _mesh_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def create_train_state(init_params: InitFn, tx, rng, shardings: TrainState,
                       rng_impl: str = DEFAULT_RNG_IMPL) -> TrainState:
    """Initialises the state directly in its sharded layout (never whole on one device).
    rng: the run's threefry seed key (`jax.random.key(seed)`); rng_impl: the dropout keys'."""
    return jax.jit(functools.partial(_init_state, init_params, tx, rng_impl),
                   out_shardings=shardings)(rng)


def replace_params(state: TrainState, loaded: dict[str, Any], shardings: TrainState) -> TrainState:
    """`state` with the top-level param groups of `loaded` (host arrays, e.g. {"bert": ...} from
    a pre-trained checkpoint) placed with the state's shardings; optimizer state untouched."""
    params = dict(state.params)
    for name, group in loaded.items():
        params[name] = jax.device_put(group, shardings.params[name])
    return state.replace(params=params)


def _micro_batches(batch: Batch, num: int) -> Batch:
    """[batch, ...] → [num, batch // num, ...], taking examples strided so that each device's
    shard of the batch axis stays on that device."""

    def split(x):
        x = x.reshape((x.shape[0] // num, num) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, batch)


GRAD_REDUCE_DTYPES = ("float32", "bfloat16")


def gradients(params, batch: Batch, dropout_rng, *, loss_fn: LossFn, grad_accum_steps: int = 1,
              denominators: DenominatorsFn | None = None) -> tuple[Any, dict[str, jax.Array]]:
    """(gradients, metrics) of the loss over `batch` (accumulated over `grad_accum_steps`
    micro-batches: shares of the batch's normalisers summed with `denominators`, else a 1 / k
    mean; see the module docstring)."""
    if grad_accum_steps == 1:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, metrics), grads = grad_fn(params, batch, dropout_rng)
        return grads, metrics
    share = loss_fn
    if denominators is not None:  # shares of the global batch: their sum is its value
        share = functools.partial(loss_fn, denominators=denominators(batch))
    grad_fn = jax.value_and_grad(share, has_aux=True)

    def accumulate(carry, inputs):
        micro, index = inputs
        (_, m), g = grad_fn(params, micro, jax.random.fold_in(dropout_rng, index))
        return jax.tree.map(lambda c, x: c + x.astype(jnp.float32), carry, (g, m)), None

    micro = _micro_batches(batch, grad_accum_steps)
    first = jax.tree.map(lambda x: x[0], micro)
    (_, metric_shapes), grad_shapes = jax.eval_shape(grad_fn, params, first, dropout_rng)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), (grad_shapes, metric_shapes))
    (grads, metrics), _ = jax.lax.scan(accumulate, zeros, (micro, jnp.arange(grad_accum_steps)))
    if denominators is None:
        grads, metrics = jax.tree.map(lambda x: x / grad_accum_steps, (grads, metrics))
    return grads, metrics


def _without_axis(rules, axis: str):
    """Logical-axis rules with mesh axis `axis` taken out of every mapping."""
    def strip(value):
        if isinstance(value, tuple):
            kept = tuple(a for a in value if a != axis)
            return kept if len(kept) > 1 else (kept[0] if kept else None)
        return None if value == axis else value

    return tuple((name, strip(value)) for name, value in rules)


def bf16_reduced_gradients(params, batch: Batch, dropout_rng, *, loss_fn: LossFn,
                           grad_accum_steps: int = 1,
                           denominators: DenominatorsFn | None = None
                           ) -> tuple[Any, dict[str, jax.Array]]:
    """`gradients` with the sum over data-parallel replicas (the `data` mesh axis) done in
    bfloat16, which halves the bytes of that all-reduce; the result is float32 again.

    The batch [B, ...] is viewed as [data, B / data, ...] (each replica's rows, already on its
    devices) and the gradient of every replica's rows is taken under `vmap` along the `data`
    axis; each is cast to bfloat16 and the replicas' are summed. With `denominators` each
    replica's gradient is its share of the global batch's, so the sum is the batch's gradient
    (else the replicas' means are averaged). Dropout keys differ per replica. Sums within a
    replica (over `fsdp` and the micro-batches) stay float32. Traced where a mesh is set
    (`sharding.with_rules`); without a `data` axis above 1 it is `gradients` cast to bf16.
    """
    mesh = jax.sharding.get_abstract_mesh()
    replicas = 1 if mesh.empty else dict(zip(mesh.axis_names, mesh.axis_sizes)).get("data", 1)
    kwargs = dict(grad_accum_steps=grad_accum_steps)
    scale = 1.0
    if denominators is not None:
        totals = denominators(batch)  # of the global batch
        if grad_accum_steps == 1:
            kwargs["loss_fn"] = functools.partial(loss_fn, denominators=totals)
        else:
            kwargs.update(loss_fn=loss_fn, denominators=lambda _: totals)
    else:
        kwargs["loss_fn"], scale = loss_fn, 1.0 / replicas
    per_replica = functools.partial(gradients, params, **kwargs)

    def reduce(x):  # [replicas, ...] → [...], summed in bfloat16 (jnp.sum would upcast)
        low = x.astype(jnp.bfloat16)
        total = jax.lax.reduce(low, jnp.zeros((), jnp.bfloat16), jax.lax.add, (0,))
        return total.astype(x.dtype) * scale

    if replicas == 1:
        grads, metrics = per_replica(batch, dropout_rng)
        return jax.tree.map(lambda g: reduce(g[None]), grads), metrics
    split = jax.tree.map(lambda x: x.reshape((replicas, x.shape[0] // replicas) + x.shape[1:]),
                         batch)
    keys = jax.vmap(lambda i: jax.random.fold_in(dropout_rng, i))(jnp.arange(replicas))
    # Inside the vmap the batch axis of the activations is split over the other axes only.
    with nn.logical_axis_rules(_without_axis(nn.get_logical_axis_rules(), "data")):
        grads, metrics = jax.vmap(per_replica, spmd_axis_name="data")(split, keys)
    metrics = jax.tree.map(lambda m: jnp.sum(m, axis=0) * scale, metrics)
    return jax.tree.map(reduce, grads), metrics


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    grad_accum_steps: int = 1,
    denominators: DenominatorsFn | None = None,
    grad_reduce_dtype: str = DEFAULT_GRAD_REDUCE_DTYPE,
    grad_sharding: Any | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on a global batch (accumulated over `grad_accum_steps` micro-batches:
    shares of the global batch's normalisers summed with `denominators`, else a 1 / k mean;
    see the module docstring). grad_reduce_dtype "bfloat16": the sum over data-parallel
    replicas in bfloat16 (`bf16_reduced_gradients`); params and moments stay float32.
    grad_sharding: the gradients' layout for the update (`gradient_shardings`): with moments
    split over `data`, the replicas' gradients are reduce-scattered into it."""
    dropout_rng = jax.random.fold_in(state.rng, state.step)
    compute = bf16_reduced_gradients if grad_reduce_dtype == "bfloat16" else gradients
    grads, metrics = compute(state.params, batch, dropout_rng, loss_fn=loss_fn,
                             grad_accum_steps=grad_accum_steps, denominators=denominators)
    if grad_sharding is not None:
        grads = jax.lax.with_sharding_constraint(grads, grad_sharding)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, grad_norm=optax.global_norm(grads), learning_rate=schedule(state.step))
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics


def stage_batch(job, stage) -> tuple[int, int]:
    """(global batch, micro-batches per step) of `stage` (loop.Stage): its own where set (a
    pre-training phase's), else the job's."""
    return (stage.batch_size or job.batch_size,
            stage.grad_accum_steps or job.grad_accum_steps)


def stage_train_steps(job, tx, schedule, state_sharding, batch_sharding,
                      rules: sharding_lib.Rules | None = None) -> dict[str, Any]:
    """{stage name: its jitted train step}: one per distinct loss and accumulation, the job's
    `loss` unless a stage brings its own (`stage.loss`, e.g. a phase with another remat
    policy), split into the stage's micro-batches (`stage_batch`). A stage with another batch
    size shares the jitted step, which traces again for the new shape. rules: see
    `jit_train_step`."""
    by_key, steps = {}, {}
    for stage in job.stages:
        key = (stage.loss or job.loss, stage_batch(job, stage)[1])
        if key not in by_key:
            by_key[key] = jit_train_step(key[0], tx, schedule, state_sharding, batch_sharding,
                                         key[1], job.denominators, rules, job.grad_reduce_dtype)
        steps[stage.name] = by_key[key]
    return steps


def jit_train_step(loss_fn: LossFn, tx, schedule, state_sharding, batch_sharding,
                   grad_accum_steps: int = 1, denominators: DenominatorsFn | None = None,
                   rules: sharding_lib.Rules | None = None,
                   grad_reduce_dtype: str = DEFAULT_GRAD_REDUCE_DTYPE):
    """`train_step` jitted with explicit in/out shardings and the state donated.

    rules: the logical-axis rules; with them (and a NamedSharding `batch_sharding`, whose mesh
    is used) the model's activation constraints take effect (`sharding.with_rules`).
    """
    grad_sharding = gradient_shardings(state_sharding)
    step = functools.partial(train_step, loss_fn=loss_fn, tx=tx, schedule=schedule,
                             grad_accum_steps=grad_accum_steps, denominators=denominators,
                             grad_reduce_dtype=grad_reduce_dtype,
                             **({} if grad_sharding is None else {"grad_sharding": grad_sharding}))
    if rules is not None and batch_sharding is not None:
        step = sharding_lib.with_rules(step, batch_sharding.mesh, rules)
    return jax.jit(
        step,
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, None),
        donate_argnums=(0,),
    )

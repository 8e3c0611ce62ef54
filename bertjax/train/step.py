"""Train state, its sharded initialisation, and the pre-training step."""

from __future__ import annotations

import functools
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec

from bertjax.models import BertForPreTraining, pretraining_loss
from bertjax.train import sharding as sharding_lib

Batch = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # [] int32, the global step across phases
    params: Any
    opt_state: Any
    rng: jax.Array  # base key; each step folds in `step` for dropout


def batch_spec(
    batch_size: int, seq_len: int, max_predictions: int, packed: bool = False
) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of a pre-training batch (the reference TFRecord features).

    packed: rows of several examples (data_pipeline/packed_input.py): `packing_ids`
    [batch, seq] instead of `next_sentence_labels` (no NSP).
    """
    i32, f32 = jnp.int32, jnp.float32
    spec = {
        "input_ids": jax.ShapeDtypeStruct((batch_size, seq_len), i32),
        "input_mask": jax.ShapeDtypeStruct((batch_size, seq_len), i32),
        "segment_ids": jax.ShapeDtypeStruct((batch_size, seq_len), i32),
        "masked_lm_positions": jax.ShapeDtypeStruct((batch_size, max_predictions), i32),
        "masked_lm_ids": jax.ShapeDtypeStruct((batch_size, max_predictions), i32),
        "masked_lm_weights": jax.ShapeDtypeStruct((batch_size, max_predictions), f32),
        "next_sentence_labels": jax.ShapeDtypeStruct((batch_size,), i32),
    }
    if packed:
        del spec["next_sentence_labels"]
        spec["packing_ids"] = jax.ShapeDtypeStruct((batch_size, seq_len), i32)
    return spec


def init_params(model: BertForPreTraining, rng: jax.Array) -> Any:
    """Boxed (logically partitioned) parameters; shapes do not depend on the sequence length."""
    ids = jnp.zeros((1, 8), jnp.int32)
    return model.init(rng, ids, ids, ids, jnp.zeros((1, 1), jnp.int32))["params"]


def _init_state(model, tx, rng) -> TrainState:
    params_rng, dropout_rng = jax.random.split(rng)
    params = nn.unbox(init_params(model, params_rng))
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=dropout_rng
    )


def state_shardings(model, tx, mesh: Mesh, rules) -> tuple[TrainState, TrainState]:
    """(abstract state, NamedShardings of the state) without allocating anything."""
    boxed = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    param_specs = nn.get_partition_spec(boxed)
    abstract = jax.eval_shape(functools.partial(_init_state, model, tx), jax.random.key(0))
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
    return abstract, shardings


def create_train_state(model, tx, rng, shardings: TrainState) -> TrainState:
    """Initialises the state directly in its sharded layout (never whole on one device)."""
    return jax.jit(functools.partial(_init_state, model, tx), out_shardings=shardings)(rng)


def model_outputs(model, params, batch: Batch, packed: bool, **kwargs) -> dict[str, jax.Array]:
    """The model applied to a batch; packed batches pass `packing_ids` (block-diagonal
    attention, position ids restarting at each example)."""
    extra = {"packing_ids": batch["packing_ids"]} if packed else {}
    return model.apply(
        {"params": params}, batch["input_ids"], batch["segment_ids"], batch["input_mask"],
        batch["masked_lm_positions"], **extra, **kwargs,
    )


def loss_and_metrics(outputs, batch: Batch, nsp_weight: float, packed: bool):
    """`pretraining_loss`; a packed row has no sentence pair, so NSP (weight 0) gets a dummy
    label and its metrics are left out."""
    if not packed:
        return pretraining_loss(outputs, batch, nsp_weight)
    labels = jnp.zeros(batch["input_ids"].shape[:1], jnp.int32)
    loss, metrics = pretraining_loss(outputs, dict(batch, next_sentence_labels=labels), 0.0)
    return loss, {k: v for k, v in metrics.items() if not k.startswith("nsp_")}


def _micro_batches(batch: Batch, num: int) -> Batch:
    """[batch, ...] → [num, batch // num, ...], taking examples strided so that each device's
    shard of the batch axis stays on that device."""

    def split(x):
        x = x.reshape((x.shape[0] // num, num) + x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, batch)


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    model: BertForPreTraining,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    grad_accum_steps: int = 1,
    nsp_weight: float = 1.0,
    packed: bool = False,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on a global batch (accumulated over `grad_accum_steps` micro-batches).

    packed: the batch carries `packing_ids` (see `batch_spec`); NSP is off (nsp_weight 0).
    """
    if packed and nsp_weight:
        raise ValueError(f"packed batches have no sentence pairs; nsp_weight={nsp_weight} "
                         "must be 0.0")
    dropout_rng = jax.random.fold_in(state.rng, state.step)

    def loss_fn(params, micro, rng):
        outputs = model_outputs(model, params, micro, packed, deterministic=False,
                                rngs={"dropout": rng})
        return loss_and_metrics(outputs, micro, nsp_weight, packed)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if grad_accum_steps == 1:
        (_, metrics), grads = grad_fn(state.params, batch, dropout_rng)
    else:
        def accumulate(carry, inputs):
            micro, index = inputs
            (_, m), g = grad_fn(state.params, micro, jax.random.fold_in(dropout_rng, index))
            return jax.tree.map(lambda c, x: c + x.astype(jnp.float32), carry, (g, m)), None

        micro = _micro_batches(batch, grad_accum_steps)
        first = jax.tree.map(lambda x: x[0], micro)
        (_, metric_shapes), grad_shapes = jax.eval_shape(grad_fn, state.params, first, dropout_rng)
        zeros = jax.tree.map(
            lambda s: jnp.zeros(s.shape, jnp.float32), (grad_shapes, metric_shapes)
        )
        (grads, metrics), _ = jax.lax.scan(
            accumulate, zeros, (micro, jnp.arange(grad_accum_steps))
        )
        grads, metrics = jax.tree.map(lambda x: x / grad_accum_steps, (grads, metrics))

    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, grad_norm=optax.global_norm(grads), learning_rate=schedule(state.step))
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics


def jit_train_step(model, tx, schedule, state_sharding, batch_sharding, **step_kwargs):
    """`train_step` jitted with explicit in/out shardings and the state donated."""
    step = functools.partial(train_step, model=model, tx=tx, schedule=schedule, **step_kwargs)
    return jax.jit(
        step,
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, None),
        donate_argnums=(0,),
    )

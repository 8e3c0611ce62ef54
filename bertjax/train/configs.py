"""Config checks and derived settings shared by every job: the dtype policy, the batch-size
check against the mesh, prediction batches, the gradient reduction and PRNG. All raise
ConfigError naming the field (pre-training's phase plan: bertjax/tasks/pretraining/rules.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh

from bertjax.errors import ConfigError
from bertjax.models import ModelConfig, model_config
from bertjax.train import step as step_lib


def compute_dtype(dtype: str) -> str:
    """The one dtype policy: "auto" computes in bfloat16 on TPU/GPU and in float32 on CPU; an
    explicit dtype is honoured on every backend (bfloat16 is fast on CPUs with AMX)."""
    if dtype == "auto":
        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return dtype


def resolve_model_config(fields: Mapping[str, Any]) -> ModelConfig:
    """BertConfig or ModernConfig (bertjax.models.model_config) from config fields
    (config.model, or a checkpoint's config with overrides)."""
    fields = dict(fields)
    fields["dtype"] = compute_dtype(fields.get("dtype", "float32"))
    return model_config(fields)


def check_batch_size(batch_size: int, mesh: Mesh, grad_accum_steps: int = 1,
                     field: str = "config.train.batch_size") -> None:
    """The global batch (and each micro-batch) must split evenly over the data-parallel devices
    and the processes."""
    data_parallel = data_parallel_size(mesh)
    if batch_size < 1:
        raise ConfigError(f"{field}={batch_size} must be positive")
    if batch_size % grad_accum_steps or (batch_size // grad_accum_steps) % data_parallel:
        accum = f" with grad_accum_steps={grad_accum_steps}" if grad_accum_steps > 1 else ""
        raise ConfigError(
            f"{field}={batch_size}{accum} does not divide evenly over the {data_parallel} "
            "data-parallel devices (data x fsdp)")
    if batch_size % jax.process_count():
        raise ConfigError(
            f"{field}={batch_size} is not divisible by the {jax.process_count()} processes")


def data_parallel_size(mesh: Mesh) -> int:
    """Devices a global batch is split over (data x fsdp)."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


# On a CPU, prediction batches (fine-tuning's evaluations, python -m bertjax.predict) hold at
# most this many rows at 128 tokens and longer: XLA:CPU computes 8 rows as fast per row as 64,
# and each length bucket's last batch is filled up with weight-0 rows, which larger batches
# multiply (on a GLUE-sized dev set, most of what 64-row batches compute).
CPU_PREDICTION_ROWS = 8


def prediction_batch_size(batch_size: int, platform: str, data_parallel: int = 1) -> int:
    """Rows of a prediction batch for a configured `batch_size` (config.eval.batch_size) on
    `platform`'s devices: on "cpu" at most CPU_PREDICTION_ROWS, rounded up to a multiple of the
    `data_parallel` devices the batch is split over; elsewhere `batch_size`. The evaluations
    and the prediction command apply the same rule, so a run's files and a later prediction
    on the same machine agree bitwise."""
    if platform != "cpu":
        return batch_size
    return min(batch_size, -(-CPU_PREDICTION_ROWS // data_parallel) * data_parallel)


def check_stage_batches(job, mesh: Mesh) -> None:
    """`check_batch_size` for each stage of `job` (bertjax/train/loop.py) at its own batch and
    accumulation (step.stage_batch), naming the field that set it (a phase's or
    config.train.batch_size)."""
    for stage in job.stages:
        batch, accum = step_lib.stage_batch(job, stage)
        check_batch_size(batch, mesh, accum, field=stage.batch_field)


def grad_reduce_dtype(config) -> str:
    """config.train.grad_reduce_dtype (default step.DEFAULT_GRAD_REDUCE_DTYPE): the dtype of
    the gradients' sum over the data-parallel devices (bertjax.train.step)."""
    return config.train.get("grad_reduce_dtype", step_lib.DEFAULT_GRAD_REDUCE_DTYPE)


def rng_impl(config) -> str:
    """config.rng_impl (default step.DEFAULT_RNG_IMPL): the PRNG of the dropout keys, one of
    step.RNG_IMPLS; the parameters' initialisation does not depend on it."""
    value = config.get("rng_impl", step_lib.DEFAULT_RNG_IMPL)
    if value not in step_lib.RNG_IMPLS:
        raise ConfigError(
            f"config.rng_impl={value!r} is not one of {' | '.join(step_lib.RNG_IMPLS)}")
    return value

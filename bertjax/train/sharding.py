"""Device mesh from config, and logical-axis → mesh shardings for parameters and batches."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bertjax.errors import ConfigError
from bertjax.models.kernels import flash_attention

MESH_AXES = ("data", "fsdp", "tensor")
Rules = Sequence[tuple[str, Any]]


def mesh_shape(sizes: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
    """Resolves `{data, fsdp, tensor}` sizes (at most one -1 = fill) for `num_devices`."""
    unknown = sorted(set(sizes) - set(MESH_AXES))
    if unknown:
        raise ConfigError(f"config.mesh has unknown axes {unknown}; the axes are {MESH_AXES}")
    shape = [int(sizes.get(axis, 1)) for axis in MESH_AXES]
    fill = [i for i, s in enumerate(shape) if s == -1]
    if len(fill) > 1 or any(s == 0 or s < -1 for s in shape):
        raise ConfigError(f"config.mesh={dict(sizes)}: sizes must be positive, with at most one -1")
    known = math.prod(s for s in shape if s != -1)
    if fill:
        if num_devices % known:
            raise ConfigError(
                f"config.mesh={dict(sizes)}: {num_devices} devices are not divisible by {known}"
            )
        shape[fill[0]] = num_devices // known
    if math.prod(shape) != num_devices:
        raise ConfigError(
            f"config.mesh={dict(sizes)} needs {math.prod(shape)} devices but {num_devices} are "
            "available; set one axis to -1 to fill the rest"
        )
    return tuple(shape)


def make_mesh(sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(sizes, len(devices))
    try:
        from jax.experimental import mesh_utils

        device_grid = mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
        # Topology-aware placement is unavailable for some device kinds (e.g. CPU subsets).
        device_grid = np.asarray(devices).reshape(shape)
    return Mesh(device_grid, MESH_AXES)


def as_rules(rules: Any) -> tuple[tuple[str, Any], ...]:
    """Normalises rules from a ConfigDict (lists become tuples)."""
    def axis(value):
        return tuple(value) if isinstance(value, list | tuple) else value

    return tuple((str(name), axis(value)) for name, value in rules)


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
    """Sharding of batch arrays: leading `batch` axis split, everything else replicated."""
    spec = nn.logical_to_mesh_axes(("batch",), as_rules(rules))
    return NamedSharding(mesh, PartitionSpec(*spec))


@contextlib.contextmanager
def in_force(mesh: Mesh, rules: Rules):
    """The logical-axis `rules` and `mesh` in force while a jitted function is traced, so the
    model's `nn.with_logical_constraint` calls constrain its activations.

    Without both, flax makes those calls no-ops and XLA picks the activations' shardings from
    the parameters': under FSDP the embedding table's `embed` split over `fsdp` sharded the
    [batch, seq, hidden] activations over hidden, every matmul's contraction then ran
    split over fsdp, and its [batch, seq, ...] results were all-gathered and all-reduced over
    the whole global batch (more temporaries per device than data parallelism).
    Flash attention's Mosaic kernels cannot be partitioned by XLA: they run per batch shard
    (flash_attention.sharded_like).
    """
    rules = as_rules(rules)
    with (jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules),
          flash_attention.sharded_like(batch_sharding(mesh, rules))):
        yield


def with_rules(fn: Callable, mesh: Mesh, rules: Rules) -> Callable:
    """`fn` traced with `in_force(mesh, rules)` (for `jax.jit`)."""
    def constrained(*args, **kwargs):
        with in_force(mesh, rules):
            return fn(*args, **kwargs)

    # Keep the function's name: profiles and HLO dumps name the jitted program by it.
    base = fn.func if isinstance(fn, functools.partial) else fn
    constrained.__name__ = constrained.__qualname__ = base.__name__
    return constrained

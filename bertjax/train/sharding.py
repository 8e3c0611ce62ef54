"""Device mesh from config, and logical-axis → mesh shardings for parameters and batches."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bertjax.models.config import ConfigError

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


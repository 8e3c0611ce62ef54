"""Encoder params in the unrolled or the `nn.scan` layout (`BertConfig.scan_layers`).

unrolled (`scan_layers=False`, the stored layout):  .../encoder/layer_{i}/<layer params>
scanned  (`scan_layers=True`):                      .../encoder/layers/layer/<layer params>
                                                    with a leading [num_layers] axis

These functions accept BertForPreTraining params ({"bert": {"encoder": ...}, ...}) or BertModel
params ({"encoder": ...}), hold NumPy or JAX arrays, and return a new dict (inputs untouched).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _with_encoder(params: Mapping[str, Any], fn) -> dict[str, Any]:
    if "bert" in params:
        return {**params, "bert": _with_encoder(params["bert"], fn)}
    if "encoder" not in params:
        raise ValueError(f"params have no encoder; top-level keys are {sorted(params)}")
    return {**params, "encoder": fn(params["encoder"])}


def stack_layers(params: Mapping[str, Any]) -> dict[str, Any]:
    """Unrolled → scanned: `layer_0..layer_{L-1}` stacked into `layers/layer` [L, ...]."""

    def stack(encoder):
        if "layers" in encoder:
            return dict(encoder)  # already scanned
        num = len(encoder)
        names = [f"layer_{i}" for i in range(num)]
        if sorted(encoder) != sorted(names):
            raise ValueError(f"encoder keys {sorted(encoder)} are not layer_0..layer_{num - 1}")
        layers = [encoder[n] for n in names]

        def stack_leaf(*xs):
            xp = jnp if any(isinstance(x, jax.Array) for x in xs) else np
            return xp.stack(xs)

        return {"layers": {"layer": jax.tree.map(stack_leaf, *layers)}}

    return _with_encoder(params, stack)


def unstack_layers(params: Mapping[str, Any]) -> dict[str, Any]:
    """Scanned → unrolled: `layers/layer` [L, ...] split into `layer_0..layer_{L-1}`."""

    def unstack(encoder):
        if "layers" not in encoder:
            return dict(encoder)  # already unrolled
        stacked = encoder["layers"]["layer"]
        num = jax.tree.leaves(stacked)[0].shape[0]
        return {f"layer_{i}": jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(num)}

    return _with_encoder(params, unstack)


def to_layout(params: Mapping[str, Any], scan_layers: bool) -> dict[str, Any]:
    """The layout that `BertConfig(scan_layers=scan_layers)` expects."""
    return stack_layers(params) if scan_layers else unstack_layers(params)

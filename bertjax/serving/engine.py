"""The prediction engine: a trained model's jitted task forward over the run's mesh.

    task.encode (length buckets of the run) → task.batches (fixed shapes per bucket)
      → jitted task.outputs + task.predict, batches sharded over the mesh's data axes
      → task.records (one plain record per example, in input order)

so predictions on a split equal those the run wrote for it at the end of training (same
batches, same compiled function, same params). Every process computes every batch (its share
of the rows, then gathered); callers write from process 0 (multihost.write_from_main). Given
`devices` (`python -m bertjax.predict` on a CPU split into one device per core), whole batches
run on those devices in turn instead (`DeviceTurns`): the same bits, the cores kept busier.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from bertjax.errors import ConfigError
from bertjax.serving.runs import TrainedModel
from bertjax.tasks.base import _predict, predict_rows
from bertjax.train import configs
from bertjax.train import sharding as sharding_lib
from bertjax.train.loop import Runner, batch_signature, compiled_ahead

# Meshes for a checkpoint directory without a run config (fill-mask): data-parallel only.
DATA_PARALLEL_MESH = {"data": -1, "fsdp": 1, "tensor": 1}
DATA_PARALLEL_RULES = (("batch", ("data", "fsdp")),)


def place_params(model, init_inputs: tuple, params, mesh, rules) -> Any:
    """Host params placed with the model's logical-axis shardings on `mesh`."""
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *init_inputs))["params"]
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh,
                                            sharding_lib.as_rules(rules))
    return jax.device_put(params, shardings)


class DeviceTurns:
    """Runs a jitted function over whole batches on devices in turn, a few batches in flight on
    each; the interface of train.loop.Runner (one process only).

    For a CPU split into devices (one per core): XLA:CPU spreads each op of one device's step
    over the cores, and its small ops (the attention's batched products, softmax, layer norms)
    leave cores idle; two devices stepping at once fill them. A batch runs whole, with the
    program and shapes it has on one device, so its predictions are bitwise those of one device
    (and of the run's files), unlike a batch split over the devices (fewer rows each).

    Each device compiles each batch shape it runs, and a compile costs as much as many batches:
    a run of fewer than SPREAD_BATCHES batches of one shape stays on one device (the runs taking
    the devices in turn, so different shapes step at once), a longer run takes them batch by
    batch."""

    SPREAD_BATCHES = 16
    IN_FLIGHT = 2  # batches dispatched and not yet fetched, per device

    def __init__(self, devices: Sequence[jax.Device]):
        if jax.process_count() > 1:
            raise ConfigError("whole batches on devices in turn are for one process; on a pod "
                              "slice the batches are sharded over the run's mesh")
        self.devices = list(devices)

    def place(self, params) -> list:
        """A copy of the host `params` on each device."""
        return [jax.device_put(params, device) for device in self.devices]

    def assign(self, batches: Iterable[dict[str, np.ndarray]]
               ) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """(device index, batch) for each of `batches`, in order (see the class docstring)."""
        n, turn = len(self.devices), 0
        run: list = []  # the current run's batches while it may still be short
        signature, spread = None, False
        for batch in batches:
            if batch_signature(batch) != signature:
                yield from ((turn, b) for b in run)  # a short run: one device
                turn = (turn + bool(run)) % n
                run, signature, spread = [], batch_signature(batch), False
            run.append(batch)
            if spread or len(run) == self.SPREAD_BATCHES:
                spread = True
                for b in run:
                    yield turn, b
                    turn = (turn + 1) % n
                run = []
        yield from ((turn, b) for b in run)

    def run(self, fn, params: list, batches: Iterable[dict[str, np.ndarray]]
            ) -> Iterator[tuple[dict[str, np.ndarray], Any]]:
        """(batch, fn(params, batch) on the host) for every batch, in order. Each device takes
        its next batch among the next 2 * SPREAD_BATCHES as soon as it has a free slot (so the
        next run steps while this one does); a jitted `fn` is compiled for each batch shape
        and device ahead (train.loop.compiled_ahead)."""
        source = self.assign(batches)
        if hasattr(fn, "lower"):
            def compile_for(i, item):
                device, batch = item
                fn.lower(params[device], jax.device_put(batch, self.devices[device])).compile()

            source = compiled_ahead(source, compile_for,
                                    lambda i, item: (item[0], batch_signature(item[1])))
        window: collections.deque = collections.deque()  # [device, batch, outputs | None]
        exhausted = False
        while window or not exhausted:
            while not exhausted and len(window) < 2 * self.SPREAD_BATCHES:
                item = next(source, None)
                exhausted = item is None
                if item is not None:
                    window.append([*item, None])
            running = collections.Counter(d for d, _, o in window
                                          if o is not None and not _ready(o))
            dispatched = False
            for entry in window:
                device, batch, outputs = entry
                if outputs is None and running[device] < self.IN_FLIGHT:
                    entry[2] = fn(params[device], jax.device_put(batch, self.devices[device]))
                    running[device] += 1
                    dispatched = True
            # The first entry is dispatched by now: the scan reaches it before any later entry
            # of its device. Fetching it waits, unless a dispatch is still to be made.
            _, batch, outputs = window[0]
            if not dispatched or _ready(outputs):
                window.popleft()
                yield batch, jax.device_get(outputs)


def _ready(outputs) -> bool:
    return all(leaf.is_ready() for leaf in jax.tree.leaves(outputs))


def runner_and_params(model, init_inputs: tuple, params, mesh_sizes, rules, batch_size: int,
                      devices: Sequence[jax.Device] | None = None) -> tuple[Any, Any]:
    """(runner, the host `params` placed for it): whole batches on each of `devices` in turn
    (`DeviceTurns`), or without devices, batches sharded over a mesh of `mesh_sizes` on every
    device (`rules`: the logical-axis rules; `batch_size` must divide over its data axes)."""
    if devices:
        runner = DeviceTurns(devices)
        return runner, runner.place(params)
    mesh = sharding_lib.make_mesh(mesh_sizes)
    configs.check_batch_size(batch_size, mesh, field="--batch_size")
    return (Runner(sharding_lib.batch_sharding(mesh, rules), rules),
            place_params(model, init_inputs, params, mesh, rules))


class Engine:
    """A trained model's jitted task forward over the run's mesh (see the module docstring).

    batch_size: rows per global batch (default: what the run's evaluations used,
    config.eval.batch_size, on a CPU at most 8: train.configs.prediction_batch_size; this makes
    predictions bitwise those of the run); it must divide over the data-parallel devices.
    devices: instead of the mesh, whole batches on each of these in turn (`DeviceTurns`)."""

    def __init__(self, trained: TrainedModel, batch_size: int | None = None,
                 devices: Sequence[jax.Device] | None = None):
        config, task = trained.config, trained.task
        self.trained, self.task = trained, task
        self.max_seq_length = int(config.max_seq_length)
        if not batch_size:  # the rows the run's evaluations used on this kind of device
            platform = (devices[0] if devices else jax.devices()[0]).platform
            parallel = 1 if devices else configs.data_parallel_size(
                sharding_lib.make_mesh(config.mesh))
            batch_size = configs.prediction_batch_size(config.eval.batch_size, platform,
                                                       parallel)
        self.batch_size = int(batch_size)
        self.model = model = task.model(trained.model_config)
        self.runner, self.params = runner_and_params(
            model, task.init_inputs(), trained.params, config.mesh, config.logical_axis_rules,
            self.batch_size, devices)
        self._predict = jax.jit(functools.partial(_predict, task=task, model=model))

    def run(self, examples: list) -> tuple[Any, dict[str, Any], dict[str, int]]:
        """(features, per-row predictions, {"real": tokens, "computed": token positions run})
        of `examples`."""
        features = self.task.encode(self.trained.tokenizer, examples, self.max_seq_length)
        tokens = {"real": 0, "computed": 0}
        predictions = predict_rows(self.task, self._predict, self.params, features,
                                   self.batch_size, self.runner, tokens)
        return features, predictions, tokens


def padding_line(tokens: dict[str, int]) -> str:
    waste = 1.0 - tokens["real"] / max(tokens["computed"], 1)
    return (f"padding is {100 * waste:.1f}% of the {tokens['computed']:,} token positions "
            "computed")

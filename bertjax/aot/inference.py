"""Dry run of the inference step (`python -m bertjax.predict --dry_run [--topology=v5e-8]`):
a finished run's predict step compiled per batch shape, for a TPU slice or this machine."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import ml_collections

from bertjax import paths
from bertjax.aot import measure
from bertjax.aot import topology as topology_lib
from bertjax.errors import CheckpointError
from bertjax.models import BertConfig
from bertjax.serving.runs import read_finished_run
from bertjax.tasks import get_task
from bertjax.tasks.base import Task, _predict
from bertjax.train import configs
from bertjax.train import sharding as sharding_lib
from bertjax.train.workdir import run_config_path


@dataclasses.dataclass
class InferenceCost:
    """The jitted predict step of one batch shape, compiled for the mesh's devices; bytes,
    FLOPs and time per device (chip)."""

    seq_len: int
    batch_size: int  # global
    total_bytes: float
    hbm_bytes: float | None  # the chip's HBM (None: the local machine's devices)
    flops: float | None
    step_seconds: float | None  # the compiler's estimate, else the roofline (TPU only)

    @property
    def fits(self) -> bool:
        return self.hbm_bytes is None or self.total_bytes <= self.hbm_bytes

    def sequences_per_second_per_chip(self, chips: int) -> float | None:
        return self.batch_size / self.step_seconds / chips if self.step_seconds else None


def batch_shapes(task: Task, max_seq_length: int, batch_size: int
                 ) -> list[tuple[int, int]]:
    """[(global rows, length)]: the batch shapes of the task's unshuffled (prediction) batches
    (data_pipeline.finetune_data's prediction plan, SQuAD windows included)."""
    from data_pipeline import finetune_data

    grid = finetune_data.prediction_buckets(finetune_data.bucket_lengths(
        max_seq_length, min(task.min_bucket_length, max_seq_length)))
    return [(finetune_data.prediction_rows(batch_size, n, max_seq_length), n) for n in grid]


def inference_costs(workdir: str, topology: str | None = None, batch_size: int | None = None,
                    dtype: str | None = None) -> tuple[list[InferenceCost], int, str]:
    """([cost per batch shape], chips, a header line) of a finished run's predict step:
    compiled by the TPU compiler for `topology`'s slice (any machine; dtype bfloat16 unless
    given), or for this machine's devices, the layers unrolled and measured as the training
    dry run does (measure.calibrated). Abstract shapes only: no checkpoint is read."""
    record, _ = read_finished_run(workdir)
    config = ml_collections.ConfigDict(
        paths.read_json_object(run_config_path(workdir), CheckpointError))
    task = get_task(config)
    task.restore(record.get("task") or task.legacy_state(record, config))
    fields = dict(record["model"])
    slice_ = topology_lib.parse(topology) if topology else None
    devices = topology_lib.devices(slice_) if slice_ else jax.devices()
    if dtype or slice_:
        fields["dtype"] = configs.compute_dtype(dtype or "bfloat16")
    model_config = BertConfig.from_dict(fields)
    mesh = sharding_lib.make_mesh(config.mesh, devices)
    batch_size = int(batch_size or config.eval.batch_size)
    configs.check_batch_size(batch_size, mesh, field="--batch_size")
    rules = sharding_lib.as_rules(config.logical_axis_rules)
    batch_sharding = sharding_lib.batch_sharding(mesh, config.logical_axis_rules)
    chips = len(devices)

    def compile_layers(layers: int, rows: int, length: int):
        model = task.model(dataclasses.replace(model_config, num_layers=layers,
                                               scan_layers=False))
        boxed = jax.eval_shape(
            lambda: model.init(jax.random.key(0), *task.init_inputs()))["params"]
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                nn.unbox(boxed), shardings)
        spec = task.batch_spec(rows, length)
        step = jax.jit(functools.partial(_predict, task=task, model=model),
                       in_shardings=(shardings, jax.tree.map(lambda _: batch_sharding, spec)))
        return measure.compile_and_measure(step, (abstract, spec), slice_)

    costs, method = [], ""
    for rows, length in batch_shapes(task, int(config.max_seq_length), batch_size):
        m, method = measure.calibrated(functools.partial(compile_layers, rows=rows,
                                                         length=length),
                                       model_config.num_layers)
        if isinstance(m, str):  # out of memory: a row that does not fit
            needed = measure.oom_sizes(m)[0]
            costs.append(InferenceCost(length, rows, needed or float("inf"),
                                       slice_.hbm_bytes if slice_ else 0.0, None, None))
            continue
        seconds = m.op_seconds or m.seconds  # the compiler's per-op estimates (dry_run)
        if slice_ and not seconds:  # no estimate at all: the roofline
            seconds = max(m.flops / slice_.peak_flops,
                          (m.hlo_bytes or m.bytes_accessed) / (slice_.chip.hbm_gbps * 1e9))
        costs.append(InferenceCost(length, rows, m.argument_bytes + m.output_bytes
                                   + m.temp_bytes, slice_.hbm_bytes if slice_ else None,
                                   m.flops or None, seconds if slice_ else None))
    where = (f"{slice_.accelerator_type} ({slice_.topology_name}, TPU compiler): {chips} chips "
             f"of {slice_.chip.hbm_gib:g} GiB HBM" if slice_ else
             f"this machine: {chips} {devices[0].platform} device(s)")
    header = (f"Predict step of {workdir} ({type(task.model(model_config)).__name__}, "
              f"{model_config.dtype}) on {where}; mesh {dict(mesh.shape)}; global batch "
              f"{batch_size} rows at full length, more when shorter; {method}")
    return costs, chips, header


def inference_table(costs: list[InferenceCost], chips: int) -> list[str]:
    """One line per batch shape: memory, FLOPs, step time and sequences/s per chip."""
    gib = 1024.0**3
    lines = [f"{'length':>6} {'rows':>5} {'memory/chip':>12} {'fits':>4} {'GFLOP/chip':>11} "
             f"{'step ms':>8} {'seq/s/chip':>11}"]
    for c in costs:
        rate = c.sequences_per_second_per_chip(chips)
        fits = "yes" if c.fits else "NO"
        memory = (f"{c.total_bytes / gib:.2f} GiB" if c.total_bytes >= gib / 10 else
                  f"{c.total_bytes / 1024**2:.1f} MiB")
        lines.append(f"{c.seq_len:>6} {c.batch_size:>5} {memory:>12} {fits:>4} "
                     f"{(c.flops or 0) / 1e9:>11.2f} "
                     f"{'n/a' if c.step_seconds is None else f'{c.step_seconds * 1e3:.3f}':>8} "
                     f"{'n/a' if rate is None else f'{rate:,.0f}':>11}")
    return lines

"""`--dry_run`: parameter table, FLOPs and per-device memory of the compiled train step.

Everything is computed on abstract shapes (`jax.eval_shape`, ahead-of-time `lower().compile()`),
so nothing model-sized is allocated, and an out-of-memory configuration is caught up front.

With `--topology=v5p-32` (topology.py) the step is compiled by the TPU compiler (libtpu) for
that slice, on any machine (measure.py) and reported per chip (report.py): memory against HBM
(or "does not fit" with the compiler's figures), FLOPs, bytes, the step time, sequences/s, MFU
and the time to finish each stage. The step time is the TPU compiler's own estimate of each op
it emitted, summed (hlo_costs.py); XLA's `optimal_seconds`, which follows its "bytes accessed"
count, is printed beside it (docs/tpu_aot.md, "Two models of the step"). `--dry_run_exact`
compiles the full step; `--breakdown` adds where the bytes and time go; `--sweep` ranks mesh
shapes, batch sizes and remat (sweep.py). The flags: bertjax.cli.define_dry_run_flags.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax
import jax
import numpy as np

from bertjax.aot import topology as topology_lib
from bertjax.aot.measure import GIB, use_tpu_dtype
from bertjax.aot.report import global_batch, run_on_slice
from bertjax.aot.sweep import sweep
from bertjax.errors import ConfigError
from bertjax.models import architecture
from bertjax.train import configs
from bertjax.train import sharding as sharding_lib
from bertjax.train import step as step_lib


def parameter_table(params: Any) -> list[tuple[str, int]]:
    """[(module path, count)] for bert/embeddings, bert/encoder, bert/pooler and each head."""
    counts: dict[str, int] = {}
    for path, leaf in flax.traverse_util.flatten_dict(params).items():
        key = "/".join(path[:2]) if path[0] == "bert" else path[0]
        counts[key] = counts.get(key, 0) + int(np.prod(leaf.shape))
    return sorted(counts.items(), key=lambda kv: (not kv[0].startswith("bert"), kv[0]))


def run(job, config, print_fn=print) -> dict[str, Any]:
    """Reports (and returns) parameter counts, FLOPs and compiled memory for each stage of
    `job` (a pre-training phase, a fine-tuning run: see bertjax/train/loop.py)."""
    tx, schedule = job.optimizer()
    mesh = sharding_lib.make_mesh(config.mesh)
    abstract_state, state_sharding = step_lib.state_shardings(
        job.init_params, tx, mesh, config.logical_axis_rules, configs.rng_impl(config),
        config.train.get("shard_optimizer_state", False))

    table = parameter_table(abstract_state.params)
    total = sum(n for _, n in table)
    # The encoder alone: its architecture's group (BertModel's bert/, ModernBertModel's model/).
    record = architecture(job.model_config)
    encoder_total = sum(n for name, n in table if name.split("/")[0] == record.encoder_group)
    encoder_row = (f"{record.encoder_group} ({record.encoder_class})", encoder_total)
    print_fn(f"Parameters of {type(job.model).__name__} ({config.get('preset', 'custom')}):")
    for name, n in table + [encoder_row, ("total", total)]:
        print_fn(f"  {name:<20} {n:>14,}")

    devices = mesh.devices.size
    print_fn(f"Mesh {dict(mesh.shape)} on {devices} x {jax.devices()[0].device_kind}; "
             f"{global_batch(job, micro_batches=False)}; compute dtype {job.model_config.dtype}")
    batch_sharding = sharding_lib.batch_sharding(mesh, config.logical_axis_rules)
    train_steps = step_lib.stage_train_steps(job, tx, schedule, state_sharding, batch_sharding,
                                             config.logical_axis_rules)
    print_fn("Train step per stage (FLOPs: forward + backward; memory: per device):")
    print_fn(f"  {'stage':<8} {'seq':>5} {'preds':>5} {'GFLOP/seq':>10} {'XLA GFLOP/seq':>14} "
             f"{'args GiB':>9} {'temp GiB':>9} {'total GiB/device':>17}")
    stages = {}
    for stage in job.stages:
        compiled = train_steps[stage.name].lower(abstract_state, stage.batch_spec).compile()
        row = stages[stage.name] = stage_figures(compiled, job, stage, devices)
        xla = row["xla_flops_per_sequence"]
        print_fn(f"  {stage.name:<8} {row['seq_len']:>5} {row['max_predictions']:>5} "
                 f"{row['flops_per_sequence'] / 1e9:>10.2f} "
                 f"{'n/a' if xla is None else f'{xla / 1e9:.2f}':>14} "
                 f"{row['argument_bytes'] / GIB:>9.3f} {row['temp_bytes'] / GIB:>9.3f} "
                 f"{row['total_bytes'] / GIB:>17.3f}")
    return {"parameters": dict(table), "total": total, "encoder_total": encoder_total,
            "phases": stages}


def stage_figures(compiled, job, stage, devices: int) -> dict[str, Any]:
    """A stage's compiled step on this machine: sequence length, masked-LM predictions per
    sequence (0 for fine-tuning heads), model and XLA FLOPs per sequence, bytes per device."""
    positions = stage.batch_spec.get("masked_lm_positions")
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    # XLA counts a scanned loop body once, so its figure is only meaningful unrolled.
    xla_flops = None
    if cost and not job.model_config.scan_layers:
        batch_size = step_lib.stage_batch(job, stage)[0]
        xla_flops = float(cost.get("flops", 0.0)) * devices / batch_size
    args, temp = memory.argument_size_in_bytes, memory.temp_size_in_bytes
    return dict(seq_len=stage.tokens_per_example,
                max_predictions=positions.shape[1] if positions is not None else 0,
                flops_per_sequence=stage.flops_per_example, xla_flops_per_sequence=xla_flops,
                argument_bytes=args, temp_bytes=temp,
                total_bytes=args + memory.output_size_in_bytes - memory.alias_size_in_bytes
                + temp)


def on_slice(make_job: Callable[[Any], Any], config, topology: str | None, sweep_: bool = False,
             sweep_seconds: float = 600.0, exact: bool = False, breakdown: bool = False,
             print_fn=print) -> bool:
    """The `--dry_run --topology [--sweep] [--dry_run_exact] [--breakdown]` report; False
    (nothing done) without a topology."""
    if not topology:
        if sweep_ or breakdown or exact:
            raise ConfigError("--sweep, --breakdown and --dry_run_exact need --topology (e.g. "
                              "--topology=v5p-32)")
        return False
    topology_lib.parse(topology)  # a bad name is reported before anything is built
    use_tpu_dtype(config)
    if sweep_:
        sweep(make_job, config, topology, print_fn, budget_seconds=sweep_seconds, exact=exact)
    else:
        run_on_slice(make_job, config, topology, exact, breakdown, print_fn)
    return True


def from_flags(make_job: Callable[[Any], Any], config, vary_layers: bool = True) -> bool:
    """With --dry_run: its report for make_job(config) (for --topology's slice, or --sweep),
    then True. Without: False, after refusing the other dry-run flags. vary_layers=False where
    make_job cannot build the model with fewer layers (fine-tuning: the checkpoint fixes them):
    the full step is then compiled."""
    from absl import flags

    f = flags.FLAGS
    if not f.dry_run:
        if f.topology or f.sweep or f.breakdown or f.dry_run_exact:
            raise ConfigError("--topology, --sweep, --breakdown and --dry_run_exact need "
                              "--dry_run")
        return False
    # A slice's compile is exact where the layers cannot vary; only --dry_run_exact asks it
    # without a topology (refused there: the local dry run compiles the full step anyway).
    exact = f.dry_run_exact or (bool(f.topology) and not vary_layers)
    if not on_slice(make_job, config, f.topology, f.sweep, f.sweep_seconds, exact=exact,
                    breakdown=f.breakdown):
        run(make_job(config), config)
    return True

"""`--dry_run`: parameter table, FLOPs and per-device memory of the compiled train step.

Everything is computed on abstract shapes (`jax.eval_shape`, ahead-of-time `lower().compile()`),
so nothing model-sized is allocated, and an out-of-memory configuration is caught up front.

With `--topology=v5p-32` (bertjax/train/topology.py) the step is compiled by the TPU compiler
(libtpu) for that slice, on any machine: per chip, memory against HBM (or "does not fit" with
the compiler's figures), FLOPs, the step time of XLA's cost model, sequences/s, MFU and the time
to finish each stage. `--sweep` ranks mesh shapes, batch sizes, remat and scan that way.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable
from typing import Any

import flax
import jax
import numpy as np

from bertjax.errors import ConfigError
from bertjax.train import configs
from bertjax.train import sharding as sharding_lib
from bertjax.train import step as step_lib
from bertjax.train import topology as topology_lib

GIB = 1024.0**3


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
        job.init_params, tx, mesh, config.logical_axis_rules
    )

    table = parameter_table(abstract_state.params)
    total = sum(n for _, n in table)
    bert_total = sum(n for name, n in table if name.startswith("bert/"))
    print_fn(f"Parameters of {type(job.model).__name__} ({config.get('preset', 'custom')}):")
    for name, n in table:
        print_fn(f"  {name:<20} {n:>14,}")
    print_fn(f"  {'bert (BertModel)':<20} {bert_total:>14,}")
    print_fn(f"  {'total':<20} {total:>14,}")

    batch_size = job.batch_size
    devices = mesh.devices.size
    print_fn(
        f"Mesh {dict(mesh.shape)} on {devices} x {jax.devices()[0].device_kind}; "
        f"global batch {batch_size}; compute dtype {job.model_config.dtype}"
    )
    batch_sharding = sharding_lib.batch_sharding(mesh, config.logical_axis_rules)
    train_step = step_lib.jit_train_step(job.loss, tx, schedule, state_sharding, batch_sharding,
                                         job.grad_accum_steps, getattr(job, "denominators", None))
    stages = {}
    header = (
        f"  {'stage':<8} {'seq':>5} {'preds':>5} {'GFLOP/seq':>10} {'XLA GFLOP/seq':>14} "
        f"{'args GiB':>9} {'temp GiB':>9} {'total GiB/device':>17}"
    )
    print_fn("Train step per stage (FLOPs: forward + backward; memory: per device):")
    print_fn(header)
    for stage in job.stages:
        # Masked-LM predictions per sequence (0 for fine-tuning heads).
        positions = stage.batch_spec.get("masked_lm_positions")
        preds = positions.shape[1] if positions is not None else 0
        compiled = train_step.lower(abstract_state, stage.batch_spec).compile()
        memory = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        # XLA counts a scanned loop body once, so its figure is only meaningful unrolled.
        xla_flops = None
        if cost and not job.model_config.scan_layers:
            xla_flops = float(cost.get("flops", 0.0)) * devices / batch_size
        flops = stage.flops_per_example
        args = memory.argument_size_in_bytes
        temp = memory.temp_size_in_bytes
        total_bytes = args + memory.output_size_in_bytes - memory.alias_size_in_bytes + temp
        gib = 1024.0**3
        stages[stage.name] = dict(
            seq_len=stage.tokens_per_example,
            max_predictions=preds,
            flops_per_sequence=flops,
            xla_flops_per_sequence=xla_flops,
            argument_bytes=args,
            temp_bytes=temp,
            total_bytes=total_bytes,
        )
        print_fn(
            f"  {stage.name:<8} {stage.tokens_per_example:>5} {preds:>5} {flops / 1e9:>10.2f} "
            f"{'n/a' if xla_flops is None else f'{xla_flops / 1e9:.2f}':>14} "
            f"{args / gib:>9.3f} {temp / gib:>9.3f} "
            f"{total_bytes / gib:>17.3f}"
        )
    return {"parameters": dict(table), "total": total, "bert_total": bert_total,
            "phases": stages}


# --- Ahead-of-time compiles for a TPU slice -------------------------------------------------


def on_slice(make_job: Callable[[Any], Any], config, topology: str | None, sweep_: bool = False,
             sweep_seconds: float = 600.0, print_fn=print) -> bool:
    """The `--dry_run --topology [--sweep]` report; False (nothing done) without a topology."""
    if not topology:
        if sweep_:
            raise ConfigError("--sweep needs --topology (e.g. --topology=v5p-32)")
        return False
    topology_lib.parse(topology)  # a bad name is reported before anything is built
    use_tpu_dtype(config)
    if sweep_:
        sweep(make_job, config, topology, print_fn, budget_seconds=sweep_seconds)
    else:
        run_on_slice(make_job(config), config, topology, print_fn)
    return True


def define_flags(what: str) -> None:
    """The --dry_run / --topology / --sweep / --sweep_seconds flags of a job command; `what`
    says what the dry run reads (e.g. "the config's data and checkpoint")."""
    from absl import flags

    flags.DEFINE_bool("dry_run", False, f"Read {what}, print parameters, FLOPs and per-device "
                      "memory of the compiled train step; exit.")
    flags.DEFINE_string("topology", None, "With --dry_run: compile for this Cloud TPU slice "
                        "with the TPU compiler, on any machine (needs the tpu extra): v4-32, "
                        "v5p-128, v5litepod-16, v6e-64, v5p:4x4x4.")
    flags.DEFINE_bool("sweep", False, "With --dry_run --topology: try meshes, batch sizes, "
                      "remat and scan; list those that fit, fastest first, with their flags.")
    flags.DEFINE_integer("sweep_seconds", 600, "Compile-time budget of --sweep.")


def from_flags(make_job: Callable[[Any], Any], config) -> bool:
    """With --dry_run: its report for make_job(config) (for --topology's slice, or --sweep),
    then True. Without: False, after refusing --topology / --sweep."""
    from absl import flags

    f = flags.FLAGS
    if not f.dry_run:
        if f.topology or f.sweep:
            raise ConfigError("--topology and --sweep need --dry_run")
        return False
    if not on_slice(make_job, config, f.topology, f.sweep, f.sweep_seconds):
        run(make_job(config), config)
    return True


def use_tpu_dtype(config) -> None:
    """A dry run for a TPU slice compiles what the slice runs: "auto" is bfloat16 there (the
    machine the dry run runs on would pick float32)."""
    if config.model.get("dtype", "auto") == "auto":
        config.model.dtype = "bfloat16"


@dataclasses.dataclass
class StageCost:
    """A stage's train step compiled for a slice; bytes and FLOPs per chip."""

    name: str
    seq_len: int
    steps: int
    batch_size: int  # global
    argument_bytes: float
    temp_bytes: float
    total_bytes: float
    hbm_bytes: float  # the chip's HBM, or what the compiler said is available
    fits: bool
    model_flops: float  # model FLOPs of one step, whole slice (for MFU)
    xla_flops: float | None  # FLOPs of the compiled step per chip (loops unrolled, see below)
    step_seconds: float | None  # XLA's cost model (`optimal_seconds`)
    message: str = ""  # the compiler's out-of-memory message
    roofline: bool = False  # step time from FLOPs and HBM traffic, not the cost model

    @property
    def sequences_per_second(self) -> float | None:
        return self.batch_size / self.step_seconds if self.step_seconds else None

    def mfu(self, slice_: topology_lib.Slice) -> float | None:
        if not self.step_seconds or not self.model_flops:
            return None
        return self.model_flops / (self.step_seconds * slice_.num_chips * slice_.peak_flops)

    @property
    def seconds(self) -> float | None:
        """Time to run the stage's steps."""
        return self.step_seconds * self.steps if self.step_seconds else None


_SIZE = re.compile(r"(\d+(?:\.\d+)?)([KMGT])\b")


def _oom_sizes(message: str) -> tuple[float | None, float | None]:
    """(needed, available) bytes from the TPU compiler's out-of-memory message, e.g. "... HLO
    temporaries (262.25G) exceeds available HBM (15.75G)"."""
    sizes = [float(v) * 1024.0 ** ("KMGT".index(u) + 1) for v, u in _SIZE.findall(message)]
    return (sizes[0], sizes[1]) if len(sizes) >= 2 else (None, None)


def _shard_bytes(abstract: Any, shardings: Any) -> float:
    """Bytes of one device's shards of `abstract` arrays placed with `shardings`."""
    leaves = jax.tree.leaves(abstract)
    specs = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    return float(sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
                     for a, s in zip(leaves, specs, strict=True)))


def _layer_flops(model_config, seq_len: int) -> float:
    """Training FLOPs of one encoder layer on one sequence (3 × forward; 4 × with full
    rematerialisation, which runs the forward pass again)."""
    from bertjax.train import flops as flops_lib

    one = dataclasses.replace(model_config, num_layers=1)
    forward = flops_lib.forward_flops_per_sequence(one, seq_len, 0)
    return (4.0 if model_config.remat_policy == "full" else 3.0) * forward


def compile_stage(job, stage, train_step, abstract_state, state_sharding, batch_sharding,
                  slice_: topology_lib.Slice) -> StageCost:
    """Compiles `stage`'s train step for the slice; an out-of-memory compile is reported (with
    the compiler's figures), never raised."""
    chips = slice_.num_chips
    batch = job.batch_size
    spec = stage.batch_spec
    args = _shard_bytes(abstract_state, state_sharding) + _shard_bytes(
        spec, jax.tree.map(lambda _: batch_sharding, spec))
    common = dict(name=stage.name, seq_len=stage.tokens_per_example,
                  steps=stage.end - stage.start, batch_size=batch,
                  model_flops=stage.flops_per_example * batch)
    # A TPU executable compiled without a TPU client cannot be read back from JAX's persistent
    # compilation cache (a warning per entry): keep it out of the cache. (JAX decides once per
    # process, at its first compile: this holds where the TPU compile comes first, as in the
    # commands.)
    caching = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        compiled = train_step.lower(abstract_state, spec).compile()
    except jax.errors.JaxRuntimeError as e:
        message = " ".join(str(e).split())
        if "RESOURCE_EXHAUSTED" not in message and "out of memory" not in message.lower():
            raise
        needed, available = _oom_sizes(message)
        temp = needed or float("nan")
        return StageCost(**common, argument_bytes=args, temp_bytes=temp, total_bytes=args + temp,
                         hbm_bytes=available or slice_.hbm_bytes, fits=False, xla_flops=None,
                         step_seconds=None, message=message)
    finally:
        jax.config.update("jax_enable_compilation_cache", caching)
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list | tuple) else cost) or {}
    args = float(memory.argument_size_in_bytes)
    temp = float(memory.temp_size_in_bytes)
    total = args + memory.output_size_in_bytes - memory.alias_size_in_bytes + temp
    flops = float(cost.get("flops", 0.0)) or None
    seconds = float(cost.get("optimal_seconds", 0.0))
    roofline = not seconds > 0  # libtpu's v4 cost model returns negative times
    if roofline and flops:
        # The roofline instead: the step takes at least its FLOPs at peak and its HBM traffic
        # at full bandwidth.
        seconds = max(flops / slice_.peak_flops,
                      float(cost.get("bytes accessed", 0.0)) / (slice_.chip.hbm_gbps * 1e9))
    seconds = seconds or None
    # XLA's cost analysis counts a loop body once: scanned layers count one layer, gradient
    # accumulation one micro-batch. Add the other layers' FLOPs and scale the time alike.
    accum = job.grad_accum_steps
    cfg = job.model_config
    if flops and seconds and cfg.scan_layers:
        extra = ((cfg.num_layers - 1) * _layer_flops(cfg, stage.tokens_per_example)
                 * batch / accum / chips)
        seconds *= (flops + extra) / flops
        flops += extra
    if flops and seconds and accum > 1:
        flops, seconds = flops * accum, seconds * accum
    return StageCost(**common, argument_bytes=args, temp_bytes=temp, total_bytes=total,
                     hbm_bytes=slice_.hbm_bytes, fits=total <= slice_.hbm_bytes,
                     xla_flops=flops, step_seconds=seconds, roofline=roofline)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None or value != value else format(value, spec)


def stage_table(costs: list[StageCost], slice_: topology_lib.Slice) -> list[str]:
    """The per-chip table of `run_on_slice`, one line per stage."""
    lines = [f"  {'stage':<8} {'seq':>5} {'batch':>6} {'args GiB':>9} {'temp GiB':>9} "
             f"{'total GiB':>10} {'HBM GiB':>8} {'fits':>4} {'TFLOP/chip':>10} {'step ms':>8} "
             f"{'seq/s':>9} {'MFU':>6} {'steps':>9} {'time':>9}"]
    for c in costs:
        mfu = c.mfu(slice_)
        lines.append(
            f"  {c.name:<8} {c.seq_len:>5} {c.batch_size:>6} {c.argument_bytes / GIB:>9.2f} "
            f"{_fmt(c.temp_bytes / GIB, '.2f'):>9} {_fmt(c.total_bytes / GIB, '.2f'):>10} "
            f"{c.hbm_bytes / GIB:>8.2f} {'yes' if c.fits else 'NO':>4} "
            f"{_fmt(c.xla_flops and c.xla_flops / 1e12, '.2f'):>10} "
            f"{_fmt(c.step_seconds and c.step_seconds * 1e3, '.1f'):>8} "
            f"{_fmt(c.sequences_per_second, ',.0f'):>9} "
            f"{_fmt(mfu and 100 * mfu, '.1f') + ('%' if mfu else ''):>6} {c.steps:>9,} "
            f"{_duration(c.seconds):>9}")
    return lines


def _compile_job(job, config, slice_: topology_lib.Slice, devices,
                 until_misfit: bool = False) -> list[StageCost]:
    """Compiles each stage of `job` on the slice's devices with the config's mesh and rules;
    until_misfit: longest sequences first, stopping at the first stage that does not fit."""
    tx, schedule = job.optimizer()
    mesh = sharding_lib.make_mesh(config.mesh, devices)
    configs.check_batch_size(job.batch_size, mesh, job.grad_accum_steps)
    abstract_state, state_sharding = step_lib.state_shardings(
        job.init_params, tx, mesh, config.logical_axis_rules)
    batch_sharding = sharding_lib.batch_sharding(mesh, config.logical_axis_rules)
    train_step = step_lib.jit_train_step(job.loss, tx, schedule, state_sharding, batch_sharding,
                                         job.grad_accum_steps, getattr(job, "denominators", None))
    stages = job.stages
    if until_misfit:
        stages = sorted(stages, key=lambda s: -s.tokens_per_example)
    costs = []
    for stage in stages:
        costs.append(compile_stage(job, stage, train_step, abstract_state, state_sharding,
                                   batch_sharding, slice_))
        if until_misfit and not costs[-1].fits:
            break
    return costs


def run_on_slice(job, config, topology: str, print_fn=print) -> list[StageCost]:
    """Compiles every stage's train step for a Cloud TPU slice (TPU compiler, any machine) and
    prints the per-chip table: memory against HBM, FLOPs, step time, sequences/s, MFU, time."""
    slice_ = topology_lib.parse(topology)
    devices = topology_lib.devices(slice_)
    mesh_shape = sharding_lib.mesh_shape(config.mesh, len(devices))
    cfg = job.model_config
    print_fn(f"{type(job.model).__name__} ({config.get('preset', 'custom')}) on "
             f"{slice_.accelerator_type} ({slice_.topology_name}): {slice_.num_chips} chips of "
             f"{slice_.chip.hbm_gib:g} GiB HBM, {slice_.chip.peak_bf16_tflops:g} bf16 TFLOP/s")
    print_fn(f"Mesh {dict(zip(sharding_lib.MESH_AXES, mesh_shape, strict=True))}; global batch "
             f"{job.batch_size}" + (f" in {job.grad_accum_steps} micro-batches"
                                    if job.grad_accum_steps > 1 else "")
             + f"; {cfg.dtype}; remat {cfg.remat_policy}; scan_layers {cfg.scan_layers}")
    start = time.time()
    costs = _compile_job(job, config, slice_, devices)
    print_fn("Train step per chip (TPU compiler; step time from XLA's cost model):")
    for line in stage_table(costs, slice_):
        print_fn(line)
    for c in costs:
        if c.roofline and c.step_seconds:
            print_fn(f"  {c.name}: no cost-model time from the compiler; step time is the "
                     "roofline max(FLOPs / peak, HBM bytes / bandwidth)")
        if not c.fits:
            print_fn(f"  {c.name} does not fit: {c.total_bytes / GIB:.2f} GiB per chip needed, "
                     f"{c.hbm_bytes / GIB:.2f} GiB available"
                     + (f" (compiler: {c.message[:240]})" if c.message else ""))
    total = [c.seconds for c in costs]
    if all(total):
        print_fn(f"All {sum(c.steps for c in costs):,} steps: {_duration(sum(total))} "
                 f"(compiled in {time.time() - start:.0f} s)")
    return costs


# --- Sweep ------------------------------------------------------------------------------------

REMAT_POLICIES = ("none", "dots", "full")
PER_REPLICA_BATCHES = (64, 32, 16, 8)  # sequences per data-parallel replica, largest first


def mesh_candidates(num_chips: int, num_heads: int) -> list[tuple[int, int, int]]:
    """(data, fsdp, tensor): data parallel, fully sharded (FSDP), and each with 2- and 4-way
    tensor parallelism where the heads and chips divide."""
    meshes = []
    for tensor in (1, 2, 4):
        if num_chips % tensor or num_heads % tensor or tensor > num_chips:
            continue
        rest = num_chips // tensor
        for fsdp in (1, rest):
            mesh = (rest // fsdp, fsdp, tensor)
            if mesh not in meshes:
                meshes.append(mesh)
    return meshes


@dataclasses.dataclass
class Candidate:
    mesh: tuple[int, int, int]
    remat: str
    scan: bool
    batch_size: int  # global
    costs: list[StageCost]

    @property
    def fits(self) -> bool:
        return bool(self.costs) and all(c.fits for c in self.costs)

    @property
    def sequences_per_second(self) -> float | None:
        """Over the whole run: sequences of every stage over the time of every stage."""
        seconds = [c.seconds for c in self.costs]
        if not self.fits or not all(seconds):
            return None
        return sum(c.steps * c.batch_size for c in self.costs) / sum(seconds)

    def flags(self) -> str:
        data, fsdp, tensor = self.mesh
        return (f"--config.mesh.data={data} --config.mesh.fsdp={fsdp} "
                f"--config.mesh.tensor={tensor} --config.train.batch_size={self.batch_size} "
                f"--config.model.remat_policy={self.remat} "
                f"--config.model.scan_layers={str(self.scan).lower()}")


def _try(make_job, config, slice_, devices, mesh, remat, scan, batch_size) -> Candidate:
    config = config.copy_and_resolve_references()
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
    config.train.batch_size = batch_size
    with config.unlocked():  # fine-tuning's config.model holds only the fields it overrides
        config.model.remat_policy, config.model.scan_layers = remat, scan
    costs = _compile_job(make_job(config), config, slice_, devices, until_misfit=True)
    return Candidate(mesh, remat, scan, batch_size, costs)


def sweep(make_job: Callable[[Any], Any], config, topology: str, print_fn=print,
          budget_seconds: float = 600.0) -> list[Candidate]:
    """Tries meshes (data / fsdp / tensor), batch sizes, remat policies and scanned layers on a
    slice; prints the configurations that fit, by estimated sequences/s, with the flags that
    select each. For each mesh, remat and scan, batches are tried largest first and the first
    that fits is kept (a larger batch would not fit; a smaller one is rarely faster).

    make_job(config) -> the job of a config (pre-training or fine-tuning). Compiles stop after
    `budget_seconds`; the candidates not tried are counted.
    """
    slice_ = topology_lib.parse(topology)
    devices = topology_lib.devices(slice_)
    heads = make_job(config).model_config.num_heads
    keys = [(mesh, remat, scan) for scan in (True, False) for remat in REMAT_POLICIES
            for mesh in mesh_candidates(slice_.num_chips, heads)]
    print_fn(f"Sweep on {slice_.accelerator_type} ({slice_.topology_name}, {slice_.num_chips} "
             f"chips): {len(keys)} mesh/remat/scan settings x batches "
             f"{'/'.join(map(str, PER_REPLICA_BATCHES))} per replica, largest first "
             f"(budget {budget_seconds:.0f} s)")
    start, results, untried = time.time(), [], 0
    for mesh, remat, scan in keys:
        for per_replica in PER_REPLICA_BATCHES:
            if time.time() - start > budget_seconds:
                untried += 1
                break
            batch = per_replica * mesh[0] * mesh[1]
            tic = time.time()
            try:
                candidate = _try(make_job, config, slice_, devices, mesh, remat, scan, batch)
            except ConfigError as e:  # e.g. a batch the mesh cannot split
                print_fn(f"  skipped mesh {mesh} batch {batch}: {e}")
                continue
            speed = candidate.sequences_per_second
            worst = max(candidate.costs, key=lambda c: c.total_bytes / c.hbm_bytes)
            verdict = (f"{speed:,.0f} seq/s" if speed else
                       f"{worst.name} does not fit ({worst.total_bytes / GIB:.1f} of "
                       f"{worst.hbm_bytes / GIB:.1f} GiB)")
            print_fn(f"  mesh data/fsdp/tensor {'x'.join(map(str, mesh)):<8} batch {batch:>6} "
                     f"remat {remat:<4} scan {str(scan):<5}: {verdict} "
                     f"({time.time() - tic:.0f} s)")
            results.append(candidate)
            if candidate.fits:
                break
    ranked = sorted((c for c in results if c.sequences_per_second),
                    key=lambda c: -c.sequences_per_second)
    print_fn(f"Configurations that fit, fastest first ({len(results)} compiled in "
             f"{time.time() - start:.0f} s" + (f", {untried} settings not tried within the "
                                               "budget" if untried else "") + "):")
    print_fn(f"  {'#':>2} {'seq/s':>9} {'MFU':>6} {'max GiB':>8} {'time':>9}  flags")
    for rank, c in enumerate(ranked, 1):
        model_flops = sum(s.model_flops * s.steps for s in c.costs)
        mfu = model_flops / (sum(s.seconds for s in c.costs) * slice_.num_chips
                             * slice_.peak_flops)
        print_fn(f"  {rank:>2} {c.sequences_per_second:>9,.0f} {100 * mfu:>5.1f}% "
                 f"{max(s.total_bytes for s in c.costs) / GIB:>8.2f} "
                 f"{_duration(sum(s.seconds for s in c.costs)):>9}  {c.flags()}")
    if not ranked:
        print_fn("  none: every configuration tried runs out of HBM")
    return ranked

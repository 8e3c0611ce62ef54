"""`--dry_run`: parameter table, FLOPs and per-device memory of the compiled train step.

Everything is computed on abstract shapes (`jax.eval_shape`, ahead-of-time `lower().compile()`),
so nothing model-sized is allocated, and an out-of-memory configuration is caught up front.

With `--topology=v5p-32` (bertjax/train/topology.py) the step is compiled by the TPU compiler
(libtpu) for that slice, on any machine: per chip, memory against HBM (or "does not fit" with
the compiler's figures), FLOPs, bytes, the step time, sequences/s, MFU and the time to finish
each stage. The step time is the TPU compiler's own estimate of each op it emitted, summed
(bertjax/train/hlo_costs.py); XLA's `optimal_seconds`, which follows its "bytes accessed"
count, is printed beside it (docs/tpu_aot.md, "Two models of the step"). Layers are compiled
unrolled, at 2 and 3 layers, and every figure extrapolated linearly to the model's
(`--dry_run_exact`: the full step); `--breakdown` adds where the bytes and time go. `--sweep`
ranks mesh shapes, batch sizes and remat that way.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
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

# The smaller of the two layer counts compiled and extrapolated from. Not 1: a 1-layer step's
# cost-model time and temporaries are off the line of deeper steps (its peak memory is set by
# what does not grow with depth); see docs/tpu_aot.md.
FIT_LAYERS = 2


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
    bert_total = sum(n for name, n in table if name.startswith("bert/"))
    print_fn(f"Parameters of {type(job.model).__name__} ({config.get('preset', 'custom')}):")
    for name, n in table:
        print_fn(f"  {name:<20} {n:>14,}")
    print_fn(f"  {'bert (BertModel)':<20} {bert_total:>14,}")
    print_fn(f"  {'total':<20} {total:>14,}")

    devices = mesh.devices.size
    print_fn(
        f"Mesh {dict(mesh.shape)} on {devices} x {jax.devices()[0].device_kind}; "
        f"{global_batch(job, micro_batches=False)}; compute dtype {job.model_config.dtype}"
    )
    batch_sharding = sharding_lib.batch_sharding(mesh, config.logical_axis_rules)
    train_steps = step_lib.stage_train_steps(job, tx, schedule, state_sharding, batch_sharding,
                                             config.logical_axis_rules)
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
        compiled = train_steps[stage.name].lower(abstract_state, stage.batch_spec).compile()
        memory = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        # XLA counts a scanned loop body once, so its figure is only meaningful unrolled.
        xla_flops = None
        if cost and not job.model_config.scan_layers:
            batch_size = step_lib.stage_batch(job, stage)[0]
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


def define_flags(what: str) -> None:
    """The --dry_run / --topology / --dry_run_exact / --breakdown / --sweep / --sweep_seconds
    flags of a job command; `what` says what the dry run reads (e.g. "the config's data")."""
    from absl import flags

    flags.DEFINE_bool("dry_run", False, f"Read {what}, print parameters, FLOPs and per-device "
                      "memory of the compiled train step; exit.")
    flags.DEFINE_string("topology", None, "With --dry_run: compile for this Cloud TPU slice "
                        "with the TPU compiler, on any machine (needs the tpu extra): v4-32, "
                        "v5p-128, v5litepod-16, v6e-64, v5p:4x4x4. The steps of 2 and 3 "
                        "unrolled layers are compiled and extrapolated to the model's layers.")
    flags.DEFINE_bool("dry_run_exact", False, "With --topology: compile the full step, every "
                      "layer unrolled, instead of extrapolating (slower).")
    flags.DEFINE_bool("breakdown", False, "With --topology: print where the step's HBM bytes, "
                      "FLOPs and time go, by category and by op.")
    flags.DEFINE_bool("sweep", False, "With --dry_run --topology: try meshes, batch sizes "
                      "and remat; list those that fit, fastest first, with their flags.")
    flags.DEFINE_integer("sweep_seconds", 600, "Compile-time budget of --sweep.")


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
    if not on_slice(make_job, config, f.topology, f.sweep, f.sweep_seconds,
                    exact=f.dry_run_exact or not vary_layers, breakdown=f.breakdown):
        run(make_job(config), config)
    return True


def use_tpu_dtype(config) -> None:
    """A dry run for a TPU slice compiles what the slice runs: "auto" is bfloat16 there (the
    machine the dry run runs on would pick float32)."""
    if config.model.get("dtype", "auto") == "auto":
        config.model.dtype = "bfloat16"


@dataclasses.dataclass(frozen=True)
class Measure:
    """What the compiler says of one compiled train step, per chip."""

    argument_bytes: float
    output_bytes: float  # outputs not aliased to (donated) arguments
    temp_bytes: float
    flops: float  # XLA's count of the compiled step
    bytes_accessed: float  # XLA's HBM traffic estimate
    seconds: float | None  # XLA's optimal_seconds; None where it gives none (< 0)
    groups: dict | None = None  # the optimized HLO op by op: {"category" | "op": {key: Group}}

    @property
    def hlo_bytes(self) -> float | None:
        """HBM bytes of the optimized HLO's ops (bertjax/train/hlo_costs.py)."""
        if not self.groups:
            return None
        return sum(g.bytes for g in self.groups["category"].values())

    @property
    def op_seconds(self) -> float | None:
        """The TPU compiler's per-op time estimates summed (hlo_costs: cycles over the clock);
        None off a TPU slice or where it gave none."""
        return op_seconds(self.groups)


def op_seconds(groups: dict | None) -> float | None:
    """Σ of the ops' estimated seconds over `groups` (Measure.groups), None if none."""
    return groups and sum(g.model_seconds for g in groups["category"].values()) or None


def measure(compiled, slice_: topology_lib.Slice | None, flash: tuple[float, bool] | None = None
            ) -> Measure:
    """A compiled step's memory, FLOPs, bytes, cost-model time and (on a slice) its ops'
    costs. flash: (attention dropout rate, causal) where the model runs the flash kernels,
    whose time is then at least their compiled schedule's (bertjax/train/kernel_schedule.py)."""
    from bertjax.train import hlo_costs, kernel_schedule

    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list | tuple) else cost) or {}
    seconds = float(cost.get("optimal_seconds", -1.0))
    groups = None
    if slice_ is not None:
        rates = (slice_.peak_flops, slice_.chip.hbm_gbps * 1e9)
        text = compiled.as_text()
        scheduled = {}
        for kernels in kernel_schedule.flash_kernels(text, *flash) if flash else ():
            scheduled.update(kernel_schedule.flash_cycles(slice_.topology_name, kernels))
        ops = hlo_costs.op_costs(text, slice_.chip.clock_hz, *rates, scheduled)
        groups = {"category": hlo_costs.group(ops, lambda o: o.category, *rates,
                                              slice_.chip.clock_hz),
                  "op": hlo_costs.group(ops, hlo_costs.short_label, *rates,
                                        slice_.chip.clock_hz)}
    return Measure(float(memory.argument_size_in_bytes),
                   float(memory.output_size_in_bytes - memory.alias_size_in_bytes),
                   float(memory.temp_size_in_bytes), float(cost.get("flops", 0.0)),
                   float(cost.get("bytes accessed", 0.0)), seconds if seconds > 0 else None,
                   groups)


def extrapolate(one: Measure, two: Measure, layers: int, first: int = FIT_LAYERS) -> Measure:
    """The step of `layers` encoder layers from compiles of `first` and `first` + 1 unrolled
    layers: every figure is fixed + per-layer × layers, i.e. one + (layers - first) × (two -
    one)."""
    def line(a, b):
        return None if a is None or b is None else a + (layers - first) * (b - a)

    groups = None
    if one.groups and two.groups:
        from bertjax.train import hlo_costs

        groups = {k: hlo_costs.extrapolate_groups(one.groups[k], two.groups[k],
                                                  layers - first + 1)
                  for k in one.groups}
    fields = ("argument_bytes", "output_bytes", "temp_bytes", "flops", "bytes_accessed",
              "seconds")
    return Measure(*(line(getattr(one, f), getattr(two, f)) for f in fields), groups)


def scaled(m: Measure, steps: int) -> Measure:
    """A gradient-accumulation step: XLA's cost analysis counts the loop body (one
    micro-batch) once, and so do the per-op estimates (the micro-batch loop carries no known
    trip count), so FLOPs, bytes and times are taken `steps` times (over-counting what runs
    once a step, the optimizer update: small beside several micro-batches)."""
    if steps == 1:
        return m
    groups = m.groups and {
        kind: {k: dataclasses.replace(g, count=g.count * steps, bytes=g.bytes * steps,
                                      flops=g.flops * steps, seconds=g.seconds * steps,
                                      model_seconds=g.model_seconds * steps)
               for k, g in by.items()}
        for kind, by in m.groups.items()}
    return dataclasses.replace(m, flops=m.flops * steps, bytes_accessed=m.bytes_accessed * steps,
                               seconds=m.seconds and m.seconds * steps, groups=groups)


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
    xla_flops: float | None  # FLOPs of the compiled step per chip
    xla_seconds: float | None  # XLA's `optimal_seconds`; None where it gives none (< 0)
    message: str = ""  # the compiler's out-of-memory message
    bytes_accessed: float | None = None  # XLA's HBM traffic per chip
    hlo_bytes: float | None = None  # HBM bytes of the optimized HLO's ops (hlo_costs.py)
    groups: dict | None = None  # the ops' costs by category and by op (see Measure)
    compute_bound: float | None = None  # seconds: XLA's FLOPs at the chip's peak
    memory_bound: float | None = None  # seconds: hlo_bytes at the chip's HBM bandwidth
    roofline: float | None = None  # seconds: the optimized HLO's per-op rooflines, summed

    @property
    def op_seconds(self) -> float | None:
        """The TPU compiler's per-op time estimates summed (hlo_costs: cycles over the clock).
        Unlike `xla_seconds`, they see vector-unit work (a PRNG's rounds) and tile padding."""
        return op_seconds(self.groups)

    @property
    def time(self) -> float | None:
        """Seconds per step: the compiler's per-op estimates, else XLA's optimal_seconds."""
        return self.op_seconds or self.xla_seconds

    @property
    def sequences_per_second(self) -> float | None:
        return self.batch_size / self.time if self.time else None

    def mfu(self, slice_: topology_lib.Slice, xla: bool = False) -> float | None:
        """Model FLOPs utilisation at `time` (xla: at XLA's optimal_seconds)."""
        seconds = self.xla_seconds if xla else self.time
        if not seconds or not self.model_flops:
            return None
        return self.model_flops / (seconds * slice_.num_chips * slice_.peak_flops)

    @property
    def seconds(self) -> float | None:
        """Time to run the stage's steps."""
        return self.time * self.steps if self.time else None


_SIZE = re.compile(r"(\d+(?:\.\d+)?)([KMGT])\b")


def oom_sizes(message: str) -> tuple[float | None, float | None]:
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


def layer_config(config, layers: int | None):
    """A copy of `config` whose encoder is unrolled (and has `layers` layers, unless None):
    what the calibrated dry run compiles."""
    config = config.copy_and_resolve_references()
    with config.unlocked():  # fine-tuning's config.model holds only the fields it overrides
        config.model.scan_layers = False
        if layers is not None:
            config.model.num_layers = layers
    return config


@dataclasses.dataclass
class _Step:
    """A job's train step, ready to compile on a slice's devices."""

    job: Any
    train_steps: dict[str, Any]  # stage name → its jitted step
    abstract_state: Any
    state_bytes: float  # the state's shards on one chip
    batch_sharding: Any

    @classmethod
    def build(cls, job, config, devices) -> _Step:
        tx, schedule = job.optimizer()
        mesh = sharding_lib.make_mesh(config.mesh, devices)
        configs.check_stage_batches(job, mesh)
        abstract_state, state_sharding = step_lib.state_shardings(
            job.init_params, tx, mesh, config.logical_axis_rules, configs.rng_impl(config),
            config.train.get("shard_optimizer_state", False))
        batch_sharding = sharding_lib.batch_sharding(mesh, config.logical_axis_rules)
        train_steps = step_lib.stage_train_steps(job, tx, schedule, state_sharding,
                                                 batch_sharding, config.logical_axis_rules)
        return cls(job, train_steps, abstract_state,
                   _shard_bytes(abstract_state, state_sharding), batch_sharding)

    def batch_bytes(self, stage) -> float:
        spec = stage.batch_spec
        return _shard_bytes(spec, jax.tree.map(lambda _: self.batch_sharding, spec))

    def compile(self, stage_name: str, slice_: topology_lib.Slice) -> Measure | str:
        """The stage's step compiled for the slice → its Measure, or the compiler's
        out-of-memory message (any other compile error is raised)."""
        stage = next(s for s in self.job.stages if s.name == stage_name)
        measured = compile_and_measure(self.train_steps[stage_name], (self.abstract_state,
                                                                      stage.batch_spec), slice_,
                                       self.job.model_config)
        return measured if isinstance(measured, str) else scaled(
            measured, step_lib.stage_batch(self.job, stage)[1])


def compile_and_measure(step, args: tuple, slice_: topology_lib.Slice | None,
                        model_config=None) -> Measure | str:
    """A jitted `step` compiled for abstract `args` → its Measure, or the compiler's
    out-of-memory message (any other compile error is raised). model_config: the BertConfig
    compiled, which says whether the flash kernels run (and their dropout rate)."""
    # A TPU executable compiled without a TPU client cannot be read back from JAX's
    # persistent compilation cache (a warning per entry): keep it out of the cache. (JAX
    # decides once per process, at its first compile: this holds where the TPU compile comes
    # first, as in the commands.)
    caching = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        compiled = step.lower(*args).compile()
    except jax.errors.JaxRuntimeError as e:
        message = " ".join(str(e).split())
        if "RESOURCE_EXHAUSTED" not in message and "out of memory" not in message.lower():
            raise
        return message
    finally:
        jax.config.update("jax_enable_compilation_cache", caching)
    flash = (model_config.attention_dropout_prob, model_config.causal) if (
        model_config is not None and model_config.attention_impl == "flash") else None
    return measure(compiled, slice_, flash)


def calibrated(compile_layers: Callable[[int], Measure | str], layers: int
               ) -> tuple[Measure | str, str]:
    """(Measure of a step of `layers` unrolled encoder layers, how it was obtained):
    `compile_layers(n)` compiles the step with n layers; above FIT_LAYERS + 1 layers, those of
    FIT_LAYERS and FIT_LAYERS + 1 are compiled and every figure extrapolated (`extrapolate`).
    A compile out of memory gives its message."""
    if layers <= FIT_LAYERS + 1:
        return compile_layers(layers), f"measured: the full step compiled ({layers} layers)"
    one = compile_layers(FIT_LAYERS)
    if isinstance(one, str):
        return one, "out of memory"
    two = compile_layers(FIT_LAYERS + 1)
    if isinstance(two, str):
        return two, "out of memory"
    return extrapolate(one, two, layers, FIT_LAYERS), (
        f"extrapolated to {layers} layers from compiles of {FIT_LAYERS} and {FIT_LAYERS + 1} "
        "unrolled layers (fixed + per-layer x layers)")


def _stage_cost(stage, full: _Step, measured: Measure | str, slice_: topology_lib.Slice
                ) -> StageCost:
    """StageCost of a stage of the full job from its (compiled or extrapolated) Measure, or
    from the compiler's out-of-memory message."""
    batch_size = step_lib.stage_batch(full.job, stage)[0]
    common = dict(name=stage.name, seq_len=stage.tokens_per_example,
                  steps=stage.end - stage.start, batch_size=batch_size,
                  model_flops=stage.flops_per_example * batch_size)
    if isinstance(measured, str):
        args = full.state_bytes + full.batch_bytes(stage)
        needed, available = oom_sizes(measured)
        temp = needed or float("nan")
        return StageCost(**common, argument_bytes=args, temp_bytes=temp, total_bytes=args + temp,
                         hbm_bytes=available or slice_.hbm_bytes, fits=False, xla_flops=None,
                         xla_seconds=None, message=measured)
    m = measured
    total = m.argument_bytes + m.output_bytes + m.temp_bytes
    return StageCost(**common, argument_bytes=m.argument_bytes, temp_bytes=m.temp_bytes,
                     total_bytes=total, hbm_bytes=slice_.hbm_bytes,
                     fits=total <= slice_.hbm_bytes, xla_flops=m.flops or None,
                     xla_seconds=m.seconds, bytes_accessed=m.bytes_accessed,
                     hlo_bytes=m.hlo_bytes, groups=m.groups,
                     compute_bound=m.flops / slice_.peak_flops,
                     memory_bound=(m.hlo_bytes or m.bytes_accessed)
                     / (slice_.chip.hbm_gbps * 1e9),
                     roofline=m.groups and sum(g.seconds for g in m.groups["category"].values()))


def compile_stages(make_job: Callable[[Any], Any], config, slice_: topology_lib.Slice,
                   devices, exact: bool = False, until_misfit: bool = False,
                   progress: Callable[[str], None] = lambda line: None
                   ) -> tuple[list[StageCost], str]:
    """Each stage's train step on the slice, with its layers unrolled → (costs, how they were
    obtained). By default the steps of FIT_LAYERS and FIT_LAYERS + 1 layers are compiled and
    every figure extrapolated linearly to the model's layers; exact: the full step is compiled.
    until_misfit: longest sequences first, stopping at the first stage that does not fit.
    progress: gets a line before and after each compile (they take minutes on a CPU)."""
    began = time.time()

    def compiled(step: _Step, stage) -> Measure | str:
        layers_ = step.job.model_config.num_layers
        progress(f"  compiling {stage.name} ({stage.tokens_per_example} tokens, {layers_} "
                 "layers unrolled) ...")
        start = time.time()
        result = step.compile(stage.name, slice_)
        progress(f"    done in {time.time() - start:.0f} s (elapsed "
                 f"{_clock(time.time() - began)})")
        return result

    full = _Step.build(make_job(layer_config(config, None)), config, devices)
    layers = full.job.model_config.num_layers
    first = FIT_LAYERS
    exact = exact or layers <= first + 1
    if exact:
        variants = []
        method = f"measured: the full step compiled, layers unrolled ({layers})"
    else:
        variants = [_Step.build(make_job(layer_config(config, n)), config, devices)
                    for n in (first, first + 1)]
        method = (f"extrapolated to {layers} layers from compiles of {first} and {first + 1} "
                  "unrolled layers (fixed + per-layer x layers); analytic model FLOPs for MFU")
    stages = full.job.stages
    if until_misfit:
        stages = sorted(stages, key=lambda s: -s.tokens_per_example)
    costs = []
    for stage in stages:
        if exact:
            result = compiled(full, stage)
        else:  # an out-of-memory compile ends the stage's compiles
            result, _ = calibrated(lambda n, s=stage: compiled(variants[n - first], s), layers)
        costs.append(_stage_cost(stage, full, result, slice_))
        if until_misfit and not costs[-1].fits:
            break
    return costs, method


def _clock(seconds: float) -> str:
    """`m:ss`."""
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


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
    """The per-chip table of `run_on_slice`, one line per stage. TFLOP/chip: XLA's count;
    XLA GB: its bytes accessed; HLO GB: the HBM bytes of the optimized HLO's ops; step ms,
    seq/s, MFU, time: by the compiler's per-op estimates (`StageCost.time`); XLA ms / XLA MFU:
    by XLA's optimal_seconds."""
    lines = [f"  {'stage':<8} {'seq':>5} {'batch':>6} {'args GiB':>9} {'temp GiB':>9} "
             f"{'total GiB':>10} {'HBM GiB':>8} {'fits':>4} {'TFLOP/chip':>10} "
             f"{'XLA GB':>7} {'HLO GB':>7} {'step ms':>8} {'seq/s':>9} {'MFU':>6} {'steps':>9} "
             f"{'time':>9} {'XLA ms':>7} {'XLA MFU':>7}"]
    for c in costs:
        mfu, xla_mfu = c.mfu(slice_), c.mfu(slice_, xla=True)
        lines.append(
            f"  {c.name:<8} {c.seq_len:>5} {c.batch_size:>6} {c.argument_bytes / GIB:>9.2f} "
            f"{_fmt(c.temp_bytes / GIB, '.2f'):>9} {_fmt(c.total_bytes / GIB, '.2f'):>10} "
            f"{c.hbm_bytes / GIB:>8.2f} {'yes' if c.fits else 'NO':>4} "
            f"{_fmt(c.xla_flops and c.xla_flops / 1e12, '.2f'):>10} "
            f"{_fmt(c.bytes_accessed and c.bytes_accessed / 1e9, '.1f'):>7} "
            f"{_fmt(c.hlo_bytes and c.hlo_bytes / 1e9, '.1f'):>7} "
            f"{_fmt(c.time and c.time * 1e3, '.1f'):>8} "
            f"{_fmt(c.sequences_per_second, ',.0f'):>9} "
            f"{_fmt(mfu and 100 * mfu, '.1f') + ('%' if mfu else ''):>6} {c.steps:>9,} "
            f"{_duration(c.seconds):>9} "
            f"{_fmt(c.xla_seconds and c.xla_seconds * 1e3, '.1f'):>7} "
            f"{_fmt(xla_mfu and 100 * xla_mfu, '.1f') + ('%' if xla_mfu else ''):>7}")
    return lines


def notes(costs: list[StageCost], slice_: topology_lib.Slice) -> list[str]:
    """What the table cannot say: where XLA's optimal_seconds is missing, where the step has
    no time at all (with its two roofline lower bounds), and stages that do not fit."""
    lines = []
    for c in costs:
        if c.fits and c.xla_seconds is None and c.op_seconds:
            lines.append(f"  {c.name}: libtpu gives no optimal_seconds for {slice_.chip.family} "
                         "(< 0); the step time is the compiler's per-op estimates alone.")
        if c.fits and c.time is None and c.compute_bound is not None:
            lines.append(
                f"  {c.name}: the compiler gave no time estimates, so no time or MFU. Lower "
                f"bounds: XLA's FLOPs at peak, {c.compute_bound * 1e3:.1f} ms; the HBM bytes "
                f"of the optimized HLO's ops at full bandwidth, {c.memory_bound * 1e3:.1f} ms.")
        if not c.fits:
            lines.append(f"  {c.name} does not fit: {c.total_bytes / GIB:.2f} GiB per chip "
                         f"needed, {c.hbm_bytes / GIB:.2f} GiB available"
                         + (f" (compiler: {c.message[:240]})" if c.message else ""))
    return lines


def fit_hints(costs: list[StageCost], job) -> list[str]:
    """For each stage that does not fit, the flags that make it smaller: its own remat policy
    and gradient accumulation where it is a pre-training phase, the job's otherwise."""
    phases = {p.name for p in job.phases}
    lines = []
    for c in costs:
        if c.fits:
            continue
        remat, accum = (("model.remat_policy", "train.grad_accum_steps") if c.name not in phases
                        else (f"phases.{c.name}.remat_policy", f"phases.{c.name}.grad_accum_steps"))
        lines.append(f"  to fit {c.name}: --config.{remat}=dots (or full), or "
                     f"--config.{accum}=2 (or more), then run this again")
    return lines


def breakdown_lines(cost: StageCost, top: int = 25) -> list[str]:
    """--breakdown: the stage's HBM bytes, matmul FLOPs, per-op roofline and per-op estimated
    time by category and by op (bertjax/train/hlo_costs.py)."""
    from bertjax.train import hlo_costs

    groups = cost.groups or {}
    if not groups:
        return []
    lines = [f"Breakdown of {cost.name}, per chip (optimized HLO, op by op: HBM bytes of "
             "operands and results, matmul FLOPs; 'bound' = max(FLOPs / peak, bytes / HBM "
             "bandwidth) per op, summed; 'model' = the TPU compiler's estimate of each op, its "
             "cycles over the clock, summed: the step time):"]
    lines += hlo_costs.table(groups["category"], "category")
    lines += hlo_costs.table(groups["op"], f"top {top} ops (fwd/bwd: forward/backward pass)",
                             top=top)
    return lines


def global_batch(job, micro_batches: bool = True) -> str:
    """The header's "global batch 256[ in 4 micro-batches]"; one per stage where the stages'
    differ (pre-training phases with their own), e.g. "global batch phase1 65536, phase2
    32768 in 2 micro-batches"."""
    def say(batch: int, accum: int) -> str:
        return f"{batch}" + (f" in {accum} micro-batches" if micro_batches and accum > 1 else "")

    said = {stage.name: say(*step_lib.stage_batch(job, stage)) for stage in job.stages}
    if len(set(said.values())) == 1:
        return f"global batch {next(iter(said.values()))}"
    return "global batch " + ", ".join(f"{name} {value}" for name, value in said.items())


def _phase_remat(job) -> str:
    """The header's note of the phases with their own remat policy, e.g. " (phase2: dots)"."""
    own = [f"{p.name}: {p.remat_policy}" for p in job.phases if p.remat_policy]
    return f" ({', '.join(own)})" if own else ""


def run_on_slice(make_job: Callable[[Any], Any], config, topology: str, exact: bool = False,
                 breakdown: bool = False, print_fn=print) -> list[StageCost]:
    """Compiles every stage's train step for a Cloud TPU slice (TPU compiler, any machine) and
    prints the per-chip table: memory against HBM, FLOPs, bytes, step time, sequences/s, MFU,
    time (see compile_stages for how)."""
    slice_ = topology_lib.parse(topology)
    devices = topology_lib.devices(slice_)
    mesh_shape = sharding_lib.mesh_shape(config.mesh, len(devices))
    job = make_job(config)
    cfg = job.model_config
    print_fn(f"{type(job.model).__name__} ({config.get('preset', 'custom')}) on "
             f"{slice_.accelerator_type} ({slice_.topology_name}): {slice_.num_chips} chips of "
             f"{slice_.chip.hbm_gib:g} GiB HBM, {slice_.chip.peak_bf16_tflops:g} bf16 TFLOP/s")
    print_fn(f"Mesh {dict(zip(sharding_lib.MESH_AXES, mesh_shape, strict=True))}; "
             f"{global_batch(job)}; {cfg.dtype}; remat {cfg.remat_policy}{_phase_remat(job)}; "
             f"layers {cfg.num_layers}")
    if cfg.scan_layers:
        print_fn("  (the config scans its layers; compiled unrolled here: a scanned step's time "
                 "is not costed right by XLA, and its temporaries are larger)")
    start = time.time()
    def progress(line: str) -> None:
        print_fn(line)
        sys.stdout.flush()

    costs, method = compile_stages(make_job, config, slice_, devices, exact=exact,
                                   progress=progress)
    print_fn("Train step per chip (TPU compiler; step time: the compiler's per-op estimates "
             f"summed; {method}):")
    for line in stage_table(costs, slice_) + notes(costs, slice_) + fit_hints(costs, job):
        print_fn(line)
    total = [c.seconds for c in costs]
    print_fn((f"All {sum(c.steps for c in costs):,} steps: {_duration(sum(total))} "
              if all(total) else "") + f"(compiled in {time.time() - start:.0f} s)")
    for c in costs if breakdown else []:
        for line in breakdown_lines(c):
            print_fn(line)
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
                f"--config.model.remat_policy={self.remat} --config.model.scan_layers=false")


def _try(make_job, config, slice_, devices, mesh, remat, batch_size, exact) -> Candidate:
    config = config.copy_and_resolve_references()
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
    config.train.batch_size = batch_size
    with config.unlocked():  # fine-tuning's config.model holds only the fields it overrides
        config.model.remat_policy = remat
    costs, _ = compile_stages(make_job, config, slice_, devices, exact, until_misfit=True)
    return Candidate(mesh, remat, batch_size, costs)


def sweep(make_job: Callable[[Any], Any], config, topology: str, print_fn=print,
          budget_seconds: float = 600.0, exact: bool = False) -> list[Candidate]:
    """Tries meshes (data / fsdp / tensor), batch sizes and remat policies on a slice (layers
    unrolled, estimated as in compile_stages); prints the configurations that fit, by estimated
    sequences/s, with the flags that select each. For each mesh and remat, batches are tried
    largest first and the first that fits is kept (a larger batch would not fit; a smaller one
    is rarely faster).

    make_job(config) -> the job of a config (pre-training or fine-tuning). Compiles stop after
    `budget_seconds`; the candidates not tried are counted.
    """
    slice_ = topology_lib.parse(topology)
    devices = topology_lib.devices(slice_)
    heads = make_job(config).model_config.num_heads
    keys = [(mesh, remat) for remat in REMAT_POLICIES
            for mesh in mesh_candidates(slice_.num_chips, heads)]
    print_fn(f"Sweep on {slice_.accelerator_type} ({slice_.topology_name}, {slice_.num_chips} "
             f"chips): {len(keys)} mesh/remat settings x batches "
             f"{'/'.join(map(str, PER_REPLICA_BATCHES))} per replica, largest first "
             f"(budget {budget_seconds:.0f} s)")
    start, results, untried = time.time(), [], 0
    for mesh, remat in keys:
        for per_replica in PER_REPLICA_BATCHES:
            if time.time() - start > budget_seconds:
                untried += 1
                break
            batch = per_replica * mesh[0] * mesh[1]
            tic = time.time()
            try:
                candidate = _try(make_job, config, slice_, devices, mesh, remat, batch, exact)
            except ConfigError as e:  # e.g. a batch the mesh cannot split
                print_fn(f"  skipped mesh {mesh} batch {batch}: {e}")
                continue
            speed = candidate.sequences_per_second
            worst = max(candidate.costs, key=lambda c: c.total_bytes / c.hbm_bytes)
            verdict = (f"{speed:,.0f} seq/s" if speed else
                       "fits (no cost-model time on this chip)" if candidate.fits else
                       f"{worst.name} does not fit ({worst.total_bytes / GIB:.1f} of "
                       f"{worst.hbm_bytes / GIB:.1f} GiB)")
            print_fn(f"  mesh data/fsdp/tensor {'x'.join(map(str, mesh)):<8} batch {batch:>6} "
                     f"remat {remat:<4}: {verdict} "
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
        print_fn("  none ranked: " + ("the compiler gave no time estimates for "
                                      f"{slice_.chip.family}" if any(c.fits for c in results)
                                      else "every configuration tried runs out of HBM"))
    return ranked

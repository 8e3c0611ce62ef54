"""Ahead-of-time compiles of a job's train step and what the compiler says of them: memory,
FLOPs, bytes and, on a TPU slice, the TPU compiler's estimate of each op (hlo_costs.py; the
flash kernels' compiled schedule: kernel_schedule.py). Layers are compiled unrolled, at
FIT_LAYERS and FIT_LAYERS + 1, and every figure extrapolated linearly to the model's
(`exact`: the full step); docs/tpu_aot.md says why."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable
from typing import Any

import jax

from bertjax.aot import hlo_costs, kernel_schedule
from bertjax.aot import topology as topology_lib
from bertjax.models import architecture
from bertjax.train import configs
from bertjax.train import sharding as sharding_lib
from bertjax.train import step as step_lib

GIB = 1024.0**3

# The smaller of the two layer counts compiled and extrapolated from. Not 1: a 1-layer step's
# cost-model time and temporaries are off the line of deeper steps (its peak memory is set by
# what does not grow with depth); see docs/tpu_aot.md.
FIT_LAYERS = 2


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
        """HBM bytes of the optimized HLO's ops (bertjax/aot/hlo_costs.py)."""
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


def measure(compiled, slice_: topology_lib.Slice | None, flash: tuple[float, bool] | None = None,
            splash: tuple[int | None, ...] | None = None) -> Measure:
    """A compiled step's memory, FLOPs, bytes, cost-model time and (on a slice) its ops'
    costs. flash: (attention dropout rate, causal) where the model runs the flash kernels;
    splash: the window radii of its layers (None: global) where it runs the splash kernels.
    Their time is then at least their compiled schedule's (bertjax/aot/kernel_schedule.py)."""
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
        for kernels in kernel_schedule.splash_kernels(text, splash) if splash else ():
            scheduled.update(kernel_schedule.splash_cycles(slice_.topology_name, kernels))
        ops = hlo_costs.op_costs(text, slice_.chip.clock_hz, *rates, scheduled)
        clock = slice_.chip.clock_hz
        groups = {"category": hlo_costs.group(ops, lambda o: o.category, *rates, clock),
                  "op": hlo_costs.group(ops, hlo_costs.short_label, *rates, clock),
                  "source": hlo_costs.group(ops, hlo_costs.source, *rates, clock)}
        # The kernels as XLA's cost model sees them, for the report's reconciliation.
        as_estimated = [dataclasses.replace(o, cycles=o.unscheduled_cycles) for o in ops
                        if hlo_costs.source(o) == hlo_costs.KERNELS]
        groups["source"].update(hlo_costs.group(
            as_estimated, lambda o: hlo_costs.KERNEL_ESTIMATES, *rates, clock))
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
        if architecture(config.model).scans_layers:  # else always unrolled
            config.model.scan_layers = False
        if layers is not None:
            config.model.num_layers = layers
    return config


@dataclasses.dataclass
class Step:
    """A job's train step, ready to compile on a slice's devices."""

    job: Any
    train_steps: dict[str, Any]  # stage name → its jitted step
    abstract_state: Any
    state_bytes: float  # the state's shards on one chip
    batch_sharding: Any

    @classmethod
    def build(cls, job, config, devices) -> Step:
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
    out-of-memory message (any other compile error is raised). model_config: the model config
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
    flash = splash = None
    if model_config is not None:
        flash, splash = architecture(model_config).tpu_kernels(model_config)
    return measure(compiled, slice_, flash, splash)


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


def _stage_cost(stage, full: Step, measured: Measure | str, slice_: topology_lib.Slice
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

    def compiled(step: Step, stage) -> Measure | str:
        layers_ = step.job.model_config.num_layers
        progress(f"  compiling {stage.name} ({stage.tokens_per_example} tokens, {layers_} "
                 "layers unrolled) ...")
        start = time.time()
        result = step.compile(stage.name, slice_)
        progress(f"    done in {time.time() - start:.0f} s (elapsed "
                 f"{_clock(time.time() - began)})")
        return result

    full = Step.build(make_job(layer_config(config, None)), config, devices)
    layers = full.job.model_config.num_layers
    first = FIT_LAYERS
    # A ModernBERT's layers are of two kinds (global, local) whose costs differ: no one
    # per-layer figure to extrapolate, so its full step is compiled.
    mixed = architecture(full.job.model_config).mixed_layers(full.job.model_config)
    exact = exact or mixed or layers <= first + 1
    if exact:
        variants = []
        method = f"measured: the full step compiled, layers unrolled ({layers})" + (
            "; global and local layers differ, so nothing is extrapolated" if mixed else "")
    else:
        variants = [Step.build(make_job(layer_config(config, n)), config, devices)
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

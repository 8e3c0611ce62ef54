"""The `--dry_run --topology` report: the per-chip table of each stage's step on a Cloud TPU
slice (memory against HBM, FLOPs, bytes, step time, sequences/s, MFU, time to finish), its
notes, the flags that would make a stage fit, and `--breakdown`'s op tables."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from bertjax.aot import hlo_costs
from bertjax.aot import topology as topology_lib
from bertjax.aot.measure import GIB, StageCost, compile_stages
from bertjax.models import architecture
from bertjax.train import sharding as sharding_lib
from bertjax.train import step as step_lib


def duration(seconds: float | None) -> str:
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
            f"{duration(c.seconds):>9} "
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


def reconciliation(costs: list[StageCost]) -> list[str]:
    """Where the two step times differ, per stage: the per-op estimate is XLA's ops at the TPU
    compiler's estimate of each plus the Pallas kernels at the larger of their compiled schedule
    and cost estimate; XLA's optimal_seconds sees the kernels only through their cost estimates
    and follows its own bytes-accessed count, which the HLO's HBM bytes set beside it."""
    lines = []
    for c in costs:
        source = (c.groups or {}).get("source")
        if not source or not c.op_seconds or not c.xla_seconds:
            continue
        ms = {k: g.model_seconds * 1e3 for k, g in source.items()}
        kernels, estimated = (ms.get(hlo_costs.KERNELS, 0.0),
                              ms.get(hlo_costs.KERNEL_ESTIMATES, ms.get(hlo_costs.KERNELS, 0.0)))
        bytes_ratio = (f", {c.bytes_accessed / c.hlo_bytes:.1f}x the HLO's HBM bytes "
                       f"({c.hlo_bytes / 1e9:.1f} GB)" if c.hlo_bytes and c.bytes_accessed else "")
        lines.append(
            f"  {c.name}: per-op {c.op_seconds * 1e3:.1f} ms = XLA ops "
            f"{ms.get(hlo_costs.XLA_OPS, 0.0):.1f} (the compiler's estimates) + Pallas kernels "
            f"{kernels:.1f} (schedule or cost estimate, the larger; by their cost estimates "
            f"{estimated:.1f}); XLA {c.xla_seconds * 1e3:.1f} ms follows its bytes accessed "
            f"({c.bytes_accessed / 1e9:.1f} GB{bytes_ratio})")
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
    time by category and by op (bertjax/aot/hlo_costs.py)."""
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


def local_attention_lines(job) -> list[str]:
    """The architecture's attention lines (`Architecture.attention_report`: a ModernBERT's
    local layers against all-global attention), one per sequence length; [] where it has
    none."""
    report = architecture(job.model_config).attention_report
    if report is None:
        return []
    stages = []
    for seq_len in sorted({stage.tokens_per_example for stage in job.stages}):
        stage = next(s for s in job.stages if s.tokens_per_example == seq_len)
        stages.append((seq_len, stage.flops_per_example))
    return report(job.model_config, stages)


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
    for line in (stage_table(costs, slice_) + notes(costs, slice_) + reconciliation(costs)
                 + fit_hints(costs, job) + local_attention_lines(job)):
        print_fn(line)
    total = [c.seconds for c in costs]
    print_fn((f"All {sum(c.steps for c in costs):,} steps: {duration(sum(total))} "
              if all(total) else "") + f"(compiled in {time.time() - start:.0f} s)")
    for c in costs if breakdown else []:
        for line in breakdown_lines(c):
            print_fn(line)
    return costs

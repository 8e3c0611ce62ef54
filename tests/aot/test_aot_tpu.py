"""Ahead-of-time compiles for Cloud TPU slices on this CPU machine (bertjax/aot/topology.py,
bertjax/aot/dry_run.py): slice names, the train step compiled by the TPU compiler for 4- and
8-chip slices with memory that grows with the batch and shrinks under FSDP, and a configuration
too large for its slice reported as not fitting, with the compiler's figures; the calibrated
estimate (2 and 3 unrolled layers extrapolated) against a full unrolled compile; the HLO
breakdown (bertjax/aot/hlo_costs.py): convolution FLOPs against einsum counts, bytes by
memory space, and categories against the analytic FLOPs of attention and the FFN.

The compile tests need libtpu (the `tpu` and `test` extras) and skip without it.
"""

import dataclasses
import importlib.util
import re

import pytest
from conftest import run_python

from bertjax import cli
from bertjax.aot import topology
from bertjax.errors import ConfigError

# conftest's persistent compilation cache is on before these compiles: TPU executables are
# written there but cannot be read back without a TPU client (JAX warns and compiles).
pytestmark = pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache")

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu (pip install -e '.[tpu]') is not installed")

# The Cloud TPU documentation's slice tables: name → (chips, shape, HBM GiB per chip). v4 and
# v5p names count TensorCores (two per chip), v5e and v6e names count chips.
SLICES = {
    "v4-8": (4, (2, 2, 1), 32), "v4-16": (8, (2, 2, 2), 32), "v4-32": (16, (2, 2, 4), 32),
    "v4-64": (32, (2, 4, 4), 32), "v4-128": (64, (4, 4, 4), 32), "v4-256": (128, (4, 4, 8), 32),
    "v4-512": (256, (4, 8, 8), 32), "v4-1024": (512, (8, 8, 8), 32),
    "v5p-8": (4, (2, 2, 1), 95), "v5p-16": (8, (2, 2, 2), 95), "v5p-32": (16, (2, 2, 4), 95),
    "v5p-64": (32, (2, 4, 4), 95), "v5p-128": (64, (4, 4, 4), 95),
    "v5p-256": (128, (4, 4, 8), 95), "v5p-512": (256, (4, 8, 8), 95),
    "v5p-1024": (512, (8, 8, 8), 95), "v5p-2048": (1024, (8, 8, 16), 95),
    "v5p-4096": (2048, (8, 16, 16), 95), "v5p-8192": (4096, (16, 16, 16), 95),
    "v5litepod-1": (1, (1, 1), 16), "v5litepod-4": (4, (2, 2), 16),
    "v5litepod-8": (8, (2, 4), 16), "v5litepod-16": (16, (4, 4), 16),
    "v5litepod-32": (32, (4, 8), 16), "v5litepod-64": (64, (8, 8), 16),
    "v5litepod-128": (128, (8, 16), 16), "v5litepod-256": (256, (16, 16), 16),
    "v5e-16": (16, (4, 4), 16), "V5E-8": (8, (2, 4), 16),
    "v6e-1": (1, (1, 1), 32), "v6e-4": (4, (2, 2), 32), "v6e-8": (8, (2, 4), 32),
    "v6e-16": (16, (4, 4), 32), "v6e-32": (32, (4, 8), 32), "v6e-64": (64, (8, 8), 32),
    "v6e-128": (128, (8, 16), 32), "v6e-256": (256, (16, 16), 32),
    "v5p:4x4x4": (64, (4, 4, 4), 95), "v4:2x2x4": (16, (2, 2, 4), 32),
    "v5e:4x8": (32, (4, 8), 16), "v5litepod:2x2": (4, (2, 2), 16), "v6e:8x8": (64, (8, 8), 32),
}
PEAK_TFLOPS = {"v4": 275, "v5p": 459, "v5e": 197, "v6e": 918}


@pytest.mark.parametrize("name", sorted(SLICES))
def test_every_accepted_name_maps_to_its_chips_and_hbm(name):
    chips, shape, hbm = SLICES[name]
    slice_ = topology.parse(name)
    assert (slice_.num_chips, slice_.shape, slice_.chip.hbm_gib) == (chips, shape, hbm)
    assert slice_.peak_flops == PEAK_TFLOPS[slice_.chip.family] * 1e12
    # The canonical forms name the same slice.
    assert topology.parse(slice_.topology_name) == slice_
    assert topology.parse(slice_.accelerator_type) == slice_


@pytest.mark.parametrize("name", ["v3-8", "v5p-7", "v5p-12", "v4-4", "v6e-2", "v6e-12",
                                  "v5e-512", "v5p:4x4", "v5e:2x2x2", "tpu-v4", "", "v5p-0"])
def test_unknown_names_give_one_line_listing_the_accepted_forms(name):
    with pytest.raises(ConfigError) as error:
        topology.parse(name)
    message = str(error.value)
    assert "\n" not in message and repr(name) in message
    for form in ("v4-N", "v5p-N", "v5litepod-N", "v6e-N", "v5p:4x4x4"):
        assert form in message


def test_cli_reports_an_unknown_topology_in_one_line():
    proc = run_python(["-m", "bertjax.pretrain", "--config=experiments/pretrain.py:tiny",
                       "--dry_run", "--topology=v3-8"])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: --topology='v3-8' is not a TPU slice; give v4-N")


@needs_libtpu
@pytest.mark.parametrize("name,kind", [("v5p-8", "TPU v5"), ("v4-16", "TPU v4"),
                                       ("v6e-8", "TPU v6 lite"), ("v5litepod-4", "TPU v5 lite")])
def test_libtpu_describes_one_device_per_chip(name, kind):
    devices = topology.devices(topology.parse(name))
    assert len(devices) == SLICES[name][0]
    assert {d.device_kind for d in devices} == {kind}
    assert {d.platform for d in devices} == {"tpu"}


def _pretraining_job(preset: str, batch_size: int, mesh: dict, phase: str, **model):
    """A pre-training job of one phase (its stage is the one compiled), bfloat16 as on TPU."""
    from bertjax.aot import measure as aot_measure
    from bertjax.tasks.pretraining import PretrainingJob

    config = cli.load_config(f"experiments/pretrain.py:{preset}")
    with config.unlocked():
        for name in list(config.phases):
            if name != phase:
                del config.phases[name]
    config.train.batch_size = batch_size
    config.train.num_train_steps = 1000
    config.mesh.update(mesh)
    config.model.update(model)
    aot_measure.use_tpu_dtype(config)
    return PretrainingJob(config, make_input=None), config


def _make_job(config):
    from bertjax.tasks.pretraining import PretrainingJob

    return PretrainingJob(config, make_input=None)


def _compile(name: str, batch_size: int, mesh: dict, preset="tiny", phase="phase1",
             exact=True, progress=lambda line: None, **model):
    from bertjax.aot import measure as aot_measure

    slice_ = topology.parse(name)
    job, config = _pretraining_job(preset, batch_size, mesh, phase, **model)
    [cost], _ = aot_measure.compile_stages(_make_job, config, slice_, topology.devices(slice_),
                                       exact=exact, progress=progress)
    return job, cost


# The tiny preset made smaller still: the TPU compiler's time grows with the tensors' sizes.
SMALL = dict(num_layers=1, hidden_size=64, intermediate_size=128, num_heads=2, vocab_size=512)


@pytest.mark.slow
@needs_libtpu
@pytest.mark.extended
def test_tiny_train_step_compiles_for_4_chips_and_memory_grows_with_the_batch():
    import jax

    lines = []
    _, small = _compile("v5litepod-4", 16, {"data": 4}, progress=lines.append, **SMALL)
    # A line before and after the compile (minutes at BERT's sizes): never silent that long.
    assert lines[0] == "  compiling phase1 (128 tokens, 1 layers unrolled) ..."
    assert re.fullmatch(r"    done in \d+ s \(elapsed \d+:\d\d\)", lines[1]) and len(lines) == 2
    job, large = _compile("v5litepod-4", 32, {"data": 4}, **SMALL)
    for cost in (small, large):
        assert cost.fits and cost.total_bytes <= cost.hbm_bytes == 16 * 1024**3
        assert cost.time > 0 and cost.xla_seconds > 0 and cost.xla_flops > 0
    # The state is the same; each chip holds twice the rows of the batch and their activations.
    state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        jax.eval_shape(job.init_params, jax.random.key(0))))
    batch_rows = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(job.stages[0].batch_spec))
    assert small.argument_bytes >= 3 * state  # params and two Adam moments, replicated
    # Each chip's batch shard gains 4 rows (the compiler pads them to its tiles). A model this
    # small keeps its activations in on-chip memory, so HBM temporaries need not grow.
    assert large.argument_bytes - small.argument_bytes >= batch_rows / 4 / 2
    assert large.total_bytes - small.total_bytes >= batch_rows / 4 / 2
    assert large.temp_bytes >= small.temp_bytes
    # Twice the work per chip: FLOPs double (within the fixed optimizer update).
    assert large.xla_flops == pytest.approx(2 * small.xla_flops, rel=0.1)
    assert large.sequences_per_second > small.sequences_per_second


def _all_reduce_bytes(hlo: str) -> dict[str, int]:
    """{element type: bytes} of the all-reduce results in optimized HLO text."""
    import math
    import re

    sizes: dict[str, int] = {}
    for line in hlo.splitlines():
        if " all-reduce(" not in line and " all-reduce-start(" not in line:
            continue
        head = re.split(r" all-reduce(?:-start)?\(", line)[0]
        for dtype, dims in re.findall(r"\b(bf16|f32)\[([0-9,]*)\]", head):
            count = math.prod(int(d) for d in dims.split(",") if d)
            sizes[dtype] = sizes.get(dtype, 0) + count * (2 if dtype == "bf16" else 4)
    return sizes


@pytest.mark.slow
@needs_libtpu
@pytest.mark.extended
def test_bf16_gradient_reduction_all_reduces_bfloat16_on_tpu():
    """grad_reduce_dtype=bfloat16 on 4 chips (data=4): the TPU compiler keeps the gradients'
    all-reduce in bfloat16 (only scalar metrics stay float32), and it moves fewer bytes than
    the default step's."""
    import jax

    from bertjax.aot import measure as aot_measure

    slice_ = topology.parse("v5p-8")
    devices = topology.devices(slice_)
    sizes = {}
    for reduce_dtype in ("float32", "bfloat16"):
        job, config = _pretraining_job("tiny", 32, {"data": 4}, "phase1", **SMALL)
        config.train.grad_reduce_dtype = reduce_dtype
        job = _make_job(config)
        step = aot_measure.Step.build(job, config, devices)
        stage = job.stages[0]
        caching = jax.config.jax_enable_compilation_cache
        jax.config.update("jax_enable_compilation_cache", False)
        try:
            compiled = step.train_steps[stage.name].lower(step.abstract_state,
                                                          stage.batch_spec).compile()
        finally:
            jax.config.update("jax_enable_compilation_cache", caching)
        sizes[reduce_dtype] = _all_reduce_bytes(compiled.as_text())
    assert sizes["bfloat16"].get("f32", 0) <= 64, sizes  # scalars only
    assert sum(sizes["bfloat16"].values()) < sum(sizes["float32"].values()), sizes


@pytest.mark.slow
@needs_libtpu
@pytest.mark.extended
def test_tiny_train_step_compiles_for_8_chips_and_fsdp_shrinks_the_state_per_chip():
    import jax

    job, fsdp = _compile("v5p-16", 32, {"data": 1, "fsdp": 8}, **SMALL)
    assert fsdp.fits and fsdp.time > 0
    state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        jax.eval_shape(job.init_params, jax.random.key(0))))
    # Data parallel, every chip holds params + two Adam moments (3 x state, as the 4-chip test
    # shows). FSDP splits every matrix with an `embed` axis over the 8 chips: at most twice an
    # eighth of that remains (LayerNorm scales, biases and the batch shard stay whole).
    assert fsdp.argument_bytes < 2 * 3 * state / 8


@pytest.mark.slow
@needs_libtpu
@pytest.mark.extended
def test_bert_large_phase2_batch_4096_on_v5e_4_does_not_fit_and_says_so():
    from bertjax.aot import measure as aot_measure
    from bertjax.aot import report as aot_report

    lines = []
    slice_ = topology.parse("v5e-4")
    # One layer: the compiler reaches its memory verdict without compiling 24 layers, and
    # with one layer already too large, the model is.
    _, config = _pretraining_job("large", 4096, {}, "phase2")
    costs, _ = aot_measure.compile_stages(_make_job, config, slice_, topology.devices(slice_))
    [cost] = costs
    assert not cost.fits and cost.time is None
    assert "RESOURCE_EXHAUSTED" in cost.message
    # float32 params and two Adam moments of BERT-large's 335M parameters, replicated.
    assert cost.argument_bytes > 12 * 335e6
    assert cost.total_bytes > cost.hbm_bytes
    assert 15 * 1024**3 < cost.hbm_bytes <= 16 * 1024**3  # what the compiler says is available
    lines = aot_report.stage_table(costs, slice_)
    assert lines[1].split()[:3] == ["phase2", "512", "4096"] and " NO " in lines[1]


def test_sweep_meshes_cover_data_fsdp_and_tensor_parallelism():
    from bertjax.aot import sweep as aot_sweep

    assert aot_sweep.mesh_candidates(16, 16) == [(16, 1, 1), (1, 16, 1), (8, 1, 2), (1, 8, 2),
                                               (4, 1, 4), (1, 4, 4)]
    # Tensor parallelism only where it divides the heads (and the chips); no duplicates.
    assert aot_sweep.mesh_candidates(4, 2) == [(4, 1, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2)]
    assert aot_sweep.mesh_candidates(1, 12) == [(1, 1, 1)]


def test_sweep_ranks_by_sequences_over_the_whole_run_and_prints_its_flags():
    from bertjax.aot import measure as aot_measure
    from bertjax.aot import sweep as aot_sweep

    def stage(name, steps, batch, seconds, fits=True):
        return aot_measure.StageCost(name, 128, steps, batch, 1.0, 1.0, 2.0, 4.0, fits, 1e12, 1e9,
                                 seconds)

    # 900 steps of 0.1 s and 100 of 0.5 s for 256 sequences each: 256,000 in 140 s.
    run = aot_sweep.Candidate((4, 2, 1), "dots", 256,
                            [stage("phase1", 900, 256, 0.1), stage("phase2", 100, 256, 0.5)])
    assert run.fits and run.sequences_per_second == pytest.approx(256_000 / 140)
    assert run.flags() == ("--config.mesh.data=4 --config.mesh.fsdp=2 --config.mesh.tensor=1 "
                           "--config.train.batch_size=256 --config.model.remat_policy=dots "
                           "--config.model.scan_layers=false")
    misfit = aot_sweep.Candidate((8, 1, 1), "none", 512,
                               [stage("phase2", 100, 512, None, fits=False)])
    assert not misfit.fits and misfit.sequences_per_second is None


def test_the_step_time_is_the_compilers_per_op_estimates_and_xla_time_is_printed_beside():
    from bertjax.aot import hlo_costs, topology
    from bertjax.aot import measure as aot_measure
    from bertjax.aot import report as aot_report

    slice_ = topology.parse("v6e-8")

    def stage(xla_seconds, op_seconds):
        groups = None if op_seconds is None else {"category": {
            "FFN": hlo_costs.Group("FFN", 1, 1e9, 1e12, 1e-3, 0.75 * op_seconds),
            "attention": hlo_costs.Group("attention", 1, 1e9, 1e12, 1e-3, 0.25 * op_seconds)}}
        return aot_measure.StageCost("phase1", 128, 1000, 256, 1.0, 1.0, 2.0, 4.0, True, 1e15, 1e12,
                                 xla_seconds, groups=groups, compute_bound=1e-3,
                                 memory_bound=2e-3)

    both, ops_only, xla_only = stage(0.03, 0.02), stage(None, 0.02), stage(0.03, None)
    assert both.time == pytest.approx(0.02) and ops_only.time == pytest.approx(0.02)
    assert xla_only.time == 0.03  # a compile whose ops carry no estimates
    assert both.mfu(slice_) == pytest.approx(1e15 / (0.02 * slice_.num_chips
                                                     * slice_.peak_flops))
    assert both.mfu(slice_, xla=True) == pytest.approx(1e15 / (0.03 * slice_.num_chips
                                                               * slice_.peak_flops))
    assert ops_only.mfu(slice_, xla=True) is None
    header, row = aot_report.stage_table([both], slice_)
    assert header.split()[-2:] == ["XLA", "MFU"] and row.split()[-2:] == [
        "30.0", f"{100 * both.mfu(slice_, xla=True):.1f}%"]
    assert f" {100 * both.mfu(slice_):.1f}% " in row and " 20.0 " in row
    (note,) = aot_report.notes([ops_only], slice_)
    assert "no optimal_seconds for v6e" in note
    assert not aot_report.notes([both], slice_)
    # No estimate of either kind: no time, no MFU, and the two lower bounds said instead.
    bare = stage(None, None)
    assert bare.time is None and bare.mfu(slice_) is None
    (note,) = aot_report.notes([bare], slice_)
    assert "1.0 ms" in note and "2.0 ms" in note


def test_the_report_says_which_parts_of_the_two_step_times_come_from_where():
    """The per-op step time is XLA's ops plus the Pallas kernels (at their schedule); the line
    sets the kernels' cost estimates, which XLA's optimal_seconds sees, and its bytes accessed
    against the HLO's HBM bytes beside it."""
    from bertjax.aot import hlo_costs
    from bertjax.aot import measure as aot_measure
    from bertjax.aot import report as aot_report

    def group(key, ms):
        return hlo_costs.Group(key, 1, 1e9, 1e12, 1e-3, ms / 1e3)

    ops = [hlo_costs.OpCost("fusion.1", "fusion", "a", "FFN", 8e9, 1e12, 1, 3.0e6),
           hlo_costs.OpCost("custom-call.2", "custom-call", "b", "attention", 1e9, 1e11, 1,
                            1.5e6)]
    source = hlo_costs.group(ops, hlo_costs.source, 1e15, 1e12, 1e9)
    assert {k: g.model_seconds for k, g in source.items()} == {
        hlo_costs.XLA_OPS: pytest.approx(3e-3), hlo_costs.KERNELS: pytest.approx(1.5e-3)}
    category = hlo_costs.group(ops, lambda o: o.category, 1e15, 1e12, 1e9)
    source[hlo_costs.KERNEL_ESTIMATES] = group(hlo_costs.KERNEL_ESTIMATES, 0.4)
    cost = aot_measure.StageCost("phase1", 128, 1000, 256, 1.0, 1.0, 2.0, 4.0, True, 1e15,
                                 1e12, 6e-3, bytes_accessed=44e9, hlo_bytes=20e9,
                                 groups={"category": category, "source": source})
    assert cost.op_seconds == pytest.approx(4.5e-3)
    (line,) = aot_report.reconciliation([cost])
    assert line == ("  phase1: per-op 4.5 ms = XLA ops 3.0 (the compiler's estimates) + Pallas "
                    "kernels 1.5 (schedule or cost estimate, the larger; by their cost "
                    "estimates 0.4); XLA 6.0 ms follows its bytes accessed (44.0 GB, 2.2x the "
                    "HLO's HBM bytes (20.0 GB))")
    assert not aot_report.reconciliation([dataclasses.replace(cost, xla_seconds=None)])


def test_a_stage_that_does_not_fit_is_given_the_flags_that_shrink_it():
    """A pre-training phase: its own remat policy and accumulation (the other phase keeps its
    settings); a stage that is not a phase (fine-tuning's): the job-wide flags."""
    from bertjax.aot import measure as aot_measure
    from bertjax.aot import report as aot_report

    job, _ = _pretraining_job("tiny", 256, {}, "phase2")

    def stage(name, fits):
        return aot_measure.StageCost(name, 512, 10, 256, 1.0, 1.0, 2.0, 4.0, fits, 1e15, 1e12, None)

    assert aot_report.fit_hints([stage("phase2", True)], job) == []
    (hint,) = aot_report.fit_hints([stage("phase2", False)], job)
    assert ("--config.phases.phase2.remat_policy=dots" in hint
            and "--config.phases.phase2.grad_accum_steps=2" in hint)
    (hint,) = aot_report.fit_hints([stage("train", False)], job)
    assert "--config.model.remat_policy=dots" in hint and "--config.train.grad_accum_steps" in hint


def test_out_of_memory_figures_are_read_from_the_compiler_message():
    from bertjax.aot import measure as aot_measure

    gib = 1024.0**3
    assert aot_measure.oom_sizes(
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (1.53T) exceeds available HBM (15.75G).") == (1.53 * 1024 * gib,
                                                                   15.75 * gib)
    assert aot_measure.oom_sizes("Used 20.5G of 15.75G hbm. Exceeded hbm capacity by 4.75G.") == (
        20.5 * gib, 15.75 * gib)
    assert aot_measure.oom_sizes("RESOURCE_EXHAUSTED: no sizes") == (None, None)


# --- The HLO breakdown (bertjax/aot/hlo_costs.py) -----------------------------------------

# Batched matmuls as the TPU compiler writes them (from a compiled BERT step: 64 sequences of
# 128 tokens per chip, 2 heads of 64), with the einsum each one computes.
CONVOLUTIONS = [
    # attention scores bqhd,bkhd->bhqk: the batch and heads as strided, dilated windows
    ("bf16[64,128,2,64]", "bf16[64,128,2,64]", "bf16[64,2,128,128]",
     "window={size=64x2 stride=63x1 lhs_dilate=64x2}, dim_labels=0b1f_0o1i->01bf",
     dict(b=64, q=128, k=128, h=2, d=64)),
    # probabilities x values bhqk,bkhd->bqhd
    ("bf16[64,128,2,64]", "bf16[64,2,128,128]", "bf16[64,2,64,128]",
     "window={size=64x2 stride=63x1 lhs_dilate=64x2}, dim_labels=0f1b_01oi->01bf",
     dict(b=64, q=128, k=128, h=2, d=64)),
    # a key projection bse,ehd->bshd: the heads as a padded, reversed window
    ("bf16[64,128,128,1]", "bf16[128,2,64,1]", "f32[64,128,2,64]",
     "window={size=1x2 pad=0_0x1_1 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f",
     dict(b=64, s=128, e=128, h=2, d=64)),
]


@pytest.mark.parametrize("lhs,rhs,out,attributes,sizes", CONVOLUTIONS)
def test_convolution_flops_equal_the_einsum_they_compute(lhs, rhs, out, attributes, sizes):
    import math

    from bertjax.aot import hlo_costs

    conv = hlo_costs.parse_instruction(
        f"  %conv = {out}{{3,2,1,0}} convolution(%a, %b), {attributes}, "
        'metadata={op_name="jit(train_step)/jvp(M)/bert/encoder/layer_0/attention/x"}')
    assert (conv.opcode, conv.operands) == ("convolution", ("a", "b"))
    # An einsum's multiply-adds: the product of every index's size.
    assert hlo_costs.convolution_flops(conv, {"a": lhs, "b": rhs}) == 2 * math.prod(
        sizes.values())


HLO = """HloModule step

%fused (p0: bf16[8,16], p1: bf16[16,4]) -> f32[8,4] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %t = (s32[], f32[8,4]{1,0}) parameter(0)
  %x = f32[8,4]{1,0} get-tuple-element(%t), index=1
  %y = f32[8,4]{1,0} add(%x, %x), metadata={op_name="jit(train_step)/add"}
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[8,4]{1,0}) tuple(%i, %y)
}

%cond (t: (s32[], f32[8,4])) -> pred[] {
  %t = (s32[], f32[8,4]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: bf16[8,16], b: bf16[16,4]) -> f32[8,4] {
  %a = bf16[8,16]{1,0:T(8,128)(2,1)} parameter(0)
  %b = bf16[16,4]{1,0} parameter(1)
  %cs = (bf16[8,16]{1,0:T(8,128)(2,1)S(1)}, bf16[8,16]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%a)
  %cd = bf16[8,16]{1,0:T(8,128)(2,1)S(1)} copy-done(%cs)
  %f = f32[8,4]{1,0} fusion(%cd, %b), kind=kOutput, calls=%fused, metadata={op_name="jit(train_step)/transpose(jvp(BertForPreTraining))/bert/encoder/layer_7/intermediate/dot_general"}
  %init = (s32[], f32[8,4]{1,0}) tuple(%c0, %f)
  %w = (s32[], f32[8,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[8,4]{1,0} get-tuple-element(%w), index=1
}
"""  # noqa: E501 (HLO lines as the compiler prints them)


def test_op_costs_count_hbm_bytes_matmul_flops_and_loop_trips():
    from bertjax.aot import hlo_costs

    costs = {c.name: c for c in hlo_costs.op_costs(HLO)}
    assert set(costs) == {"cs", "f", "y"}  # parameters, tuples, copy-done move nothing
    # The prefetch reads `a` from HBM (its VMEM destination and sync flag are on chip) and is
    # named after the op that reads what it fetched.
    assert costs["cs"].bytes == 8 * 16 * 2
    assert costs["cs"].op_name == costs["f"].op_name
    # The fusion reads `b` from HBM (its other operand is in VMEM) and writes its result; its
    # dot is 8 x 4 outputs of 16 multiply-adds.
    assert costs["f"].bytes == 16 * 4 * 2 + 8 * 4 * 4
    assert costs["f"].flops == 2 * 8 * 4 * 16
    assert costs["f"].op_name.endswith("/bert/encoder/layer_N/intermediate/dot_general")
    assert costs["f"].category == "FFN"
    # The loop body runs 3 times: reads x twice and writes y, each time.
    assert costs["y"].bytes == 3 * 3 * 8 * 4 * 4 and costs["y"].count == 3
    assert costs["y"].category == "optimizer update"


def test_op_costs_take_the_compilers_cycle_estimates_and_a_kernels_cost_estimate():
    """The TPU compiler's `estimated_cycles` per op (times a loop's trips) and, for a Pallas
    kernel (no estimate of the compiler's), the roofline of its cost_estimate in cycles; ops
    with neither count no cycles. Grouped, cycles over the clock are the model's seconds."""
    from bertjax.aot import hlo_costs

    text = """HloModule step

%body (t: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %t = (s32[], f32[8,4]{1,0}) parameter(0)
  %x = f32[8,4]{1,0} get-tuple-element(%t), index=1
  %y = f32[8,4]{1,0} fusion(%x), kind=kLoop, calls=%c, metadata={op_name="jit(train_step)/add"}, \
backend_config={"window_config":{"estimated_cycles":"700","iteration_bounds":["1"]}}
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[8,4]{1,0}) tuple(%i, %y)
}

ENTRY %main (a: bf16[64,128,768]) -> f32[8,4] {
  %a = bf16[64,128,768]{2,1,0} parameter(0)
  %k = bf16[64,128,768]{2,1,0} custom-call(%a), custom_call_target="tpu_custom_call", \
backend_config={"custom_call_config":{"body":"x","cost_estimate":{"flops":"459000000000",\
"transcendentals":"12","bytes_accessed":"2765000000","remote_bytes_transferred":"0"}}}
  %n = f32[8,4]{1,0} add(%x0, %x0)
  %w = (s32[], f32[8,4]{1,0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[8,4]{1,0} get-tuple-element(%w), index=1
}
"""
    clock, peak, bandwidth = 1.75e9, 459e12, 2765e9
    costs = {c.name: c for c in hlo_costs.op_costs(text, clock, peak, bandwidth)}
    assert costs["y"].cycles == 3 * 700
    # 459 GFLOP at 459 TFLOP/s (1 ms) against 2.765 GB at 2,765 GB/s (1 ms): 1 ms of cycles
    assert costs["k"].cycles == pytest.approx(1e-3 * clock)
    assert costs["n"].cycles == 0
    groups = hlo_costs.group(costs.values(), lambda c: c.name, peak, bandwidth, clock)
    assert groups["k"].model_seconds == pytest.approx(1e-3)
    assert groups["y"].model_seconds == pytest.approx(3 * 700 / clock)
    lines = hlo_costs.table(groups, "op")
    assert "model ms" in lines[0] and lines[1].split()[0] == "k"  # largest model time first
    # A kernel's scheduled cycles replace its roofline where they are more, never where less.
    key = (459000000000, 2765000000)
    for scheduled, expected in ((3e6, 3e6), (1e3, 1e-3 * clock)):
        with_schedule = {c.name: c for c in hlo_costs.op_costs(text, clock, peak, bandwidth,
                                                              {key: scheduled})}
        assert with_schedule["k"].cycles == pytest.approx(expected)
        assert with_schedule["y"].cycles == 3 * 700


# A kernel's final bundles as libtpu writes them: two bundles before its grid loop, a loop
# body of three (marked ">"), exiting after 5 trips, and one bundle after.
BUNDLES = """= control target key start
LH: loop header
LB: loop body
     0   :  { %s1 = sld [smem:[#allocation0]] /* core id */ }
   0x1   :  { %2 = vsyncpa [#allocation7], 0 }
   0x2 LB: > { %v3 = vmul.u32 %v1, %v2 }
   0x3   : > { %s4 = sadd.s32 1, %s5  ;;  %p6 = scmp.ge.s32.totalorder %s4, 5 /* loop exit test */ }
   0x4   : > { %7 = sbr.rel (!%p6) target = $region3 }
   0x5   :  { %8 = vsyncpa [#allocation7], 1 } /* exit bundle: %k = custom-call(%a) */
"""


def test_scheduled_cycles_are_the_loop_body_times_its_trips_plus_the_rest():
    from bertjax.aot import kernel_schedule

    assert kernel_schedule.scheduled_cycles(BUNDLES) == 3 + 3 * 5
    straight = "\n".join(line for line in BUNDLES.splitlines() if ">" not in line)
    assert kernel_schedule.scheduled_cycles(straight) == 3
    with pytest.raises(ValueError, match="one loop"):
        kernel_schedule.scheduled_cycles(BUNDLES.replace(" /* loop exit test */", ""))


def test_flash_kernels_are_found_by_the_forward_kernels_results():
    from bertjax.aot import kernel_schedule

    forward = ('  %f = (bf16[16,512,1024]{2,1,0:T(8,128)(2,1)}, f32[16,16,1,512]{3,2,1,0:T(1,128)})'
               ' custom-call(%s, %q, %k, %v, %a, %b), custom_call_target="tpu_custom_call", x\n')
    backward = ('  %g = (bf16[16,512,1024]{2,1,0}, bf16[16,512,1024]{2,1,0}, '
                'bf16[16,512,1024]{2,1,0}) custom-call(%s), custom_call_target="tpu_custom_call"\n')
    assert kernel_schedule.flash_kernels(forward + backward + forward, 0.1, True) == {
        kernel_schedule.FlashKernels(16, 512, 16, 64, 0.1, True)}
    assert not kernel_schedule.flash_kernels(backward, 0.1, False)


def test_splash_kernels_are_found_by_the_forward_kernels_results():
    """A splash forward's results are o [batch, seq, heads·head_dim] and the log-sum-exp rows
    [batch, heads, 8, seq]; each shape is taken for every radius asked (global and local
    layers share it). A flash forward's (log-sum-exp [batch, heads, 1, seq]) is not one."""
    from bertjax.aot import kernel_schedule

    forward = ('  %f = (bf16[64,1024,768]{2,1,0:T(8,128)(2,1)}, f32[64,12,8,1024]{3,2,1,0})'
               ' custom-call(%i, %l, %q, %k, %v), custom_call_target="tpu_custom_call", x\n')
    dq = ('  %g = (bf16[64,1024,768]{2,1,0}) custom-call(%i), '
          'custom_call_target="tpu_custom_call"\n')
    flash = ('  %f = (bf16[16,128,1024]{2,1,0}, f32[16,16,1,128]{3,2,1,0}) custom-call(%s), '
             'custom_call_target="tpu_custom_call"\n')
    assert not kernel_schedule.splash_kernels(flash, (None,))
    assert kernel_schedule.splash_kernels(forward + dq + forward, (None, 64)) == {
        kernel_schedule.SplashKernels(64, 1024, 12, 64, None),
        kernel_schedule.SplashKernels(64, 1024, 12, 64, 64)}
    assert not kernel_schedule.splash_kernels(dq, (None,))
    assert not kernel_schedule.flash_kernels(forward, 0.0, False)


@needs_libtpu
@pytest.mark.extended
def test_the_splash_kernels_schedule_grows_with_their_grid_and_exceeds_the_roofline():
    """Compiled for one v5p chip: the splash kernels' cycles (forward, dk/dv, dq and di),
    keyed by the estimates the step's HLO carries (a local layer's attention kernels differ
    from a global one's of the same shape), double with the batch (the grid's parallel steps,
    split over the 2 TensorCores), and each is slower than its roofline (the attention
    kernels by their vector work: masks, softmax)."""
    import jax
    import jax.numpy as jnp

    from bertjax.aot import kernel_schedule
    from bertjax.models.kernels import splash_attention

    slice_ = topology.parse("v5p-8")
    cycles, di = {}, {}
    for batch in (2, 4):
        for radius in (None, 64):
            kernels = kernel_schedule.SplashKernels(batch, 1024, 2, 64, radius)
            cycles[batch, radius] = kernel_schedule.splash_cycles(slice_.topology_name, kernels)
            static = splash_attention.Static(1024, 512, radius, 2, 64)
            shaped = jax.ShapeDtypeStruct((batch, 1024, 2 * 64), jnp.bfloat16)
            costs = splash_attention.kernel_costs(static, shaped)
            assert set(cycles[batch, radius]) == {
                (int(c.flops), int(c.bytes_accessed)) for c in costs.values()}
            for cost in costs.values():
                scheduled = cycles[batch, radius][(int(cost.flops), int(cost.bytes_accessed))]
                roofline = slice_.chip.clock_hz * max(
                    cost.flops / slice_.peak_flops,
                    cost.bytes_accessed / (slice_.chip.hbm_gbps * 1e9))
                assert scheduled > roofline
        # Every attention kernel's key tells a global layer from a local one (di's, the same
        # kernel in both, is shared).
        di[batch] = (int(costs["di"].flops), int(costs["di"].bytes_accessed))
        assert set(cycles[batch, None]) & set(cycles[batch, 64]) == {di[batch]}
    # A global layer's kernels: 2·1·2·2 grid steps at batch 2 (one group of 2 heads), twice
    # that at 4, halved over the cores (the backward's over its rows and head groups), +2 to
    # fill; a local layer's kernels have no key steps, nor has di's grid: 2·1·2
    for radius, steps in ((None, 8), (64, 4)):
        small, large = ([v for k, v in sorted(cycles[b, radius].items()) if k != di[b]]
                        for b in (2, 4))
        for s, l_ in zip(sorted(small), sorted(large)):
            assert l_ / s == pytest.approx((steps + 2) / (steps // 2 + 2), rel=0.05)
        assert cycles[4, radius][di[4]] / cycles[2, radius][di[2]] == pytest.approx(
            (8 // 2 + 2) / (4 // 2 + 2), rel=0.05)


@needs_libtpu
@pytest.mark.extended
def test_the_flash_kernels_schedule_grows_with_their_grid_and_exceeds_the_roofline():
    """Compiled for one v5p chip: each kernel's cycles are its grid loop's: twice the batch,
    twice the grid steps (4 rows of 128 tokens per step, 2 heads per 128-lane tile, the steps
    split over the chip's 2 TensorCores, +2 trips to fill the pipeline), keyed by the
    cost_estimate the step's HLO carries; at 128 tokens the vector work makes both kernels
    slower than their roofline."""
    from bertjax.aot import kernel_schedule
    from bertjax.models.kernels import dropout_attention, flash_attention

    slice_ = topology.parse("v5p-8")
    cycles, trips = {}, {}
    for batch in (16, 32):
        kernels = kernel_schedule.FlashKernels(batch, 128, 4, 64, 0.1, False)
        cycles[batch] = kernel_schedule.flash_cycles(slice_.topology_name, kernels)
        rows = dropout_attention.rows_per_step(batch, 128)
        trips[batch] = batch // rows * 2 // 2 + 2
        shape = flash_attention.Shape(batch, 4, 128, 64, 2)
        static = dropout_attention.Static(False, 0.125, 0.1, 4, 64, rows)
        for cost in (dropout_attention.forward_cost(shape, static),
                     dropout_attention.backward_cost(shape, static)):
            scheduled = cycles[batch][(int(cost.flops), int(cost.bytes_accessed))]
            roofline = slice_.chip.clock_hz * max(cost.flops / slice_.peak_flops,
                                                  cost.bytes_accessed
                                                  / (slice_.chip.hbm_gbps * 1e9))
            assert scheduled > roofline
    for small, large in zip(sorted(cycles[16].values()), sorted(cycles[32].values())):
        assert large / small == pytest.approx(trips[32] / trips[16], rel=0.05)


def test_a_slice_moves_the_bytes_it_returns_not_its_whole_source():
    from bertjax.aot import hlo_costs

    # The TPU compiler's asynchronous slice (v6e): 4 MiB of a 31 MB HBM buffer into VMEM (the
    # backslash continues the HLO line).
    text = """HloModule step

ENTRY %main (p: s8[31260672]) -> s8[4194304] {
  %p = s8[31260672]{0:T(1024)(128)(4,1)} parameter(0)
  %slice-start = ((s8[31260672]{0:T(1024)(128)(4,1)}), s8[4194304]{0:T(1024)(128)(4,1)S(1)}, \
s32[]{:S(2)}) slice-start(%p), slice={[0:4194304]}
  %slice-done = s8[4194304]{0:T(1024)(128)(4,1)S(1)} slice-done(%slice-start)
  %q = f32[64,64]{1,0} parameter(1)
  %s = f32[8,4]{1,0} slice(%q), slice={[0:8], [0:4]}
  ROOT %r = s8[4194304]{0:T(1024)(128)(4,1)} copy(%slice-done)
}
"""
    costs = {c.name: c.bytes for c in hlo_costs.op_costs(text)}
    assert "slice-done" not in costs  # its start moved the data
    assert costs["slice-start"] == 4194304  # read from HBM; the VMEM destination is on chip
    assert costs["s"] == 2 * 8 * 4 * 4  # an HBM-to-HBM slice reads and writes its result
    assert costs["r"] == 4194304  # the copy out of VMEM writes HBM


@pytest.mark.parametrize("name,expected", [
    ("jvp(BertForPreTraining)/bert/encoder/layer_N/attention/Dropout_0/jit(_where)/select_n",
     "dropout + RNG"),
    ("jvp(BertForPreTraining)/bert/embeddings/dropout/jit(_threefry_fold_in)/add", "dropout + RNG"),
    ("transpose(jvp(BertForPreTraining))/bert/encoder/layer_N/output_layer_norm/div",
     "layer norm"),
    ("transpose(jvp(BertForPreTraining))/bert/encoder/layer_N/attention/bhqk,bkhd->bqhd/x",
     "attention"),
    ("jvp(BertForPreTraining)/bert/encoder/layer_N/erfc", "FFN"),
    ("transpose(jvp(BertForPreTraining))/bert/encoder/checkpoint/layer_N/output/dot_general",
     "FFN"),
    ("jvp(BertForPreTraining)/bert/embeddings/word_embeddings/jit(_take)/gather", "embeddings"),
    ("transpose(jvp(BertForPreTraining))/mlm/dot_general", "heads + loss"),
    ("jvp(BertForPreTraining)/bert/pooler/dense/dot_general", "heads + loss"),
    ("jvp(jit(log_softmax))/reduce_max", "heads + loss"),
    ("sqrt", "optimizer update"),
    ("", "other"),
    # A ModernBERT's module names.
    ("jvp(ModernBertForMaskedLM)/model/layers_N/attn/cond/branch_0_fun/transpose", "attention"),
    ("transpose(jvp(ModernBertForMaskedLM))/model/layers_N/mlp/wi/dot_general", "FFN"),
    ("jvp(ModernBertForMaskedLM)/model/layers_N/mlp_norm/reduce_sum", "layer norm"),
    ("jvp(ModernBertForMaskedLM)/model/final_norm/rsqrt", "layer norm"),
    ("jvp(ModernBertForMaskedLM)/model/embeddings/norm/sub", "layer norm"),
    ("jvp(ModernBertForMaskedLM)/model/embeddings/tok_embeddings/jit(_take)/gather",
     "embeddings"),
    ("jvp(ModernBertForMaskedLM)/head/dense/dot_general", "heads + loss"),
])
def test_ops_are_categorised_by_their_module_path(name, expected):
    from bertjax.aot import hlo_costs

    assert hlo_costs.category("fusion", name) == expected
    assert hlo_costs.category("all-reduce-start", name) == "collectives"


def test_unnamed_ops_are_other_unless_they_make_random_bits():
    from bertjax.aot import hlo_costs

    made_up = hlo_costs.parse_instruction(
        '  %b = u32[64,2]{1,0} broadcast(%x), metadata={op_name="broadcast.2168"}')
    assert hlo_costs.op_name(made_up) == ""
    for layer, named in (("bert/encoder/layer_11", "bert/encoder/layer_N"),
                         ("model/layers_21", "model/layers_N")):
        op = hlo_costs.parse_instruction(
            f'  %d = bf16[8,8]{{1,0}} fusion(%x), metadata={{op_name="jit(train_step)/'
            f'jvp(M)/{layer}/attn/dot_general"}}')
        assert hlo_costs.op_name(op) == f"jvp(M)/{named}/attn/dot_general"
    assert hlo_costs.category("broadcast", "", made_up.shape) == "dropout + RNG"
    assert hlo_costs.category("broadcast", "", "f32[64,2]{1,0}") == "other"


def test_extrapolation_is_fixed_plus_per_layer_times_layers():
    import dataclasses

    from bertjax.aot import measure as aot_measure

    # fixed 10, per layer 3 (and 0.5 ms per layer over 1 ms fixed), from 1 and 2 layers
    one = aot_measure.Measure(1.0, 2.0, 13.0, 13.0, 13.0, 1.5e-3)
    two = aot_measure.Measure(1.0, 2.0, 16.0, 16.0, 16.0, 2.0e-3)
    twelve = aot_measure.extrapolate(one, two, 12, first=1)
    assert (twelve.temp_bytes, twelve.flops, twelve.bytes_accessed) == (46.0, 46.0, 46.0)
    assert twelve.argument_bytes == 1.0 and twelve.seconds == pytest.approx(7e-3)
    # The same line from 2 and 3 layers.
    three = aot_measure.Measure(1.0, 2.0, 19.0, 19.0, 19.0, 2.5e-3)
    fields = ("argument_bytes", "output_bytes", "temp_bytes", "flops", "bytes_accessed",
              "seconds")
    again = aot_measure.extrapolate(two, three, 12, first=2)
    for field in fields:
        assert getattr(again, field) == pytest.approx(getattr(twelve, field)), field
    # No cost-model time on one side: none extrapolated.
    none = dataclasses.replace(two, seconds=None)
    assert aot_measure.extrapolate(one, none, 12, first=1).seconds is None


# BERT-mini (4 layers of 256), its 4 layers fitted from 2 and 3. A still smaller model is no
# test of the fit: its temporaries peak in buffers that do not grow with depth (the MLM
# logits, the optimizer update), so they are not linear in the layers (docs/tpu_aot.md).


@pytest.mark.slow
@needs_libtpu
@pytest.mark.extended
def test_extrapolated_step_matches_the_full_unrolled_compile_on_v5p():
    from bertjax.train import flops as flops_lib

    job, full = _compile("v5p-8", 64, {}, "mini", exact=True)
    _, estimate = _compile("v5p-8", 64, {}, "mini", exact=False)
    for field in ("xla_flops", "time", "xla_seconds", "bytes_accessed", "temp_bytes",
                  "total_bytes"):
        assert getattr(estimate, field) == pytest.approx(getattr(full, field), rel=0.05), field
    assert estimate.argument_bytes == pytest.approx(full.argument_bytes, rel=1e-3)
    # The step time is the compiler's per-op estimates (every matmul fusion carries one).
    assert full.time == full.op_seconds and full.op_seconds > full.compute_bound
    # The breakdown: its matmul FLOPs by category are the analytic ones (3 x forward: the
    # forward pass, and two matmuls per matmul in the backward pass), per chip. The scores'
    # matmuls run inside the flash kernels (the TPU default): FLOPs of theirs, not XLA's.
    cfg, chips, stage = job.model_config, 4, job.stages[0]
    tokens = job.batch_size * stage.tokens_per_example / chips
    hidden, inner = cfg.hidden_size, cfg.intermediate_size
    attention = 3 * cfg.num_layers * 2 * tokens * 4 * hidden**2
    scores = 3 * cfg.num_layers * 2 * 2 * tokens * stage.tokens_per_example * hidden
    ffn = 3 * cfg.num_layers * 2 * tokens * 2 * hidden * inner
    for cost in (full, estimate):
        category = cost.groups["category"]
        assert category["attention"].flops == pytest.approx(attention, rel=0.01)
        assert category["FFN"].flops == pytest.approx(ffn, rel=0.01)
        # Every matmul is in some category: together they are the model's FLOPs.
        matmuls = sum(g.flops for g in category.values())
        model = flops_lib.train_flops_per_sequence(cfg, stage.tokens_per_example, 20) \
            * job.batch_size / chips
        assert matmuls == pytest.approx(model - scores, rel=0.02)
    # The ops' table covers the same ops as the categories; extrapolated, each category's
    # bytes are those of the full compile.
    category = full.groups["category"]
    assert sum(g.bytes for g in full.groups["op"].values()) == pytest.approx(
        sum(g.bytes for g in category.values()), rel=1e-9)
    for name, group in category.items():
        assert estimate.groups["category"][name].bytes == pytest.approx(
            group.bytes, rel=0.05, abs=1e6), name


def test_an_attribute_over_several_lines_neither_ends_the_computation_nor_loses_its_op():
    """A Pallas kernel's kernel_metadata (as JAX's splash kernels write it) spans lines, the
    continuation starting with "}}": the ops after it are still the computation's, and the
    kernel keeps its cost estimate (it is on the continuation line)."""
    from bertjax.aot import hlo_costs

    text = """HloModule step

ENTRY %main (a: bf16[64,128,768]) -> f32[8,4] {
  %a = bf16[64,128,768]{2,1,0} parameter(0)
  %k = bf16[64,128,768]{2,1,0} custom-call(%a), custom_call_target="tpu_custom_call", \
frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 512}"
}}, backend_config={"custom_call_config":{"body":"x","cost_estimate":{"flops":"459000000000",\
"transcendentals":"0","bytes_accessed":"1","remote_bytes_transferred":"0"}}}
  %n = f32[8,4]{1,0} add(%x0, %x0)
  ROOT %out = f32[8,4]{1,0} add(%n, %n)
}
"""
    computations, entry = hlo_costs.parse_module(text)
    assert [i.name for i in computations[entry]] == ["a", "k", "n", "out"]
    costs = {c.name: c for c in hlo_costs.op_costs(text, 1.75e9, 459e12, 2765e9)}
    assert set(costs) >= {"k", "n", "out"}
    assert costs["k"].cycles == pytest.approx(1e-3 * 1.75e9)

"""Ahead-of-time compiles for Cloud TPU slices on this CPU machine (bertjax/train/topology.py,
bertjax/train/dry_run.py): slice names, the train step compiled by the TPU compiler for 4- and
8-chip slices with memory that grows with the batch and shrinks under FSDP, and a configuration
too large for its slice reported as not fitting, with the compiler's figures.

The compile tests need libtpu (the `tpu` and `test` extras) and skip without it.
"""

import importlib.util

import pytest
from conftest import run_python

from bertjax import cli
from bertjax.errors import ConfigError
from bertjax.train import topology

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
    from bertjax.tasks.pretraining import PretrainingJob
    from bertjax.train import dry_run

    config = cli.load_config(f"experiments/pretrain.py:{preset}")
    with config.unlocked():
        for name in list(config.phases):
            if name != phase:
                del config.phases[name]
    config.train.batch_size = batch_size
    config.train.num_train_steps = 1000
    config.mesh.update(mesh)
    config.model.update(model)
    dry_run.use_tpu_dtype(config)
    return PretrainingJob(config, make_input=None), config


def _compile(name: str, batch_size: int, mesh: dict, preset="tiny", phase="phase1", **model):
    from bertjax.train import dry_run

    slice_ = topology.parse(name)
    job, config = _pretraining_job(preset, batch_size, mesh, phase, **model)
    [cost] = dry_run._compile_job(job, config, slice_, topology.devices(slice_))
    return job, cost


# The tiny preset made smaller still: the TPU compiler's time grows with the tensors' sizes.
SMALL = dict(num_layers=1, hidden_size=64, intermediate_size=128, num_heads=2, vocab_size=512)


@pytest.mark.slow
@needs_libtpu
def test_tiny_train_step_compiles_for_4_chips_and_memory_grows_with_the_batch():
    import jax

    _, small = _compile("v5litepod-4", 16, {"data": 4}, **SMALL)
    job, large = _compile("v5litepod-4", 32, {"data": 4}, **SMALL)
    for cost in (small, large):
        assert cost.fits and cost.total_bytes <= cost.hbm_bytes == 16 * 1024**3
        assert cost.step_seconds > 0 and cost.xla_flops > 0
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


@pytest.mark.slow
@needs_libtpu
def test_tiny_train_step_compiles_for_8_chips_and_fsdp_shrinks_the_state_per_chip():
    import jax

    job, fsdp = _compile("v5p-16", 32, {"data": 1, "fsdp": 8}, **SMALL)
    assert fsdp.fits and fsdp.step_seconds > 0
    state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        jax.eval_shape(job.init_params, jax.random.key(0))))
    # Data parallel, every chip holds params + two Adam moments (3 x state, as the 4-chip test
    # shows). FSDP splits every matrix with an `embed` axis over the 8 chips: at most twice an
    # eighth of that remains (LayerNorm scales, biases and the batch shard stay whole).
    assert fsdp.argument_bytes < 2 * 3 * state / 8


@pytest.mark.slow
@needs_libtpu
def test_bert_large_phase2_batch_4096_on_v5e_4_does_not_fit_and_says_so():
    from bertjax.train import dry_run

    lines = []
    slice_ = topology.parse("v5e-4")
    # Scanned layers: the compiler reaches its memory verdict without compiling 24 layers.
    job, config = _pretraining_job("large", 4096, {}, "phase2", scan_layers=True)
    costs = dry_run._compile_job(job, config, slice_, topology.devices(slice_))
    [cost] = costs
    assert not cost.fits and cost.step_seconds is None
    assert "RESOURCE_EXHAUSTED" in cost.message
    # float32 params and two Adam moments of BERT-large's 335M parameters, replicated.
    assert cost.argument_bytes > 12 * 335e6
    assert cost.total_bytes > cost.hbm_bytes
    assert 15 * 1024**3 < cost.hbm_bytes <= 16 * 1024**3  # what the compiler says is available
    lines = dry_run.stage_table(costs, slice_)
    assert lines[1].split()[:3] == ["phase2", "512", "4096"] and " NO " in lines[1]


def test_sweep_meshes_cover_data_fsdp_and_tensor_parallelism():
    from bertjax.train import dry_run

    assert dry_run.mesh_candidates(16, 16) == [(16, 1, 1), (1, 16, 1), (8, 1, 2), (1, 8, 2),
                                               (4, 1, 4), (1, 4, 4)]
    # Tensor parallelism only where it divides the heads (and the chips); no duplicates.
    assert dry_run.mesh_candidates(4, 2) == [(4, 1, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2)]
    assert dry_run.mesh_candidates(1, 12) == [(1, 1, 1)]


def test_sweep_ranks_by_sequences_over_the_whole_run_and_prints_its_flags():
    from bertjax.train import dry_run

    def stage(name, steps, batch, seconds, fits=True):
        return dry_run.StageCost(name, 128, steps, batch, 1.0, 1.0, 2.0, 4.0, fits, 1e12, 1e9,
                                 seconds)

    # 900 steps of 0.1 s and 100 of 0.5 s for 256 sequences each: 256,000 in 140 s.
    run = dry_run.Candidate((4, 2, 1), "dots", True, 256,
                            [stage("phase1", 900, 256, 0.1), stage("phase2", 100, 256, 0.5)])
    assert run.fits and run.sequences_per_second == pytest.approx(256_000 / 140)
    assert run.flags() == ("--config.mesh.data=4 --config.mesh.fsdp=2 --config.mesh.tensor=1 "
                           "--config.train.batch_size=256 --config.model.remat_policy=dots "
                           "--config.model.scan_layers=true")
    misfit = dry_run.Candidate((8, 1, 1), "none", False, 512,
                               [stage("phase2", 100, 512, None, fits=False)])
    assert not misfit.fits and misfit.sequences_per_second is None


def test_out_of_memory_figures_are_read_from_the_compiler_message():
    from bertjax.train import dry_run

    gib = 1024.0**3
    assert dry_run._oom_sizes(
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (1.53T) exceeds available HBM (15.75G).") == (1.53 * 1024 * gib,
                                                                   15.75 * gib)
    assert dry_run._oom_sizes("Used 20.5G of 15.75G hbm. Exceeded hbm capacity by 4.75G.") == (
        20.5 * gib, 15.75 * gib)
    assert dry_run._oom_sizes("RESOURCE_EXHAUSTED: no sizes") == (None, None)

"""Presets, parameter counts, config overrides and the `--dry_run` report."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_python

from bertjax.models import PRESETS, BertConfig, BertForPreTraining, BertModel
from bertjax.models.bert.config import ConfigError
from bertjax.tasks.pretraining import checks as pretraining_checks
from bertjax.train.configs import resolve_model_config
from experiments import pretrain as pretrain_experiment

# BertForPreTraining at vocab 30522 (tied decoder), as in the paper and its released models.
EXPECTED_TOTALS = {
    "tiny": 4_433_468,
    "mini": 11_267_900,
    "small": 29_058_876,
    "medium": 41_668_412,
    "base": 110_106_428,
    "large": 336_226_108,
}
EXPECTED_ENCODER_AND_POOLER = {"base": 109_482_240, "large": 335_141_888}


def count(module, *args):
    shapes = jax.eval_shape(module.init, jax.random.key(0), *args)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["params"]))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_parameter_counts_match_the_paper(preset):
    cfg = BertConfig.from_preset(preset)
    ids = jnp.zeros((1, 8), jnp.int32)
    assert count(BertForPreTraining(cfg), ids, ids, ids, ids[:, :2]) == EXPECTED_TOTALS[preset]
    if preset in EXPECTED_ENCODER_AND_POOLER:
        assert count(BertModel(cfg), ids) == EXPECTED_ENCODER_AND_POOLER[preset]


def test_presets_follow_the_paper_shapes():
    cfg = BertConfig.from_preset("large")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.intermediate_size) == (
        24, 1024, 16, 4096)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.type_vocab_size) == (30522, 512, 2)
    assert cfg.hidden_dropout_prob == cfg.attention_dropout_prob == 0.1
    assert cfg.hidden_act == "gelu" and cfg.layer_norm_eps == 1e-12


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_experiment_config_round_trips_into_the_model_config(preset):
    config = pretrain_experiment.get_config(preset)
    cfg = resolve_model_config(config.model)
    assert cfg.num_layers == PRESETS[preset][0]
    assert cfg.dtype == ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    config.model.dtype = "bfloat16"  # an explicit dtype is honoured on every backend
    assert resolve_model_config(config.model).dtype == "bfloat16"
    assert sorted(config.phases) == ["phase1", "phase2"]
    assert config.phases.phase1.seq_len == 128 and config.phases.phase2.seq_len == 512


def test_invalid_model_values_name_the_field():
    with pytest.raises(ConfigError, match="model.num_heads"):
        BertConfig.from_preset("tiny", num_heads=3)
    with pytest.raises(ConfigError, match="model.attention_impl"):
        BertConfig.from_preset("tiny", attention_impl="splash")
    with pytest.raises(ConfigError, match="num_layerz"):
        BertConfig.from_dict({"num_layerz": 3})


def _one_line_error(proc):
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert proc.returncode != 0
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    "override,field",
    [
        ("--config.model.num_layerz=3", "num_layerz"),
        ("--config.model.num_layers=abc", "config.model.num_layers"),
        ("--config.optimizer.learning_rate=fast", "config.optimizer.learning_rate"),
        ("--config.trian.batch_size=8", "trian"),
        ("--config.model.attention_impl=splash", "model.attention_impl"),
        ("--config.mesh.tensor=3", "config.mesh"),
        ("--config.phases.phase2.batch_size=-4", "config.phases.phase2.batch_size=-4"),
    ],
)
def test_bad_override_fails_with_one_line_naming_the_field(override, field):
    proc = run_python(["-m", "bertjax.pretrain", "--config=experiments/pretrain.py:tiny",
                       "--dry_run", override])
    line = _one_line_error(proc)
    assert line.startswith("error:") and field in line, line


@pytest.mark.slow
def test_dry_run_applies_overrides():
    proc = run_python(["-m", "bertjax.pretrain", "--config=experiments/pretrain.py:tiny",
                       "--dry_run", "--config.model.num_layers=3", "--config.train.batch_size=8",
                       "--config.phases.phase2.seq_len=256"])
    assert proc.returncode == 0, proc.stderr
    # One more tiny layer: attention 4(H²+H), two LayerNorms 4H, FFN 2HI + I + H.
    per_layer = 4 * (128 * 128 + 128) + 2 * 2 * 128 + 2 * 128 * 512 + 512 + 128
    assert f"{EXPECTED_TOTALS['tiny'] + per_layer:,}" in proc.stdout
    assert re.search(r"phase2\s+256\s+80", proc.stdout), proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["base", "large"])
@pytest.mark.extended
def test_dry_run_prints_the_paper_totals_and_compiled_memory(preset):
    # Scanned layers compile one layer, which keeps this test fast for BERT-large.
    proc = run_python(["-m", "bertjax.pretrain", f"--config=experiments/pretrain.py:{preset}",
                       "--dry_run", "--config.model.scan_layers=true"])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert re.search(rf"total\s+{EXPECTED_TOTALS[preset]:,}\b", out), out
    assert re.search(rf"bert \(BertModel\)\s+{EXPECTED_ENCODER_AND_POOLER[preset]:,}\b", out)
    rows = re.findall(r"^\s+(phase\d)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+\S+\s+([\d.]+)\s+([\d.]+)\s+"
                      r"([\d.]+)$", out, re.M)
    assert [r[:3] for r in rows] == [("phase1", "128", "20"), ("phase2", "512", "80")], out
    gflops = {r[0]: float(r[3]) for r in rows}
    if preset == "base":  # the paper's estimate: 0.546 GFLOP/token at s=128
        assert gflops["phase1"] == pytest.approx(69.9, abs=0.05)
    # Arguments hold at least params + two Adam moments in float32.
    arg_gib = float(rows[0][4])
    assert arg_gib * 1024**3 >= 3 * 4 * EXPECTED_TOTALS[preset]
    assert all(float(r[6]) >= float(r[4]) for r in rows)


def test_large_lamb_is_bert_large_with_the_lamb_recipe():
    """You et al. (2019): 8,599 steps, 7,038 at length 128 and batch 65536, then 1,561 at 512
    and batch 32768; LAMB peaking at 6e-3 after 2,000 steps, then phase 2 warmed up again over
    its first 200 steps to its own peak of 4e-3 and decayed linearly to 0 at the last step."""
    from bertjax.tasks.pretraining import PretrainingJob

    config = pretrain_experiment.get_config("large_lamb")
    pretraining_checks.check(config, workdir=None)
    job = PretrainingJob(config, make_input=None)
    assert [(p.seq_len, p.start, p.end) for p in job.phases] == [(128, 0, 7038),
                                                                 (512, 7038, 8599)]
    assert config.train.batch_size == 65536 and config.optimizer.name == "lamb"
    assert [(s.batch_size, s.batch_spec["input_ids"].shape) for s in job.stages] == [
        (65536, (65536, 128)), (32768, (32768, 512))]
    shapes = jax.eval_shape(job.init_params, jax.random.key(0))
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == EXPECTED_TOTALS["large"]
    _, schedule = job.optimizer()

    def decayed(step):  # phase 1: linear from 6e-3 at the end of warm-up to 0 at the last step
        return 6e-3 * (1 - (step - 2000) / (8599 - 2000))

    def phase2(step):  # linear from 4e-3 at the end of the re-warm-up to 0 at the last step
        return 4e-3 * (8599 - step) / (8599 - 7238)

    for step, expected in [(1000, 3e-3), (2000, 6e-3), (5000, decayed(5000)),
                           (7037, decayed(7037)), (7038, 0.0), (7138, phase2(7138) / 2),
                           (7238, 4e-3), (7900, phase2(7900)), (8599, 0.0)]:
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-5, abs=1e-9), step


def _phases_config(**phase2):
    config = pretrain_experiment.get_config("tiny")
    config.train.num_train_steps = 100
    config.train.batch_size, config.train.grad_accum_steps = 32, 2
    config.optimizer.warmup_steps, config.optimizer.phase_warmup_steps = 10, 10
    config.phases.phase1.steps = 60
    config.phases.phase2.update(phase2)
    return config


def test_plan_phases_resolves_each_phase_batch_accumulation_and_peak():
    from bertjax.tasks.pretraining.rules import plan_phases

    one, two = plan_phases(_phases_config())
    assert (one.batch_size, one.grad_accum_steps, one.learning_rate) == (32, 2, 0.0)
    assert (two.batch_size, two.grad_accum_steps, two.learning_rate) == (32, 2, 0.0)
    assert two.batch_field == "config.train.batch_size"
    one, two = plan_phases(_phases_config(batch_size=12, grad_accum_steps=3, learning_rate=5e-4))
    assert (one.batch_size, one.grad_accum_steps) == (32, 2)
    assert (two.batch_size, two.grad_accum_steps, two.learning_rate) == (12, 3, 5e-4)
    assert two.batch_field == "config.phases.phase2.batch_size"
    # Only the accumulation: the batch stays config.train's.
    _, two = plan_phases(_phases_config(grad_accum_steps=4))
    assert (two.batch_size, two.grad_accum_steps) == (32, 4)


@pytest.mark.parametrize("phase2,message", [
    (dict(batch_size=-8), "config.phases.phase2.batch_size=-8 must be an integer >= 0"),
    (dict(grad_accum_steps=-1), "config.phases.phase2.grad_accum_steps=-1 must be an integer"),
    (dict(batch_size=30, grad_accum_steps=4),
     "config.phases.phase2.batch_size=30 is not divisible by "
     "config.phases.phase2.grad_accum_steps=4"),
    (dict(batch_size=31), "config.phases.phase2.batch_size=31 is not divisible by "
                          "config.train.grad_accum_steps=2"),
    (dict(grad_accum_steps=3), "config.train.batch_size=32 is not divisible by "
                               "config.phases.phase2.grad_accum_steps=3"),
    (dict(learning_rate=-1e-3), "config.phases.phase2.learning_rate=-0.001 must be a number"),
    # The peak is where the re-warm-up ends: it must end inside the phase's 40 steps.
    (dict(learning_rate=1e-3, steps=0, fraction=0.1),
     "config.phases.phase2.learning_rate=0.001 is the peak where the phase's warm-up ends, "
     "but config.optimizer.phase_warmup_steps=10 is not below its 10 steps"),
])
def test_bad_phase_batch_or_learning_rate_is_one_line_naming_the_field(phase2, message):
    from bertjax.tasks.pretraining.rules import plan_phases

    config = _phases_config(**phase2)
    if phase2.get("fraction"):
        config.phases.phase1.steps = 90
    with pytest.raises(ConfigError) as error:
        plan_phases(config)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_phase_batch_must_split_over_the_mesh_naming_its_field():
    """check_batch_size at each stage's own batch and accumulation, naming the field that set
    the batch (the mesh is only read for its data and fsdp sizes)."""
    import types

    from bertjax.tasks.pretraining import PretrainingJob
    from bertjax.train import configs

    mesh = types.SimpleNamespace(shape={"data": 4, "fsdp": 2})
    configs.check_stage_batches(PretrainingJob(_phases_config(batch_size=16), None), mesh)
    with pytest.raises(ConfigError, match=r"^config.phases.phase2.batch_size=20 does not divide "
                                          r"evenly over the 8 data-parallel devices"):
        configs.check_stage_batches(
            PretrainingJob(_phases_config(batch_size=20, grad_accum_steps=1), None), mesh)
    # 32 in 8 micro-batches of 4 rows cannot split over 8 devices either.
    with pytest.raises(ConfigError, match=r"^config.train.batch_size=32 with "
                                          r"grad_accum_steps=8 does not divide"):
        configs.check_stage_batches(PretrainingJob(_phases_config(grad_accum_steps=8), None),
                                    mesh)


def test_prediction_batch_size_is_at_most_8_rows_on_a_cpu_only():
    from bertjax.train.configs import prediction_batch_size

    assert prediction_batch_size(64, "cpu") == 8
    assert prediction_batch_size(4, "cpu") == 4  # never more than configured
    assert prediction_batch_size(48, "cpu", data_parallel=3) == 9  # splits over the devices
    assert prediction_batch_size(64, "cpu", data_parallel=16) == 16
    assert prediction_batch_size(64, "tpu", data_parallel=4) == 64
    assert prediction_batch_size(64, "gpu") == 64


@pytest.mark.slow
def test_fine_tuning_dry_run_without_a_topology_compiles_the_local_step(tmp_path):
    """`finetune --dry_run` on the machine at hand (no --topology): the report, not a refusal
    of flags the user did not give."""
    import json
    import random

    from conftest import KEYWORD_VOCAB, filler_sentence, write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(tmp_path, KEYWORD_VOCAB)
    rng = random.Random(0)
    for split in ("train", "dev"):
        (tmp_path / f"{split}.jsonl").write_text("".join(
            json.dumps({"text": filler_sentence(rng, word), "label": word}) + "\n"
            for word in ("good", "bad") * 4))
    proc = run_python(["-m", "bertjax.finetune", "--config=experiments/finetune_files.py:"
                       "classification", "--dry_run", f"--config.init_checkpoint={checkpoint}",
                       f"--config.data.train={tmp_path / 'train.jsonl'}",
                       f"--config.data.validation={tmp_path / 'dev.jsonl'}",
                       "--config.data.text_a=text", "--config.max_seq_length=32"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "topology" not in proc.stderr, proc.stderr

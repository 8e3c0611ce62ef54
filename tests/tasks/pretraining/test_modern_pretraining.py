"""A ModernBERT pre-trained by the same job as BERT: the published recipe as a config
(experiments/pretrain.py:modern_base), its checks, a packed run through every kind of phase
(batch warm-up, context extension with a raised RoPE theta, the decay) that learns and
exports a checkpoint directory bertjax.load_pretrained reads back, and the directory format
itself for a ModernBERT."""

import json
import signal

import flax
import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import run_python
from subprocess_runs import final_params, latest_checkpoint, start, wait_for

from bertjax import checkpoint_dir
from bertjax.errors import ConfigError
from bertjax.models import BertConfig, architecture
from bertjax.models.modernbert import ModernBertModel, ModernConfig, num_params
from bertjax.tasks.pretraining import checks, rules
from experiments import pretrain


def test_modern_base_is_the_published_recipe_in_tokens():
    config = pretrain.get_config("modern_base")
    phases = rules.plan_phases(config)
    tokens = {p.name: (p.end - p.start) * p.batch_size * p.seq_len for p in phases}
    short = sum(t for name, t in tokens.items() if name.startswith("phase1"))
    assert short == pytest.approx(1.7e12, rel=1e-4)
    assert sum(tokens[n] for n in ("phase1a", "phase1b", "phase1c")) == pytest.approx(
        50e9, rel=1e-3)
    assert [p.batch_size for p in phases] == [768, 1536, 3072, 4608, 576, 576]
    assert tokens["phase2"] == pytest.approx(250e9, rel=1e-4)
    assert tokens["phase3"] == pytest.approx(50e9, rel=1e-3)
    # RoPE theta 10k at 1,024 tokens, the model's 160k from the context extension on.
    assert [p.global_rope_theta for p in phases] == [1e4] * 4 + [0.0, 0.0]
    assert config.model.global_rope_theta == 160_000
    assert all(p.max_predictions >= 0.3 * p.seq_len for p in phases)
    assert config.optimizer.decay_steps == phases[-1].end - phases[-1].start
    assert (config.optimizer.name, config.optimizer.schedule) == ("stable_adamw", "wsd")
    checks.check(config, workdir=None)  # every field valid, nothing written


@pytest.mark.parametrize("preset,want", [("modern_base", 149_655_232),
                                         ("modern_large", 395_881_664)])
def test_recipe_presets_have_the_published_sizes(preset, want):
    config = pretrain.get_config(preset)
    assert num_params(ModernConfig.from_dict({**config.model, "dtype": "float32"})) == want


def test_a_modern_model_needs_the_mlm_objective_and_bert_has_no_rope_theta():
    config = pretrain.get_config("modern_tiny")
    config.objective = "mlm_nsp"
    with pytest.raises(ConfigError, match="config.objective='mlm_nsp': a ModernBERT"):
        checks.check(config, workdir=None)
    config = pretrain.get_config("tiny")
    config.phases.phase2.global_rope_theta = 1e5
    with pytest.raises(ConfigError, match="config.phases.phase2.global_rope_theta"):
        checks.check(config, workdir=None)


def test_checkpoint_directory_of_an_encoder_only_modern_model(tmp_path):
    """ModernBertModel params alone: the MLM head is initialised and reported; the directory
    reads back as a ModernConfig with the same encoder."""
    cfg = ModernConfig.from_preset("modern_tiny", vocab_size=40, pad_token_id=0)
    (tmp_path / "vocab.txt").write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                  + [f"w{i}" for i in range(35)]) + "\n")
    ids = np.ones((1, 4), np.int32)
    encoder = ModernBertModel(cfg).init(jax.random.key(1), ids, ids)["params"]
    summary = checkpoint_dir.save_pretrained(tmp_path / "ckpt", cfg, encoder,
                                             tmp_path / "vocab.txt")
    assert summary["initialised"] == ["head", "decoder_bias"]
    loaded, params, tokenizer = checkpoint_dir.load_pretrained(tmp_path / "ckpt")
    assert architecture(loaded).name == "modernbert"
    assert loaded == cfg and tokenizer.vocab_size == 40
    flat = flax.traverse_util.flatten_dict(params["model"])
    for key, value in flax.traverse_util.flatten_dict(nn.unbox(encoder)).items():
        np.testing.assert_array_equal(flat[key], np.asarray(value))
    with pytest.raises(ConfigError, match="the model there is a ModernBERT but config.model "
                                          "is a BERT"):
        checkpoint_dir.check_sizes(loaded, BertConfig(), "here")


STEPS = {"phase1a": 4, "phase1b": 4, "phase1c": 4, "phase1d": 12, "phase2": 8, "phase3": 8}
TOTAL = sum(STEPS.values())


def every_phase_args(tmp_path, workdir):
    """A packed modern_tiny run through every kind of phase, in TOTAL steps."""
    from news_corpus import write_segments

    data, vocab_size, _ = write_segments(tmp_path)
    batches = {"phase1a": 4, "phase1b": 8, "phase1c": 8, "phase1d": 16, "phase2": 8,
               "phase3": 8}
    args = ["-m", "bertjax.pretrain", "--config=experiments/pretrain.py:modern_tiny",
            f"--workdir={workdir}", f"--config.vocab={tmp_path / 'vocab.txt'}",
            "--config.model.dtype=float32", "--config.model.local_attention=16",
            f"--config.train.num_train_steps={TOTAL}", "--config.log_every_steps=1",
            "--config.checkpoint.every_steps=2", "--config.optimizer.warmup_steps=4",
            "--config.optimizer.learning_rate=3e-3", "--config.optimizer.decay_steps=8",
            f"--config.eval.every_steps={TOTAL}", "--config.eval.num_batches=2"]
    for name, n in STEPS.items():
        seq = 32 if name.startswith("phase1") else 64
        args += [f"--config.phases.{name}.data={data}/part-*",
                 f"--config.phases.{name}.eval_data={data}/part-*",
                 f"--config.phases.{name}.seq_len={seq}",
                 f"--config.phases.{name}.max_predictions={seq * 3 // 10 + 2}",
                 f"--config.phases.{name}.steps={n}",
                 f"--config.phases.{name}.batch_size={batches[name]}"]
    args += ["--config.phases.phase2.learning_rate=1e-3",
             "--config.phases.phase3.learning_rate=1e-3"]
    return args, vocab_size


@pytest.mark.slow
def test_packed_modern_run_through_every_phase_learns_and_exports(tmp_path):
    workdir = tmp_path / "run"
    args, vocab_size = every_phase_args(tmp_path, workdir)
    proc = run_python(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "objective mlm" in proc.stdout and "packed" in proc.stdout

    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if r["split"] == "train"}
    assert sorted(train) == list(range(1, TOTAL + 1))
    losses = [train[s]["loss"] for s in range(1, TOTAL + 1)]
    assert np.mean(losses[-6:]) < np.mean(losses[:4]) - 0.5, losses
    assert train[TOTAL]["learning_rate"] < 1e-3 * 0.5  # the 1 - sqrt decay is under way
    evaluation = [r for r in records if r["split"] == "eval"][-1]
    assert evaluation["mlm_accuracy"] > 0.1 and "nsp_accuracy" not in evaluation

    config, params, tokenizer = checkpoint_dir.load_pretrained(workdir / "export")
    assert architecture(config).name == "modernbert" and config.global_rope_theta == 160_000
    assert (config.pad_token_id, config.cls_token_id, config.sep_token_id) == (0, 2, 3)
    assert config.vocab_size == vocab_size == tokenizer.vocab_size
    stored = final_params(str(workdir), TOTAL)
    exported = flax.traverse_util.flatten_dict(params, sep="/")
    assert sorted(stored) == sorted(exported)
    for key in stored:
        np.testing.assert_array_equal(stored[key], exported[key])


@pytest.mark.extended
def test_packed_modern_run_killed_in_the_context_extension_resumes_exactly(tmp_path):
    """Killed inside the context extension (phase2: steps 24..32, its own RoPE theta) and
    resumed: every loss and the final params bitwise those of the uninterrupted run."""
    workdir = tmp_path / "run"
    args, _ = every_phase_args(tmp_path, workdir)
    proc = run_python(args)
    assert proc.returncode == 0, proc.stderr[-3000:]

    resumed = tmp_path / "resumed"
    args = [a.replace(f"--workdir={workdir}", f"--workdir={resumed}") for a in args]
    first = start(args, quiet=True)
    assert wait_for(lambda: first.poll() is not None
                    or (latest_checkpoint(str(resumed)) or 0) >= 26, timeout=600)
    assert first.poll() is None, "the run to kill ended first"
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert latest_checkpoint(str(resumed)) < TOTAL
    proc = run_python(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Resumed from" in proc.stdout and "Phase phase1" not in proc.stdout

    def losses(run):
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        train = {r["step"]: r["loss"] for r in records if r["split"] == "train"}
        return [train[s] for s in range(1, TOTAL + 1)]

    assert losses(resumed) == losses(workdir)
    stored = final_params(str(workdir), TOTAL)
    for key, value in final_params(str(resumed), TOTAL).items():
        np.testing.assert_array_equal(value, stored[key], err_msg=key)


def test_checkpoint_directory_with_a_tokenizer_json(tmp_path):
    """A BPE tokenizer.json (ModernBERT's kind) is counted by its entries, not its lines, and
    travels with the model: the directory loads back with the same tokenizer."""
    from bertjax.tokenization.bpe import train_bpe

    lines = ["the prime minister said the vote would be held next week"] * 20
    train_bpe(lines, vocab_size=300).save(str(tmp_path / "tokenizer.json"))
    size = checkpoint_dir.count_vocab(tmp_path / "tokenizer.json")
    lines_in_file = (tmp_path / "tokenizer.json").read_text().count("\n")
    assert size != lines_in_file
    cfg = ModernConfig.from_preset("modern_tiny", vocab_size=size, pad_token_id=0)
    ids = np.ones((1, 4), np.int32)
    encoder = ModernBertModel(cfg).init(jax.random.key(1), ids, ids)["params"]
    checkpoint_dir.save_pretrained(tmp_path / "ckpt", cfg, encoder, tmp_path / "tokenizer.json")
    assert (tmp_path / "ckpt" / "tokenizer.json").exists()
    _, _, tokenizer = checkpoint_dir.load_pretrained(tmp_path / "ckpt")
    assert tokenizer.vocab_size == size
    from bertjax.tokenization import load_tokenizer

    original = load_tokenizer(str(tmp_path / "tokenizer.json"))
    text = "the minister said the vote"
    assert tokenizer.encode(text).input_ids == original.encode(text).input_ids
    assert len(original.encode(text).input_ids) > 3

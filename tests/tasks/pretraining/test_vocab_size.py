"""The model's vocabulary size comes from its source (issue 45, point 1): pre-training takes
config.model.vocab_size from config.vocab when it is left at the presets' 30522, and refuses a
different explicit size in one line before step 0 and in --dry_run (the export needs one
embedding row per entry: a mismatch used to train every step, then fail to save). Fine-tuning
takes its sizes from the checkpoint: an override, or a checkpoint vocabulary larger than its
embedding, stops before the data is read."""

from __future__ import annotations

import json
import os

import pytest
from conftest import KEYWORD_VOCAB, run_python, write_tiny_checkpoint

from bertjax import cli
from bertjax.errors import CheckpointError, ConfigError
from bertjax.tasks import checks as finetuning_checks
from bertjax.tasks.pretraining import checks as pretraining_checks

# The tiny preset (vocab_size 30522) made smaller still; one phase of 32 tokens on synthetic
# data (no TFRecords to write), so a run compiles one step.
TINY = ["--config=experiments/pretrain.py:tiny", "--config.model.num_layers=1",
        "--config.model.hidden_size=32", "--config.model.num_heads=2",
        "--config.model.intermediate_size=64", "--config.model.max_position_embeddings=64",
        "--config.model.dtype=float32", "--config.phases.phase1.data=synthetic",
        "--config.phases.phase1.seq_len=32", "--config.phases.phase1.max_predictions=5",
        "--config.phases.phase2.seq_len=64", "--config.phases.phase2.max_predictions=5",
        "--config.phases.phase1.steps=2", "--config.phases.phase2.steps=0",
        "--config.train.num_train_steps=2", "--config.train.batch_size=2",
        "--config.optimizer.warmup_steps=1", "--config.log_every_steps=1",
        "--config.checkpoint.every_steps=2", "--config.eval.every_steps=0"]


@pytest.fixture
def vocab(tmp_path):
    path = tmp_path / "vocab" / "vocab.txt"
    path.parent.mkdir()
    path.write_text("\n".join(KEYWORD_VOCAB) + "\n")
    return str(path)


def pretrain_config(**overrides):
    config = cli.load_config("experiments/pretrain.py:tiny")
    config.update_from_flattened_dict({"train.num_train_steps": 10, "train.batch_size": 2,
                                       "phases.phase1.data": "synthetic",
                                       "phases.phase2.data": "synthetic", **overrides})
    return config


# ------------------------------------------------------------------------- pre-training


def test_left_at_the_preset_it_is_taken_from_the_vocabulary(vocab):
    config = pretrain_config(vocab=vocab)
    assert config.model.vocab_size == 30522
    logged = []
    tokenizer = pretraining_checks.resolve(config, log=logged.append)
    assert config.model.vocab_size == len(KEYWORD_VOCAB) == tokenizer.vocab_size
    assert logged == [f"config.model.vocab_size={len(KEYWORD_VOCAB)}: the entries of "
                      f"config.vocab={vocab}"]
    assert pretraining_checks.resolve(config, log=logged.append)  # now they agree: no news
    assert len(logged) == 1
    before = config.to_json()
    pretraining_checks.check(config, None, tokenizer)  # the dry run's validation accepts it
    assert config.to_json() == before  # and, a check, changes nothing


def test_without_a_vocabulary_nothing_changes():
    config = pretrain_config()
    assert pretraining_checks.resolve(config) is None
    assert config.model.vocab_size == 30522


@pytest.mark.parametrize("size,given", [(30522, True), (100, False), (100, True)])
def test_an_explicit_other_size_is_refused_in_one_line(vocab, size, given):
    """Given on the command line (even the presets' 30522) or set to anything else in a
    config file: never silently replaced."""
    config = pretrain_config(vocab=vocab, **{"model.vocab_size": size})
    with pytest.raises(ConfigError) as info:
        pretraining_checks.resolve(config, given)
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert f"config.vocab={vocab} has {len(KEYWORD_VOCAB)} entries" in message
    assert f"config.model.vocab_size={size}" in message
    assert f"--config.model.vocab_size={len(KEYWORD_VOCAB)}" in message
    assert config.model.vocab_size == size


def test_the_dry_run_validation_refuses_it(vocab, tmp_path):
    config = pretrain_config(vocab=vocab, **{"model.vocab_size": 100})
    with pytest.raises(ConfigError, match=f"--config.model.vocab_size={len(KEYWORD_VOCAB)}"):
        pretraining_checks.check(config, workdir=None)
    with pytest.raises(ConfigError, match=f"--config.model.vocab_size={len(KEYWORD_VOCAB)}"):
        pretraining_checks.check(config, workdir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_the_size_the_export_counts_is_the_one_checked(tmp_path):
    """vocab_entries counts as the export's check (checkpoint_dir.count_vocab) does, for a
    tokenizer directory and a file without a final newline too."""
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "vocab.txt").write_text("\n".join(KEYWORD_VOCAB))  # no final newline
    from bertjax.checkpoint_dir import count_vocab, vocab_path

    assert pretraining_checks.vocab_entries(str(directory)) == len(KEYWORD_VOCAB)
    assert count_vocab(vocab_path(directory)) == len(KEYWORD_VOCAB)


@pytest.mark.slow
@pytest.mark.extended
def test_the_command_refuses_a_mismatch_before_step_0_and_in_the_dry_run(vocab, tmp_path):
    workdir = tmp_path / "run"
    expected = (f"error: config.vocab={vocab} has {len(KEYWORD_VOCAB)} entries but "
                "config.model.vocab_size=30522")
    fix = f"--config.model.vocab_size={len(KEYWORD_VOCAB)}"
    for extra in ([f"--workdir={workdir}"], ["--dry_run"]):
        proc = run_python(["-m", "bertjax.pretrain", *TINY, f"--config.vocab={vocab}",
                           "--config.model.vocab_size=30522", *extra])
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(expected) and fix in lines[0], \
            proc.stderr
        assert "Traceback" not in proc.stderr
        assert not workdir.exists()  # no checkpoint, no run_config.json, no step


@pytest.mark.slow
@pytest.mark.extended
def test_the_command_takes_the_size_trains_exports_and_resumes(vocab, tmp_path):
    workdir = tmp_path / "run"
    args = ["-m", "bertjax.pretrain", *TINY, f"--config.vocab={vocab}", f"--workdir={workdir}"]
    proc = run_python(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (f"config.model.vocab_size={len(KEYWORD_VOCAB)}: the entries of config.vocab="
            f"{vocab}") in proc.stdout
    export = json.loads((workdir / "export" / "config.json").read_text())
    assert export["vocab_size"] == len(KEYWORD_VOCAB)
    recorded = json.loads((workdir / "run_config.json").read_text())
    assert recorded["model"]["vocab_size"] == len(KEYWORD_VOCAB)
    # The same command again resumes the finished run (the size resolves the same way).
    proc = run_python(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Training done." in proc.stdout


# ------------------------------------------------------------------------- fine-tuning


@pytest.fixture
def checkpoint(tmp_path):
    return write_tiny_checkpoint(tmp_path, KEYWORD_VOCAB)


def finetune_config(checkpoint, tmp_path, **overrides):
    train = tmp_path / "train.csv"
    train.write_text("text,label\nfiller1 good,pos\nfiller2 bad,neg\n")
    config = cli.load_config("experiments/finetune_files.py:classification")
    config.update_from_flattened_dict({"init_checkpoint": checkpoint, "data.train": str(train),
                                       "data.validation": str(train), "max_seq_length": 32,
                                       "train.batch_size": 2, **overrides})
    return config


def test_finetuning_accepts_the_checkpoint_as_it_is(checkpoint, tmp_path):
    finetuning_checks.check(finetune_config(checkpoint, tmp_path), str(tmp_path / "ft"))


def test_finetuning_refuses_a_vocab_size_other_than_the_checkpoints(checkpoint, tmp_path):
    config = finetune_config(checkpoint, tmp_path)
    with config.unlocked():
        config.model.vocab_size = 30522
    with pytest.raises(ConfigError) as info:
        finetuning_checks.check(config, str(tmp_path / "ft"))
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert (f"config.init_checkpoint={checkpoint}: model.vocab_size is {len(KEYWORD_VOCAB)} "
            "there but config.model.vocab_size=30522 here") == message
    assert not (tmp_path / "ft").exists()


def test_finetuning_refuses_a_checkpoint_vocabulary_larger_than_its_embedding(checkpoint,
                                                                              tmp_path):
    with open(os.path.join(checkpoint, "vocab.txt"), "a") as f:
        f.write("extra1\nextra2\n")
    with pytest.raises(CheckpointError) as info:
        finetuning_checks.check(finetune_config(checkpoint, tmp_path), str(tmp_path / "ft"))
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert (f"{checkpoint}/vocab.txt has {len(KEYWORD_VOCAB) + 2} entries but the model has "
            f"{len(KEYWORD_VOCAB)} word-embedding rows") in message

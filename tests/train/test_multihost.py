"""Multi-host runs of every job family, on one machine: two CPU processes (jax.distributed on
localhost, one device each) stand in for two TPU hosts, against one process with two devices.

What a pod slice needs and a single host never shows: every collective (a train step, an
evaluation's gather, a checkpoint or export write) must be joined by every process, or the run
hangs; and the global batch must not depend on the process count, or the runs differ. So for
each job: both processes exit 0, each within EXIT_BOUND_S of its last step (none is left
waiting for a peer), the training losses equal the one-process run's at every step, and the
outputs (exports, predictions, tables) are those of the one-process run. Each test prints
`job | exit codes | s from last step to exit | losses equal | outputs equal` (pytest -s), and
appends it to the file named by $BERTJAX_MULTIHOST_REPORT when set.
"""

from __future__ import annotations

import functools
import json
import random
import shlex
import shutil
import time

import pytest
import tagging_data as td
from ablation_data import write_test_data
from conftest import KEYWORD_VOCAB, filler_sentence, run_python, write_jsonl
from multihost import (
    assert_same_evals,
    assert_same_export,
    assert_same_files,
    assert_same_losses,
    check_job,
    devices_env,
    files_under,
    run_pair_and_reference,
)
from multihost_finetune import finetune, sentiment_rows, tiny_checkpoint
from squad_data import VOCAB as SQUAD_VOCAB
from squad_data import generate

# A tiny pre-training model over KEYWORD_VOCAB, logging every step.
PRETRAIN_MODEL = ["--config.model.num_layers=2", "--config.model.hidden_size=32",
                  "--config.model.num_heads=4", "--config.model.intermediate_size=64",
                  f"--config.model.vocab_size={len(KEYWORD_VOCAB)}",
                  "--config.model.dtype=float32"]
PRETRAIN_STEPS = 12


def pretrain_flags(steps: int = PRETRAIN_STEPS) -> list[str]:
    """Phase 1 of `steps` steps at length 32 (phase 2 gets none), global batch 8."""
    return [*PRETRAIN_MODEL, f"--config.train.num_train_steps={steps}",
            f"--config.phases.phase1.steps={steps}", "--config.phases.phase1.seq_len=32",
            "--config.phases.phase1.max_predictions=5", "--config.train.batch_size=8",
            "--config.log_every_steps=1", "--config.checkpoint.every_steps=1000",
            "--config.optimizer.warmup_steps=2", "--config.optimizer.learning_rate=1e-3"]


def write_pretraining_data(root) -> tuple[str, str]:
    """(vocab.txt, pattern of 3 TFRecord shards) made by create_pretraining_data, unmasked
    (dynamic masking) from documents of filler sentences."""
    from data_pipeline import create_pretraining_data as cpd

    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(KEYWORD_VOCAB) + "\n")
    rng = random.Random(0)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(
        "".join(filler_sentence(rng, rng.choice(["good", "bad", None])) + "\n"
                for _ in range(rng.randint(4, 8)))
        for _ in range(60)))
    cfg = cpd.CreateConfig(input=str(corpus), output_dir=str(root / "data"), max_seq_length=32,
                           max_predictions_per_seq=5, dupe_factor=1, masking="dynamic",
                           num_shards=3, shuffle_buffer=10)
    cpd.create_pretraining_data(cfg, functools.partial(cpd.load_tokenizer, str(vocab), None),
                                vocab=str(vocab))
    assert len(list((root / "data").glob("*.tfrecord"))) == 3
    return str(vocab), str(root / "data" / "*.tfrecord")


# --------------------------------------------------------------------------------- the jobs


@pytest.mark.slow
@pytest.mark.extended
def test_pretraining_with_vocab_exports_the_same_model_and_resumes_on_one_process(tmp_path):
    vocab, pattern = write_pretraining_data(tmp_path)

    def args_for(out):  # evaluated (and so checkpointed) at steps 6 and 12
        return ["-m", "bertjax.pretrain", "--config=experiments/pretrain.py:tiny",
                f"--workdir={out}", *pretrain_flags(), f"--config.vocab={vocab}",
                f"--config.phases.phase1.data={pattern}",
                f"--config.phases.phase1.eval_data={pattern}", "--config.eval.every_steps=6",
                "--config.eval.num_batches=2"]

    pair, reference = run_pair_and_reference(args_for, tmp_path)

    def same_outputs():
        assert_same_export(tmp_path / "pair" / "export", tmp_path / "single" / "export")
        assert_same_evals(tmp_path / "pair", tmp_path / "single")

    check_job("pretrain (vocab, 3 shards, eval)", pair, reference,
              lambda: assert_same_losses(tmp_path / "pair", tmp_path / "single"), same_outputs)

    # The input position in a checkpoint is the global one: the pair's step-6 checkpoint,
    # resumed by one process with 2 devices, continues the same batches.
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "pair", resumed)
    shutil.rmtree(resumed / "checkpoints" / str(PRETRAIN_STEPS))
    shutil.rmtree(resumed / "export")
    metrics = resumed / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if json.loads(line)["step"] <= 6))
    result = run_python(args_for(resumed), env=devices_env(2))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "at step 6" in result.stdout, result.stdout[-3000:]
    assert_same_losses(resumed, tmp_path / "single")
    assert_same_export(resumed / "export", tmp_path / "single" / "export")


def check_finetuning(job: str, tmp_path, pair, reference, outputs: list[str]) -> None:
    """Losses, then results.json and `outputs` (files, or every file of a directory/)
    byte-identical."""
    pair_dir, single_dir = tmp_path / "pair", tmp_path / "single"

    def names(root) -> list[str]:
        return [name for o in outputs
                for name in (files_under(root / o) if o.endswith("/") else [o])]

    def same_outputs():
        assert names(pair_dir) == names(single_dir)
        assert_same_files(pair_dir, single_dir, ["results.json", *names(single_dir)])

    check_job(job, pair, reference, lambda: assert_same_losses(pair_dir, single_dir),
              same_outputs)


@pytest.mark.slow
@pytest.mark.extended
def test_classification_with_a_test_file(tmp_path):
    checkpoint = tiny_checkpoint(tmp_path)
    rng = random.Random(1)
    train = write_jsonl(tmp_path / "train.jsonl", sentiment_rows(rng, 64))
    dev = write_jsonl(tmp_path / "dev.jsonl", sentiment_rows(rng, 24))
    test = write_jsonl(tmp_path / "test.jsonl", sentiment_rows(rng, 20, labelled=False))
    pair, reference = run_pair_and_reference(finetune(
        "experiments/finetune_files.py:classification", checkpoint,
        f"--config.data.train={train}", f"--config.data.validation={dev}",
        f"--config.data.test={test}", "--config.train.num_epochs=2", "--config.max_seq_length=32",
        "--config.min_bucket_length=32", "--config.eval.batch_size=16"), tmp_path)
    check_finetuning("finetune classification (test file)", tmp_path, pair, reference,
                     ["submission/", "export.json"])
    predicted = (tmp_path / "single" / "submission" / "test.tsv").read_text().splitlines()[1:]
    assert len({row.split("\t")[1] for row in predicted}) == 2  # not a constant answer


@pytest.mark.slow
@pytest.mark.extended
def test_a_write_failing_on_process_0_stops_both_with_its_error_line(tmp_path):
    """Process 0 alone writes the test predictions; where it cannot (`submission` is a file),
    both processes stop at once with the same `error:` line, instead of process 1 waiting for
    process 0 until the runtime's barrier aborts them."""
    from multihost import Process, coordinator_flags, free_port, wait_all

    checkpoint = tiny_checkpoint(tmp_path)
    rng = random.Random(1)
    train = write_jsonl(tmp_path / "train.jsonl", sentiment_rows(rng, 16))
    test = write_jsonl(tmp_path / "test.jsonl", sentiment_rows(rng, 8, labelled=False))
    (tmp_path / "pair").mkdir()
    (tmp_path / "pair" / "submission").write_text("not a directory")
    args = finetune("experiments/finetune_files.py:classification", checkpoint,
                    f"--config.data.train={train}", f"--config.data.validation={train}",
                    f"--config.data.test={test}", "--config.train.num_epochs=1",
                    "--config.max_seq_length=32")(tmp_path / "pair")
    port = free_port()
    pair = [Process(f"process {i}", args + coordinator_flags(port, i), devices_env(1))
            for i in range(2)]
    wait_all(pair, [], deadline=time.monotonic() + 300)
    errors = [[line for _, line in p.lines if line.startswith("error: ")] for p in pair]
    print(f"error lines: {errors}; exits {[p.proc.returncode for p in pair]}, "
          f"{max(p.seconds_from_last_step_to_exit() for p in pair):.1f} s after the last step",
          flush=True)
    assert [p.proc.returncode for p in pair] == [1, 1], [p.output() for p in pair]
    assert len(errors[0]) == 1 and errors[0] == errors[1], errors
    assert "submission" in errors[0][0]
    assert all(p.seconds_from_last_step_to_exit() < 60 for p in pair)


@pytest.mark.slow
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.extended
def test_squad(tmp_path, version):
    checkpoint = tiny_checkpoint(tmp_path, SQUAD_VOCAB)
    impossible_rate = 0.3 if version == "v2" else 0.0
    train = generate(tmp_path / "train.json", 40, seed=1, impossible_rate=impossible_rate)
    dev = generate(tmp_path / "dev.json", 16, seed=2, impossible_rate=impossible_rate)
    pair, reference = run_pair_and_reference(finetune(
        f"experiments/squad.py:{version}", checkpoint, f"--config.data.train={train}",
        f"--config.data.validation={dev}", f"--config.data.test={dev}",
        "--config.max_seq_length=64", "--config.task.doc_stride=16",
        "--config.task.max_query_length=10", "--config.train.num_epochs=2",
        "--config.eval.batch_size=16"), tmp_path)
    names = ["predictions.json", "nbest_predictions.json"]
    if version == "v2":
        names.append("null_odds.json")
    # export.json holds v2.0's dev-chosen null threshold (null_score_diff_threshold).
    check_finetuning(f"squad {version}", tmp_path, pair, reference,
                     [*names, *(f"test_{n}" for n in names), "export.json"])


@pytest.mark.slow
@pytest.mark.extended
def test_tagging_with_a_test_file(tmp_path):
    (tmp_path / "tiny").mkdir()
    checkpoint = td.write_checkpoint(tmp_path / "tiny")
    for name, seed, n in (("train", 0, 64), ("dev", 1, 24), ("test", 2, 20)):
        td.write_conll(tmp_path / f"{name}.conll", td.dataset(seed, n), docs_every=8)
    pair, reference = run_pair_and_reference(finetune(
        "experiments/ner.py:files", checkpoint, f"--config.data.train={tmp_path / 'train.conll'}",
        f"--config.data.validation={tmp_path / 'dev.conll'}",
        f"--config.data.test={tmp_path / 'test.conll'}", "--config.train.num_epochs=2",
        "--config.max_seq_length=32", "--config.data.stride=8", "--config.min_bucket_length=32",
        "--config.eval.batch_size=16", learning_rate=3e-3), tmp_path)
    check_finetuning("tagging (test file)", tmp_path, pair, reference, ["predictions/"])
    predicted = (tmp_path / "single" / "predictions" / "test.conll").read_text().split()[2::3]
    assert len(set(predicted)) > 2  # learnt: entities are tagged


@pytest.mark.slow
@pytest.mark.extended
def test_feature_extraction(tmp_path):
    checkpoint = tiny_checkpoint(tmp_path)
    rng = random.Random(3)
    lines = [filler_sentence(rng, rng.choice(["good", "bad"])) for _ in range(14)]
    lines[3] += " ||| " + filler_sentence(rng)  # a pair
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "pair").mkdir()
    (tmp_path / "single").mkdir()
    pair, reference = run_pair_and_reference(lambda out: [
        "-m", "bertjax.extract_features", f"--checkpoint={checkpoint}",
        f"--input_file={tmp_path / 'in.txt'}", f"--output_file={out / 'out.jsonl'}",
        "--layers=-1,-2", "--max_seq_length=32", "--batch_size=4"], tmp_path)
    check_job("extract_features", pair, reference, None,
              lambda: assert_same_files(tmp_path / "pair", tmp_path / "single", ["out.jsonl"]))


@pytest.mark.slow
@pytest.mark.parametrize("chunk_rows", [0, 7])
@pytest.mark.extended
def test_predict_on_a_finished_run(tmp_path, chunk_rows):
    """`python -m bertjax.predict` (whole file, and streamed 7 rows at a time): every process
    computes its share of each batch, process 0 writes; the same bytes as one process."""
    checkpoint = tiny_checkpoint(tmp_path)
    rng = random.Random(2)
    train = write_jsonl(tmp_path / "train.jsonl", sentiment_rows(rng, 32))
    new = write_jsonl(tmp_path / "new.jsonl", sentiment_rows(rng, 45, labelled=False))
    result = run_python(finetune(
        "experiments/finetune_files.py:classification", checkpoint,
        f"--config.data.train={train}", f"--config.data.validation={train}",
        "--config.train.num_epochs=1", "--config.max_seq_length=32",
        "--config.eval.batch_size=8")(tmp_path / "run"), env=devices_env(1))
    assert result.returncode == 0, result.stderr[-3000:]

    def args_for(out):
        out.mkdir()
        return ["-m", "bertjax.predict", f"--workdir={tmp_path / 'run'}", f"--input={new}",
                f"--output={out / 'predictions.jsonl'}", f"--chunk_rows={chunk_rows}"]

    pair, reference = run_pair_and_reference(args_for, tmp_path)
    check_job(f"predict classification (chunk_rows={chunk_rows})", pair, reference, None,
              lambda: assert_same_files(tmp_path / "pair", tmp_path / "single",
                                        ["predictions.jsonl"]))
    lines = (tmp_path / "single" / "predictions.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [str(i) for i in range(45)]


@pytest.mark.slow
@pytest.mark.extended
def test_ablation_grid_cell(tmp_path):
    """One cell of Table 5 at test scale: the MLM + NSP pre-training and its Rotten-Tomatoes-
    style fine-tuning, one seed."""
    sets = write_test_data(tmp_path)
    row = {"name": "BERT (MLM + NSP)", "pretraining": "mlm_nsp", "finetune": {}}
    sets["rows"] = json.dumps([row])
    pair, reference = run_pair_and_reference(lambda out: [
        "-m", "bertjax.ablations", "table5", "--scale=test", f"--workdir={out}", "--seeds=0",
        "--tasks=rotten_tomatoes", *(f"--set={k}={v}" for k, v in sets.items())], tmp_path)
    pretrain = "pretrain/mlm_nsp/seed_0"
    finetune_cell = "finetune/bert_mlm_nsp/rotten_tomatoes/lr_0.0003/seed_0"

    def same_losses():
        for cell in (pretrain, finetune_cell):
            assert_same_losses(tmp_path / "pair" / cell, tmp_path / "single" / cell)

    def same_outputs():
        assert_same_evals(tmp_path / "pair" / pretrain, tmp_path / "single" / pretrain)
        assert_same_export(tmp_path / "pair" / pretrain / "export",
                           tmp_path / "single" / pretrain / "export")
        assert_same_files(tmp_path / "pair", tmp_path / "single", [
            f"{pretrain}/results.json", f"{finetune_cell}/results.json", "results.json",
            "table.md"])

    check_job("ablations table5 cell", pair, reference, same_losses, same_outputs)


# ------------------------------------------------------------------------- the TPU launcher


@pytest.mark.slow
@pytest.mark.extended
def test_tpu_launcher_multi_host_run_command_runs_as_two_processes(tmp_path):
    """The job argv that `python -m bertjax.tpu run` starts on every worker of a v5p-32 (with
    --distributed), run here as 2 processes with the coordinator flags that
    jax.distributed.initialize() detects on a pod, against 1 process with 2 devices."""
    overrides = ["--config.phases.phase1.data=synthetic", "--config.phases.phase2.data=synthetic",
                 *pretrain_flags(steps=6)]
    result = run_python(["-m", "bertjax.tpu", "run", "--print_only", "--name=bert",
                         "--zone=us-east5-a", "--accelerator_type=v5p-32",
                         "--config=experiments/pretrain.py:tiny", "--workdir=gs://bucket/run",
                         "--nofollow", "--", *overrides])
    assert result.returncode == 0, result.stderr
    (ssh,) = result.stdout.splitlines()
    (command,) = [a for a in shlex.split(ssh) if a.startswith("--command=")]
    words = shlex.split(command.removeprefix("--command="))
    start = words.index("nohup") + 1
    assert words[start] == ".venv/bin/python"
    job = words[start + 1:words.index(">")]
    assert job[:2] == ["-m", "bertjax.pretrain"] and "--workdir=gs://bucket/run" in job
    assert "--distributed" in job and [a for a in job if a in overrides] == overrides

    # Here: --workdir a local directory, --distributed the coordinator flags (added to the
    # pair's processes), and no --distributed for the one-process reference.
    pair, reference = run_pair_and_reference(
        lambda out: [f"--workdir={out}" if a.startswith("--workdir=") else a
                     for a in job if a != "--distributed"], tmp_path)
    check_job("tpu launcher run (v5p-32 argv)", pair, reference,
              lambda: assert_same_losses(tmp_path / "pair", tmp_path / "single"), None)

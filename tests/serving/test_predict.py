"""Predictions from trained models (`python -m bertjax.predict`, `bertjax.Predictor`,
`bertjax.FillMask`).

Tiny fine-tuning runs (one or two epochs on generated data, as the end-to-end tests build them)
are predicted again after the fact; the references are independent of the prediction engine:
the files and dev metrics the run itself wrote at the end of training (equal bitwise on CPU),
transformers' BertFor* classes on the exported model (within 1e-4), and transformers'
BertForMaskedLM for fill-mask. Bad input is one `error:` line.
"""

import csv
import json
import os
import pathlib
import random
import threading

import jax
import numpy as np
import pytest
import tagging_data as td
from conftest import KEYWORD_VOCAB, filler_sentence, run_python, write_tiny_checkpoint

from bertjax.errors import CheckpointError, DataError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), KEYWORD_VOCAB)


def _files_config(kind, checkpoint, **data):
    from experiments.finetune_files import get_config

    config = get_config(kind)
    config.init_checkpoint = checkpoint
    config.max_seq_length = 32
    config.train.batch_size = 16
    config.eval.batch_size = 8
    config.train.num_epochs = 1
    config.optimizer.learning_rate = 1e-3
    config.log_every_steps = 1000
    for key, value in data.items():
        config.data[key] = value
    return config


def _train(config, workdir):
    from bertjax.tasks import train_and_evaluate

    return train_and_evaluate(config, str(workdir), log=lambda *_: None)


def _write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return str(path)


@pytest.fixture(scope="module")
def classification_run(checkpoint, tmp_path_factory):
    """A finished 2-label run (buckets 16 and 32) with an unlabelled test file."""
    root = tmp_path_factory.mktemp("cls")
    rng = random.Random(0)

    def rows(n, labelled=True):
        out = []
        for i in range(n):
            y = rng.random() < 0.5
            # Some long rows: both length buckets (16, 32) and truncation are exercised.
            text = filler_sentence(rng, "good" if y else "bad", 1 + 3 * (i % 5 == 0))
            if i % 7 == 0:
                text = " ".join([text] * 4)
            out.append([f"r{i}", text, ["neg", "pos"][y]] if labelled else [f"r{i}", text])
        return out

    train = _write_csv(root / "train.csv", ["id", "text", "label"], rows(96))
    dev = _write_csv(root / "dev.csv", ["id", "text", "label"], rows(40))
    test = _write_csv(root / "test.csv", ["id", "text"], rows(29, labelled=False))
    config = _files_config("classification", checkpoint, train=train, validation=dev, test=test)
    config.eval.every_steps = 3
    summary = _train(config, root / "run")
    return {"workdir": root / "run", "dev": dev, "test": test, "summary": summary}


def test_read_finished_run_refuses_unfinished_and_pretraining(tmp_path):
    from bertjax.serving.runs import read_finished_run

    with pytest.raises(CheckpointError, match="no such directory"):
        read_finished_run(tmp_path / "nothing")
    (tmp_path / "config.json").write_text(json.dumps({"task": {"family": "files"}}))
    with pytest.raises(CheckpointError, match="no results.json: the fine-tuning run has not "
                                              "finished"):
        read_finished_run(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"phases": {}, "model": {}}))
    with pytest.raises(CheckpointError, match="is a pre-training run"):
        read_finished_run(tmp_path)


def test_cli_bad_input_is_one_error_line(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps({"task": {"family": "files"}}))
    result = run_python(["-m", "bertjax.predict", f"--workdir={tmp_path / 'run'}",
                         f"--input={tmp_path / 'x.csv'}", f"--output={tmp_path / 'o.jsonl'}"])
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: --workdir {tmp_path / 'run'}: no results.json: the fine-tuning run has not "
        "finished or predates export.json; run its command again (a finished run only rewrites "
        "its outputs)"]


def test_split_cpu_makes_devices_unless_their_count_is_set(monkeypatch):
    from bertjax import runtime
    from bertjax.errors import ConfigError

    monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with pytest.raises(ConfigError, match="--cpu_devices=0 must be positive"):
        runtime.split_cpu(0)
    assert runtime.split_cpu(1) == 0  # one device: nothing to split
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert runtime.split_cpu(3) == 0  # an accelerator runs the batches
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    assert runtime.split_cpu() == 0  # the user's count stands (a mesh on CPU devices)
    with pytest.raises(ConfigError, match="already set by XLA_FLAGS"):
        runtime.split_cpu(3)
    monkeypatch.delenv("XLA_FLAGS")
    result = run_python(["-c", "from bertjax import runtime; n = runtime.split_cpu(3); import jax; "
                         "print(n, jax.device_count(), jax.default_backend())"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["3", "3", "cpu"]


CACHE_SCRIPT = """
import os, sys
os.environ.pop("JAX_COMPILATION_CACHE_DIR")  # the tests' own (conftest); JAX_DIR: the user's
if os.environ.get("JAX_DIR"):
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["JAX_DIR"]
from absl import flags
from bertjax import cli
cli.define_compilation_cache_flag()
flags.FLAGS(["x", *sys.argv[1:]])
try:
    print(cli.use_compilation_cache())
except Exception as e:
    print(type(e).__name__, e)
import jax
print(jax.config.jax_compilation_cache_dir, jax.config.jax_compilation_cache_max_size)
"""


def test_compilation_cache_directory(tmp_path):
    """--compilation_cache, else JAX_COMPILATION_CACHE_DIR, else bertjax's own directory under
    XDG_CACHE_HOME (bounded); '' for none; an unusable default is no cache, a given one is an
    error naming the flag."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "JAX_DIR": ""}

    def cache(*args, **extra):
        result = run_python(["-c", CACHE_SCRIPT, *args], env={**env, **extra})
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout.splitlines()

    own = str(tmp_path / "xdg" / "bertjax" / "jax")
    assert cache() == [own, f"{own} {2 << 30}"]
    assert (tmp_path / "xdg" / "bertjax" / "jax").is_dir()
    assert cache(f"--compilation_cache={tmp_path / 'mine'}") == [
        str(tmp_path / "mine"), f"{tmp_path / 'mine'} -1"]
    assert cache(JAX_DIR=str(tmp_path / "jax")) == [
        str(tmp_path / "jax"), f"{tmp_path / 'jax'} -1"]
    assert cache("--compilation_cache=") == ["None", "None -1"]
    (tmp_path / "file").write_text("")
    assert cache(XDG_CACHE_HOME=str(tmp_path / "file")) == ["None", "None " + str(2 << 30)]
    assert cache(f"--compilation_cache={tmp_path / 'file' / 'x'}") == [
        f"ConfigError --compilation_cache={tmp_path / 'file' / 'x'}: Not a directory (give "
        "another directory, or '' for none)", "None -1"]


def test_whole_word_of_wordpiece_continuations_and_of_byte_level_pieces(tmp_path):
    from modern_checkpoint import bpe_tokenizer

    from bertjax.serving.fill_mask import whole_word
    from bertjax.tokenization import load_tokenizer

    (tmp_path / "vocab.txt").write_text("\n".join(
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "play", "##ing", "##s", "now", "run",
         "a", "b", "cat"]) + "\n")
    wordpiece = load_tokenizer(str(tmp_path / "vocab.txt"))

    def word(tokens, position, candidate):
        ids = wordpiece.convert_tokens_to_ids(tokens)
        return whole_word(wordpiece, tokens, ids, position,
                          wordpiece.convert_tokens_to_ids([candidate])[0])

    tokens = ["[CLS]", "play", "[MASK]", "##s", "now", "[SEP]"]
    assert word(tokens, 2, "##ing") == "playings"  # play + ##ing + ##s
    assert word(tokens, 2, "run") == "runs"
    assert word(["[CLS]", "[MASK]", "[SEP]"], 1, "##s") == "s"
    assert word(["[CLS]", "a", "[MASK]", "b", "[SEP]"], 2, "cat") == "cat"
    # A byte-level BPE: a candidate with the "Ġ" word-start marker is its decoded word, and
    # a continuation joins the piece before it.
    bpe = bpe_tokenizer()
    enc = bpe.encode("the [MASK] of the river")
    position = enc.tokens.index("[MASK]")
    word_start = sorted(t for t in bpe.vocab if t.startswith("\u0120") and t[1:].isalpha())[-1]
    assert whole_word(bpe, enc.tokens, enc.input_ids, position,
                      bpe.convert_tokens_to_ids([word_start])[0]) == word_start[1:]
    pieces = bpe.encode("the riverbank").tokens
    tail = next(t for t in pieces[2:] if bpe.is_continuation(t))
    row = bpe.encode("the river [MASK]")
    masked = row.tokens.index("[MASK]")
    made = whole_word(bpe, row.tokens, row.input_ids, masked,
                      bpe.convert_tokens_to_ids([tail])[0])
    assert made == bpe.decode(row.input_ids[masked - 1:masked]).strip() + tail.lstrip("\u0120")


@pytest.mark.slow
def test_classification_cli_and_python_equal_the_run(classification_run, tmp_path):
    from bertjax import Predictor

    run = classification_run
    workdir = run["workdir"]
    out = tmp_path / "test.jsonl"
    # The CPU split into 3 devices, whole batches on each in turn; the Python predictor below
    # runs on this process's one device: the same bits.
    # Its compiled programs are kept in a cache of its own: a second run loads them.
    cache = tmp_path / "cache"
    args = ["-m", "bertjax.predict", f"--workdir={workdir}", f"--input={run['test']}",
            "--cpu_devices=3", f"--compilation_cache={cache}"]
    result = run_python([*args, f"--output={out}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "padding is" in result.stdout and "metrics" not in result.stdout
    assert "3 CPU devices, whole batches in turn" in result.stdout
    def kept():
        return {name: os.stat(cache / name).st_mtime_ns for name in os.listdir(cache)}

    first = kept()
    assert first
    again = run_python([*args, f"--output={tmp_path / 'again.jsonl'}"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert kept() == first  # nothing compiled anew (a compile writes its program again)
    assert (tmp_path / "again.jsonl").read_bytes() == out.read_bytes()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    with open(workdir / "submission" / "test.tsv") as f:
        written = list(csv.reader(f, delimiter="\t"))[1:]
    # Input order and ids kept; labels those the run wrote for its test split.
    assert [r["id"] for r in records] == [f"r{i}" for i in range(29)]
    assert [r["label"] for r in records] == [label for _, label in written]
    for r in records:
        p = r["probabilities"]
        assert set(p) == {"neg", "pos"} and abs(sum(p.values()) - 1) < 1e-6
        assert r["label"] == max(p, key=p.get)

    predictor = Predictor.from_workdir(str(workdir))
    # A labelled file: the metrics equal the run's dev evaluation of its best step, bitwise.
    _, _, metrics = predictor.predict_file(run["dev"])
    assert metrics == {k: v for k, v in run["summary"]["best"].items() if k != "epoch"}
    texts = [row[1] for row in csv.reader(open(run["test"]))][1:]
    python_records = predictor(texts)
    assert [r["probabilities"] for r in python_records] == [r["probabilities"] for r in records]
    # Another batch size changes the batches, not the predictions (to float tolerance).
    other = Predictor.from_workdir(str(workdir), batch_size=3)(texts[:5])
    for a, b in zip(other, python_records[:5]):
        assert a["label"] == b["label"]
        assert np.allclose(list(a["probabilities"].values()), list(b["probabilities"].values()),
                           atol=1e-5)


@pytest.mark.slow
def test_classification_equals_exported_transformers_model(classification_run, tmp_path):
    import torch
    from transformers import BertForSequenceClassification, BertTokenizer

    from bertjax import Predictor

    workdir = classification_run["workdir"]
    result = run_python(["-m", "bertjax.convert", "to_hf", f"--input={workdir}",
                         f"--output={tmp_path / 'hf'}"])
    assert result.returncode == 0, result.stderr[-2000:]
    texts = [row[1] for row in csv.reader(open(classification_run["test"]))][1:]
    ours = Predictor.from_workdir(str(workdir))(texts)
    model = BertForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    tokenizer = BertTokenizer.from_pretrained(tmp_path / "hf")
    inputs = tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt")
    with torch.no_grad():
        probabilities = torch.softmax(model(**inputs).logits, -1).numpy()
    labels = [model.config.id2label[i] for i in range(2)]
    expected = [dict(zip(labels, p)) for p in probabilities]
    for record, reference in zip(ours, expected):
        for label in labels:
            assert abs(record["probabilities"][label] - reference[label]) < 1e-4
    # The export directory predicts by itself (its bertjax_task.json), bitwise as the run.
    assert Predictor.from_export(str(tmp_path / "hf"))(texts) == ours
    out = tmp_path / "export.jsonl"
    result = run_python(["-m", "bertjax.predict", f"--export={tmp_path / 'hf'}",
                         f"--input={classification_run['test']}", f"--output={out}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert [json.loads(line)["probabilities"] for line in out.read_text().splitlines()] == [
        r["probabilities"] for r in ours]


def test_a_moved_run_predicts_as_before(classification_run, tmp_path):
    """export.json names the vocabulary the run keeps beside it: a copied or moved workdir
    predicts without the init checkpoint's directory."""
    import shutil

    from bertjax import Predictor

    workdir = classification_run["workdir"]
    record = json.loads((workdir / "export.json").read_text())
    assert record["vocab"] == "vocab.txt" and (workdir / "vocab.txt").exists()
    moved = tmp_path / "moved"
    shutil.copytree(workdir, moved)
    texts = [row[1] for row in csv.reader(open(classification_run["test"]))][1:6]
    expected = Predictor.from_workdir(str(workdir))(texts)
    source = pathlib.Path(record["init_checkpoint"]) / "vocab.txt"
    source.rename(source.with_suffix(".away"))  # the run's origin is gone
    try:
        assert Predictor.from_workdir(str(moved))(texts) == expected
    finally:
        source.with_suffix(".away").rename(source)


def test_export_without_a_task_record_says_what_to_pass(tmp_path, checkpoint):
    from bertjax import Predictor

    with pytest.raises(CheckpointError, match="pre-trained bertjax checkpoint directory .*"
                                              "fill_mask --checkpoint"):
        Predictor.from_export(checkpoint)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    with pytest.raises(CheckpointError, match="no bertjax_task.json .* pass the fine-tuning "
                                              "workdir"):
        Predictor.from_export(str(tmp_path / "hf"))
    (tmp_path / "hf" / "bertjax_task.json").write_text("{}")
    with pytest.raises(CheckpointError, match="transformers export; pass it as --export"):
        Predictor.from_workdir(str(tmp_path / "hf"))


@pytest.mark.slow  # the module's classification run
@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl"])
def test_streamed_chunks_equal_the_one_shot_output(classification_run, tmp_path, suffix):
    from bertjax import Predictor

    rng = random.Random(5)
    # A generated file without an id column (ids are row numbers in the whole file), with
    # quoted newlines and commas in the CSV, and a few rows that keep their own ids.
    rows = []
    for i in range(61):
        text = filler_sentence(rng, "good" if i % 3 else "bad", 1 + (i % 4 == 0))
        rows.append({"text": text + (", \"x\"\nfiller2" if i % 9 == 0 else ""),
                     **({"id": f"own{i}"} if i % 10 == 0 else {})})
    path = tmp_path / f"big{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        with open(path, "w", newline="") as f:
            writer = csv.writer(f, delimiter="\t" if suffix == ".tsv" else ",")
            writer.writerow(["text", "id"])
            writer.writerows([r["text"], r.get("id", "")] for r in rows)
    predictor = Predictor.from_workdir(str(classification_run["workdir"]))
    whole = predictor.predict_file(str(path))[1]
    assert [r["id"] for r in whole][:2] == ["own0", "1"]
    chunks = []
    count = predictor.predict_stream(str(path), lambda e, r, labelled: chunks.append(r),
                                     chunk_rows=7)
    assert count == 61 and [len(c) for c in chunks] == [7] * 8 + [5]
    streamed = [r for c in chunks for r in c]
    # Bitwise the one-shot output: a row's batch shape depends on its own length only, not on
    # the rows read with it (XLA's CPU kernels are not bitwise independent of the shape).
    assert streamed == whole


@pytest.mark.slow  # the module's classification run
@pytest.mark.extended
def test_dry_run_of_the_predict_step_on_a_tpu_slice(classification_run):
    from bertjax.aot.inference import inference_costs
    from bertjax.models import BertConfig
    from bertjax.models.bert import flops as bert_flops
    from bertjax.serving.runs import read_finished_run

    workdir = str(classification_run["workdir"])
    costs, chips, header = inference_costs(workdir, "v5e-4", batch_size=64)
    assert chips == 4 and "v5litepod-4" in header and "bfloat16" in header
    # The prediction plan's shapes: the run's buckets 16, 32 cut finer, short ones with more rows.
    assert [(c.seq_len, c.batch_size) for c in costs] == [(16, 128), (24, 64), (32, 64)]
    model = BertConfig.from_dict(read_finished_run(workdir)[0]["model"])
    for c in costs:
        # The compiled FLOPs per chip cover the encoder's matmuls on its rows (an independent
        # count; the classifier's final layer for [CLS] alone), plus little else (head,
        # softmax, LayerNorm).
        matmuls = (bert_flops.forward_flops(model, c.seq_len, 0, pooled_only=True)
                   * c.batch_size / chips)
        assert matmuls <= c.flops <= 2 * matmuls
        assert c.fits and 0 < c.total_bytes < 1024**3
        assert c.step_seconds > 0 and c.sequences_per_second_per_chip(chips) > 0
    result = run_python(["-m", "bertjax.predict", f"--workdir={workdir}", "--dry_run",
                         "--topology=v5e-4", "--batch_size=64"])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == header and lines[1].split() == [
        "length", "rows", "memory/chip", "fits", "GFLOP/chip", "step", "ms", "seq/s/chip"]
    assert [line.split()[:2] for line in lines[2:]] == [["16", "128"], ["24", "64"],
                                                          ["32", "64"]]


@pytest.mark.slow  # the module's classification run
def test_bad_inputs_of_a_finished_run(classification_run, tmp_path):
    from bertjax import Predictor

    predictor = Predictor.from_workdir(str(classification_run["workdir"]))
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(DataError, match="empty file"):
        predictor.predict_file(str(tmp_path / "empty.csv"))
    (tmp_path / "header.jsonl").write_text("")
    with pytest.raises(DataError, match="no examples"):
        predictor.predict_file(str(tmp_path / "header.jsonl"))
    (tmp_path / "other.csv").write_text("sentence\nfiller1 good\n")
    with pytest.raises(DataError, match="no column 'text' .* the file's columns: sentence"):
        predictor.predict_file(str(tmp_path / "other.csv"))
    assert predictor.predict_file(str(tmp_path / "other.csv"), {"text_a": "sentence"})[1][0][
        "id"] == "0"
    with pytest.raises(DataError, match="no such file"):
        predictor.predict_file(str(tmp_path / "missing.csv"))
    with pytest.raises(DataError, match=r"input\[1\]: give a text"):
        predictor(["fine", 3])


@pytest.mark.slow
@pytest.mark.extended
def test_regression_and_multiple_choice(checkpoint, tmp_path):
    from bertjax import Predictor

    rng = random.Random(1)
    rows = [[filler_sentence(rng, "good", k % 3), k % 3 + 0.1] for k in range(48)]
    train = _write_csv(tmp_path / "reg.csv", ["text", "score"], rows)
    config = _files_config("regression", checkpoint, train=train, validation=train,
                           label="score")
    summary = _train(config, tmp_path / "reg")
    predictor = Predictor.from_workdir(str(tmp_path / "reg"))
    records, metrics = predictor.predict_file(train)[1:]
    assert metrics == {k: v for k, v in summary["best"].items() if k != "epoch"}
    assert [set(r) for r in records] == [{"id", "score"}] * 48
    assert predictor([rows[0][0]])[0]["score"] == records[0]["score"]

    mc = [[filler_sentence(rng)] + [filler_sentence(rng, "good" if i == a else "bad")
                                    for i in range(3)] + [a] for a in [0, 1, 2] * 8]
    train = _write_csv(tmp_path / "mc.csv", ["context", "a", "b", "c", "answer"], mc)
    config = _files_config("multiple_choice", checkpoint, train=train, validation=train,
                           text_a="context", choices="a,b,c", label="answer")
    summary = _train(config, tmp_path / "mc")
    predictor = Predictor.from_workdir(str(tmp_path / "mc"))
    records, metrics = predictor.predict_file(train)[1:]
    assert metrics == {k: v for k, v in summary["best"].items() if k != "epoch"}
    assert all(r["choice"] == int(np.argmax(r["scores"])) for r in records)
    assert predictor([(mc[0][0], mc[0][1:4])])[0]["scores"] == records[0]["scores"]


def test_a_cpu_predicts_in_batches_of_at_most_8_rows(checkpoint, tmp_path, monkeypatch):
    """A run configured with eval.batch_size=32 evaluates on a CPU in batches of 8 rows (at its
    longest bucket; the shorter ones scaled from 8), and the predictor's default batch is the
    same: its metrics are the run's, computing fewer filler rows than 32-row batches; an
    explicit batch size stands."""
    from bertjax import Predictor
    from bertjax.tasks import base

    used = []
    real = base.predict_rows

    def spy(task, fn, params, features, batch_size, runner, tokens=None):
        used.append(batch_size)
        return real(task, fn, params, features, batch_size, runner, tokens)

    monkeypatch.setattr(base, "predict_rows", spy)
    rng = random.Random(2)
    rows = [[filler_sentence(rng, "good", k % 3), k % 3 + 0.1] for k in range(40)]
    train = _write_csv(tmp_path / "reg.csv", ["text", "score"], rows)
    config = _files_config("regression", checkpoint, train=train, validation=train,
                           label="score")
    config.eval.batch_size = 32
    summary = _train(config, tmp_path / "reg")
    assert used and set(used) == {8}
    predictor = Predictor.from_workdir(str(tmp_path / "reg"))
    assert predictor.engine.batch_size == 8
    metrics = predictor.predict_file(train)[2]
    assert metrics == {k: v for k, v in summary["best"].items() if k != "epoch"}
    examples = predictor.task.read_inputs(train, dict(config.data))[0]
    computed = {}
    for batch_size in (None, 32):
        engine = Predictor.from_workdir(str(tmp_path / "reg"), batch_size).engine
        computed[engine.batch_size] = engine.run(examples)[2]
    assert computed[8]["real"] == computed[32]["real"]
    assert computed[8]["computed"] < computed[32]["computed"]


@pytest.mark.slow
@pytest.mark.extended
def test_squad_v2_predictions_equal_the_run_files(tmp_path):
    from squad_data import VOCAB, generate

    from bertjax import Predictor
    from experiments.squad import get_config

    checkpoint = write_tiny_checkpoint(tmp_path, VOCAB)
    train = generate(tmp_path / "train.json", 60, seed=1, impossible_rate=0.3)
    dev = generate(tmp_path / "dev.json", 24, seed=2, impossible_rate=0.3)
    config = get_config("v2")
    config.init_checkpoint = checkpoint
    config.data.train, config.data.validation, config.data.test = train, dev, dev
    config.max_seq_length, config.task.doc_stride, config.task.max_query_length = 64, 16, 10
    config.train.batch_size, config.eval.batch_size, config.train.num_epochs = 16, 16, 1
    config.log_every_steps = 1000
    _train(config, tmp_path / "run")
    predictor = Predictor.from_workdir(str(tmp_path / "run"))
    records, metrics = predictor.predict_file(dev)[1:]
    nbest = json.loads((tmp_path / "run" / "test_nbest_predictions.json").read_text())
    final = json.loads((tmp_path / "run" / "test_predictions.json").read_text())
    odds = json.loads((tmp_path / "run" / "test_null_odds.json").read_text())
    assert [r["id"] for r in records] == list(final)
    for r in records:
        assert r["answer"] == final[r["id"]] and r["null_odds"] == odds[r["id"]]
        assert [{k: e[k] for k in ("text", "probability", "start_logit", "end_logit")}
                for e in r["nbest"]] == nbest[r["id"]]
    contexts = {qa["id"]: p["context"] for p in json.loads(open(dev).read())["data"][0][
        "paragraphs"] for qa in p["qas"]}
    for r in records:  # offsets cut the answer out of the context
        for e in r["nbest"]:
            assert contexts[r["id"]][e["start"]:e["end"]] == e["text"] if e["text"] else \
                e["start"] == -1
    assert set(metrics) >= {"exact", "f1", "best_f1"}
    # The .json streamed five questions at a time (whole paragraphs): the same records.
    streamed = []
    predictor.predict_stream(dev, lambda e, r, labelled: streamed.append(r), chunk_rows=5)
    assert len(streamed) > 3 and [r for c in streamed for r in c] == records
    # The same question through Python, from a JSONL file and as a pair.
    first = json.loads(open(dev).read())["data"][0]["paragraphs"][0]
    question = first["qas"][0]
    (tmp_path / "q.jsonl").write_text(json.dumps({"id": "q", "question": question["question"],
                                                  "context": first["context"]}) + "\n")
    from_file = predictor.predict_file(str(tmp_path / "q.jsonl"))[1][0]
    pair = predictor([(question["question"], first["context"])])[0]
    assert from_file["nbest"] == pair["nbest"] == records[0]["nbest"]

    # The exported BertForQuestionAnswering: the Predictor's start / end logits of every
    # window within 1e-4 at its real tokens; the export predicts by itself as the run does.
    import torch
    from transformers import BertForQuestionAnswering

    result = run_python(["-m", "bertjax.convert", "to_hf", f"--input={tmp_path / 'run'}",
                         f"--output={tmp_path / 'hf'}"])
    assert result.returncode == 0, result.stderr[-2000:]
    examples = predictor.task.read_inputs(dev, {})[0]
    features, predictions, _ = predictor.engine.run(examples)
    predictor.task.release(examples)
    model = BertForQuestionAnswering.from_pretrained(tmp_path / "hf").eval()
    batch = {k: torch.tensor(np.asarray(getattr(features, k)), dtype=torch.long)
             for k in ("input_ids", "segment_ids", "input_mask")}
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], token_type_ids=batch["segment_ids"],
                    attention_mask=batch["input_mask"])
    for name, reference in (("start_logits", out.start_logits), ("end_logits", out.end_logits)):
        for row, ours in enumerate(predictions[name]):
            n = int(batch["input_mask"][row].sum())
            assert np.max(np.abs(ours[:n] - reference[row, :n].numpy())) < 1e-4, (name, row)
    exported = Predictor.from_export(str(tmp_path / "hf")).predict_file(dev)[1]
    assert [r["answer"] for r in exported] == [r["answer"] for r in records]


@pytest.mark.slow
@pytest.mark.extended
def test_tagging_conll_output_equals_the_run_file(tmp_path):
    from bertjax import Predictor
    from experiments.ner import get_config

    checkpoint = td.write_checkpoint(tmp_path)
    paths = {}
    for name, seed, n in (("train", 1, 48), ("dev", 2, 16), ("test", 3, 16)):
        paths[name] = str(tmp_path / f"{name}.conll")
        td.write_conll(tmp_path / f"{name}.conll", td.dataset(seed, n), docs_every=4)
    config = get_config("files")
    config.init_checkpoint = checkpoint
    config.data.train, config.data.validation, config.data.test = (
        paths["train"], paths["dev"], paths["test"])
    config.data.scheme, config.data.token_column = "iob2", 0
    config.max_seq_length, config.train.batch_size, config.eval.batch_size = 32, 16, 8
    config.train.num_epochs, config.log_every_steps = 1, 1000
    _train(config, tmp_path / "run")
    out = tmp_path / "predicted.conll"
    result = run_python(["-m", "bertjax.predict", f"--workdir={tmp_path / 'run'}",
                         f"--input={paths['test']}", f"--output={out}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "metrics: accuracy" in result.stdout and " f1 " in result.stdout
    assert out.read_text() == (tmp_path / "run" / "predictions" / "test.conll").read_text()
    # Streamed three sentences at a time (cut where a document starts): the same file.
    streamed = tmp_path / "streamed.conll"
    result = run_python(["-m", "bertjax.predict", f"--workdir={tmp_path / 'run'}",
                         f"--input={paths['test']}", f"--output={streamed}", "--chunk_rows=3"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "metrics" not in result.stdout
    assert streamed.read_text() == out.read_text()
    predictor = Predictor.from_workdir(str(tmp_path / "run"))
    records = predictor.predict_file(paths["test"])[1]
    # The same sentences as JSONL with document fields, streamed (cut where a document
    # starts): the records of the CoNLL file.
    examples = predictor.task.read_inputs(paths["test"], {})[0]
    jsonl = tmp_path / "test.jsonl"
    jsonl.write_text("".join(json.dumps({"tokens": list(s.words), "document": s.document}) + "\n"
                             for s in examples))
    chunks = []
    predictor.predict_stream(str(jsonl), lambda e, r, labelled: chunks.append(r), chunk_rows=3)
    assert len(chunks) > 1 and [r for c in chunks for r in c] == records
    words = [r["tokens"] for r in records]
    # The exported BertForTokenClassification: the Predictor's logits within 1e-4 at real
    # tokens; the export (no pooler) predicts by itself the same tags.
    import torch
    from transformers import BertForTokenClassification

    result = run_python(["-m", "bertjax.convert", "to_hf", f"--input={tmp_path / 'run'}",
                         f"--output={tmp_path / 'hf'}"])
    assert result.returncode == 0, result.stderr[-2000:]
    model = BertForTokenClassification.from_pretrained(tmp_path / "hf").eval()
    examples = predictor.task.read_inputs(paths["test"], {})[0]
    features = predictor.engine.run(examples)[0]
    engine = predictor.engine
    for batch in predictor.task.batches(features, engine.batch_size, shuffle=False):
        ours = np.asarray(predictor.task.outputs(engine.model, engine.params, batch))
        with torch.no_grad():
            reference = model(**{name: torch.tensor(batch[key], dtype=torch.long) for name, key in (
                ("input_ids", "input_ids"), ("token_type_ids", "segment_ids"),
                ("attention_mask", "input_mask"))}).logits.numpy()
        mask = batch["input_mask"].astype(bool)
        assert np.max(np.abs(ours[mask] - reference[mask])) < 1e-4
    predictor.task.release(examples)
    assert Predictor.from_export(str(tmp_path / "hf")).predict_file(paths["test"])[1] == records
    # Without document context (one sentence at a time) the tags may differ; each word has one.
    alone = predictor(words)
    assert [len(r["tags"]) for r in alone] == [len(w) for w in words]
    assert all(t in predictor.task.labels for r in alone for t in r["tags"])


@pytest.mark.slow
@pytest.mark.extended
def test_fill_mask_equals_transformers_masked_lm(checkpoint, tmp_path):
    import torch
    from transformers import BertForMaskedLM

    from bertjax import FillMask
    from bertjax.checkpoint_dir import load_pretrained

    result = run_python(["-m", "bertjax.convert", "to_hf", f"--input={checkpoint}",
                         f"--output={tmp_path / 'hf'}", "--architecture=BertForMaskedLM"])
    assert result.returncode == 0, result.stderr[-2000:]
    texts = ["filler1 [MASK] filler2 good", "[MASK] filler3 [MASK]"]
    fill = FillMask.from_checkpoint(checkpoint, max_seq_length=32, batch_size=2)
    ours = fill(texts, top_k=3)
    tokenizer = load_pretrained(checkpoint)[2]
    model = BertForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    for text, masks in zip(texts, ours):
        enc = tokenizer.encode(text)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([enc.input_ids])).logits[0]
        probabilities = torch.softmax(logits, -1).numpy()
        for mask in masks:
            reference = probabilities[mask["position"]]
            ranked = [i for i in np.argsort(-reference) if i not in tokenizer.special_ids][:3]
            assert [c["token"] for c in mask["candidates"]] == tokenizer.convert_ids_to_tokens(
                ranked)
            for c, i in zip(mask["candidates"], ranked):
                assert abs(c["probability"] - reference[i]) < 1e-4
    result = run_python(["-m", "bertjax.predict", "fill_mask", f"--checkpoint={checkpoint}",
                         "--top_k=2", texts[0]])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[0] == texts[0]
    assert result.stdout.splitlines()[1].startswith("  [MASK] at token 2: "
                                                    + ours[0][0]["candidates"][0]["word"])


@pytest.mark.parametrize("kind", ["mesh", "turns"])
def test_programs_compile_ahead_once_per_batch_shape(kind):
    """The runners compile a jitted function for the batch shapes ahead, in background threads
    (train.loop.compiled_ahead): each shape once, none when its batch is dispatched, outputs
    in the batches' order."""
    from bertjax.serving.engine import DeviceTurns
    from bertjax.train import sharding as sharding_lib
    from bertjax.train.loop import Runner

    if kind == "mesh":
        rules = (("batch", ("data", "fsdp")),)
        mesh = sharding_lib.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
        runner, params = Runner(sharding_lib.batch_sharding(mesh, rules), rules), np.float32(2)
    else:
        runner = DeviceTurns(jax.devices()[:1])
        params = runner.place(np.float32(2))
    fn = jax.jit(lambda p, batch: batch["x"].sum(axis=1) * p)  # a new function: not cached
    widths = [3, 3, 5, 7, 5, 3]
    batches = [{"x": np.full((4, w), i, np.float32)} for i, w in enumerate(widths)]
    compiled_in = []

    def listener(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled_in.append(threading.current_thread().name)

    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # every program compiles here
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        outputs = list(runner.run(fn, params, batches))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        jax.config.update("jax_enable_compilation_cache", cache)
    for (batch, out), i, w in zip(outputs, range(len(widths)), widths, strict=True):
        np.testing.assert_array_equal(batch["x"], batches[i]["x"])
        np.testing.assert_array_equal(out, np.full(4, 2 * i * w, np.float32))
    ahead = [name for name in compiled_in if name.startswith("compile")]
    assert len(ahead) == len(set(widths))
    assert "MainThread" not in compiled_in


def test_compiled_ahead_raises_a_compile_error_at_its_batch():
    from bertjax.train.loop import compiled_ahead

    def compile_for(i, batch):
        if batch == "bad":
            raise ValueError("no program for bad")

    got = []
    with pytest.raises(ValueError, match="no program for bad"):
        for batch in compiled_ahead(["a", "a", "b", "bad", "c"], compile_for, lambda i, b: b):
            got.append(batch)
    assert got == ["a", "a", "b"]  # the batches before it ran


def test_device_turns_keep_short_runs_on_one_device_and_the_order():
    """A run of fewer than SPREAD_BATCHES same-shape batches stays on one device (each device
    compiles each shape it runs), a longer one takes the devices batch by batch, runs take the
    devices in turn; outputs come in the batches' order."""
    from bertjax.serving.engine import DeviceTurns

    turns = DeviceTurns(jax.devices()[:1] * 2)  # two slots of one device: the same schedule
    spread = turns.SPREAD_BATCHES
    widths = [3] * 3 + [5] * (spread + 4) + [7] * 2 + [3]
    batches = [{"x": np.full((2, w), i, np.float32)} for i, w in enumerate(widths)]
    devices = [d for d, _ in turns.assign(batches)]
    assert devices == [0] * 3 + [1, 0] * (spread // 2 + 2) + [1] * 2 + [0]
    fn = jax.jit(lambda p, batch: batch["x"].sum(axis=1) * p)
    outputs = list(turns.run(fn, turns.place(np.float32(2)), batches))
    assert [int(batch["x"][0, 0]) for batch, _ in outputs] == list(range(len(widths)))
    for (_, out), i, w in zip(outputs, range(len(widths)), widths, strict=True):
        np.testing.assert_array_equal(out, np.full(2, 2 * i * w, np.float32))


def test_compiled_ahead_reads_a_bounded_number_of_batches_ahead():
    from bertjax.train import loop

    read = []

    def batches(n, size):
        for i in range(n):
            read.append(i)
            yield {"x": np.zeros(size, np.uint8)}

    ahead = loop.compiled_ahead(batches(200, 10), lambda i, b: None, lambda i, b: 0)
    next(ahead)
    assert len(read) == loop.COMPILE_LOOKAHEAD + 1  # small batches: a count
    read.clear()
    big = loop.COMPILE_LOOKAHEAD_BYTES // 4 + 1
    ahead = loop.compiled_ahead(batches(200, big), lambda i, b: None, lambda i, b: 0)
    next(ahead)
    assert len(read) == 4  # large ones: the bytes held
    assert sum(1 for _ in ahead) == 199

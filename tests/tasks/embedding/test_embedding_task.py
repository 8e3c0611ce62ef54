"""The embedding family end to end: users' files and BEIR directories read (with one-line
errors), fine-tuning on pairs / scored pairs raises the dev metric above the starting
checkpoint's (logged first), and 2 processes train exactly as one process with the whole
batch (global negatives across hosts)."""

import json

import embedding_data as data
import numpy as np
import pytest
from conftest import run_python
from multihost import assert_same_files, assert_same_losses, check_job, run_pair_and_reference

from bertjax import tasks
from bertjax.errors import ConfigError, DataError
from bertjax.tasks.embedding import readers
from experiments import embedding


def config_for(tmp_path, kind="pairs", **data_fields):
    config = embedding.get_config(kind)
    config.init_checkpoint = data.tiny_checkpoint(tmp_path)
    config.max_seq_length = 32
    config.train.batch_size = 32
    config.eval.batch_size = 32
    config.optimizer.learning_rate = 2e-3
    config.data.update(data_fields)
    return config


# ---------------------------------------------------------------------------- bad input


def test_bad_files_give_one_line_naming_the_file_and_field(tmp_path):
    pairs = data.write_pairs(tmp_path / "pairs.jsonl", 4)
    with pytest.raises(DataError, match=r"pairs.jsonl:1: no column 'answer' \(config.data."
                                        r"columns.*the file's columns: query, passage"):
        readers.read_texts(pairs, ("query", "answer"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty.jsonl: no examples"):
        readers.read_texts(str(tmp_path / "empty.jsonl"), ("query", "passage"))
    beir = data.write_beir(tmp_path / "beir")
    qrels = tmp_path / "beir" / "qrels" / "dev.tsv"
    qrels.write_text(qrels.read_text() + "q0_0\tnowhere\t1\n")
    with pytest.raises(DataError, match=r"dev.tsv:\d+: corpus id 'nowhere' is not in "
                                        "corpus.jsonl"):
        readers.read_beir(beir, "dev")
    with pytest.raises(DataError, match=r"qrels/test.tsv: no such file"):
        readers.read_beir(beir, "test")


def test_beir_directory_reads_titles_and_keeps_judged_queries(tmp_path):
    beir = readers.read_beir(data.write_beir(tmp_path / "beir"), "dev")
    first = json.loads((tmp_path / "beir" / "corpus.jsonl").read_text().splitlines()[0])
    assert beir.corpus[first["_id"]] == f"{first['title']} {first['text']}"
    assert set(beir.queries) == set(beir.qrels) and len(beir.queries) == 48
    assert beir.qrels["q0_0"] == {"d0_0": 2, "d0_1": 1, "d0_2": 1}


def test_a_config_without_a_dev_set_or_with_a_wrong_loss_is_refused(tmp_path):
    config = config_for(tmp_path, train=data.write_pairs(tmp_path / "p.jsonl", 8),
                        columns="query,passage")
    with pytest.raises(ConfigError, match="give a dev set: config.data.validation"):
        tasks.train_and_evaluate(config, str(tmp_path / "run"))
    config.task.loss = "cosent"
    with pytest.raises(ConfigError, match="config.task.loss='cosent': a pairs task trains "
                                          "with in_batch"):
        tasks.get_task(config)


# ------------------------------------------------------------------------------- training


def zero_shot(lines: list[str]) -> dict:
    line = next(x for x in lines if x.startswith("eval before training"))
    return json.loads(line.split(": ", 1)[1])


@pytest.mark.slow
@pytest.mark.extended
def test_pairs_with_hard_negatives_raise_ndcg_above_the_starting_checkpoint(tmp_path):
    config = config_for(tmp_path, train=data.write_pairs(tmp_path / "p.jsonl", 480,
                                                         negatives=1),
                        columns="query,passage,negative1",
                        beir=data.write_beir(tmp_path / "beir"))
    config.train.num_epochs = 4
    config.task.normalize = "true"
    lines = []
    summary = tasks.train_and_evaluate(config, str(tmp_path / "run"), log=lines.append)
    assert "3 text(s) a row, mean pooling, normalised, loss in_batch" in "\n".join(lines)
    before = zero_shot(lines)["ndcg@10"]
    assert summary["primary_metric"] == "ndcg@10"
    assert summary["best"]["ndcg@10"] > before + 0.15, (before, summary["best"])
    export = json.loads((tmp_path / "run" / "export.json").read_text())
    assert export["architecture"] == "BertModel"
    assert export["pooling"] == {"mode": "mean", "normalize": True, "include_prompt": True}

    # The run as a sentence-transformers directory: SentenceTransformer encodes the vectors
    # bertjax gives (its best checkpoint, from the workdir and from the export).
    from sentence_transformers import SentenceTransformer

    from bertjax.serving.embedder import Embedder

    result = run_python(["-m", "bertjax.convert", "to_hf", f"--input={tmp_path / 'run'}",
                         f"--output={tmp_path / 'st'}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SentenceTransformer(" in result.stdout
    texts = ["topic3 word1 word7", "word2 topic11 word5 word9 word1", "topic0"]
    ours = Embedder.from_workdir(str(tmp_path / "run"))(texts)
    theirs = SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(texts)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    np.testing.assert_allclose(Embedder.from_export(str(tmp_path / "st"))(texts), ours,
                               atol=1e-5)


def test_an_epoch_with_a_partial_last_batch_and_repeated_texts_trains_to_the_end(tmp_path):
    """As users' files are: 75 pairs (not a multiple of the batch of 32) whose passages repeat,
    so that the no-duplicates batches come out partial, with filler rows; every step's loss and
    gradient norm is finite and the run finishes with finite parameters and a dev score."""
    rows = [json.loads(x) for x in open(data.write_pairs(tmp_path / "p.jsonl", 75))]
    for i, row in enumerate(rows):
        row["passage"] = rows[i % 20]["passage"]  # 20 distinct passages
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = config_for(tmp_path, train=str(tmp_path / "p.jsonl"),
                        columns="query,passage", beir=data.write_beir(tmp_path / "beir"))
    config.train.num_epochs = 1
    config.log_every_steps = 1
    summary = tasks.train_and_evaluate(config, str(tmp_path / "run"), log=lambda *_: None)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines() if '"train"' in x]
    assert summary["status"] == "done" and len(records) == summary["total_steps"] >= 4
    for record in records:
        assert np.isfinite(record["loss"]) and np.isfinite(record["grad_norm"]), record
    assert np.isfinite(summary["best"]["ndcg@10"])


@pytest.mark.slow
def test_scored_pairs_raise_the_sts_spearman_with_cosent(tmp_path):
    config = config_for(tmp_path, "scored", train=data.write_scored(tmp_path / "t.csv", 480),
                        validation=data.write_scored(tmp_path / "d.csv", 120, seed=5))
    config.train.num_epochs = 3
    lines = []
    summary = tasks.train_and_evaluate(config, str(tmp_path / "run"), log=lines.append)
    before = zero_shot(lines)["spearman"]
    assert summary["primary_metric"] == "spearman"
    assert summary["best"]["spearman"] > before + 0.15, (before, summary["best"])


@pytest.mark.slow
@pytest.mark.extended
def test_two_processes_train_as_one_with_the_whole_global_batch(tmp_path):
    """Global negatives across hosts: each process holds half the rows of every batch, and the
    losses, dev metrics and exported record equal one process's with both devices."""
    checkpoint = data.tiny_checkpoint(tmp_path)
    pairs = data.write_pairs(tmp_path / "p.jsonl", 96)
    beir = data.write_beir(tmp_path / "beir")

    def args_for(out):
        return ["-m", "bertjax.finetune", "--config=experiments/embedding.py:pairs",
                f"--config.init_checkpoint={checkpoint}", f"--workdir={out}",
                f"--config.data.train={pairs}", "--config.data.columns=query,passage",
                f"--config.data.beir={beir}", "--config.train.batch_size=16",
                "--config.train.num_epochs=2", "--config.max_seq_length=32",
                "--config.log_every_steps=1", "--config.optimizer.learning_rate=1e-3",
                "--config.eval.batch_size=16"]

    pair, reference = run_pair_and_reference(args_for, tmp_path)
    check_job("finetune embedding (pairs, BEIR dev)", pair, reference,
              lambda: assert_same_losses(tmp_path / "pair", tmp_path / "single"),
              lambda: assert_same_files(tmp_path / "pair", tmp_path / "single",
                                        ["results.json", "export.json"]))
    results = json.loads((tmp_path / "single" / "results.json").read_text())
    assert results["primary_metric"] == "ndcg@10"


def test_training_batches_hold_no_text_twice_and_every_row_once(tmp_path):
    """Rows sharing passages (6 passages, 5 anchors each): every epoch's batches hold each row
    once and no passage twice; without the option, duplicates do occur."""
    import random

    from bertjax.tasks.embedding.task import no_duplicate_groups
    from bertjax.tokenization import load_tokenizer

    rng = random.Random(0)
    passages = [data.sentence(rng, t, 6) for t in data.TOPICS[:6]]
    rows = [{"query": data.sentence(rng, data.TOPICS[i % 6], 3), "passage": passages[i % 6]}
            for i in range(30)]
    config = config_for(tmp_path, train=data.write_jsonl(tmp_path / "p.jsonl", rows),
                        columns="query,passage")
    task = tasks.get_task(config)
    examples = readers.read_texts(config.data.train, ("query", "passage"))
    tokenizer = load_tokenizer(config.init_checkpoint)
    features = task.encode(tokenizer, examples, 32)
    for seed in range(3):
        batches = list(task.batches(features, 4, shuffle=True, seed=seed))
        index = np.concatenate([b["example_index"] for b in batches])
        assert sorted(index[index >= 0].tolist()) == list(range(30))
        for b in batches:
            real = b["example_index"][b["example_index"] >= 0]
            texts = [examples[i].texts[1] for i in real]
            assert len(texts) == len(set(texts)), texts
            assert b["weights"].shape[0] == 4 and b["weights"].sum() == len(real)
    keys = [frozenset([i % 6]) for i in range(30)]
    groups = no_duplicate_groups(keys, 4, np.random.default_rng(0))
    assert all(len({k for i in g for k in keys[i]}) == len(g) for g in groups)
    assert sum(len(g) for g in groups) == 30 and len(groups) <= 10
    config.task.no_duplicates = False
    plain = tasks.get_task(config)
    plain.encode(tokenizer, examples, 32)
    duplicated = [b for seed in range(3)
                  for b in plain.batches(features, 4, shuffle=True, seed=seed)
                  if len({examples[i].texts[1] for i in b["example_index"] if i >= 0})
                  < (b["example_index"] >= 0).sum()]
    assert duplicated

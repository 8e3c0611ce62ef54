"""The reranking family end to end: a few listwise steps on a planted set (an epoch ending in a
partial batch) raise the dev nDCG@10 above the starting checkpoint's (logged first); the
finished run serves as `bertjax.Reranker` (pairs, rankings, files of candidate lists), and
`convert to_hf` writes it as a directory sentence-transformers' CrossEncoder loads, scoring
as bertjax does within 1e-5."""

import json

import numpy as np
import pytest
import reranking_data as data
from convert_cli import convert_main

from bertjax import Reranker, tasks
from bertjax.errors import ConfigError, DataError
from experiments import reranking


def zero_shot(lines: list[str]) -> dict:
    line = next(x for x in lines if x.startswith("eval before training"))
    return json.loads(line.split(": ", 1)[1])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(workdir, its log lines, summary, dev file): 90 listwise rows (query, positive, 3
    negatives) in batches of 8, one epoch: 12 steps, the last batch 2 rows short."""
    root = tmp_path_factory.mktemp("rerank")
    config = reranking.get_config("listwise")
    config.init_checkpoint = data.tiny_checkpoint(root)
    config.max_seq_length = 32
    config.eval.batch_size = 32
    config.optimizer.learning_rate = 3e-3
    config.optimizer.warmup_proportion = 0.0
    config.model.hidden_dropout_prob = config.model.attention_dropout_prob = 0.0
    config.log_every_steps = 1
    config.data.train = data.write_listwise(root / "train.jsonl", 90)
    config.data.columns = "query,positive,negative_1,negative_2,negative_3"
    config.data.validation = data.write_candidates(root / "dev.jsonl", 24)
    lines = []
    summary = tasks.train_and_evaluate(config, str(root / "run"), log=lines.append)
    return root / "run", lines, summary, config.data.validation


def test_listwise_steps_raise_ndcg_above_the_starting_checkpoint(run):
    workdir, lines, summary, _ = run
    assert "listwise: 4 passage(s) a row, sigmoid activation at predict" in "\n".join(lines)
    before = zero_shot(lines)
    assert summary["primary_metric"] == "ndcg@10" and summary["total_steps"] == 12
    assert summary["best"]["ndcg@10"] > before["ndcg@10"] + 0.1, (before, summary["best"])
    assert summary["best"]["mrr@10"] > before["mrr@10"]
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()
               if '"train"' in x]
    assert len(records) == 12 and all(np.isfinite(r["loss"]) for r in records)
    export = json.loads((workdir / "export.json").read_text())
    assert export["architecture"] == "BertForSequenceClassification"
    assert export["cross_encoder"] == {"activation": "sigmoid"}
    assert export["task"] == {"kind": "listwise", "activation": "sigmoid"}


def test_the_run_serves_as_a_reranker(run, tmp_path):
    workdir, _, summary, dev = run
    reranker = Reranker.from_workdir(str(workdir))
    pairs = [("word1 topic2", "word3 topic2 word4"), ("word1 topic2", "word3 word5 word4")]
    logits = reranker.logits(pairs)
    np.testing.assert_allclose(reranker.score(pairs), 1 / (1 + np.exp(-logits)), rtol=1e-6)
    ranked = reranker.rank(pairs[0][0], [pairs[1][1], pairs[0][1]])
    assert [r["corpus_id"] for r in ranked] == [1, 0]  # the planted one first
    records, metrics, before = reranker.rerank_file(dev, top_k=2)
    assert len(records) == 24 and all(len(r["candidates"]) == 2 for r in records)
    assert [r["id"] for r in records] == [f"q{i}" for i in range(24)]
    scores = [[c["score"] for c in r["candidates"]] for r in records]
    assert all(s[0] >= s[1] for s in scores)  # best first
    best = {k: summary["best"][k] for k in metrics}
    assert metrics == pytest.approx(best) and before["ndcg@10"] < metrics["ndcg@10"]
    unjudged = data.write_candidates(tmp_path / "u.jsonl", 3, judged=False)
    assert reranker.rerank_file(unjudged)[1:] == (None, None)
    with pytest.raises(DataError, match=r"input\[1\]: give a \(query, passage\) pair"):
        reranker.score([("q", "p"), "q p"])
    with pytest.raises(ConfigError, match="a reranking run reranks candidate lists: python -m "
                                          "bertjax.predict rerank"):
        tasks.get_task(reranker.trained.config).read_inputs("x.csv", {})


def test_to_hf_writes_a_cross_encoder_that_scores_as_bertjax(run, tmp_path, capsys):
    st = pytest.importorskip("sentence_transformers")
    workdir, _, _, _ = run
    convert_main(["to_hf", "--input", workdir, "--output", tmp_path / "ce"])
    assert "CrossEncoder, sigmoid activation at predict, max_length=32" in capsys.readouterr().out
    model = st.CrossEncoder(str(tmp_path / "ce"), device="cpu")
    assert type(model.activation_fn).__name__ == "Sigmoid" and model.max_seq_length == 32
    pairs = [("word1 topic2", "word3 topic2 word4"), ("topic5", "word3 word5 word4 word6"),
             ("word2 word9 topic0", "topic0")]
    ours = Reranker.from_workdir(str(workdir))
    np.testing.assert_allclose(ours.score(pairs), model.predict(pairs), atol=1e-5)
    exported = Reranker.from_export(str(tmp_path / "ce"))
    np.testing.assert_allclose(exported.logits(pairs), ours.logits(pairs), atol=1e-6)

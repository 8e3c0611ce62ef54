"""bertjax.fidelity's retrieval families past the `embedding` row: `embedding_mined` (hard
negatives each side mines) and `rerank` (a cross-encoder over the mined retriever's top 50).
Both sides mine the same rows from the same vectors at the harness's settings; the
sentence-transformers side's batches hold no text twice; its listwise loss is bertjax's; the
shared candidate lists keep the retriever's order and leave out its misses; and (slow) one
quick run of both families end to end."""

import json
import subprocess
import sys

import numpy as np
import pytest
from test_embedding_fidelity import write_ropes, write_sentence_transformers_model

from bertjax.fidelity import data, reference_embedding, reference_rerank, retrieval
from bertjax.fidelity.__main__ import MINE, PAIR_COLUMNS
from bertjax.tasks.embedding import mining
from bertjax.tasks.embedding.readers import read_beir
from bertjax.tasks.reranking import losses

WORDS = ["what", "did", "do", "won", "the", "match", "story", "train", "dev", "?", ":", ".",
         *(f"team{p}" for p in range(160)), *map(str, range(160))]


def write_discerning_model(path):
    """A tiny sentence-transformers directory whose vectors tell the generated texts apart: a
    random BERT scores every pair alike (a positive 0.953, the rest 0.947 on average, so a 5%
    margin leaves no negative); word embeddings 10 times larger make each text's own words
    count (0.62 against 0.54). 512 positions: the reranker reads pairs of up to 256 tokens."""
    import torch
    import transformers

    write_sentence_transformers_model(path, WORDS)
    model = transformers.BertModel.from_pretrained(path)
    with torch.no_grad():
        model.embeddings.word_embeddings.weight.mul_(10.0)
        positions = model.embeddings.position_embeddings.weight
        model.embeddings.position_embeddings = torch.nn.Embedding(512, positions.shape[1])
        model.embeddings.position_embeddings.weight[:len(positions)] = positions
    model.config.max_position_embeddings = 512
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def ropes(tmp_path_factory):
    """The generated ROPES stand-in's pairs and BEIR dev set, and a tiny
    sentence-transformers directory."""
    root = tmp_path_factory.mktemp("ropes")
    write_ropes(root / "ropes", 40, "train")
    write_ropes(root / "ropes", 12, "dev")
    files = data.ropes_retrieval(root / "ropes", root / "out", data.Sizes(24, 8))
    write_discerning_model(root / "st")
    return files, root / "st"


def test_both_sides_mine_the_same_rows_from_the_same_vectors(ropes):
    from sentence_transformers import SentenceTransformer

    files, model_dir = ropes
    model = SentenceTransformer(str(model_dir), device="cpu")
    records = reference_embedding.read_jsonl(files["train"])
    theirs = reference_embedding.mine(model, records, PAIR_COLUMNS, **MINE)

    def embed(texts):
        return model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)

    ours, summary = mining.mine_pairs(embed, [(r["question"], r["passage"]) for r in records],
                                      **MINE)
    columns = PAIR_COLUMNS + retrieval.negative_columns(MINE["num_negatives"])
    assert summary.columns == ("anchor", "positive", "negative_1")
    assert sorted(ours) == sorted(tuple(r[c] for c in columns) for r in theirs)
    assert len(ours) >= len(records) // 2


def test_no_duplicate_batches_cover_every_row_once_an_epoch_with_no_text_twice():
    # Each row's negative is the next row's positive.
    records = [{"a": f"q{i}", "p": f"p{i}", "n": f"p{(i + 1) % 20}"} for i in range(20)]
    plan = reference_embedding.batch_plan(records, ("a", "p", "n"), 4, 2, seed=3,
                                          no_duplicates=True)
    assert len(plan) == 2 and plan[0] != plan[1]
    for batches in plan:
        assert sorted(i for b in batches for i in b) == list(range(20))
        for batch in batches:
            texts = [records[i][c] for i in batch for c in ("a", "p", "n")]
            assert len(texts) == len(set(texts))
    # Without: the shuffled order of the embedding row, consecutive rows a batch.
    plain = reference_embedding.batch_plan(records, ("a", "p"), 8, 1, seed=0,
                                           no_duplicates=False)
    assert [len(b) for b in plain[0]] == [8, 8, 4]


def test_the_reference_listwise_loss_is_bertjaxs(ropes):
    import torch
    from sentence_transformers import CrossEncoder
    from sentence_transformers.cross_encoder.losses import MultipleNegativesRankingLoss

    _, model_dir = ropes
    model = CrossEncoder(str(model_dir), num_labels=1, device="cpu")
    loss_fn = MultipleNegativesRankingLoss(model, activation_fn=None, scale=1.0)
    logits = np.random.default_rng(0).normal(0, 3, (6, 3)).astype(np.float32)
    theirs = loss_fn.calculate_loss([torch.from_numpy(c) for c in logits.T], 6)
    ours, _ = losses.listwise_loss(logits, np.ones(6, np.float32))
    np.testing.assert_allclose(float(theirs), float(ours), rtol=1e-6)


def test_candidate_lists_keep_the_hits_order_and_leave_out_the_misses(ropes, tmp_path):
    files, _ = ropes
    beir = read_beir(files["beir"], "dev")
    corpus = list(beir.corpus)
    qids = list(beir.qrels)[:3]
    relevant = {q: next(iter(beir.qrels[q])) for q in qids}
    others = {q: [d for d in corpus if d != relevant[q]] for q in qids}
    hits = [others[qids[0]][:2] + [relevant[qids[0]]],  # relevant third
            [relevant[qids[1]]] + others[qids[1]][:2],  # relevant first
            others[qids[2]][:3]]  # missed
    (tmp_path / "hits.jsonl").write_text("".join(
        json.dumps({"id": q, "hits": [{"id": d, "score": 0.0} for d in h]}) + "\n"
        for q, h in zip(qids, hits)))
    lists, missed = retrieval.candidate_lists(str(tmp_path / "hits.jsonl"), files["beir"])
    assert missed == 1 and [r["id"] for r in lists] == qids[:2]
    assert [c["id"] for c in lists[0]["candidates"]] == hits[0]
    assert [c["relevant"] for c in lists[0]["candidates"]] == [0, 0, 1]
    assert lists[1]["query"] == beir.queries[qids[1]]
    assert lists[1]["candidates"][0]["text"] == beir.corpus[relevant[qids[1]]]
    first = retrieval.write_candidates(tmp_path / "c.jsonl", lists)
    assert first["ndcg@10"] == pytest.approx((0.5 + 1.0) / 2)  # 1/log2(4), 1/log2(2)
    assert first["mrr@10"] == pytest.approx((1 / 3 + 1.0) / 2)
    # The sentence-transformers evaluator's samples: the same texts, the relevant as positive.
    samples = reference_rerank.evaluator_samples(str(tmp_path / "c.jsonl"))
    assert samples[0]["documents"] == [beir.corpus[d] for d in hits[0]]
    assert samples[0]["positive"] == [beir.corpus[relevant[qids[0]]]]


def test_the_commands_name_the_mined_columns_and_the_beir_files():
    command = retrieval.mine_command("ckpt", "pairs.jsonl", "out.jsonl", PAIR_COLUMNS, MINE)
    assert command[3:] == ["mine", "--checkpoint=ckpt", "--pairs=pairs.jsonl",
                           "--output=out.jsonl", "--text_a=question", "--text_b=passage",
                           "--num_negatives=1", "--relative_margin=0.05", "--range_max=50"]
    command = retrieval.search_command("run", "beir", "hits.jsonl", 50)
    assert "--corpus=beir/corpus.jsonl" in command and "--top_k=50" in command
    assert "--text_a=text" in command and "--id=_id" in command


@pytest.mark.slow
@pytest.mark.extended
def test_quick_mined_and_rerank_runs_train_both_sides(tmp_path):
    # --quick: 96 training situations and 48 distractors.
    write_ropes(tmp_path / "data" / "ropes", 160, "train")
    write_ropes(tmp_path / "data" / "ropes", 30, "dev")
    write_discerning_model(tmp_path / "st")
    work = tmp_path / "fidelity"
    done = subprocess.run(
        [sys.executable, "-m", "bertjax.fidelity", f"--workdir={work}", "--quick",
         "--families=embedding_mined,rerank", f"--model={tmp_path / 'st'}",
         f"--data_dir={tmp_path / 'data'}"], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    mined, rerank = json.loads((work / "fidelity.json").read_text())
    assert (mined["family"], rerank["family"]) == ("embedding_mined", "rerank")
    for row in (mined, rerank):
        assert all(0.0 <= v <= 1.0 for v in row["bertjax"] + row["transformers"])
    # bertjax trained on the rows its `predict mine` wrote, with their negative column.
    rows = [json.loads(line) for line in open(work / "embedding_mined" / "data" / "mined.jsonl")]
    assert rows and set(rows[0]) == {"question", "passage", "negative_1"}
    [ours], [theirs] = mined["start"]["bertjax"], mined["start"]["transformers"]
    assert abs(ours - theirs) < 1e-3  # one starting model
    # Both sides reranked the shared lists, each of the top 50 with its relevant situation.
    lists = [json.loads(line) for line in open(work / "rerank" / "data" / "candidates.jsonl")]
    assert lists and all(len(r["candidates"]) == 50 for r in lists)
    assert all(any(c["relevant"] for c in r["candidates"]) for r in lists)
    results = json.loads((work / "rerank" / "bertjax_0" / "results.json").read_text())
    assert results["best"]["ndcg@10"] == rerank["bertjax"][0]
    cached = json.loads((work / "rerank" / "transformers_0.json").read_text())["metrics"]
    assert cached["retriever_ndcg@10"] == pytest.approx(
        retrieval.write_candidates(tmp_path / "again.jsonl", lists)["ndcg@10"], abs=1e-6)

"""Embedding metrics against independent references: retrieval metrics against pytrec_eval
(trec_eval itself), device search against brute-force NumPy float64, STS against SciPy."""

import numpy as np
import pytest
import pytrec_eval
import scipy.stats

from bertjax.errors import DataError
from bertjax.tasks.embedding import metrics


def _reference_cosines(queries, corpus):
    q = np.asarray(queries, np.float64)
    c = np.asarray(corpus, np.float64)
    return (q / np.linalg.norm(q, axis=1, keepdims=True)) @ (
        c / np.linalg.norm(c, axis=1, keepdims=True)).T


def _retrieval_case(seed):
    """Graded qrels and a ranking that favours relevant documents, covering: a query in qrels
    but not in the run, one whose relevant documents are never retrieved, one judged with only
    non-relevant documents (not counted), one in the run but not in qrels (ignored), and
    rankings longer than 100."""
    rng = np.random.default_rng(seed)
    docs = [f"d{i}" for i in range(300)]
    qrels, ranked = {}, {}
    for q in range(40):
        qid = f"q{q}"
        judged = rng.choice(300, size=int(rng.integers(1, 25)), replace=False)
        qrels[qid] = {docs[d]: int(rng.integers(0, 4)) for d in judged}
        qrels[qid][docs[judged[0]]] = int(rng.integers(1, 4))  # at least one relevant
        # Relevant documents tend to rank higher, so every metric takes varied values.
        bonus = np.zeros(300)
        for doc, rel in qrels[qid].items():
            bonus[docs.index(doc)] = rel * rng.uniform(0, 1.5)
        order = np.argsort(-(rng.normal(size=300) + bonus), kind="stable")
        ranked[qid] = [docs[d] for d in order[:int(rng.integers(5, 200))]]
    qrels["q-unranked"] = {"d1": 2, "d2": 0}
    qrels["q-unretrieved"] = {"d3": 1, "d4": 3}
    ranked["q-unretrieved"] = [d for d in docs if d not in ("d3", "d4")][:150]
    qrels["q-nothing-relevant"] = {"d5": 0}
    ranked["q-nothing-relevant"] = ["d5", "d6"]
    ranked["q-unjudged"] = ["d7", "d8"]
    return qrels, ranked


def _trec_run(ranked, depth=None):
    # Strictly decreasing scores: trec_eval orders by score, so this is the ranking as given.
    return {qid: {doc: float(len(ids) - rank) for rank, doc in enumerate(ids[:depth])}
            for qid, ids in ranked.items()}


@pytest.mark.parametrize("seed", range(3))
def test_retrieval_metrics_match_trec_eval(seed):
    qrels, ranked = _retrieval_case(seed)
    cuts = {"ndcg@10": "ndcg_cut_10", "recall@1": "recall_1", "recall@10": "recall_10",
            "recall@100": "recall_100"}
    per_query = pytrec_eval.RelevanceEvaluator(qrels, set(cuts.values())).evaluate(
        _trec_run(ranked))
    # MRR@10 is trec_eval's reciprocal rank of the run cut to its top 10.
    reciprocal = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(
        _trec_run(ranked, depth=10))
    for qid, values in reciprocal.items():
        per_query.setdefault(qid, {})["mrr"] = values["recip_rank"]
    cuts["mrr@10"] = "mrr"
    # Averaged over the queries with a relevant document; one missing from the run scores 0.
    counted = [qid for qid, judged in qrels.items() if any(r > 0 for r in judged.values())]
    assert "q-unranked" in counted and "q-unranked" not in per_query
    assert "q-nothing-relevant" not in counted
    expected = {name: np.mean([per_query.get(qid, {}).get(measure, 0.0) for qid in counted])
                for name, measure in cuts.items()}

    got = metrics.retrieval_metrics(ranked, qrels)
    assert set(got) == set(metrics.RETRIEVAL_METRICS)
    for name in metrics.RETRIEVAL_METRICS:
        assert got[name] == pytest.approx(expected[name], abs=1e-6), name
        assert 0.0 < got[name] < 1.0, name  # a case where the metric is not trivially 0 or 1


def test_retrieval_metrics_without_relevant_queries_and_bad_rankings():
    assert metrics.retrieval_metrics({"q": ["d"]}, {"q": {"d": 0}}) == {
        name: 0.0 for name in metrics.RETRIEVAL_METRICS}
    with pytest.raises(DataError, match="'q'.*'d'"):
        metrics.retrieval_metrics({"q": ["d", "e", "d"]}, {"q": {"d": 1}})


@pytest.mark.parametrize("similarity", ["cosine", "dot"])
@pytest.mark.parametrize("k", [10, 100])
def test_search_matches_brute_force(similarity, k):
    rng = np.random.default_rng(7)
    # 3 full chunks of 16 rows and a partial one; 3 query blocks of 8, the last partial.
    queries = rng.normal(size=(19, 24)).astype(np.float32)
    corpus = (rng.normal(size=(55, 24)) * rng.uniform(0.5, 2, (55, 1))).astype(np.float32)
    corpus[40] = corpus[3]  # an exact tie across chunks: the lower row must rank first

    scores, indices = metrics.search(queries, corpus, k, similarity=similarity,
                                     chunk_rows=16, query_rows=8)

    if similarity == "cosine":
        reference = _reference_cosines(queries, corpus)
    else:
        reference = queries.astype(np.float64) @ corpus.astype(np.float64).T
    top = min(k, len(corpus))
    expected = np.argsort(-reference, axis=1, kind="stable")[:, :top]
    # The seed is one whose order float32 cannot blur: apart from the exact tie, neighbouring
    # scores differ by far more than float32 rounding.
    ordered = np.take_along_axis(reference, expected, axis=1)
    gaps = ordered[:, :-1] - ordered[:, 1:]
    assert gaps[gaps > 0].min() > 1e-5
    assert scores.shape == indices.shape == (19, top)
    assert scores.dtype == np.float32 and indices.dtype == np.int64
    np.testing.assert_array_equal(indices, expected)
    np.testing.assert_allclose(scores, ordered, rtol=1e-6, atol=1e-5)
    if k > len(corpus):
        assert (np.sort(indices, axis=1) == np.arange(len(corpus))).all()


def test_rank_ids_maps_search_rows_to_ids():
    rng = np.random.default_rng(1)
    queries, corpus = rng.normal(size=(5, 8)), rng.normal(size=(30, 8))
    _, indices = metrics.search(queries, corpus, 4, chunk_rows=8)
    corpus_ids = [f"doc{i}" for i in range(30)]
    ranked = metrics.rank_ids(indices, ["a", "b", "c", "d", "e"], corpus_ids)
    expected = np.argsort(-_reference_cosines(queries, corpus), axis=1)[:, :4]
    assert ranked == {qid: [corpus_ids[i] for i in row]
                      for qid, row in zip("abcde", expected)}
    with pytest.raises(DataError, match="corpus ids: id 'doc0'"):
        metrics.rank_ids(indices, list("abcde"), corpus_ids[:-1] + ["doc0"])


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("ties", [False, True])
def test_sts_matches_scipy(seed, ties):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(10, 300))
    a = rng.normal(size=(n, 16)).astype(np.float32)
    b = (a + rng.normal(scale=1.5, size=(n, 16))).astype(np.float32)
    cosines = np.sum(a.astype(np.float64) * b, axis=1) / (
        np.linalg.norm(a.astype(np.float64), axis=1) * np.linalg.norm(b.astype(np.float64), axis=1))
    gold = 2.5 + 2.5 * cosines + rng.normal(scale=0.5, size=n)
    if ties:  # STS-B gold scores are multiples of 0.2
        gold = np.round(gold * 5) / 5

    got = metrics.sts(a, b, gold)

    assert got["spearman"] == pytest.approx(scipy.stats.spearmanr(gold, cosines)[0], abs=1e-9)
    assert got["pearson"] == pytest.approx(scipy.stats.pearsonr(gold, cosines)[0], abs=1e-9)


def test_search_over_a_corpus_smaller_than_k_and_over_tied_or_broken_vectors():
    """A corpus of 3 documents asked for the top 100: 3 each, every document once; equal
    vectors tie to the lower row; a NaN vector (a model whose parameters went NaN) is named,
    never ranked."""
    rng = np.random.default_rng(0)
    corpus = rng.normal(size=(3, 8)).astype(np.float32)
    corpus[2] = corpus[1]  # a tie
    queries = rng.normal(size=(4, 8)).astype(np.float32)
    scores, indices = metrics.search(queries, corpus, k=100)
    assert indices.shape == (4, 3) and all(sorted(row) == [0, 1, 2] for row in indices.tolist())
    for row in indices.tolist():
        assert row.index(1) < row.index(2)
    ranked = metrics.rank_ids(indices, ["a", "b", "c", "d"], ["d0", "d1", "d2"])
    qrels = {q: {"d1": 1} for q in "abcd"}
    assert metrics.retrieval_metrics(ranked, qrels)["recall@100"] == 1.0
    corpus[0, 3] = np.nan
    with pytest.raises(ValueError, match="corpus row 0: its vector is not finite"):
        metrics.search(queries, corpus, k=100)

"""Sentence-embedding evaluation: STS correlations, exact nearest-neighbour search on device,
and retrieval metrics in trec_eval's definitions (as BEIR reports them).

No SciPy, scikit-learn or pytrec_eval at run time; tests/tasks/embedding/test_metrics.py checks
each function against them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bertjax.errors import DataError
from bertjax.models.embedding import l2_normalize
from bertjax.tasks.classification import metrics as classification_metrics

RETRIEVAL_METRICS = ("ndcg@10", "mrr@10", "recall@1", "recall@10", "recall@100")
SIMILARITIES = ("cosine", "dot")


def pair_cosines(vectors_a, vectors_b) -> np.ndarray:
    """vectors_a, vectors_b [n, hidden] → the cosine of each row pair [n], in float64."""
    a = np.asarray(vectors_a, np.float64)
    b = np.asarray(vectors_b, np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"vectors {a.shape} and {b.shape} must be equal 2-D shapes")
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    # A zero vector has cosine 0 with everything rather than NaN.
    return np.sum(a * b, axis=1) / np.maximum(norms, 1e-12)


def sts(vectors_a, vectors_b, scores) -> dict[str, float]:
    """Correlations of the pair cosines with the gold similarity `scores` [n].

    vectors_a, vectors_b [n, hidden] → {"spearman", "pearson"}."""
    cosines = pair_cosines(vectors_a, vectors_b)
    return {
        "spearman": classification_metrics.spearman(scores, cosines),
        "pearson": classification_metrics.pearson(scores, cosines),
    }


@functools.cache
def _search_step(mesh: Mesh, k: int, similarity: str):
    """The jitted merge of one corpus chunk into the running top k, the chunk's rows split
    evenly over the devices of `mesh` in their order:

      (best_scores [block, k] float32, best_indices [block, k] int32: the top k so far, best
      first; queries [block, hidden]; chunk [devices * rows, hidden], its row i corpus row
      offset + i; n: the corpus's rows, those past it padding) → the new (best_scores,
      best_indices).

    Everything but the chunk is replicated; so are the results."""
    axes = tuple(mesh.axis_names)

    def merge(best_scores, best_indices, queries, shard, offset, n):
        # This device's rows of the chunk start at chunk row device * shard_rows.
        start = offset + jax.lax.axis_index(axes) * shard.shape[0]
        if similarity == "cosine":
            queries, shard = l2_normalize(queries), l2_normalize(shard)
        # Full float32 products: the default precision of TPUs (and TF32 GPUs) would reorder
        # near-equal neighbours.
        scores = jnp.matmul(queries, shard.T, precision=jax.lax.Precision.HIGHEST)
        # Padding rows score -inf, below every real row, so they are never among the top k.
        rows = start + jnp.arange(shard.shape[0])
        scores = jnp.where(rows < n, scores, -jnp.inf)
        local_scores, positions = jax.lax.top_k(scores, min(k, shard.shape[0]))
        # Every device's candidates, in device order: lower devices hold lower corpus rows.
        gathered = [jax.lax.all_gather(x, axes, axis=1, tiled=True)
                    for x in (local_scores, positions + start)]
        # The running top k comes first and holds lower corpus rows, each device's candidates
        # put the lower row first among equals, and top_k the lower position: ties go to the
        # lower corpus row.
        scores = jnp.concatenate([best_scores, gathered[0]], axis=1)
        indices = jnp.concatenate([best_indices, gathered[1]], axis=1)
        best_scores, picked = jax.lax.top_k(scores, k)
        return best_scores, jnp.take_along_axis(indices, picked, axis=1)

    replicated = P()
    # check_vma off: the all-gathered candidates are the same on every device, which the
    # type checker cannot tell, and the merge of them is replicated.
    return jax.jit(jax.shard_map(
        merge, mesh=mesh, in_specs=(replicated, replicated, replicated, P(axes, None),
                                    replicated, replicated),
        out_specs=(replicated, replicated), check_vma=False))


def _rows(array: np.ndarray, start: int, size: int) -> np.ndarray:
    """array[start:start + size], zero-padded to `size` rows."""
    block = array[start:start + size]
    return np.pad(block, ((0, size - len(block)), (0, 0))) if len(block) < size else block


def _put(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array as a global array of `sharding`: each process sends only its own devices'
    pieces (every process holds the same `array`)."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def search(queries, corpus, k: int, similarity: str = "cosine", chunk_rows: int = 16384,
           query_rows: int = 1024, mesh: Mesh | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k search of each query over the corpus, on device.

    queries [q, hidden], corpus [n, hidden] → (scores [q, k] float32, indices [q, k] int64),
    best first; k is capped at n. similarity: "cosine" (of the L2-normalised vectors) or
    "dot". Equal scores rank the lower corpus row first. Each device scores `chunk_rows`
    corpus rows at a time against `query_rows` queries; the last chunk and block are padded
    so that one shape compiles.

    mesh: the corpus is split over all of its devices, `chunk_rows` rows each a step; each
    device keeps the top k of its rows, and the candidates of all are merged. Every device
    runs the one-device program's shapes, so the results are those of one device, bitwise.
    None: the default device alone. On several hosts, give the global mesh and the same
    queries and corpus in every process; each process sends only its own devices' rows, and
    every process gets the results."""
    if similarity not in SIMILARITIES:
        raise ValueError(f"similarity must be one of {SIMILARITIES}, not {similarity!r}")
    if k < 1 or chunk_rows < 1 or query_rows < 1:
        raise ValueError(f"k {k}, chunk_rows {chunk_rows}, query_rows {query_rows} must be >= 1")
    queries = np.asarray(queries, np.float32)
    corpus = np.asarray(corpus, np.float32)
    if queries.ndim != 2 or corpus.ndim != 2 or queries.shape[1] != corpus.shape[1]:
        raise ValueError(f"queries {queries.shape} and corpus {corpus.shape} must be "
                         "[rows, hidden] with equal hidden")
    for name, vectors in (("queries", queries), ("corpus", corpus)):
        if not np.isfinite(vectors).all():
            bad = int(np.flatnonzero(~np.isfinite(vectors).all(axis=1))[0])
            raise ValueError(f"{name} row {bad}: its vector is not finite (NaN or inf): the "
                             "model's parameters or its input are")
    num_queries, n = len(queries), len(corpus)
    k = min(k, n)
    if k == 0 or num_queries == 0:
        return np.zeros((num_queries, k), np.float32), np.zeros((num_queries, k), np.int64)

    if mesh is None:
        mesh = Mesh(np.array(jax.local_devices()[:1]), ("corpus",))
    replicated = NamedSharding(mesh, P())
    sharded = NamedSharding(mesh, P(tuple(mesh.axis_names), None))
    step = _search_step(mesh, k, similarity)
    # A device's rows a step do not depend on the device count: the same shapes, the same
    # products (a corpus under chunk_rows rows is all on the first device).
    shard_rows = min(chunk_rows, n)
    chunk = shard_rows * mesh.size
    block = min(query_rows, num_queries)
    blocks = [_put(_rows(queries, start, block), replicated)
              for start in range(0, num_queries, block)]
    initial = (np.full((block, k), -np.inf, np.float32), np.full((block, k), -1, np.int32))
    best = [tuple(_put(x, replicated) for x in initial) for _ in blocks]
    # Chunks outside, query blocks inside: each chunk goes to the devices once.
    for offset in range(0, n, chunk):
        chunk_vectors = _put(_rows(corpus, offset, chunk), sharded)
        previous = best
        best = [step(*state, query_block, chunk_vectors, np.int32(offset), np.int32(n))
                for state, query_block in zip(best, blocks)]
        # At most two chunks on the devices: the next one's copy overlaps this one's scores,
        # and dispatch, which runs ahead, cannot copy the whole corpus over meanwhile.
        jax.block_until_ready(previous)
    # The results are replicated: every process reads its own copy.
    scores = np.concatenate([np.asarray(s.addressable_data(0)) for s, _ in best])
    indices = np.concatenate([np.asarray(i.addressable_data(0)) for _, i in best])
    return scores[:num_queries], indices[:num_queries].astype(np.int64)


def _repeated(ids) -> str | None:
    """The first id that appears a second time, or None."""
    seen = set()
    for i in ids:
        if i in seen:
            return i
        seen.add(i)
    return None


def rank_ids(indices, query_ids, corpus_ids) -> dict[str, list[str]]:
    """indices [q, k] (rows of the corpus, best first, as `search` gives them) → {query id:
    [corpus id, ...]}, the `ranked` argument of `retrieval_metrics`."""
    indices, query_ids, corpus_ids = np.asarray(indices), list(query_ids), list(corpus_ids)
    # A repeated corpus id would count one document twice in a ranking.
    for field, ids in (("query ids", query_ids), ("corpus ids", corpus_ids)):
        if (repeated := _repeated(ids)) is not None:
            raise DataError(f"{field}: id {repeated!r} appears more than once")
    if indices.ndim != 2 or len(indices) != len(query_ids):
        raise ValueError(f"indices {indices.shape} must be [{len(query_ids)} queries, k]")
    return {qid: [corpus_ids[i] for i in row] for qid, row in zip(query_ids, indices.tolist())}


def _query_metrics(qid: str, ranking: list[str], judged: dict[str, int]) -> dict[str, float]:
    """The metrics of one query: `ranking` corpus ids best first, `judged` {doc id: relevance}
    (relevance <= 0: not relevant, gain 0)."""
    ranking = list(ranking)[:100]
    if (repeated := _repeated(ranking)) is not None:
        raise DataError(f"ranking of query {qid!r}: corpus id {repeated!r} appears twice")
    relevance = [max(judged.get(doc, 0), 0) for doc in ranking]
    num_relevant = sum(r > 0 for r in judged.values())
    # nDCG as trec_eval's ndcg_cut: linear gain, discount log2(rank + 1), the ideal ranking
    # made of the judged relevances.
    ideal = sorted((r for r in judged.values() if r > 0), reverse=True)[:10]
    dcg = sum(r / np.log2(rank + 1) for rank, r in enumerate(relevance[:10], 1))
    idcg = sum(r / np.log2(rank + 1) for rank, r in enumerate(ideal, 1))
    first = next((rank for rank, r in enumerate(relevance[:10], 1) if r > 0), None)
    metrics = {"ndcg@10": float(dcg / idcg), "mrr@10": 1.0 / first if first else 0.0}
    for cutoff in (1, 10, 100):
        metrics[f"recall@{cutoff}"] = sum(r > 0 for r in relevance[:cutoff]) / num_relevant
    return metrics


def retrieval_metrics(ranked: dict[str, list[str]],
                      qrels: dict[str, dict[str, int]]) -> dict[str, float]:
    """nDCG@10, MRR@10 and recall@{1,10,100} as trec_eval defines them, averaged over the
    queries of `qrels` with at least one relevant (relevance > 0) document.

    ranked {query id: [corpus id, ...] best first}; qrels {query id: {corpus id: relevance}}.
    A query of `ranked` absent from `qrels` is ignored; one of `qrels` absent from `ranked`
    scores 0."""
    per_query = [_query_metrics(qid, ranked.get(qid, []), judged)
                 for qid, judged in qrels.items() if any(r > 0 for r in judged.values())]
    if not per_query:
        return {name: 0.0 for name in RETRIEVAL_METRICS}
    return {name: float(np.mean([m[name] for m in per_query])) for name in RETRIEVAL_METRICS}

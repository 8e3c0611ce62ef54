"""A planted reranking set for the reranking tests: 8 topics, each a word; a query names its
topic among filler words, a relevant passage holds the same topic word, the others filler
words alone (what a tiny model learns in a few steps; telling one topic from another takes it
hundreds). Written as training rows (labelled, listwise, distill, margin) and candidate lists."""

import random
from pathlib import Path

from conftest import topic_sentence, write_jsonl, write_tiny_checkpoint

TOPICS = [f"topic{i}" for i in range(8)]
FILLERS = [f"word{i}" for i in range(30)]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *FILLERS, *TOPICS]


def sentence(rng: random.Random, topic: str | None, length: int) -> str:
    return topic_sentence(rng, FILLERS, topic, length)


def triples(n: int, seed: int = 0, negatives: int = 1):
    """[(query, positive, [negatives])]: the positive of the query's topic, the negatives of
    none."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        out.append((sentence(rng, topic, rng.randint(1, 3)),
                    sentence(rng, topic, rng.randint(3, 6)),
                    [sentence(rng, None, rng.randint(3, 6))
                     for _ in range(negatives)]))
    return out


def write_labelled(path: Path, n: int, seed: int = 0) -> str:
    """{"query", "passage", "label"}: each query once with its positive (1), once with a
    negative (0)."""
    rows = []
    for query, positive, (negative,) in triples(n, seed):
        rows += [{"query": query, "passage": positive, "label": 1},
                 {"query": query, "passage": negative, "label": 0}]
    return write_jsonl(path, rows)


def write_listwise(path: Path, n: int, negatives: int = 3, seed: int = 0) -> str:
    """{"query", "positive", "negative_1" ..}."""
    rows = []
    for query, positive, others in triples(n, seed, negatives):
        rows.append({"query": query, "positive": positive,
                     **{f"negative_{k + 1}": t for k, t in enumerate(others)}})
    return write_jsonl(path, rows)


def write_candidates(path: Path, n: int, candidates: int = 6, seed: int = 7,
                     judged: bool = True) -> str:
    """Candidate lists: each query's one relevant passage among others, in a random order
    (relevance 1 and 0 where `judged`)."""
    rng = random.Random(seed)
    rows = []
    for i, (query, positive, others) in enumerate(triples(n, seed, candidates - 1)):
        items = [{"id": "pos", "text": positive, "relevant": 1}] + [
            {"id": f"neg{k}", "text": t, "relevant": 0} for k, t in enumerate(others)]
        rng.shuffle(items)
        if not judged:
            items = [{k: v for k, v in c.items() if k != "relevant"} for c in items]
        rows.append({"id": f"q{i}", "query": query, "candidates": items})
    return write_jsonl(path, rows)


def tiny_checkpoint(root: Path) -> str:
    return write_tiny_checkpoint(root, VOCAB)

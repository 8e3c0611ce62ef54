"""A synthetic retrieval set for the embedding tests: 24 topics, each a word; a query names its
topic among filler words, its relevant passages hold the topic word among other fillers.
Written as pairs (JSONL), scored pairs (CSV) and a BEIR directory."""

import csv
import random
from pathlib import Path

from conftest import topic_sentence, write_jsonl, write_tiny_checkpoint

TOPICS = [f"topic{i}" for i in range(24)]
FILLERS = [f"word{i}" for i in range(40)]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *FILLERS, *TOPICS]


def sentence(rng: random.Random, topic: str | None, length: int) -> str:
    return topic_sentence(rng, FILLERS, topic, length)


def write_pairs(path: Path, n: int, seed: int = 0, negatives: int = 0) -> str:
    """{"query", "passage", "negative1"...}: a query and a passage of the same topic."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        row = {"query": sentence(rng, topic, rng.randint(2, 5)),
               "passage": sentence(rng, topic, rng.randint(6, 12))}
        for k in range(negatives):
            other = rng.choice([t for t in TOPICS if t != topic])
            row[f"negative{k + 1}"] = sentence(rng, other, rng.randint(6, 12))
        rows.append(row)
    return write_jsonl(path, rows)


def write_scored(path: Path, n: int, seed: int = 0) -> str:
    """sentence1, sentence2, score: 5 for the same topic, 0 for another, 2.5 for half."""
    rng = random.Random(seed)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["sentence1", "sentence2", "score"])
        for i in range(n):
            topic = TOPICS[i % len(TOPICS)]
            kind = i % 3
            other = topic if kind == 0 else rng.choice([t for t in TOPICS if t != topic])
            b = sentence(rng, other, rng.randint(4, 9))
            if kind == 2:
                b += " " + topic
            writer.writerow([sentence(rng, topic, rng.randint(3, 8)), b, [5.0, 0.0, 2.5][kind]])
    return str(path)


def write_beir(directory: Path, queries_per_topic: int = 2, passages_per_topic: int = 3,
               seed: int = 1) -> str:
    """corpus.jsonl, queries.jsonl, qrels/dev.tsv: each query's relevant passages are its
    topic's (relevance 1, the first one 2)."""
    rng = random.Random(seed)
    (directory / "qrels").mkdir(parents=True)
    corpus, queries, qrels = [], [], []
    for t, topic in enumerate(TOPICS):
        ids = [f"d{t}_{k}" for k in range(passages_per_topic)]
        corpus += [{"_id": d, "title": rng.choice(FILLERS), "text": sentence(rng, topic, 8)}
                   for d in ids]
        for q in range(queries_per_topic):
            queries.append({"_id": f"q{t}_{q}", "text": sentence(rng, topic, 3)})
            qrels += [(f"q{t}_{q}", d, 2 if k == 0 else 1) for k, d in enumerate(ids)]
    write_jsonl(directory / "corpus.jsonl", corpus)
    write_jsonl(directory / "queries.jsonl", queries)
    (directory / "qrels" / "dev.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t{r}\n" for q, d, r in qrels))
    return str(directory)


def tiny_checkpoint(root: Path) -> str:
    return write_tiny_checkpoint(root, VOCAB)

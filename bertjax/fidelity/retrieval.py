"""bertjax's side of the retrieval fidelity families past one fine-tuning command, by the
commands a user runs: hard negatives for the training pairs (`python -m bertjax.predict
mine`), a retriever's top hits for the dev queries (`python -m bertjax.predict search`), and
the candidate lists a reranker reads (bertjax/tasks/reranking/readers.py) made of those hits.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Sequence

from bertjax.tasks.embedding.readers import read_beir
from bertjax.tasks.reranking.metrics import input_order, reranking_metrics
from bertjax.tasks.reranking.readers import read_candidates


def run_command(command: Sequence[str], log_path: pathlib.Path, what: str
                ) -> subprocess.CompletedProcess:
    """Runs `command`, its output kept in `log_path`; the finished process (stdout, stderr),
    or RuntimeError naming `what` and the log."""
    done = subprocess.run(list(command), capture_output=True, text=True)
    log_path.write_text(done.stdout + done.stderr)
    if done.returncode:
        raise RuntimeError(f"{what} failed (exit {done.returncode}); log: {log_path}\n"
                           + done.stderr[-2000:])
    return done


def negative_columns(num_negatives: int) -> tuple[str, ...]:
    """The columns `predict mine` (and sentence-transformers' "n-tuple" output) adds."""
    return tuple(f"negative_{i}" for i in range(1, num_negatives + 1))


def mine_command(checkpoint: str, pairs: str, output: str, columns: tuple[str, str],
                 settings: dict) -> list[str]:
    """`predict mine` on the (anchor, positive) `columns` of `pairs` with the starting
    `checkpoint` (its own max length and pooling); settings: its flags (num_negatives,
    relative_margin, range_max ...)."""
    return [sys.executable, "-m", "bertjax.predict", "mine", f"--checkpoint={checkpoint}",
            f"--pairs={pairs}", f"--output={output}", f"--text_a={columns[0]}",
            f"--text_b={columns[1]}", *(f"--{k}={v}" for k, v in settings.items())]


def search_command(workdir: str, beir_dir: str, output: str, top_k: int) -> list[str]:
    """`predict search` of a BEIR directory's queries over its corpus with an embedding run."""
    beir = pathlib.Path(beir_dir)
    return [sys.executable, "-m", "bertjax.predict", "search", f"--workdir={workdir}",
            f"--corpus={beir / 'corpus.jsonl'}", f"--queries={beir / 'queries.jsonl'}",
            "--text_a=text", "--id=_id", f"--top_k={top_k}", f"--output={output}"]


def candidate_lists(hits_path: str, beir_dir: str) -> tuple[list[dict], int]:
    """(the candidate list of each query of `predict search`'s hits whose relevant document is
    among them: {"id", "query", "candidates": [{"id", "text", "relevant"}]} in the hits'
    order; how many queries were left out). A query the retriever missed is left out so that
    every list can be reranked to the top: bertjax's reranking metrics average over lists with
    a relevant candidate, sentence-transformers' evaluator over every list."""
    beir = read_beir(beir_dir, "dev")
    lists, missed = [], 0
    with open(hits_path, encoding="utf-8") as f:
        for hits in map(json.loads, f):
            judged = beir.qrels.get(hits["id"], {})
            candidates = [{"id": h["id"], "text": beir.corpus[h["id"]],
                           "relevant": judged.get(h["id"], 0)} for h in hits["hits"]]
            if not any(c["relevant"] > 0 for c in candidates):
                missed += 1
                continue
            lists.append({"id": hits["id"], "query": beir.queries[hits["id"]],
                          "candidates": candidates})
    return lists, missed


def write_candidates(path: pathlib.Path, lists: list[dict]) -> dict[str, float]:
    """Writes the candidate lists (JSONL); the metrics of their own order (the retriever's),
    by bertjax's reranking metrics."""
    path.write_text("".join(json.dumps(r) + "\n" for r in lists), encoding="utf-8")
    read = read_candidates(str(path))
    return reranking_metrics(read, input_order(read))

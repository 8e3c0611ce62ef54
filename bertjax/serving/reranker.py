"""`bertjax.Reranker`: cross-encoder scores of (query, passage) pairs, from a finished reranking
run, its export, or a checkpoint directory converted from a sentence-transformers CrossEncoder
(its classifier in classifier.npz, its activation and max length in conversion.json).

    reranker = bertjax.Reranker.from_checkpoint("checkpoints/ms-marco-minilm")
    scores = reranker.score([("a query", "a passage"), ...])   # [n] float32
    ranked = reranker.rank("a query", ["passage", ...])        # [{"corpus_id", "score"}]

`score` is CrossEncoder.predict (the model's activation applied: sigmoid, or the logit itself
for identity), `rank` CrossEncoder.rank (best first; equal scores keep the passages' order),
`logits` the raw scores. Pairs run through the serving engine (length buckets, a mesh or CPU
devices in turn), so a pair's score does not depend on the pairs it is batched with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from bertjax import checkpoint_dir, paths
from bertjax.errors import CheckpointError, ConfigError, DataError
from bertjax.serving.engine import DATA_PARALLEL_MESH, DATA_PARALLEL_RULES, Engine
from bertjax.serving.runs import TrainedModel, load_export, load_workdir
from bertjax.tasks import get_task
from bertjax.tasks.reranking import metrics
from bertjax.tasks.reranking.readers import CandidateList, pair_examples, read_candidates
from bertjax.tasks.reranking.task import activate
from bertjax.train import configs


def checkpoint_config(directory: str, max_seq_length: int, batch_size: int
                      ) -> ml_collections.ConfigDict:
    """The run config a reranking task of a checkpoint directory reads (its activation and
    classifier: the directory's own)."""
    return ml_collections.ConfigDict(dict(
        init_checkpoint=str(directory), max_seq_length=max_seq_length, min_bucket_length=16,
        task=dict(family="reranking", name="rerank", kind="labelled", activation="auto",
                  classifier_pooling="cls", classifier_dropout=None),
        train=dict(group_by_length=False), data=dict(), eval=dict(batch_size=batch_size),
        mesh=dict(DATA_PARALLEL_MESH), logical_axis_rules=DATA_PARALLEL_RULES))


def load_checkpoint(directory: str, max_seq_length: int | None = None, batch_size: int = 64,
                    dtype: str | None = None) -> TrainedModel:
    """A checkpoint directory converted from a CrossEncoder as a reranker: pairs cut to
    `max_seq_length` tokens, else the model's own, at most its positions."""
    if checkpoint_dir.load_classifier(directory) is None:
        head = checkpoint_dir.CLASSIFIER_FILE
        raise CheckpointError(f"{directory}: no cross-encoder head ({head}): convert a "
                              "sentence-transformers CrossEncoder "
                              "(python -m bertjax.convert from_hf), or fine-tune a reranker "
                              "(experiments/reranking.py) and pass its --workdir")
    model_config, params, tokenizer = checkpoint_dir.load_pretrained(
        directory, dtype=configs.compute_dtype(dtype or "auto"))
    max_seq_length = checkpoint_dir.max_seq_length(directory, max_seq_length,
                                                   model_config.max_position_embeddings)
    config = checkpoint_config(directory, max_seq_length, batch_size)
    task = get_task(config)
    return TrainedModel(str(directory), config, task, model_config,
                        task.initial_params(model_config, params), tokenizer, 0)


class Reranker:
    """Scores [n] float32 of (query, passage) pairs, rankings, and files of candidate lists."""

    def __init__(self, trained: TrainedModel, batch_size: int | None = None,
                 devices: Sequence[jax.Device] | None = None):
        if trained.config.task.family != "reranking":
            raise ConfigError(f"{trained.workdir}: a {trained.config.task.family} run does not "
                              "score pairs as a reranker (a reranking run, or a converted "
                              "CrossEncoder with --checkpoint, does)")
        self.trained, self.task = trained, trained.task
        self.engine = Engine(trained, batch_size, devices)

    @classmethod
    def from_workdir(cls, workdir: str, batch_size: int | None = None,
                     dtype: str | None = None, devices=None) -> Reranker:
        return cls(load_workdir(workdir, dtype), batch_size, devices)

    @classmethod
    def from_export(cls, directory: str, batch_size: int | None = None,
                    dtype: str | None = None, devices=None) -> Reranker:
        """From `python -m bertjax.convert to_hf --input=WORKDIR --output=DIR`'s DIR."""
        return cls(load_export(directory, dtype), batch_size, devices)

    @classmethod
    def from_checkpoint(cls, directory: str, max_seq_length: int | None = None,
                        batch_size: int | None = None, dtype: str | None = None,
                        devices=None) -> Reranker:
        return cls(load_checkpoint(directory, max_seq_length, batch_size or 64, dtype),
                   batch_size, devices)

    @property
    def activation(self) -> str:
        """"sigmoid" | "identity": what `score` applies to the logits."""
        return self.task.activation

    def _logits(self, examples: list) -> np.ndarray:
        _, predictions, _ = self.engine.run(examples)
        return np.asarray(predictions["score"], np.float32)

    def logits(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """[len(pairs)] float32: the raw score of each (query, passage)."""
        return self._logits(self.task.examples(list(pairs)))

    def score(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """[len(pairs)] float32, as CrossEncoder.predict: the activation of each logit."""
        return activate(self.logits(pairs), self.activation)

    def rank(self, query: str, passages: Sequence[str], top_k: int | None = None
             ) -> list[dict[str, Any]]:
        """[{"corpus_id": index into passages, "score"}] best first (the top_k of them), as
        CrossEncoder.rank (ordered by the logits: a saturated sigmoid ties nothing)."""
        logits = self.logits([(query, p) for p in passages])
        scores = activate(logits, self.activation)
        order = np.argsort(-logits.astype(np.float64), kind="stable")[:top_k]
        return [{"corpus_id": int(i), "score": float(scores[i])} for i in order]

    def rerank_lists(self, lists: Sequence[CandidateList], top_k: int | None = None
                     ) -> tuple[list[dict[str, Any]], np.ndarray]:
        """(a record per list, {id, candidates: [{id, score}] best first (the top_k of
        them)}, the logits [pairs] of every list's candidates in their input order)."""
        logits = self._logits(pair_examples(lists))
        scores = activate(logits, self.activation)
        records, start = [], 0
        for c, order in zip(lists, metrics.orders(lists, logits)):
            own = scores[start:start + len(c.ids)]
            records.append({"id": c.id, "candidates": [
                {"id": c.ids[i], "score": float(own[i])} for i in order[:top_k]]})
            start += len(c.ids)
        return records, logits

    def rerank_file(self, path: str, top_k: int | None = None,
                    encoding: str = paths.DEFAULT_ENCODING
                    ) -> tuple[list[dict[str, Any]], dict[str, float] | None,
                               dict[str, float] | None]:
        """(records as `rerank_lists`, the metrics of the reranked lists and of their input
        order, or None, None where no line is judged) of a JSONL file of candidate lists
        (bertjax/tasks/reranking/readers.py)."""
        if not paths.exists(path):
            raise DataError(f"{path}: no such file")
        lists = read_candidates(path, encoding)
        records, logits = self.rerank_lists(lists, top_k)
        if not any(c.relevance is not None for c in lists):
            return records, None, None
        return (records, metrics.reranking_metrics(lists, logits),
                metrics.reranking_metrics(lists, metrics.input_order(lists)))

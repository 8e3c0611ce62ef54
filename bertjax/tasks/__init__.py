"""Jobs for the shared training loop (bertjax/train/loop.py), one folder per task family:
  pretraining/     MLM + NSP (and the Table 5 variants): objective, input, job
  classification/  GLUE, SWAG and users' files: readers, task, metrics, leaderboard files
  squad/           SQuAD v1.1 / v2.0: readers, window features, task, post-processing, metrics
  tagging/         CoNLL / JSONL tagging: tag schemes, readers, features, fine-tuned and
                   feature-based taggers, metrics
  embedding/       sentence embeddings: pairs / scored pairs / BEIR readers, contrastive and
                   CoSENT losses, STS and retrieval metrics
  reranking/       cross-encoder rerankers: labelled / listwise / distilled rows and candidate
                   lists, BCE / listwise / MSE / Margin MSE losses, nDCG@10 and MRR@10
Each fine-tuning family is a plug-in of base.py (`Task`: data, features, head, loss,
predictions, metrics, output files); its heads are flax modules in bertjax/models. Importing
never loads TensorFlow (a TFDS reader imports it when called).

A new family is a folder with its `Task`, one line of FAMILIES, a config file and its tests.
`train_and_evaluate(config, workdir)` runs any of them (python -m bertjax.finetune).
"""

import dataclasses
import math
from typing import Any

from bertjax import checkpoint_dir
from bertjax.models import architecture
from bertjax.models.classification import BertForMultipleChoice, BertForSequenceClassification
from bertjax.tasks import checks
from bertjax.tasks.base import FineTuningJob, Splits, Task
from bertjax.tasks.classification.task import SequenceTask, classification_loss, regression_loss
from bertjax.tasks.families import FAMILIES, get_task, task_class  # noqa: F401  (the registry)
from bertjax.train import loop
from bertjax.train import step as step_lib


def train_and_evaluate(config, workdir: str, log=print) -> dict[str, Any]:
    """Fine-tunes (or resumes), evaluates, keeps the best checkpoint, writes test predictions.

    Returns {"status", "best_step", "best": dev metrics of the best checkpoint,
    "primary_metric", "history", "total_steps"}.
    """
    own_max_seq_length(config)
    init = checks.check(config, workdir)  # before the data is read or anything is written
    job = FineTuningJob(get_task(config), config, log=log, init=init)
    return loop.train(job, config, workdir, log=log)


def own_max_seq_length(config) -> None:
    """config.max_seq_length 0 ("auto", the embedding configs' default) becomes the init
    checkpoint's own (a converted sentence-transformers model embeds as it was built to),
    else 128, before anything reads it; the run's config records the number."""
    if config.get("max_seq_length") == 0:  # without a checkpoint, the checks name that
        own = config.get("init_checkpoint") and checkpoint_dir.own_max_seq_length(
            config.init_checkpoint)
        config.max_seq_length = own or checkpoint_dir.DEFAULT_MAX_SEQ_LENGTH


def dry_run_job(config, log=print):
    """The job of `config` for `--dry_run` (its data and checkpoint are read, nothing is
    trained), with the model FLOPs of its stage for MFU: 3 × the encoder's forward pass over
    each sequence it computes (a choice, a text column, or a packed row of its own length)."""
    own_max_seq_length(config)
    init = checks.check(config, None)
    job = FineTuningJob(get_task(config), config, log=log, init=init)
    stage = job.stages[0]
    tokens = stage.batch_spec.get("input_ids")
    # Sequences an example costs: its choices or text columns; packed rows over the examples
    # they hold (the step's batch counts examples where a loss needs them, else rows).
    sequences = 1 if tokens is None else (math.prod(tokens.shape[:-1])
                                          / step_lib.stage_batch(job, stage)[0])
    forward = architecture(job.model_config).forward_flops(
        job.model_config, stage.tokens_per_example, 0, job.task.pooled_only)
    job.stages = [dataclasses.replace(stage, flops_per_example=3.0 * forward * sequences)]
    return job


__all__ = [
    "FAMILIES",
    "dry_run_job",
    "train_and_evaluate",
    "BertForMultipleChoice",
    "BertForSequenceClassification",
    "FineTuningJob",
    "SequenceTask",
    "Splits",
    "Task",
    "classification_loss",
    "get_task",
    "regression_loss",
]

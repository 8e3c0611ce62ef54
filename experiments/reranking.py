r"""Cross-encoder rerankers: a (query, passage) pair scored by one logit, fine-tuned on your own
CSV / TSV / JSONL rows, evaluated by nDCG@10 / MRR@10 of candidate lists.

  python -m bertjax.finetune --config=experiments/reranking.py:labelled \
      --config.init_checkpoint=checkpoints/base --workdir=runs/rerank \
      --config.data.train=pairs.jsonl --config.data.validation=dev_candidates.jsonl
  python -m bertjax.finetune --config=experiments/reranking.py:listwise \
      --config.init_checkpoint=checkpoints/ms-marco-minilm --workdir=runs/rerank_hard \
      --config.data.train=mined.jsonl --config.data.columns=anchor,positive,negative_1,negative_2 \
      --config.data.validation=dev_candidates.jsonl

`arg` = labelled | listwise | distill | margin (bertjax/tasks/reranking/readers.py: the rows):
labelled (query, passage, label) with binary cross-entropy; listwise (query, positive,
negative_1 ..) with the softmax cross-entropy of the positive among its negatives (the rows
`python -m bertjax.predict mine` writes); distill (query, passage, score) with the squared
error to a teacher's score; margin (query, positive, negative, margin) with Margin MSE. The
dev file: one query a line, {"query", "candidates": [{"text", "relevant"}, ...]}. An init
checkpoint converted from a sentence-transformers CrossEncoder starts from its classifier too.
"""

import ml_collections

from experiments.glue import base_config

KINDS = ("labelled", "listwise", "distill", "margin")
# Each kind's text columns and number column (config.data.columns, config.data.label).
COLUMNS = {"labelled": ("query,passage", "label"), "listwise": ("query,positive,negative", ""),
           "distill": ("query,passage", "score"), "margin": ("query,positive,negative", "margin")}


def get_config(arg: str = "labelled") -> ml_collections.ConfigDict:
    if arg not in KINDS:
        raise ValueError(f"experiments/reranking.py: unknown kind {arg!r}; choose one of {KINDS}")
    config = base_config()
    config.task.family, config.task.name, config.task.kind = "reranking", arg, arg
    # activation: what predictions apply to the logit, as CrossEncoder.predict: auto (a
    # converted CrossEncoder's own, else sigmoid) | sigmoid | identity (a distilled model's
    # teacher scores). Training and the dev metrics read the raw logits.
    config.task.activation = "auto"
    config.data.columns, config.data.label = COLUMNS[arg]
    config.eval.at_start = True  # the starting checkpoint's score, for comparison
    # Tokens per pair: 0 is the init checkpoint's own (a converted CrossEncoder's max length),
    # else 128.
    config.max_seq_length = 0
    # Rows a batch; a listwise row is 1 + negatives pairs.
    config.train.batch_size = 8 if arg == "listwise" else 32
    config.train.num_epochs = 1.0
    return config

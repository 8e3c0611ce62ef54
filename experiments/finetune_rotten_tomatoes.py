r"""The demo fine-tuning task: Rotten Tomatoes sentences, binary (score > 0) or regression.

  python -m bertjax.demos.rotten_tomatoes --source=data/vaderSentiment-3.3.2.tar.gz \
      --output_dir=data/rotten_tomatoes                       # once (the Makefile does it)
  python -m bertjax.finetune --config=experiments/finetune_rotten_tomatoes.py:binary \
      --config.init_checkpoint=runs/demo/export --workdir=runs/rotten_tomatoes_binary
  python -m bertjax.finetune --config=experiments/finetune_rotten_tomatoes.py:regression ...
  python -m bertjax.finetune_grid --config=experiments/finetune_rotten_tomatoes.py:binary \
      --config.init_checkpoint=runs/demo/export --workdir=runs/rotten_tomatoes_grid \
      --grid='learning_rate=1e-4,3e-4,1e-3 num_epochs=2,3' --seeds=3

`arg` = binary (dev accuracy, F1, MCC; compare with the majority class, ~51%) | regression
(dev Pearson, Spearman against the mean human score on [-4, 4]). About 8.5k training
sentences. The paper's recipe (batch 32, warmup over 10% of the steps then linear decay,
weight decay 0.01) sized for the tiny demo model on a CPU: no dropout (as it was pre-trained),
two epochs, sequences of 64 tokens (99% of the sentences fit with the demo vocabulary), and the
largest learning rate of the search used for Google's small BERTs (3e-5 ... 3e-4,
google-research/bert README): small, briefly pre-trained models want larger steps than
BERT-base.
"""

import ml_collections

from experiments import finetune_files

DATA = "data/rotten_tomatoes/{split}.jsonl"
KINDS = {"binary": "classification", "regression": "regression"}


def get_config(arg: str = "binary") -> ml_collections.ConfigDict:
    if arg not in KINDS:
        raise ValueError(f"experiments/finetune_rotten_tomatoes.py: unknown kind {arg!r}; "
                         f"choose one of {tuple(KINDS)}")
    config = finetune_files.get_config(KINDS[arg])
    config.task.name = f"rotten_tomatoes_{arg}"
    config.data.train = DATA.format(split="train")
    config.data.validation = DATA.format(split="dev")
    config.data.test = DATA.format(split="test")
    config.data.text_a = "text"
    if arg == "binary":
        config.data.label = "label"
        config.data.labels = "0,1"  # fixed order: id 1 = positive, the class F1 is about
    else:
        config.data.label = "score"
    config.max_seq_length = 64
    config.train.batch_size = 32
    config.train.num_epochs = 2.0
    config.optimizer.learning_rate = 3e-4
    config.eval.batch_size = 128
    config.log_every_steps = 50
    config.model.dtype = "float32"
    # The demo model is pre-trained without dropout (experiments/pretrain_demo.py), and is
    # fine-tuned better without it too (docs/finetuning.md, "The demo's settings").
    config.model.update(hidden_dropout_prob=0.0, attention_dropout_prob=0.0)
    return config

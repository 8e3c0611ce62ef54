r"""Fine-tuning on your own CSV / TSV / JSONL files.

  python -m bertjax.finetune --config=experiments/finetune_files.py:classification \
      --config.init_checkpoint=checkpoints/bert-base-uncased --workdir=runs/reviews \
      --config.data.train=train.csv --config.data.validation=dev.csv --config.data.test=test.csv \
      --config.data.text_a=review --config.data.label=stars
  # regression: a numeric label column; multiple_choice: text_a = the context column,
  # --config.data.choices=a,b,c,d and a label column holding the 0-based right choice.

`arg` = classification | regression | multiple_choice. Labels are inferred from the training
file (sorted distinct values) unless given: --config.data.labels=neg,pos.
"""

import ml_collections

from experiments.glue import base_config

KINDS = ("classification", "regression", "multiple_choice")


def get_config(arg: str = "classification") -> ml_collections.ConfigDict:
    if arg not in KINDS:
        raise ValueError(f"experiments/finetune_files.py: unknown kind {arg!r}; choose one of "
                         f"{KINDS}")
    config = base_config()
    config.task.family, config.task.name, config.task.kind = "files", arg, arg
    config.data.text_a = "text"
    if arg == "multiple_choice":
        config.train.batch_size = 16
    return config

r"""SQuAD fine-tuning with the paper's recipe (Sec. 4.2-4.3, A.3).

  python -m bertjax.finetune --config=experiments/squad.py:v1 --workdir=runs/squad1 \
      --config.init_checkpoint=checkpoints/bert-base-uncased \
      --config.data.train=train-v1.1.json --config.data.validation=dev-v1.1.json
  python -m bertjax.finetune --config=experiments/squad.py:v2 --workdir=runs/squad2 \
      --config.init_checkpoint=checkpoints/bert-large-uncased \
      --config.data.train=tfds:squad/v2.0 --config.data.validation=tfds:squad/v2.0
  python -m bertjax.finetune --config=experiments/squad.py:files ...   # own SQuAD-format files

`arg` = v1 (3 epochs, lr 5e-5, batch 32), v2 (2 epochs, lr 5e-5, batch 48) or files (v1.1
settings; --config.task.version_2=true for files with unanswerable questions). Windows of
max_seq_length 384 tokens, doc_stride 128, questions cut at 64 tokens, answers of at most 30
tokens, 20-best. A TFDS name reads its `train` split for data.train and `validation` otherwise;
`tfds:squad/v2.0[validation]` names the split. v2.0: the no-answer threshold is chosen on dev
(best F1) unless --config.task.null_threshold is given, and applied to the test split.
Outputs in the workdir: predictions.json, nbest_predictions.json, null_odds.json (v2.0) for
dev, `test_`-prefixed ones for data.test.
"""

import ml_collections

from experiments import common
from experiments.glue import base_config

VERSIONS = ("v1", "v2", "files")


def get_config(arg: str = "v1") -> ml_collections.ConfigDict:
    if arg not in VERSIONS:
        raise ValueError(f"experiments/squad.py: unknown variant {arg!r}; choose one of "
                         f"{VERSIONS}")
    config = base_config()
    config.max_seq_length = 384
    config.task = ml_collections.ConfigDict(dict(
        family="squad", name=f"squad_{arg}", kind="extractive_qa", version_2=arg == "v2",
        doc_stride=128, max_query_length=64, n_best_size=20, max_answer_length=30,
        null_threshold=ml_collections.config_dict.placeholder(float),
        num_workers=1,  # > 1: feature conversion in that many forked processes
        **common.modern_head()))
    config.data = ml_collections.ConfigDict(dict(train="", validation="", test="",
                                                 tfds_data_dir="", encoding=common.DATA_ENCODING))
    config.optimizer.learning_rate = 5e-5
    config.train.batch_size = 48 if arg == "v2" else 32
    config.train.num_epochs = 2.0 if arg == "v2" else 3.0
    config.eval.batch_size = 64
    config.log_every_steps = 100
    return config

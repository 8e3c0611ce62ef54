r"""The feature-based approach on CoNLL-2003 (paper Table 7): BERT frozen, features cached, a
two-layer BiLSTM (768 units per direction) and a classifier trained on them.

  python -m bertjax.finetune --config=experiments/ner_feature_based.py:concat_last_four \
      --workdir=runs/fb_concat --config.init_checkpoint=checkpoints/bert-base-cased \
      --config.data.dir=conll2003
  # all six rows of Table 7 and their table (workdir/summary.md), the encoder run once:
  V=embeddings,second_to_last,last,weighted_sum_last_four,concat_last_four,weighted_sum_all
  python -m bertjax.finetune_grid --config=experiments/ner_feature_based.py \
      --workdir=runs/table --seeds=1 --config.feature_based.cache_layers=all \
      --grid="feature_based.variant=$V" \
      --config.init_checkpoint=checkpoints/bert-base-cased --config.data.dir=conll2003

`arg`: embeddings | second_to_last | last | weighted_sum_last_four | concat_last_four |
weighted_sum_all, optionally followed by `,files` for users' data (experiments/ner.py:files
fields). Features are computed once per dataset and encoder, into
config.feature_based.cache_dir (default ~/.cache/bertjax/features), memory-mapped; every
variant and every epoch reads them. The encoder gets no gradient and is not in the trained
state. The LSTM trains with a larger learning rate than fine-tuning (1e-3, Adam).
"""

import ml_collections

from experiments import ner

VARIANTS = ("embeddings", "second_to_last", "last", "weighted_sum_last_four",
            "concat_last_four", "weighted_sum_all")


def get_config(arg: str = "concat_last_four") -> ml_collections.ConfigDict:
    variant, _, data = arg.partition(",")
    if variant not in VARIANTS:
        raise ValueError(f"experiments/ner_feature_based.py: unknown variant {variant!r}; choose "
                         f"one of {VARIANTS}")
    config = ner.get_config(data or "conll2003")
    config.task.family = "feature_based"  # bertjax/tasks/tagging/feature_based.py
    config.feature_based = ml_collections.ConfigDict(dict(
        variant=variant,
        cache_dir="",  # "" = ~/.cache/bertjax/features
        cache_dtype="float16",  # halves the cache; the LSTM computes in float32
        cache_layers="",  # extra layers to cache in the same pass ("all": every layer)
        encode_batch_size=64,
        lstm_units=768, lstm_layers=2))
    config.optimizer.learning_rate = 1e-3
    config.optimizer.weight_decay = 0.0
    config.train.num_epochs = 4.0
    return config

r"""The `make demo` run: a tiny BERT pre-trained on CPU on BBC News articles (two phases).

  make demo        # prepares data/demo/ (corpus, vocabulary, TFRecords), then runs:
  python -m bertjax.pretrain --config=experiments/pretrain_demo.py --workdir=runs/demo

Data paths point at what `python -m bertjax.demo` writes under data/demo/.
"""

from experiments import pretrain


def get_config(arg: str = "tiny"):
    config = pretrain.get_config(arg)
    config.model.vocab_size = 8000  # the demo WordPiece vocabulary (bertjax.demo checks it)
    config.model.dtype = "float32"
    config.vocab = "data/demo/vocab/vocab.txt"
    # Sized to finish in a few minutes on 2 CPU cores.
    config.train.batch_size = 32
    config.train.num_train_steps = 800
    data = "data/demo/pretrain_{split}_{seq}/*.tfrecord"
    config.phases.phase1.update(
        data=data.format(split="train", seq=128), eval_data=data.format(split="eval", seq=128),
        seq_len=128, max_predictions=20, fraction=0.9)
    config.phases.phase2.update(
        data=data.format(split="train", seq=256), eval_data=data.format(split="eval", seq=256),
        seq_len=256, max_predictions=40, fraction=0.1)
    # A tiny model on little data, 800 steps: a larger step than BERT-base's 1e-4, with
    # bias-corrected AdamW. The reference optimizer (no bias correction) takes early steps up
    # to ~3x larger; at 1e-3 it stayed at the unigram solution for the whole demo.
    config.optimizer.name = "adamw"
    config.optimizer.learning_rate = 1e-3
    config.optimizer.warmup_steps = 80
    config.checkpoint.every_steps = 200
    config.eval.every_steps = 400
    config.eval.num_batches = 14  # ~all 468-660 held-out pairs at batch 32
    config.log_every_steps = 50
    return config

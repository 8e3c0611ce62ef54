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
    # Sized to pre-train in ~8 minutes on 2 CPU cores, where learning is limited by the tokens
    # seen, not by the step size (lr 2e-3 ... 6e-3 and 2 or 4 heads gave the same held-out
    # curve): 64-token pairs for phase 1 (twice the steps per second of 128, the same tokens
    # per second), batch 64 (more held-out accuracy per token than 32), then 5% of the steps
    # at 256 tokens so that positions up to 256 are trained.
    config.train.batch_size = 64
    config.train.num_train_steps = 1200
    data = "data/demo/pretrain_{split}_{seq}/*.tfrecord"
    config.phases.phase1.update(
        data=data.format(split="train", seq=64), eval_data=data.format(split="eval", seq=64),
        seq_len=64, max_predictions=10, fraction=0.95)
    config.phases.phase2.update(
        data=data.format(split="train", seq=256), eval_data=data.format(split="eval", seq=256),
        seq_len=256, max_predictions=40, fraction=0.05)
    # A few minutes of training: no dropout (it only slows learning when nothing is seen
    # twice), and the initial weights at 0.06 instead of BERT-base's 0.02 (~0.7/sqrt(128) for
    # the 128-wide model; 0.02 suits 768): attention logits start ~10x larger, so attention
    # patterns form sooner. Bias-corrected AdamW with beta2 0.98 and a large step; the
    # reference optimizer (no bias correction) takes early steps up to ~3x larger.
    config.model.hidden_dropout_prob = 0.0
    config.model.attention_dropout_prob = 0.0
    config.model.initializer_range = 0.06
    config.optimizer.name = "adamw"
    config.optimizer.learning_rate = 3e-3
    config.optimizer.b2 = 0.98
    config.optimizer.warmup_steps = 60
    config.checkpoint.every_steps = 300
    config.eval.every_steps = 300
    config.eval.num_batches = 10  # ~all 600-1200 held-out pairs at batch 64
    config.log_every_steps = 50
    return config

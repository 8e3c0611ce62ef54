r"""The `make demo` run: a tiny BERT pre-trained on CPU on BBC News articles (two phases).

  make demo        # prepares data/demo/ (corpus, vocabulary, TFRecords), then runs:
  python -m bertjax.pretrain --config=experiments/pretrain_demo.py --workdir=runs/demo
  make modern_demo  # the modern recipe beside it (`modern` below, bertjax/demos/modern_demo.py)

Data paths point at what `python -m bertjax.demos.pretraining_demo` writes under data/demo/.
"""

import ml_collections

from experiments import pretrain


def get_config(arg: str = "tiny"):
    if arg == "modern":
        return modern()
    config = pretrain.get_config(arg)
    config.model.dtype = "float32"
    config.vocab = "data/demo/vocab/vocab.txt"
    # Sized to pre-train in minutes on 2 CPU cores, chosen by a sweep of recipes on held-out
    # pairs (docs/pretraining.md, "The demo recipe", has the figures): held-out MLM accuracy
    # jumps once the model starts to use its context, and this recipe brings that jump much
    # earlier.
    #  - 40% of the tokens masked, not 15% (Wettig et al., 2023, "Should You Mask 15% in
    #    Masked Language Modeling?"): more predictions per sequence for little more time.
    #  - FFN width 128 instead of 512: the MLM output layer dominates the step at this size,
    #    and the narrower FFN paid for the extra predictions.
    #  - 64-token pairs for phase 1, batch 64, then 4% of the steps at 256 tokens so that
    #    positions up to 256 are trained (predictions capped at 40 there: a 256-token step
    #    costs several 64-token ones).
    #  - No dropout (it only slows learning when little is seen twice), initial weights at 0.06
    #    instead of BERT-base's 0.02 (~0.7/sqrt(128) for the 128-wide model: attention patterns
    #    form sooner), bias-corrected AdamW, lr 3e-3, b1 0.8, b2 0.98, 200 warmup steps.
    # NSP rises only after the MLM jump, hence the 2,000 steps.
    config.model.intermediate_size = 128
    config.masking.masked_lm_prob = 0.4
    config.train.batch_size = 64
    config.train.num_train_steps = 2000
    data = "data/demo/pretrain_{split}_{seq}/*.tfrecord"
    config.phases.phase1.update(
        data=data.format(split="train", seq=64), eval_data=data.format(split="eval", seq=64),
        seq_len=64, max_predictions=27, fraction=0.96)
    config.phases.phase2.update(
        data=data.format(split="train", seq=256), eval_data=data.format(split="eval", seq=256),
        seq_len=256, max_predictions=40, fraction=0.04)
    config.model.hidden_dropout_prob = 0.0
    config.model.attention_dropout_prob = 0.0
    config.model.initializer_range = 0.06
    config.optimizer.name = "adamw"
    config.optimizer.learning_rate = 3e-3
    config.optimizer.b1 = 0.8
    config.optimizer.b2 = 0.98
    config.optimizer.warmup_steps = 200
    config.checkpoint.every_steps = 300
    config.eval.every_steps = 300
    config.eval.num_batches = 10  # ~all 600-1200 held-out pairs at batch 64
    config.log_every_steps = 50
    return config


def modern():
    """The ModernBERT recipe (experiments/pretrain.py:modern) at the demo's size, on the same
    vocabulary and training documents, for `make modern_demo`'s comparison at equal training
    FLOPs (that script sets the steps): 2 layers x 128 (layer 0 global, layer 1 local with a
    64-token window), the GeGLU 88 wide so the feed-forward has the BERT demo's parameters
    (3·128·88 ≈ 2·128·128); MLM alone at 30% on packed 128-token rows of whole documents
    (positions restart per document), then 4% of the steps at 256 tokens with RoPE theta
    raised from 10,000 to 160,000 and the 1 - sqrt decay; StableAdamW. The demo's own choices
    carry over: its peak 3e-3, 200 warm-up steps, initial weights at 0.06, no dropout. No batch
    warm-up at this scale (batch 64 throughout)."""
    config = pretrain.get_config("modern_tiny")
    config.model.update(dtype="float32", intermediate_size=88, local_attention=64,
                        initializer_range=0.06)
    config.vocab = "data/demo/vocab/vocab.txt"
    config.train.batch_size = 64
    config.train.num_train_steps = 2000
    data = "data/demo/segments_{split}_128/*.tfrecord"
    phase = dict(data=data.format(split="train"), eval_data=data.format(split="eval"),
                 fraction=0.0, remat_policy="", batch_size=0, grad_accum_steps=0,
                 learning_rate=0.0)
    config.phases = ml_collections.ConfigDict(dict(
        phase1=dict(phase, seq_len=128, max_predictions=40, steps=1920,
                    global_rope_theta=10_000.0),
        phase2=dict(phase, seq_len=256, max_predictions=80, steps=80, global_rope_theta=0.0)))
    config.optimizer.learning_rate = 3e-3
    config.optimizer.warmup_steps = 200
    config.optimizer.decay_steps = 80
    config.checkpoint.every_steps = 250
    config.checkpoint.max_to_keep = 20
    config.eval.every_steps = 500
    config.eval.num_batches = 10
    config.log_every_steps = 50
    return config

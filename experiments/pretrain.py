r"""BERT pre-training (Devlin et al., 2018), one preset per model size.

  python -m bertjax.pretrain --config=experiments/pretrain.py:base --workdir=gs://bucket/run
  python -m bertjax.pretrain --config=experiments/pretrain.py:large --dry_run
  python -m bertjax.pretrain --config=experiments/pretrain.py:tiny \
      --config.model.num_layers=4 --config.train.batch_size=32

`arg` names a model preset: tiny, mini, small, medium, base, large; or `large_lamb`, BERT-large
with LAMB at batch 65536 then 32768 (You et al., 2019; see `large_lamb`); or a ModernBERT with
its recipe: modern_base, modern_large (modern_tiny, modern_mini for demos; see `modern`). Every
field below can be overridden with --config.<path>=<value>.
"""

import ml_collections

from bertjax.models import ARCHITECTURES, BertConfig
from experiments import common


def get_config(arg: str = "base") -> ml_collections.ConfigDict:
    if arg == "large_lamb":
        return large_lamb()
    if arg in ARCHITECTURES["modernbert"].presets:
        return modern(arg)
    config = ml_collections.ConfigDict()
    config.preset = arg
    config.seed = 0
    # PRNG of the dropout keys: "threefry2x32" | "rbg" | "unsafe_rbg" (XLA's RngBitGenerator,
    # the TPU's hardware generator; see docs/tpu_aot.md "Levers"). Resumes are bitwise with each.
    config.rng_impl = "threefry2x32"
    # Pre-training objective (the paper's Table 5): "mlm_nsp" (masked LM + next sentence
    # prediction on sentence pairs), "mlm" (No NSP: masked LM on packed single-segment rows),
    # "ltr" (LTR & No NSP: a left-to-right LM on packed rows, causal attention, recorded in
    # the exported model's config so fine-tuning keeps it). "mlm" and "ltr" read unmasked data
    # with metadata (create_segments, or create_pretraining_data --masking=dynamic).
    config.objective = "mlm_nsp"

    # Model: exactly the fields of bertjax.models.BertConfig.
    config.model = BertConfig.from_preset(arg).to_dict()
    # Compute dtype. "auto": bfloat16 on TPU/GPU, float32 on CPU; "bfloat16" is honoured on CPU
    # too (fast where the CPU has AMX or AVX512-BF16 units).
    config.model.dtype = "auto"
    config.model.param_dtype = "float32"

    # Paper recipe: batch 256, 1M steps, 90% of the steps at length 128, then 10% at 512.
    # Phases run in the order of their names.
    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 256  # global, in sequences (a phase may set its own)
    config.train.num_train_steps = 1_000_000
    config.train.grad_accum_steps = 1  # micro-batches per step (batch_size must divide)
    # "bfloat16": gradients summed over data-parallel replicas in bfloat16 (half the bytes of
    # that all-reduce); params and optimizer moments stay float32.
    config.train.grad_reduce_dtype = "float32"
    # True: the optimizer's moments split over the data-parallel replicas, each updating its
    # share of the parameters (gradients reduce-scattered, parameters all-gathered: the bytes
    # of the all-reduce they replace).
    config.train.shard_optimizer_state = False
    config.train.nsp_weight = 1.0  # NSP loss weight of objective "mlm_nsp"
    # Seconds without a batch (a stalled file system) before the run stops with an error.
    config.train.input_timeout_s = 600.0

    # Each phase: TFRecord file pattern (or "synthetic"), held-out data for evaluation,
    # sequence length, max predictions, and its share of the steps (`steps` > 0 overrides it);
    # remat_policy: "" (config.model.remat_policy) or this phase's (none | full | dots), e.g.
    # phase 2 rematerialising where phase 1 need not. batch_size / grad_accum_steps: this
    # phase's global batch and micro-batches (0: config.train's). learning_rate: this phase's
    # peak (0.0: the one schedule as is); the schedule from the phase's start is scaled to be
    # this value where the phase's warm-up ends (optimizer.phase_warmup_steps after its start;
    # optimizer.warmup_steps for the first phase), and decays from there as before.
    # BERT-large's phase 2 at batch 256 fits v5p-8 and v6e-8 as it is, but v5e-8 and v4-8 only
    # with phase2.remat_policy="dots" (docs/tpu_aot.md); `--dry_run --topology` says so.
    config.phases = ml_collections.ConfigDict()
    config.phases.phase1 = dict(data="", eval_data="", seq_len=128, max_predictions=20,
                                fraction=0.9, steps=0, remat_policy="", batch_size=0,
                                grad_accum_steps=0, learning_rate=0.0)
    config.phases.phase2 = dict(data="", eval_data="", seq_len=512, max_predictions=80,
                                fraction=0.1, steps=0, remat_policy="", batch_size=0,
                                grad_accum_steps=0, learning_rate=0.0)
    # Masking inside tf.data with a fresh mask every epoch (for unmasked "pairs" data);
    # static pre-masked TFRecords are read as they are when dynamic is False.
    # mask / same / random: the shares of the chosen words replaced by [MASK], left unchanged
    # and replaced by a random token (Table 8; static data takes them from
    # create_pretraining_data's --mask_prob / --same_prob / --random_prob).
    config.masking = dict(dynamic=True, masked_lm_prob=0.15, whole_word=False, mask=0.8,
                          same=0.1, random=0.1)
    # Packing (no-NSP pre-training, e.g. RoBERTa-style full sentences): several examples per
    # row, attention kept inside each (data_pipeline/packed_input.py). Needs unmasked data with
    # metadata, dynamic masking and train.nsp_weight=0.0 (objectives "mlm" and "ltr" always
    # pack). Blocks of block_size records are
    # packed in parallel (~55,000 rows/s of 128 and ~15,000 of 512 on 2 cores); rows close at a
    # block's end, so larger blocks pad slightly less.
    config.packing = dict(enabled=False, num_open_rows=8, block_size=1024)

    config.optimizer = common.optimizer(1e-4, name="bert_adamw", schedule="reference")
    config.optimizer.warmup_steps = 10_000
    config.optimizer.phase_warmup_steps = 0  # > 0: warm up again at the start of phase 2

    config.checkpoint = common.checkpoint(every_steps=5000)

    config.eval = ml_collections.ConfigDict()
    config.eval.every_steps = 10_000  # on each phase's eval_data, when set
    config.eval.num_batches = 50

    config.log_every_steps = 100
    # A bertjax checkpoint directory (bertjax.load_pretrained) to start from, params only:
    # continued pre-training, or phase 2 from a finished phase-1 export.
    config.init_checkpoint = ""
    # vocab.txt / SentencePiece model of the data (needed by dynamic masking and the export).
    # Its entries are the model's vocab_size: taken when model.vocab_size is left at 30522,
    # else they must agree (bertjax/tasks/pretraining/checks.py: vocab_size), in --dry_run too.
    config.vocab = ""

    config.mesh = common.mesh()
    config.distributed = common.distributed()
    config.profile = common.profile()
    config.logical_axis_rules = common.LOGICAL_AXIS_RULES
    return config


def large_lamb() -> ml_collections.ConfigDict:
    """BERT-large with LAMB after You et al. (2019), "Large Batch Optimization for Deep
    Learning: Training BERT in 76 minutes": 8,599 steps in all (their Table 1, batch 64k/32k),
    7,038 at length 128 and batch 65536 (config.train.batch_size, phase 1's default), then
    1,561 at length 512 and batch 32768 (phases.phase2.batch_size).

    The published LAMB recipe for these batch sizes (NVIDIA's BERT pre-training scripts):
    phase 1 peaks at 6e-3 after 2,000 warm-up steps (28.43% of its steps), then decays
    linearly (the one schedule's decay, toward 0 at the last step); phase 2 has its own peak
    of 4e-3 (phases.phase2.learning_rate), reached after a 200-step re-warm-up (12.8% of its
    steps, optimizer.phase_warmup_steps), then decays linearly to 0 at its last step. Pick
    grad_accum_steps for the slice, per phase where they differ (phases.<name>.
    grad_accum_steps; --dry_run --topology reports what fits).
    """
    config = get_config("large")
    config.preset = "large_lamb"
    config.train.batch_size = 65536
    config.train.num_train_steps = 7038 + 1561
    config.phases.phase1.steps = 7038
    config.phases.phase2.steps = 1561
    config.phases.phase2.batch_size = 32768
    config.phases.phase2.learning_rate = 4e-3
    config.optimizer = common.optimizer(6e-3, name="lamb", schedule="from_peak")
    config.optimizer.warmup_steps = 2000
    config.optimizer.phase_warmup_steps = 200
    config.checkpoint = common.checkpoint(every_steps=500)
    config.eval.every_steps = 1000
    config.log_every_steps = 10
    return config


# ModernBERT's pre-training (Warner et al., 2024), in tokens: a batch warm-up from 768 to 4,608
# sequences of 1,024 tokens over the first 50B tokens, 1.7T tokens at 1,024 in all, then a
# context extension to 8,192 tokens for 250B (global RoPE theta 10,000 → 160,000, peak lowered
# to 3e-4) and a decay over 50B more. Steps = tokens / (batch x length).
_MODERN_TOKENS_PER_STEP = 4608 * 1024
_MODERN_BATCH_WARMUP = ((768, 50e9 / 3), (1536, 50e9 / 3), (3072, 50e9 / 3))


def modern(arg: str = "modern_base") -> ml_collections.ConfigDict:
    """A ModernBERT (bertjax/models/modernbert/modules.py) pre-trained with its published recipe:

    - MLM only (objective "mlm": no NSP) on packed rows of whole documents, 30% of the tokens
      masked (80/10/10), predicted only at the masked positions;
    - StableAdamW (AdamW with per-tensor update clipping; no global-norm clipping), betas
      (0.9, 0.98), eps 1e-6, weight decay 1e-5 not on norms or biases;
    - a warmup-stable-decay schedule: linear warm-up over 3B tokens, constant peak (8e-4 for
      base, 5e-4 for large), a 1 - sqrt decay to 0 over the last phase;
    - batch-size warm-up as phases of growing batch (phase1a..c), then phase1d at 4,608 x
      1,024; phase2 extends the context to 8,192 tokens with the global layers' RoPE theta at
      160,000 (config.model.global_rope_theta, what the exported model keeps; phase 1 runs at
      10,000) and the peak at 3e-4; phase3 decays at 8,192.
    Every phase resumes bitwise like BERT's. Data: unmasked documents with metadata
    (python -m data_pipeline.create_segments at each phase's length) and config.vocab, e.g. a
    BPE tokenizer.json (python -m bertjax.tokenization train --model_type=bpe).
    """
    config = get_config("base")
    config.preset = arg
    config.objective = "mlm"
    config.model = ARCHITECTURES["modernbert"].config_class.from_preset(arg).to_dict()
    config.model.dtype = "auto"
    config.model.param_dtype = "float32"
    config.model.attention_impl = "auto"
    config.masking.masked_lm_prob = 0.3
    config.packing.enabled = True
    config.train.nsp_weight = 0.0
    config.train.batch_size = 4608
    large = arg == "modern_large"
    peak, context_peak = (5e-4, 3e-4) if large else (8e-4, 3e-4)
    warmup_tokens = 2e9 if large else 3e9

    def phase(seq_len, steps, batch_size=0, learning_rate=0.0, global_rope_theta=0.0):
        # 30% of the row masked: max_predictions rounded up to a multiple of 8.
        predictions = -(-int(0.3 * seq_len + 1) // 8) * 8
        return dict(data="", eval_data="", seq_len=seq_len, max_predictions=predictions,
                    fraction=0.0, steps=int(steps), remat_policy="", batch_size=batch_size,
                    grad_accum_steps=0, learning_rate=learning_rate,
                    global_rope_theta=global_rope_theta)

    short_theta = 10_000.0
    config.phases = ml_collections.ConfigDict()
    warmup_total = 0.0
    for name, (batch, tokens) in zip("abc", _MODERN_BATCH_WARMUP):
        config.phases[f"phase1{name}"] = phase(1024, round(tokens / (batch * 1024)), batch,
                                               global_rope_theta=short_theta)
        warmup_total += tokens
    config.phases.phase1d = phase(1024, round((1.7e12 - warmup_total) / _MODERN_TOKENS_PER_STEP),
                                  global_rope_theta=short_theta)
    long_batch = _MODERN_TOKENS_PER_STEP // 8192  # 576 rows of 8,192: the same tokens a step
    config.phases.phase2 = phase(8192, round(250e9 / _MODERN_TOKENS_PER_STEP), long_batch,
                                 learning_rate=context_peak)
    config.phases.phase3 = phase(8192, round(50e9 / _MODERN_TOKENS_PER_STEP), long_batch,
                                 learning_rate=context_peak)
    config.train.num_train_steps = sum(p.steps for p in config.phases.values())

    config.optimizer = common.optimizer(peak, name="stable_adamw", schedule="wsd")
    config.optimizer.update(b1=0.9, b2=0.98, eps=1e-6, weight_decay=1e-5, clip_norm=0.0)
    config.optimizer.warmup_steps = round(warmup_tokens / (768 * 1024))
    config.optimizer.decay_steps = config.phases.phase3.steps
    config.optimizer.decay_shape = "1-sqrt"
    config.checkpoint = common.checkpoint(every_steps=2000)
    config.eval.every_steps = 10_000
    config.log_every_steps = 100
    return config

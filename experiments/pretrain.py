r"""BERT pre-training (Devlin et al., 2018), one preset per model size.

  python -m bertjax.pretrain --config=experiments/pretrain.py:base --workdir=gs://bucket/run
  python -m bertjax.pretrain --config=experiments/pretrain.py:large --dry_run
  python -m bertjax.pretrain --config=experiments/pretrain.py:tiny \
      --config.model.num_layers=4 --config.train.batch_size=32

`arg` names a model preset: tiny, mini, small, medium, base, large; or `large_lamb`, BERT-large
with LAMB at batch 65536 then 32768 (You et al., 2019; see `large_lamb`). Every field below can be
overridden with --config.<path>=<value>.
"""

import ml_collections

from bertjax.models.config import BertConfig
from experiments import common


def get_config(arg: str = "base") -> ml_collections.ConfigDict:
    if arg == "large_lamb":
        return large_lamb()
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

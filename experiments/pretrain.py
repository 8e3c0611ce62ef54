r"""BERT pre-training (Devlin et al., 2018), one preset per model size.

  python -m bertjax.pretrain --config=experiments/pretrain.py:base --workdir=gs://bucket/run
  python -m bertjax.pretrain --config=experiments/pretrain.py:large --dry_run
  python -m bertjax.pretrain --config=experiments/pretrain.py:tiny \
      --config.model.num_layers=4 --config.train.batch_size=32

`arg` names a model preset: tiny, mini, small, medium, base, large. Every field below can be
overridden with --config.<path>=<value>.
"""

import ml_collections

from bertjax.models.config import BertConfig


def get_config(arg: str = "base") -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.preset = arg
    config.seed = 0

    # Model: exactly the fields of bertjax.models.BertConfig.
    config.model = BertConfig.from_preset(arg).to_dict()
    config.model.dtype = "bfloat16"  # compute dtype on TPU/GPU; the trainer uses float32 on CPU
    config.model.param_dtype = "float32"

    # Paper recipe: batch 256, 1M steps, 90% of the steps at length 128, then 10% at 512.
    # Phases run in the order of their names.
    config.train = ml_collections.ConfigDict()
    config.train.batch_size = 256  # global, in sequences
    config.train.num_train_steps = 1_000_000
    config.train.grad_accum_steps = 1  # micro-batches per step (batch_size must divide)
    config.train.nsp_weight = 1.0  # 0.0 = the "No NSP" ablation

    config.phases = ml_collections.ConfigDict()
    config.phases.phase1 = dict(data="", seq_len=128, max_predictions=20, fraction=0.9)
    config.phases.phase2 = dict(data="", seq_len=512, max_predictions=80, fraction=0.1)

    # The reference optimizer: Adam without bias correction, decoupled weight decay 0.01 not on
    # LayerNorm or biases, global-norm clipping 1.0, warmup then linear decay counted from step 0.
    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.name = "bert_adamw"  # bert_adamw | adamw | lamb
    config.optimizer.learning_rate = 1e-4
    config.optimizer.warmup_steps = 10_000
    config.optimizer.schedule = "reference"  # reference (decay from step 0) | from_peak
    config.optimizer.weight_decay = 0.01
    config.optimizer.b1 = 0.9
    config.optimizer.b2 = 0.999
    config.optimizer.eps = 1e-6
    config.optimizer.clip_norm = 1.0

    # Device mesh: data / fsdp / tensor; -1 fills the remaining devices.
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    # Logical axis name → mesh axis (or axes, or None for replicated).
    config.logical_axis_rules = (
        ("batch", ("data", "fsdp")),
        ("vocab", "tensor"),
        ("embed", "fsdp"),
        ("mlp", "tensor"),
        ("heads", "tensor"),
        ("kv", None),
        ("length", None),
        ("layers", None),
        ("classes", None),
    )
    return config

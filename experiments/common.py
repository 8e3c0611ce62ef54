"""Defaults every job shares (pre-training and fine-tuning): the device mesh, the logical-axis
rules, the reference optimizer and checkpointing. Configs start from these and override."""

import ml_collections


def mesh() -> ml_collections.ConfigDict:
    """Device mesh: data / fsdp / tensor; -1 fills the remaining devices."""
    return ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))


# Logical axis name → mesh axis (or axes, or None for replicated).
LOGICAL_AXIS_RULES = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", None),
    ("length", None),
    ("layers", None),
    ("classes", None),
    # Output axis of the square pooler / MLM-transform matrices. Kept replicated: sharding it
    # over `tensor` made XLA mis-compile the MLM backward pass on a 2x2x2 mesh (CPU, jax
    # 0.10.2; tests/test_trainer.py checks every mesh against one device).
    ("embed_out", None),
)


def optimizer(learning_rate: float) -> ml_collections.ConfigDict:
    """The reference optimizer: Adam without bias correction, decoupled weight decay 0.01 not
    on LayerNorm or biases, global-norm clipping 1.0, warmup then linear decay counted from
    step 0 (schedule "reference"; "from_peak" decays from the end of warmup)."""
    return ml_collections.ConfigDict(dict(
        name="bert_adamw",  # bert_adamw | adamw | lamb
        learning_rate=learning_rate, schedule="reference", weight_decay=0.01, b1=0.9,
        b2=0.999, eps=1e-6, clip_norm=1.0))


def checkpoint(every_steps: int, max_to_keep: int = 3) -> ml_collections.ConfigDict:
    """Checkpoints under workdir/checkpoints: every `every_steps` steps and at the end; the
    last `max_to_keep` are kept (plus the best by dev metric when a job evaluates one)."""
    return ml_collections.ConfigDict(dict(every_steps=every_steps, max_to_keep=max_to_keep,
                                          async_save=True))

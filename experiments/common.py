"""Defaults every job shares (pre-training and fine-tuning): the device mesh, the logical-axis
rules, the optimizer and checkpointing. Configs start from these and override."""

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
    # 0.10.2; tests/train/test_trainer.py checks every mesh against one device).
    ("embed_out", None),
)


def optimizer(learning_rate: float, name: str, schedule: str) -> ml_collections.ConfigDict:
    """Decoupled weight decay 0.01 not on LayerNorm or biases, global-norm clipping 1.0, linear
    warmup then linear decay to 0.

    name: "bert_adamw" (the original reference's Adam WITHOUT bias correction), "adamw"
      (bias-corrected, as torch/transformers and optax) or "lamb". schedule: "reference" (the
      decay is counted from step 0) or "from_peak" (from the end of warmup, as transformers'
      linear schedule). Pre-training keeps the paper's pair; fine-tuning uses adamw/from_peak,
      because over a few hundred steps the uncorrected second moment inflates the step size
      (~3x at step 100) and settings ported from other frameworks assume bias correction.
    """
    return ml_collections.ConfigDict(dict(
        name=name, learning_rate=learning_rate, schedule=schedule, weight_decay=0.01, b1=0.9,
        b2=0.999, eps=1e-6, clip_norm=1.0))


def modern_head() -> dict:
    """config.task fields of a ModernBERT's task head (a BERT's reads neither; setting them
    for one is an error): classifier_pooling "cls" (first token) | "mean" (masked mean), as
    transformers' ModernBertConfig; classifier_dropout None = the encoder's hidden dropout."""
    return dict(classifier_pooling="cls",
                classifier_dropout=ml_collections.config_dict.placeholder(float))


def checkpoint(every_steps: int, max_to_keep: int = 3, every_minutes: float = 15.0
               ) -> ml_collections.ConfigDict:
    """Checkpoints under workdir/checkpoints: every `every_steps` steps and at the end; the
    last `max_to_keep` are kept (plus the best by dev metric when a job evaluates one).
    every_minutes: also once this long has passed since the last save (0: never), so a slow
    run (a laptop, 5,000 steps apart) loses at most that much to a crash; such a checkpoint is
    kept only until the next save. An async save costs seconds, 15 minutes of steps far more.
    timeout_s: the longest an asynchronous save may take (orbax's barrier after the writes);
    where one process's writes fail, the others learn it after this long."""
    return ml_collections.ConfigDict(dict(every_steps=every_steps, max_to_keep=max_to_keep,
                                          every_minutes=float(every_minutes), async_save=True,
                                          timeout_s=1200))


def distributed() -> ml_collections.ConfigDict:
    """Multi-process runs (one process per host). timeout_s: how long a process may send no
    heartbeat (its host died, its process was killed) before every other one ends with one
    line naming it (JAX's own heartbeat timeout, the fallback, is twice that), and how long a
    finishing process waits for the others."""
    return ml_collections.ConfigDict(dict(timeout_s=300))


# config.data.encoding of every fine-tuning config: the text encoding of the users' data files
# (CSV / TSV / JSONL / CoNLL / SQuAD JSON), e.g. latin-1 or cp1252 for files saved by older
# tools; "utf-8" also reads a file that starts with a BOM.
DATA_ENCODING = "utf-8"


def profile() -> ml_collections.ConfigDict:
    """steps: "START,END" traces steps START..END (as the logs number them) with the JAX
    profiler into workdir/profile, for TensorBoard's profile plugin; "" (default): no trace."""
    return ml_collections.ConfigDict(dict(steps=""))

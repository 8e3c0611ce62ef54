"""The checks every job shares, made once before any step, export or file write: the config's
ranges, the optimizer, the workdir, an init checkpoint. Each job adds its own where it lives
(bertjax/tasks/pretraining/checks.py, bertjax/tasks/checks.py).

Every check raises ConfigError / DataError / CheckpointError naming the field, file or flag,
so that a mistake costs seconds, not a phase of training.
"""

from __future__ import annotations

import os

from bertjax import models, paths
from bertjax.checkpoint_dir import check_sizes, load_config, vocab_path
from bertjax.errors import CheckpointError, ConfigError, DataError
from bertjax.train import optimizer, profiling
from bertjax.train import step as step_lib

# ------------------------------------------------------------------------------ config ranges


def number(config, path: str):
    """The value at dotted `path` of a ConfigDict (None when absent)."""
    value = config
    for key in path.split("."):
        if value is None or key not in value:
            return None
        value = value[key]
    return value


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_ranges(config, ints_min: dict[str, int], positive: tuple[str, ...] = (),
                 fractions: tuple[str, ...] = ()) -> None:
    """ints_min: `config.<path>` must be an integer >= the minimum; positive: a number > 0;
    fractions: in (0, 1]. Absent fields are not checked (jobs differ)."""
    for path, low in ints_min.items():
        value = number(config, path)
        if value is not None and (not is_int(value) or value < low):
            raise ConfigError(f"config.{path}={value!r} must be an integer >= {low}")
    for path in positive:
        value = number(config, path)
        if value is not None and not (isinstance(value, (int, float)) and value > 0):
            raise ConfigError(f"config.{path}={value!r} must be positive")
    for path in fractions:
        value = number(config, path)
        if value is not None and not (isinstance(value, (int, float)) and 0 < value <= 1):
            raise ConfigError(f"config.{path}={value!r} must be in (0, 1]")


def model_config(fields):
    """BertConfig or ModernConfig of config.model fields (bertjax.models.model_config): it
    checks every model field. dtype "auto" is checked as float32: resolving it queries the JAX
    backend, which must wait for jax.distributed.initialize()."""
    fields = dict(fields)
    if fields.get("dtype") == "auto":
        fields["dtype"] = "float32"
    return models.model_config(fields)


def check_common(config) -> None:
    """What every job shares: batch, optimizer, checkpoints, logging."""
    check_ranges(
        config,
        {"train.batch_size": 1, "train.grad_accum_steps": 1, "eval.batch_size": 1,
         "checkpoint.every_steps": 1, "checkpoint.max_to_keep": 1, "log_every_steps": 1,
         "eval.every_steps": 0, "eval.num_batches": 1, "optimizer.warmup_steps": 0,
         "optimizer.phase_warmup_steps": 0},
        positive=("optimizer.learning_rate", "optimizer.eps"),
    )
    batch, accum = number(config, "train.batch_size"), number(config, "train.grad_accum_steps")
    if batch and accum and batch % accum:
        raise ConfigError(f"config.train.batch_size={batch} is not divisible by "
                          f"config.train.grad_accum_steps={accum}")
    for path in ("optimizer.weight_decay", "optimizer.clip_norm"):
        value = number(config, path)
        if value is not None and not (isinstance(value, (int, float)) and value >= 0):
            raise ConfigError(f"config.{path}={value!r} must be >= 0")
    for path in ("optimizer.b1", "optimizer.b2"):
        value = number(config, path)
        if value is not None and not (isinstance(value, (int, float)) and 0 <= value < 1):
            raise ConfigError(f"config.{path}={value!r} must be in [0, 1)")
    profiling.steps_of(config)
    reduce_dtype = number(config, "train.grad_reduce_dtype")
    if reduce_dtype is not None and reduce_dtype not in step_lib.GRAD_REDUCE_DTYPES:
        raise ConfigError(f"config.train.grad_reduce_dtype={reduce_dtype!r} is not one of "
                          f"{step_lib.GRAD_REDUCE_DTYPES}")
    name = number(config, "optimizer.name")
    if name is not None and name not in optimizer.OPTIMIZERS:
        raise ConfigError(f"config.optimizer.name={name!r} is not one of "
                          f"{optimizer.OPTIMIZERS}")


# ------------------------------------------------------------------------------ files


def check_workdir(workdir: str, flag: str = "--workdir") -> None:
    """The workdir is a writable directory, or can be made one (its nearest existing parent
    is a writable directory). Remote paths (gs://) are left to the run."""
    if "://" in workdir:
        return
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"{flag}={workdir} is a file, not a directory")
    existing = os.path.abspath(workdir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{flag}={workdir}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag}={workdir}: {existing} is not writable")


def check_init_checkpoint(directory: str, model=None, field: str = "config.init_checkpoint"):
    """A readable bertjax checkpoint directory (its config.json read once) whose sizes match
    `model` (when given); its BertConfig."""
    if not paths.exists(directory):
        raise CheckpointError(f"{field}={directory}: no such directory")
    try:
        loaded = load_config(directory)
    except (CheckpointError, ConfigError) as e:
        raise CheckpointError(f"{field}: {e}") from None
    if model is not None:
        check_sizes(loaded, model, f"{field}={directory}")
    return loaded


def checkpoint_tokenizer(directory: str, loaded, field: str = "config.init_checkpoint"):
    """The checkpoint's own tokenizer (the fine-tuning one, read here once for the job), which
    must fit its word embeddings: fewer entries than rows is what bertjax.load_pretrained
    accepts (ids index the rows), more would index past them. Checked here so the job stops
    before its data is read. None without a single vocabulary there (load_pretrained names
    what it lacks)."""
    from bertjax.tokenization import load_tokenizer

    try:
        vocab_path(directory)
    except CheckpointError:
        return None
    try:
        tokenizer = load_tokenizer(directory)
    except DataError as e:  # VocabError: the message names the file
        raise CheckpointError(f"{field}: {e}") from None
    if tokenizer.vocab_size > loaded.vocab_size:
        raise CheckpointError(f"{field}={directory}: its vocabulary {vocab_path(directory)} "
                              f"has {tokenizer.vocab_size} entries but the model has "
                              f"{loaded.vocab_size} word-embedding rows (model.vocab_size)")
    return tokenizer



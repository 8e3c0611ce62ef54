"""What a fine-tuning run checks before its data is read or anything is written, beside the
checks every job shares (bertjax/validate.py): its ranges, the data encoding, and the init
checkpoint (its config.json read once): readable, its sizes not overridden, its vocabulary
within its embeddings, its positions covering config.max_seq_length. Each family's data files
are read, and named in any error, by its Task.read."""

from __future__ import annotations

from bertjax import paths
from bertjax.checkpoint_dir import check_sizes
from bertjax.errors import ConfigError
from bertjax.validate import (
    check_checkpoint_vocab,
    check_common,
    check_init_checkpoint,
    check_ranges,
    check_workdir,
    model_config,
    number,
)


def check(config, workdir: str | None) -> None:
    """Raises ConfigError / CheckpointError naming the field (workdir None: a dry run)."""
    check_common(config)
    check_ranges(config, {"max_seq_length": 3, "seed": 0, "min_bucket_length": 1},
                 positive=("train.num_epochs",))
    warmup = number(config, "optimizer.warmup_proportion")
    if warmup is not None and not (isinstance(warmup, (int, float)) and 0 <= warmup <= 1):
        raise ConfigError(f"config.optimizer.warmup_proportion={warmup!r} must be in [0, 1]")
    if "encoding" in (config.get("data") or {}):
        paths.check_encoding(config.data.encoding, "config.data.encoding")
    if workdir is not None:
        check_workdir(workdir)
    if not config.get("init_checkpoint"):
        raise ConfigError("config.init_checkpoint is empty; give a bertjax checkpoint directory")
    loaded = check_init_checkpoint(config.init_checkpoint)
    model = model_config({**loaded.to_dict(), **dict(config.get("model") or {})})
    # The checkpoint fixes the sizes (its params and its vocabulary): an override of one
    # would fail on the params' shapes after the data is read.
    check_sizes(loaded, model, f"config.init_checkpoint={config.init_checkpoint}")
    check_checkpoint_vocab(config.init_checkpoint, loaded)
    if config.max_seq_length > model.max_position_embeddings:
        raise ConfigError(f"config.max_seq_length={config.max_seq_length} exceeds the model's "
                          f"{model.max_position_embeddings} positions "
                          f"({config.init_checkpoint})")

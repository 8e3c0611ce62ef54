"""What a fine-tuning run checks before its data is read or anything is written, beside the
checks every job shares (bertjax/validate.py): its ranges, the data encoding, and the init
checkpoint (its config.json read once): readable, its sizes not overridden, its vocabulary
within its embeddings, its positions covering config.max_seq_length; the head options
(config.task.classifier_pooling / classifier_dropout / bilstm_units) its architecture takes;
config.data.pack for the tasks that pack (classification, regression, token tagging, embedding
pairs and scored pairs).
Each family's data files are read, and named in any error, by its Task.read."""

from __future__ import annotations

from bertjax import paths
from bertjax.checkpoint_dir import check_sizes
from bertjax.errors import ConfigError
from bertjax.models import heads
from bertjax.tasks.base import InitCheckpoint, model_overrides
from bertjax.tasks.families import FAMILIES, task_class
from bertjax.validate import (
    check_common,
    check_init_checkpoint,
    check_ranges,
    check_workdir,
    checkpoint_tokenizer,
    model_config,
    number,
)


def check(config, workdir: str | None) -> InitCheckpoint:
    """Raises ConfigError / CheckpointError naming the field (workdir None: a dry run).
    Returns the init checkpoint's config and tokenizer as read here, for the job."""
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
    model = model_config({**loaded.to_dict(),
                          **model_overrides(config.get("model"), loaded)})
    # The checkpoint fixes the sizes (its params and its vocabulary): an override of one
    # would fail on the params' shapes after the data is read.
    check_sizes(loaded, model, f"config.init_checkpoint={config.init_checkpoint}")
    tokenizer = checkpoint_tokenizer(config.init_checkpoint, loaded)
    if config.max_seq_length > model.max_position_embeddings:
        raise ConfigError(f"config.max_seq_length={config.max_seq_length} exceeds the model's "
                          f"{model.max_position_embeddings} positions "
                          f"({config.init_checkpoint})")
    check_head(config, model)
    check_packing(config, model)
    return InitCheckpoint(loaded, tokenizer)




def check_packing(config, model) -> None:
    """config.data.pack for a task and model whose head reads each example of a packed row
    apart (the Task class's `packed_kinds`: a pooled vector per example, or a score per
    token), and whose other settings its packing takes (`packing_refusal`)."""
    if not (config.get("data") or {}).get("pack", False):
        return
    task = config.get("task") or {}
    family, kind = task.get("family"), task.get("kind") or ""
    cls = task_class(family)
    if kind not in cls.packed_kinds:
        what = f"config.task.family={family!r}" + (f", kind={kind!r}" if kind else "")
    elif int(task.get("bilstm_units") or 0):
        # Its recurrence would run from one packed example into the next.
        what = "the + BiLSTM head (config.task.bilstm_units)"
    elif cls.pools_one_token and getattr(model, "causal", False):
        what = "a causal (left-to-right) BERT"  # its pooled token is the last one
    else:
        what = cls.packing_refusal(config, model)
    if what:
        kinds = sorted({k for name in FAMILIES for k in task_class(name).packed_kinds})
        raise ConfigError(f"config.data.pack=True packs config.task.kind {', '.join(kinds)} "
                          f"only; {what} is not packed yet: set config.data.pack=False")


def check_head(config, model) -> None:
    """config.task's head options for the model's architecture (bertjax/models/heads.py)."""
    task = config.get("task") or {}
    dropout = task.get("classifier_dropout")
    if dropout is not None and not (isinstance(dropout, (int, float))
                                    and not isinstance(dropout, bool) and 0 <= dropout < 1):
        raise ConfigError(f"config.task.classifier_dropout={dropout!r} must be in [0, 1) "
                          "(or None: the encoder's hidden dropout)")
    heads.check_head_options(model, task.get("classifier_pooling") or "cls",
                             int(task.get("bilstm_units") or 0))

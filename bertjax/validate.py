"""One pass over a job before any step, export or file write: the config's ranges, every
phase's data (files exist and are not empty, their metadata agrees with the config, the first
record has the expected features), the vocabulary, the init checkpoint and the workdir.

Every check raises ConfigError / DataError / CheckpointError naming the field, file or flag,
so that a mistake costs seconds, not a phase of training (a bad phase-2 pattern, a vocab that
is missing at export, a model vocab smaller than the data's ids: "loss is nan at step N").

  validate.pretraining(config, workdir)   python -m bertjax.pretrain
  validate.finetuning(config, workdir)    python -m bertjax.finetune / finetune_grid
  validate.vocab_size(config, given)      config.model.vocab_size from config.vocab
"""

from __future__ import annotations

import os

from bertjax import paths
from bertjax.errors import CheckpointError, ConfigError, DataError

# ------------------------------------------------------------------------------ config ranges


def _number(config, path: str):
    """The value at dotted `path` of a ConfigDict (None when absent)."""
    value = config
    for key in path.split("."):
        if value is None or key not in value:
            return None
        value = value[key]
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_ranges(config, ints_min: dict[str, int], positive: tuple[str, ...] = (),
                 fractions: tuple[str, ...] = ()) -> None:
    """ints_min: `config.<path>` must be an integer >= the minimum; positive: a number > 0;
    fractions: in (0, 1]. Absent fields are not checked (jobs differ)."""
    for path, low in ints_min.items():
        value = _number(config, path)
        if value is not None and (not _is_int(value) or value < low):
            raise ConfigError(f"config.{path}={value!r} must be an integer >= {low}")
    for path in positive:
        value = _number(config, path)
        if value is not None and not (isinstance(value, (int, float)) and value > 0):
            raise ConfigError(f"config.{path}={value!r} must be positive")
    for path in fractions:
        value = _number(config, path)
        if value is not None and not (isinstance(value, (int, float)) and 0 < value <= 1):
            raise ConfigError(f"config.{path}={value!r} must be in (0, 1]")


def model_config(fields):
    """BertConfig of config.model fields: it checks every model field. dtype "auto" is checked
    as float32: resolving it queries the JAX backend, which must wait for
    jax.distributed.initialize()."""
    from bertjax.models import BertConfig

    fields = dict(fields)
    if fields.get("dtype") == "auto":
        fields["dtype"] = "float32"
    return BertConfig.from_dict(fields)


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
    batch, accum = _number(config, "train.batch_size"), _number(config, "train.grad_accum_steps")
    if batch and accum and batch % accum:
        raise ConfigError(f"config.train.batch_size={batch} is not divisible by "
                          f"config.train.grad_accum_steps={accum}")
    for path in ("optimizer.weight_decay", "optimizer.clip_norm"):
        value = _number(config, path)
        if value is not None and not (isinstance(value, (int, float)) and value >= 0):
            raise ConfigError(f"config.{path}={value!r} must be >= 0")
    for path in ("optimizer.b1", "optimizer.b2"):
        value = _number(config, path)
        if value is not None and not (isinstance(value, (int, float)) and 0 <= value < 1):
            raise ConfigError(f"config.{path}={value!r} must be in [0, 1)")
    from bertjax.train import profiling
    from bertjax.train import step as step_lib

    profiling.steps_of(config)
    reduce_dtype = _number(config, "train.grad_reduce_dtype")
    if reduce_dtype is not None and reduce_dtype not in step_lib.GRAD_REDUCE_DTYPES:
        raise ConfigError(f"config.train.grad_reduce_dtype={reduce_dtype!r} is not one of "
                          f"{step_lib.GRAD_REDUCE_DTYPES}")
    name = _number(config, "optimizer.name")
    if name is not None and name not in ("bert_adamw", "adamw", "lamb"):
        raise ConfigError(f"config.optimizer.name={name!r} is not one of "
                          "('bert_adamw', 'adamw', 'lamb')")


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


def load_vocab(path: str, field: str = "config.vocab"):
    """The tokenizer of `path` (a vocab.txt, SentencePiece model or tokenizer directory)."""
    if not paths.exists(path):
        raise ConfigError(f"{field}={path}: no such vocabulary file or directory")
    from bertjax.tokenization import load_tokenizer

    try:
        return load_tokenizer(path)
    except DataError as e:  # VocabError: the message names the file
        raise ConfigError(f"{field}: {e}") from None


def vocab_entries(path: str, field: str = "config.vocab") -> int:
    """Entries of the vocabulary at `path`: the rows the model's word embeddings must have.
    For every vocabulary the tokenizer accepts (no empty or duplicate entry) this is the
    export's count (checkpoint_dir.count_vocab), read as the run reads it (gs:// too)."""
    return load_vocab(path, field).vocab_size


def vocab_size(config, given: bool = False) -> int | None:
    """config.model.vocab_size against config.vocab, before anything is compiled: the export
    needs one word-embedding row per entry, so any other size trains a model that can never
    be saved (nor resumed with the right size). Not `given` (on the command line) and still
    the presets' size: set to the vocabulary's entries, which are returned; otherwise they
    must be equal. Without config.vocab: nothing to check (None)."""
    path = config.get("vocab")
    if not path:
        return None
    from bertjax.models.config import BertConfig

    entries = vocab_entries(path)
    size = config.model.get("vocab_size")
    if size == entries:
        return None
    if not given and size == BertConfig.vocab_size:  # the presets' size: left as it came
        config.model.vocab_size = entries
        return entries
    raise ConfigError(f"config.vocab={path} has {entries} entries but config.model.vocab_size="
                      f"{size} (the exported model needs one embedding row per entry); pass "
                      f"--config.model.vocab_size={entries} or leave it out")


SIZE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
               "max_position_embeddings", "type_vocab_size")


def check_init_checkpoint(directory: str, model=None, field: str = "config.init_checkpoint"):
    """A readable bertjax checkpoint directory whose sizes match `model` (when given)."""
    from bertjax.checkpoint_dir import load_config

    if not paths.exists(directory):
        raise CheckpointError(f"{field}={directory}: no such directory")
    try:
        loaded = load_config(directory)
    except (CheckpointError, ConfigError) as e:
        raise CheckpointError(f"{field}: {e}") from None
    if model is not None:
        for name in SIZE_FIELDS:
            if getattr(loaded, name) != getattr(model, name):
                raise ConfigError(
                    f"{field}={directory}: model.{name} is {getattr(loaded, name)} there but "
                    f"config.model.{name}={getattr(model, name)} here")
    return loaded


def check_checkpoint_vocab(directory: str, loaded, field: str = "config.init_checkpoint"):
    """The checkpoint's own vocabulary (the fine-tuning tokenizer) fits its word embeddings:
    fewer entries than rows is what bertjax.load_pretrained accepts (ids index the rows), more
    would index past them. Checked here so the job stops before its data is read."""
    from bertjax.checkpoint_dir import count_vocab, vocab_path

    try:
        entries = count_vocab(vocab_path(directory))
    except CheckpointError:
        return  # no single vocabulary there: load_pretrained names what it lacks
    if entries > loaded.vocab_size:
        raise CheckpointError(f"{field}={directory}: its vocabulary {vocab_path(directory)} "
                              f"has {entries} entries but the model has {loaded.vocab_size} "
                              "word-embedding rows (model.vocab_size)")


# ------------------------------------------------------------------------------ TFRecords


# ------------------------------------------------------------------------------ pre-training


def _check_records(field: str, files: list[str], phase, static: bool, packed: bool,
                   vocab_size: int) -> None:
    """The first record of the first file: the features the reader needs, of the phase's
    lengths, with ids the model's embedding covers."""
    from data_pipeline import tfrecords

    path = files[0]
    try:
        features = tfrecords.example_features(tfrecords.first_record(path))
    except tfrecords.FramingError as e:
        raise DataError(f"{path}: not a TFRecord file ({e})") from None
    except ValueError as e:
        raise DataError(f"{path}: not a tf.train.Example record ({e})") from None
    need = ["input_ids", "input_mask", "segment_ids"]
    if static:
        need += ["masked_lm_positions", "masked_lm_ids", "masked_lm_weights"]
    if not packed:
        need.append("next_sentence_labels")
    missing = [name for name in need if name not in features]
    if missing:
        raise DataError(f"{path}: records lack the feature(s) {', '.join(missing)} that "
                        f"{field} needs (has {', '.join(sorted(features)) or 'none'}); "
                        "write pre-training data with python -m data_pipeline."
                        "create_pretraining_data")
    length = len(features["input_ids"])
    if (length > phase.seq_len) if packed else (length != phase.seq_len):
        raise DataError(f"{path}: input_ids has {length} positions but "
                        f"{field.rsplit('.', 1)[0]}.seq_len={phase.seq_len}")
    if static and len(features["masked_lm_ids"]) != phase.max_predictions:
        raise DataError(f"{path}: masked_lm_ids has {len(features['masked_lm_ids'])} entries "
                        f"but {field.rsplit('.', 1)[0]}.max_predictions={phase.max_predictions}")
    ids = features["input_ids"] + (features.get("masked_lm_ids", []) if static else [])
    if ids and max(ids) >= vocab_size:
        raise DataError(f"{path}: token id {max(ids)} is outside config.model.vocab_size="
                        f"{vocab_size}")


def _check_metadata(field: str, phase, meta_path: str, meta: dict, config, model,
                    vocab_hash: str | None, packed: bool) -> bool:
    """The data's metadata.json against the config; returns whether records are pre-masked."""
    where = f"{field}: {meta_path}"
    length = meta.get("max_seq_length")
    if not _is_int(length):
        raise DataError(f"{meta_path}: max_seq_length is {length!r}, not an integer")
    if (length > phase.seq_len) if packed else (length != phase.seq_len):
        raise DataError(f"{where}: max_seq_length is {length} but "
                        f"config.phases.{phase.name}.seq_len={phase.seq_len}")
    static = meta.get("masking", "static") == "static"
    dynamic = bool(config.masking.get("dynamic", True))
    if not static and not dynamic:
        raise DataError(f"{where}: masking is 'dynamic' (records have no masks) but "
                        "config.masking.dynamic=False")
    if static and not dynamic and meta.get("max_predictions_per_seq") != phase.max_predictions:
        raise DataError(f"{where}: max_predictions_per_seq is "
                        f"{meta.get('max_predictions_per_seq')} but "
                        f"config.phases.{phase.name}.max_predictions={phase.max_predictions}")
    size = meta.get("vocab_size")
    if _is_int(size) and size > model.vocab_size:
        raise DataError(f"{where}: the data's vocabulary has {size} ids but "
                        f"config.model.vocab_size={model.vocab_size}")
    if vocab_hash and meta.get("vocab_hash") and meta["vocab_hash"] != vocab_hash:
        raise DataError(f"{where}: the data was made with another vocabulary than "
                        f"config.vocab={config.vocab} (vocab_hash differs; metadata's vocab: "
                        f"{meta.get('vocab')})")
    return static


def check_pretraining_data(config, model, vocab_hash: str | None = None) -> None:
    """Every phase's data and eval_data: files match, none is empty, the metadata and the
    first record agree with the phase, the model and config.vocab."""
    from bertjax.train.configs import packing_enabled, plan_phases
    from data_pipeline import metadata

    packed = packing_enabled(config)
    if packed and not config.masking.get("dynamic", True):
        raise ConfigError("config.packing.enabled=True needs config.masking.dynamic=True "
                          "(packed rows are masked after packing)")
    for phase in plan_phases(config):
        for name in ("data", "eval_data"):
            field = f"config.phases.{phase.name}.{name}"
            pattern = getattr(phase, name)
            if name == "data" and phase.end > phase.start and not pattern:
                raise ConfigError(f"{field} is empty; give a TFRecord file pattern (or "
                                  "'synthetic')")
            if name == "eval_data" and phase.end == phase.start:
                continue
            if not pattern or pattern == "synthetic":
                if pattern and packed:
                    raise ConfigError(f"{field}=synthetic cannot be packed; give unmasked "
                                      "TFRecords or config.packing.enabled=False")
                continue
            files = paths.glob(pattern)
            if not files:
                raise ConfigError(f"{field}: no files match {pattern!r}")
            empty = [f for f in files if paths.getsize(f) == 0]
            if empty:
                raise DataError(f"{empty[0]}: empty TFRecord file (0 bytes; {len(empty)} of "
                                f"the {len(files)} files of {field}); remove it or rewrite "
                                "the data")
            found = metadata.read(pattern)
            if found is None:
                if packed:
                    raise DataError(f"{field}: no metadata*.json beside {pattern!r}; packing "
                                    "reads data written by python -m data_pipeline."
                                    "create_segments")
                static = True  # reference data (google-research/bert): pre-masked
            else:
                static = _check_metadata(field, phase, *found, config, model, vocab_hash,
                                         packed)
                static = static or not config.masking.get("dynamic", True)
            _check_records(field, files, phase, static, packed, model.vocab_size)


def pretraining(config, workdir: str | None, vocab_size_given: bool = False) -> None:
    """Everything `python -m bertjax.pretrain` can check before step 0 (workdir None: a dry
    run, which writes nothing, but whose sizes must be the run's). config.model.vocab_size
    may be set from config.vocab here (`vocab_size`)."""
    from bertjax.train.configs import packing_enabled, plan_phases

    model_config(config.model)  # its own fields first, then their agreement with config.vocab
    vocab_size(config, vocab_size_given)
    model = model_config(config.model)
    check_common(config)

    plan_phases(config)
    packing_enabled(config)
    check_ranges(config, {"seed": 0}, fractions=("masking.masked_lm_prob",))
    if workdir is None:
        return
    check_workdir(workdir)
    vocab_hash = None
    if config.get("vocab"):
        from data_pipeline import metadata

        tokenizer = load_vocab(config.vocab)
        vocab_hash = metadata.vocab_hash(
            tokenizer.convert_ids_to_tokens(list(range(tokenizer.vocab_size))))
    check_pretraining_data(config, model, vocab_hash)
    if config.get("init_checkpoint"):
        check_init_checkpoint(config.init_checkpoint, model)


# ------------------------------------------------------------------------------ fine-tuning


def finetuning(config, workdir: str | None) -> None:
    """The config ranges and paths of a fine-tuning job (its data files are read, and named in
    any error, by the task before anything is written)."""
    check_common(config)
    check_ranges(config, {"max_seq_length": 3, "seed": 0, "min_bucket_length": 1},
                 positive=("train.num_epochs",))
    warmup = _number(config, "optimizer.warmup_proportion")
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
    check_init_checkpoint(config.init_checkpoint, model)
    check_checkpoint_vocab(config.init_checkpoint, loaded)
    if config.max_seq_length > model.max_position_embeddings:
        raise ConfigError(f"config.max_seq_length={config.max_seq_length} exceeds the model's "
                          f"{model.max_position_embeddings} positions "
                          f"({config.init_checkpoint})")

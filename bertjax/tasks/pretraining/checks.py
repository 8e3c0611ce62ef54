"""What a pre-training run checks before any step or file write, beside the checks every job
shares (bertjax/validate.py): the phase plan and objective (rules.py), config.vocab against
config.model.vocab_size, every phase's data (files exist and are not empty, their metadata
agrees with the config, the first record has the expected features and ids the model covers)
and the init checkpoint. A bad phase-2 pattern costs seconds, not phase 1; a model vocabulary
smaller than the data's ids never reaches "loss is nan at step N".
"""

from __future__ import annotations

from bertjax import paths
from bertjax.errors import ConfigError, DataError
from bertjax.models import ARCHITECTURES, architecture
from bertjax.tasks.pretraining.rules import packing_enabled, plan_phases
from bertjax.tokenization import load_tokenizer
from bertjax.validate import (
    check_common,
    check_init_checkpoint,
    check_ranges,
    check_workdir,
    is_int,
    model_config,
)
from data_pipeline import metadata, tfrecords


def resolve(config, vocab_size_given: bool = False, log=print):
    """Completes config.model from config.vocab, the one place a pre-training config is filled
    in rather than checked: its vocabulary size (`vocab_size`; logged) and the architecture's
    vocabulary fields. Returns the tokenizer, read once for the checks (None without
    config.vocab)."""
    model_config(config.model)  # its own fields first, then their agreement with config.vocab
    if not config.get("vocab"):
        return None
    tokenizer = load_vocab(config.vocab)
    record = architecture(config.model)
    if record.vocab_fields is not None:  # e.g. a ModernBERT's special ids
        config.model.update(record.vocab_fields(tokenizer))
    taken = vocab_size(config, tokenizer, vocab_size_given)
    if taken:
        log(f"config.model.vocab_size={taken}: the entries of config.vocab={config.vocab}")
    return tokenizer


def check(config, workdir: str | None, tokenizer=None) -> None:
    """Everything a pre-training run can check before step 0 (workdir None: a dry run, which
    writes nothing, but whose sizes must be the run's); changes nothing. tokenizer: config.vocab's,
    as `resolve` returned it (read here otherwise)."""
    if tokenizer is None and config.get("vocab"):
        tokenizer = load_vocab(config.vocab)
    if tokenizer is not None:
        vocab_size(config, tokenizer, given=True)  # equal, or refused: nothing is set here
    model = model_config(config.model)
    check_common(config)

    plan_phases(config)
    packing_enabled(config)
    check_architecture(config, model)
    check_ranges(config, {"seed": 0}, fractions=("masking.masked_lm_prob",))
    if workdir is None:
        return
    check_workdir(workdir)
    vocab_hash = None
    if tokenizer is not None:
        vocab_hash = metadata.vocab_hash(
            tokenizer.convert_ids_to_tokens(list(range(tokenizer.vocab_size))))
    check_data(config, model, vocab_hash)
    if config.get("init_checkpoint"):
        check_init_checkpoint(config.init_checkpoint, model)


def check_architecture(config, model) -> None:
    """The objective is one the architecture pre-trains (`Architecture.objectives`: a
    ModernBERT's masked-LM head alone, "mlm"), and the phases set only model fields it has
    (`Architecture.phase_fields`, e.g. a ModernBERT's global_rope_theta)."""
    record = architecture(model)
    objective = config.get("objective", "mlm_nsp")
    if objective not in record.objectives:
        raise ConfigError(f"config.objective={objective!r}: {record.title} "
                          f"(config.model.model_type={record.name!r}) pre-trains with "
                          f"{' | '.join(record.objectives)}")
    phase_fields = {field for r in ARCHITECTURES.values() for field in r.phase_fields}
    for name, phase in config.phases.items():
        for field in sorted(phase_fields - set(record.phase_fields)):
            if phase.get(field, 0.0):
                raise ConfigError(f"config.phases.{name}.{field}: {record.title} has no such "
                                  f"field (config.model.model_type={record.name!r})")


def vocab_size(config, tokenizer, given: bool = False) -> int | None:
    """config.model.vocab_size against config.vocab's `tokenizer`, before anything is compiled:
    the export needs one word-embedding row per entry, so any other size trains a model that
    can never be saved (nor resumed with the right size). Not `given` (on the command line) and
    still the presets' size: set to the vocabulary's entries, which are returned; otherwise
    they must be equal."""
    entries = tokenizer.vocab_size
    record = architecture(config.model)
    size = config.model.get("vocab_size")
    if size == entries:
        return None
    preset_size = record.config_class.vocab_size
    if not given and size == preset_size:  # the presets' size: left as it came
        config.model.vocab_size = entries
        return entries
    raise ConfigError(f"config.vocab={config.vocab} has {entries} entries but "
                      f"config.model.vocab_size={size} (the exported model needs one "
                      f"embedding row per entry); pass --config.model.vocab_size={entries} or "
                      "leave it out")


def load_vocab(path: str, field: str = "config.vocab"):
    """The tokenizer of `path` (a vocab.txt, SentencePiece model or tokenizer directory)."""
    if not paths.exists(path):
        raise ConfigError(f"{field}={path}: no such vocabulary file or directory")
    try:
        return load_tokenizer(path)
    except DataError as e:  # VocabError: the message names the file
        raise ConfigError(f"{field}: {e}") from None


def vocab_entries(path: str, field: str = "config.vocab") -> int:
    """Entries of the vocabulary at `path`: the rows the model's word embeddings must have.
    For every vocabulary the tokenizer accepts (no empty or duplicate entry) this is the
    export's count (checkpoint_dir.count_vocab), read as the run reads it (gs:// too)."""
    return load_vocab(path, field).vocab_size


def _check_records(field: str, files: list[str], phase, static: bool, packed: bool,
                   vocab_size: int) -> None:
    """The first record of the first file: the features the reader needs, of the phase's
    lengths, with ids the model's embedding covers."""
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
    if not is_int(length):
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
    if is_int(size) and size > model.vocab_size:
        raise DataError(f"{where}: the data's vocabulary has {size} ids but "
                        f"config.model.vocab_size={model.vocab_size}")
    if vocab_hash and meta.get("vocab_hash") and meta["vocab_hash"] != vocab_hash:
        raise DataError(f"{where}: the data was made with another vocabulary than "
                        f"config.vocab={config.vocab} (vocab_hash differs; metadata's vocab: "
                        f"{meta.get('vocab')})")
    return static


def check_data(config, model, vocab_hash: str | None = None) -> None:
    """Every phase's data and eval_data: files match, none is empty, the metadata and the
    first record agree with the phase, the model and config.vocab."""
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

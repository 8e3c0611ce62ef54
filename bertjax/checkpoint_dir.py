"""bertjax checkpoint directories: the one format that converters, the trainer's export,
fine-tuning, feature extraction and users' own code read and write.

    DIR/config.json            BertConfig.to_dict(), always with scan_layers=false (see params),
                               or ModernConfig.to_dict() (model_type "modernbert")
    DIR/params/                orbax-checkpoint PyTree (StandardCheckpointer) of the unboxed
                               BertForPreTraining params {"bert", "mlm", "nsp"}: host NumPy
                               arrays in config.param_dtype, layers unrolled
                               (bert/encoder/layer_0 ... layer_{L-1}); for a ModernBERT its
                               ModernBertForMaskedLM params {"model", "head", "decoder_bias"}
    DIR/vocab.txt | DIR/*.model | DIR/tokenizer.json  the WordPiece vocabulary, the
                               SentencePiece model or a Hugging Face tokenizer (BPE, ...)
    DIR/tokenizer_config.json  {"type": "wordpiece" | "sentencepiece" | "tokenizers",
                               "do_lower_case": bool}
    DIR/conversion.json        only when something was not taken from a source checkpoint:
                               {"source", "initialised": [param groups], "skipped": {...}, ...}
    DIR/classifier.npz         only for a converted sentence-transformers CrossEncoder: its
                               classifier {kernel [hidden, 1], bias [1]} (float32); its
                               activation and max_seq_length are in conversion.json

    config, params, tokenizer = bertjax.load_pretrained(DIR)             # unrolled layers
    config, params, tokenizer = bertjax.load_pretrained(DIR, scan_layers=True, dtype="bfloat16")

Heads that a source lacks (an encoder-only or MLM-only checkpoint) are initialised with the
model's own initialisers; they are listed in the return value, logged, and recorded in
conversion.json, so nothing is ever silently random.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from typing import Any

import flax
import flax.linen as nn
import jax
import numpy as np
from absl import logging
from etils import epath

from bertjax import paths
from bertjax.errors import CheckpointError, ConfigError
from bertjax.models import ModelConfig, architecture, model_config
from bertjax.models.embedding import POOLING_FILE, Pooling, Prompts
from bertjax.models.layout import to_layout
from bertjax.train import multihost

CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
VOCAB_FILE = "vocab.txt"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CONVERSION_FILE = "conversion.json"
CLASSIFIER_FILE = "classifier.npz"  # a converted cross-encoder's classifier (its reranker head)
SENTENCE_TRANSFORMERS = "sentence_transformers"  # conversion.json: what from_hf read there
DEFAULT_MAX_SEQ_LENGTH = 128  # tokens per text where a model says nothing of its own

def optional_groups(config: ModelConfig) -> tuple[str, ...]:
    """Parameter groups a source may lack entirely (encoder-only or MLM-only checkpoints):
    then initialised and reported, never silently. The encoder group is always required."""
    return architecture(config).optional_groups


def _unrolled(config: ModelConfig) -> ModelConfig:
    """The config with its layers unrolled, as stored (where they can scan)."""
    if not architecture(config).scans_layers:
        return config
    return dataclasses.replace(config, scan_layers=False)


# ---------------------------------------------------------------------------------------------
# Parameter trees


@functools.lru_cache(maxsize=8)
def abstract_params(config: ModelConfig) -> dict[str, Any]:
    """ShapeDtypeStructs of every parameter of the pre-training model (BertForPreTraining or
    ModernBertForMaskedLM, layout of `config`); cached, do not modify the result."""
    init = architecture(config).init_pretraining
    return nn.unbox(jax.eval_shape(lambda: init(config, jax.random.key(0))))


def config_summary(config: ModelConfig) -> str:
    """The config fields that fix the parameter shapes, for error messages."""
    return ", ".join(f"{name}={getattr(config, name)}" for name in size_fields(config))


def _flat(tree: Mapping[str, Any]) -> dict[str, Any]:
    return {"/".join(k): v for k, v in flax.traverse_util.flatten_dict(dict(tree)).items()}


def check_params(config: ModelConfig, params: Mapping[str, Any], where: str) -> None:
    """Raises CheckpointError naming the first missing, unexpected or misshapen parameter."""
    want = _flat(abstract_params(config))
    have = _flat(params)
    for key in want:
        if key not in have:
            raise CheckpointError(f"{where}: missing parameter {key}")
    for key in have:
        if key not in want:
            raise CheckpointError(f"{where}: unexpected parameter {key} for this config")
    for key, spec in want.items():
        shape = tuple(np.shape(have[key]))
        if shape != spec.shape:
            raise CheckpointError(
                f"{where}: parameter {key} has shape {shape} but the config "
                f"({config_summary(config)}) implies {spec.shape}"
            )


def _group_present(params: Mapping[str, Any], group: str) -> bool:
    tree = params
    for key in group.split("/"):
        if not isinstance(tree, Mapping) or key not in tree:
            return False
        tree = tree[key]
    return True


def init_groups(config: ModelConfig, groups: list[str], seed: int) -> dict[str, Any]:
    """Freshly initialised subtrees `groups` (e.g. ["nsp", "bert/pooler"]) of the params,
    from the model's own initialisers."""
    return jax.device_get(_group_initialiser(config, tuple(groups))(jax.random.key(seed)))


@functools.lru_cache(maxsize=8)
def _group_initialiser(config: ModelConfig, groups: tuple[str, ...]):
    # Only the requested subtrees leave the jitted init, so XLA drops the rest of the model's
    # initialisation (no BERT-large-sized allocation to fill a 2-class head).
    def init(rng):
        params = nn.unbox(architecture(config).init_pretraining(config, rng))
        picked: dict[str, Any] = {}
        for group in groups:
            src, dst = params, picked
            *parents, leaf = group.split("/")
            for key in parents:
                src, dst = src[key], dst.setdefault(key, {})
            dst[leaf] = src[leaf]
        return picked

    return jax.jit(init)


def complete_params(
    config: ModelConfig, params: Mapping[str, Any], seed: int = 0
) -> tuple[dict[str, Any], list[str]]:
    """Adds the optional groups (`bert/pooler`, `mlm`, `nsp`; a ModernBERT's `head`,
    `decoder_bias`) that `params` lacks entirely.

    Returns (params, names of the initialised groups). A partly present group is left alone
    (check_params then names the missing tensor).
    """
    missing = [g for g in optional_groups(config) if not _group_present(params, g)]
    if not missing:
        return dict(params), []
    fresh = init_groups(config, missing, seed)
    merged = flax.traverse_util.flatten_dict(dict(params))
    merged.update(flax.traverse_util.flatten_dict(fresh))
    return flax.traverse_util.unflatten_dict(merged), missing


def _to_host(params: Any, dtype: str) -> Any:
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)).astype(dtype), params)


# ---------------------------------------------------------------------------------------------
# Vocabulary


def vocab_path(path: str | epath.Path) -> epath.Path:
    """The vocab.txt, SentencePiece .model or tokenizer.json file at `path` (a file or a
    directory; in a directory, in that order, as bertjax.tokenization.load_tokenizer)."""
    path = epath.Path(path)
    if path.is_dir():
        if (path / VOCAB_FILE).exists():
            return path / VOCAB_FILE
        models = sorted(path.glob("*.model"))
        if len(models) == 1:
            return models[0]
        if not models and (path / TOKENIZER_JSON).exists():
            return path / TOKENIZER_JSON
        raise CheckpointError(
            f"{path}: expected a {VOCAB_FILE}, exactly one SentencePiece *.model or a "
            f"{TOKENIZER_JSON}, found {len(models)} *.model files"
        )
    if not path.exists():
        raise CheckpointError(f"vocabulary {path} does not exist")
    return path


def is_sentencepiece(path: epath.Path) -> bool:
    return path.name.endswith(".model")


def is_tokenizer_json(path: epath.Path) -> bool:
    return path.name.endswith(".json")


def count_vocab(path: epath.Path) -> int:
    """Entries in a vocab.txt (one token a line, as the reference reads it), a .model or a
    tokenizer.json (its vocabulary and added tokens)."""
    if is_tokenizer_json(path):
        from bertjax.tokenization import load_tokenizer

        return load_tokenizer(str(path)).vocab_size
    if is_sentencepiece(path):
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=str(path)).get_piece_size()
    data = path.read_bytes()
    # Count b"\n" rather than str.splitlines(): vocabularies contain characters (\x1c, \x85,
    # \u2028) that splitlines treats as line breaks but the reference does not.
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def infer_do_lower_case(path: epath.Path) -> bool:
    """A WordPiece vocabulary with upper-case tokens is a cased one (do_lower_case=False)."""
    for line in path.read_text(encoding="utf-8").split("\n"):
        token = line.strip()
        if token.startswith("[") and token.endswith("]"):
            continue  # [PAD], [UNK], [unused0] ...
        if token != token.lower():
            return False
    return True


def check_vocab_size(config: ModelConfig, size: int, source: str) -> None:
    # Some embedding tables are padded past their tokenizer (`Architecture.padded_vocab`:
    # ModernBERT-base has 50,280 tokens, 50,368 rows); a BERT's matches its vocabulary.
    record = architecture(config)
    if size != config.vocab_size and not (record.padded_vocab and size < config.vocab_size):
        raise CheckpointError(
            f"{source} has {size} entries but {record.embedding_table} has "
            f"{config.vocab_size} rows (vocab_size={config.vocab_size})"
        )


def _check_vocabulary(config: ModelConfig, tokenizer_or_vocab_path: Any) -> None:
    if hasattr(tokenizer_or_vocab_path, "save"):  # a bertjax.tokenization.Tokenizer
        check_vocab_size(config, tokenizer_or_vocab_path.vocab_size, "the tokenizer's vocabulary")
    else:
        source = vocab_path(tokenizer_or_vocab_path)
        check_vocab_size(config, count_vocab(source), str(source))


def _write_vocabulary(
    directory: epath.Path, tokenizer_or_vocab_path: Any, do_lower_case: bool | None
) -> dict[str, Any]:
    """Copies/saves the vocabulary and writes tokenizer_config.json; returns that config."""
    if hasattr(tokenizer_or_vocab_path, "save"):  # a bertjax.tokenization.Tokenizer
        tokenizer_or_vocab_path.save(str(directory))
        return {"do_lower_case": tokenizer_or_vocab_path.do_lower_case,
                "do_lower_case_source": "tokenizer"}
    source = vocab_path(tokenizer_or_vocab_path)
    if is_tokenizer_json(source):  # lower-casing is the tokenizer's own normaliser
        from bertjax.tokenization import load_tokenizer

        return _write_vocabulary(directory, load_tokenizer(str(source)), do_lower_case)
    sentencepiece = is_sentencepiece(source)
    how = "given"
    if do_lower_case is None:
        source_config = source.parent / TOKENIZER_CONFIG_FILE
        if source_config.exists():  # ours, or Hugging Face's (same key)
            do_lower_case = json.loads(source_config.read_text()).get("do_lower_case")
            how = f"from {source_config}"
    if do_lower_case is None:
        do_lower_case = False if sentencepiece else infer_do_lower_case(source)
        has = "no upper-case tokens" if do_lower_case else "upper-case tokens"
        how = "default for SentencePiece" if sentencepiece else f"inferred: vocabulary has {has}"
    target = directory / (source.name if sentencepiece else VOCAB_FILE)
    if source.resolve() != target.resolve():
        source.copy(target, overwrite=True)
    tokenizer_config = {
        "type": "sentencepiece" if sentencepiece else "wordpiece",
        "do_lower_case": bool(do_lower_case),
    }
    (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return {**tokenizer_config, "do_lower_case_source": how}


# ---------------------------------------------------------------------------------------------
# Save / load


def save_pretrained(
    directory: str | epath.Path,
    model_config: ModelConfig,
    params: Mapping[str, Any],
    tokenizer_or_vocab_path: Any,
    *,
    do_lower_case: bool | None = None,
    provenance: Mapping[str, Any] | None = None,
    seed: int = 0,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Writes a checkpoint directory (format in the module docstring).

    params: BertForPreTraining params (boxed or not, unrolled or scanned, on device or host,
      fully addressable by this process), or BertModel params; `bert/pooler`, `mlm`, `nsp`
      may be absent: they are then initialised (seed `seed`). For a ModernConfig:
      ModernBertForMaskedLM params, or ModernBertModel params (`head` and `decoder_bias`
      then initialised).
    tokenizer_or_vocab_path: a bertjax Tokenizer, or a vocab.txt / *.model / directory holding
      one (its tokenizer_config.json, if any, supplies do_lower_case unless given).
    provenance: extra fields for conversion.json (e.g. {"source": ..., "skipped": ...}).
    Returns the summary written to conversion.json (`initialised` lists the new groups).
    """
    directory = epath.Path(directory)
    params = nn.unbox(dict(params))
    if "embeddings" in params:  # BertModel / ModernBertModel params: the encoder alone
        params = {architecture(model_config).encoder_group: params}
    if architecture(model_config).scans_layers:
        params = to_layout(params, scan_layers=False)
    config = _unrolled(model_config)
    params, initialised = complete_params(config, params, seed)
    check_params(config, params, where="params")
    _check_vocabulary(config, tokenizer_or_vocab_path)  # before anything is written
    params = _to_host(params, config.param_dtype)

    params_dir = directory / PARAMS_DIR
    if params_dir.exists() and not overwrite:
        raise CheckpointError(f"{params_dir} already exists (pass overwrite=True/--overwrite)")
    summary = {**(provenance or {}), "initialised": initialised}

    def write_small_files():
        if params_dir.exists():
            params_dir.rmtree()
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        tokenizer_config = _write_vocabulary(directory, tokenizer_or_vocab_path, do_lower_case)
        summary["do_lower_case"] = tokenizer_config["do_lower_case"]
        summary["do_lower_case_source"] = tokenizer_config["do_lower_case_source"]
        conversion_file = directory / CONVERSION_FILE
        if initialised or provenance:
            conversion_file.write_text(json.dumps(summary, indent=2) + "\n")
        elif conversion_file.exists():
            conversion_file.unlink()  # stale provenance from an earlier save would mislead

    # Multi-host: every process calls this; process 0 writes the small files, then every
    # process joins orbax's params save (a collective).
    multihost.write_from_main(write_small_files)
    for group in initialised:
        logging.warning("%s: %s was not in the source and was initialised (seed %d)",
                        directory, group, seed)

    import orbax.checkpoint as ocp

    from bertjax.train.checkpoints import ignore_late_callbacks

    ignore_late_callbacks()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(_absolute(params_dir), params)
    checkpointer.wait_until_finished()
    return summary


def _absolute(path: epath.Path) -> epath.Path:
    # orbax needs absolute local paths; cloud paths (gs://...) already are.
    return path if "://" in str(path) else path.resolve()


def load_config(directory: str | epath.Path) -> ModelConfig:
    directory = epath.Path(directory)
    config_file = directory / CONFIG_FILE
    if not (directory / PARAMS_DIR).exists():
        hint = ""
        if any((directory / f).exists() for f in ("model.safetensors", "pytorch_model.bin")):
            hint = f"; convert it first: python -m bertjax.convert from_hf --input {directory}"
        elif (directory / "bert_config.json").exists():
            hint = "; convert it first: python -m bertjax.convert from_tf ... --output DIR"
        elif (directory / "export" / PARAMS_DIR).exists():  # a pre-training workdir
            hint = f"; it is a pre-training run: its model is {directory / 'export'}"
        elif (directory / "checkpoints").exists():
            hint = ("; it is a training run's workdir (a pre-training run writes its model to "
                    "export/ when it finishes; a fine-tuning run: python -m bertjax.convert "
                    f"to_hf --input {directory})")
        raise CheckpointError(f"{directory} is not a bertjax checkpoint (no {PARAMS_DIR}/){hint}")
    if not config_file.exists():
        raise CheckpointError(f"{config_file} does not exist")
    fields = paths.read_json_object(config_file, CheckpointError)
    try:
        return model_config(fields)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{config_file}: {e}") from None


def size_fields(config: ModelConfig) -> tuple[str, ...]:
    """The config fields that fix the parameter shapes."""
    return architecture(config).size_fields


def check_sizes(stored: ModelConfig, wanted: ModelConfig, where: str) -> None:
    """The parameter shapes of a stored model (its size_fields) are those of `wanted`, and it
    is the same architecture; else ConfigError from `where` (e.g.
    "config.init_checkpoint=DIR")."""
    if architecture(stored) is not architecture(wanted):
        raise ConfigError(f"{where}: the model there is {architecture(stored).title} but "
                          f"config.model is {architecture(wanted).title} (model.model_type)")
    for name in size_fields(stored):
        if getattr(stored, name) != getattr(wanted, name):
            raise ConfigError(f"{where}: model.{name} is {getattr(stored, name)} there but "
                              f"config.model.{name}={getattr(wanted, name)} here")


def load_do_lower_case(directory: str | epath.Path) -> bool:
    """do_lower_case as DIR/tokenizer_config.json records it (True when it does not say)."""
    tokenizer_config = epath.Path(directory) / TOKENIZER_CONFIG_FILE
    if not tokenizer_config.exists():
        return True
    return json.loads(tokenizer_config.read_text()).get("do_lower_case", True)


def load_pooling(directory: str | epath.Path) -> Pooling | None:
    """How the directory's texts become vectors (DIR/pooling.json, written for a converted
    sentence-transformers model or an embedding run), or None where it has no such file."""
    path = epath.Path(directory) / POOLING_FILE
    if not path.exists():
        return None
    fields = paths.read_json_object(path, CheckpointError)
    if not isinstance(fields.get("normalize", False), bool):
        raise CheckpointError(f"{path}: normalize={fields['normalize']!r} is not true or false")
    try:
        return Pooling.from_dict(fields)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def sentence_record(directory: str | epath.Path) -> dict[str, Any]:
    """What from_hf kept of a converted sentence-transformers model (conversion.json's
    SENTENCE_TRANSFORMERS record: pooling, max_seq_length, prompts, default_prompt_name,
    do_lower_case); {} for any other checkpoint directory."""
    path = epath.Path(directory) / CONVERSION_FILE
    if not path.exists():
        return {}
    record = paths.read_json_object(path, CheckpointError).get(SENTENCE_TRANSFORMERS)
    return record if isinstance(record, dict) else {}


def own_max_seq_length(directory: str | epath.Path) -> int | None:
    """The tokens per text a converted sentence-transformers model was built to embed (its
    sentence_bert_config.json max_seq_length, kept in conversion.json), or None."""
    length = sentence_record(directory).get("max_seq_length")
    return int(length) if isinstance(length, int) and length > 0 else None


def own_prompts(directory: str | epath.Path) -> Prompts:
    """The prompts a converted sentence-transformers model came with (its
    config_sentence_transformers.json's, kept in conversion.json); none for another model."""
    try:
        return Prompts.from_dict(sentence_record(directory))
    except ConfigError as e:
        raise CheckpointError(f"{epath.Path(directory) / CONVERSION_FILE}: {e}") from None


def own_lower_case(directory: str | epath.Path) -> bool:
    """Whether a converted sentence-transformers model lower-cases its texts before the
    tokenizer (sentence_bert_config.json's do_lower_case, kept in conversion.json)."""
    return sentence_record(directory).get("do_lower_case") is True


def own_activation(directory: str | epath.Path) -> str | None:
    """The activation a converted sentence-transformers CrossEncoder applies to its logits in
    predict ("sigmoid" | "identity", kept in conversion.json), or None for another model."""
    record = sentence_record(directory)
    return record.get("activation") if record.get("model_type") == "CrossEncoder" else None


def save_classifier(directory: str | epath.Path, classifier: Mapping[str, Any] | None) -> None:
    """Writes DIR/CLASSIFIER_FILE, a cross-encoder's classifier {"kernel": [hidden, labels],
    "bias": [labels]} in float32, or (None) removes a stale one: it would make the directory a
    reranker."""
    import io

    path = epath.Path(directory) / CLASSIFIER_FILE
    if classifier is None:
        if path.exists():
            path.unlink()
        return
    buffer = io.BytesIO()
    np.savez(buffer, **{k: np.asarray(classifier[k], np.float32) for k in ("kernel", "bias")})
    path.write_bytes(buffer.getvalue())


def load_classifier(directory: str | epath.Path) -> dict[str, np.ndarray] | None:
    """DIR/CLASSIFIER_FILE as {"kernel": [hidden, labels], "bias": [labels]}, or None where
    the directory has none (not a converted cross-encoder)."""
    import io

    path = epath.Path(directory) / CLASSIFIER_FILE
    if not path.exists():
        return None
    try:
        with np.load(io.BytesIO(path.read_bytes()), allow_pickle=False) as stored:
            kernel, bias = np.asarray(stored["kernel"]), np.asarray(stored["bias"])
    except (KeyError, ValueError, OSError) as e:
        raise CheckpointError(f"{path}: not a classifier file ({e})") from None
    if kernel.ndim != 2 or bias.shape != kernel.shape[1:]:
        raise CheckpointError(f"{path}: kernel {kernel.shape} and bias {bias.shape} are not "
                              "[hidden, labels] and [labels]")
    return {"kernel": kernel, "bias": bias}


def max_seq_length(directory: str | epath.Path, given: int | None,
                   max_positions: int) -> int:
    """Tokens per text for a model at `directory`: `given` (a flag or config) where there is
    one, else the model's own (`own_max_seq_length`), else DEFAULT_MAX_SEQ_LENGTH; at most its
    positions."""
    length = given or own_max_seq_length(directory) or DEFAULT_MAX_SEQ_LENGTH
    return min(length, max_positions)


def load_params(directory: str | epath.Path, config: ModelConfig) -> dict[str, Any]:
    """Host NumPy params in `config.param_dtype`, in the layout `config.scan_layers` selects."""
    import orbax.checkpoint as ocp

    from bertjax.train.checkpoints import read_checkpoint

    directory = epath.Path(directory)
    params_dir = directory / PARAMS_DIR
    params = read_checkpoint(params_dir, lambda: ocp.StandardCheckpointer().restore(
        _absolute(params_dir)), hint=("incomplete", "write or convert the checkpoint again"))
    check_params(_unrolled(config), params, where=str(params_dir))
    params = _to_host(params, config.param_dtype)
    if not architecture(config).scans_layers:
        return params
    return to_layout(params, config.scan_layers)


def load_pretrained(
    directory: str | epath.Path, *, do_lower_case: bool | None = None,
    stored: ModelConfig | None = None, tokenizer: Any = None, **config_overrides: Any
) -> tuple[ModelConfig, dict[str, Any], Any]:
    """(config, params, tokenizer) from a checkpoint directory.

    config_overrides: BertConfig (or ModernConfig) fields to change, e.g. scan_layers=True
      (params are then stacked to match), dtype="bfloat16", param_dtype, hidden_dropout_prob,
      attention_impl.
    params: host NumPy arrays (place them with jax.device_put(params, shardings)).
    tokenizer: bertjax.tokenization.load_tokenizer(directory, do_lower_case).
    stored, tokenizer: the directory's config.json and tokenizer where the caller has read
      them already (a fine-tuning run's checks): not read again.
    """
    stored = stored or load_config(directory)
    config = model_config({**stored.to_dict(), **config_overrides})
    params = load_params(directory, config)
    from bertjax.tokenization import load_tokenizer

    if tokenizer is None or (do_lower_case is not None
                             and do_lower_case != tokenizer.do_lower_case):
        tokenizer = load_tokenizer(str(directory), do_lower_case=do_lower_case)
    ids = tokenizer.vocab.values()
    if ids and max(ids) >= config.vocab_size:
        raise CheckpointError(
            f"{directory}: the vocabulary has token id {max(ids)} but the model has only "
            f"{config.vocab_size} word embeddings"
        )
    return config, params, tokenizer

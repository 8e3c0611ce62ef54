"""sentence-transformers directories (modules.json) ↔ bertjax checkpoint directories.

A sentence-transformers model is a pipeline of modules (DIR/modules.json). bertjax reads and
writes the one pipeline its `BertForEmbedding` computes:

    0  Transformer   a BERT or a ModernBERT (config.json + weights; path "" is DIR itself)
    1  Pooling       one mode of mean | cls | max (1_Pooling/config.json)
    2  Normalize     optional: unit-length vectors

Anything else (Dense, several pooling modes at once, weightedmean / lasttoken /
mean_sqrt_len_tokens, another transformer type) stops with one line naming the file. The
pooling becomes the checkpoint directory's pooling.json (`bertjax.models.embedding.Pooling`),
its include_prompt too: false pools a prompted text from the first token after the prompt.

The text settings travel too (conversion.json, beside max_seq_length): the prompts of
config_sentence_transformers.json (`Prompts`: the text encode() prepends, by name, and the
default one), sentence_bert_config.json's do_lower_case (the texts lower-cased before the
tokenizer, whatever its own casing).

Reads both layouts: sentence-transformers 6's (`pooling_mode`, module types under
sentence_transformers.base/...) and the older one (`pooling_mode_*_tokens` flags,
`sentence_transformers.models.*`). Writes the older one, which sentence-transformers 2 to 6
all load. Nothing here imports torch or sentence_transformers.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from etils import epath

from bertjax import paths
from bertjax.convert.mapping import ConversionError
from bertjax.errors import ConfigError
from bertjax.models.embedding import MODES, Pooling, Prompts

MODULES_FILE = "modules.json"
SBERT_CONFIG_FILE = "sentence_bert_config.json"  # the Transformer module's settings
ST_CONFIG_FILE = "config_sentence_transformers.json"  # prompts, similarity, versions
POOLING_DIR = "1_Pooling"
NORMALIZE_DIR = "2_Normalize"
# The Transformer module's config.json model_type values bertjax converts.
TRANSFORMER_TYPES = ("bert", "modernbert")
SUPPORTED = ("supported: Transformer (BERT or ModernBERT), then Pooling with one mode of "
             f"{' | '.join(MODES)}, then an optional Normalize")
# The older config's flags → the mode each selects (sentence-transformers' own order).
LEGACY_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# What write_modules names the modules (sentence-transformers 6 resolves these old paths too).
MODULE_TYPES = {
    "Transformer": "sentence_transformers.models.Transformer",
    "Pooling": "sentence_transformers.models.Pooling",
    "Normalize": "sentence_transformers.models.Normalize",
}


@dataclasses.dataclass(frozen=True)
class SentenceTransformerDir:
    """What a sentence-transformers directory says beyond its encoder's weights."""

    transformer_directory: epath.Path  # the Transformer module's config.json + weights
    pooling: Pooling
    max_seq_length: int  # texts are cut to this many tokens ([CLS] and [SEP] included)
    # sentence_bert_config.json: lower-case the texts before the tokenizer. (sentence-
    # transformers 6 saves it as a Lowercase step of tokenizer.json's normalizer, which
    # transformers' BertTokenizer drops on loading: it is then lost to both.)
    do_lower_case: bool
    model_type: str = "bert"  # the Transformer's config.json model_type (TRANSFORMER_TYPES)
    prompts: Prompts = Prompts()

    def record(self) -> dict[str, Any]:
        """What conversion.json keeps (checkpoint_dir.sentence_record)."""
        return {"pooling": self.pooling.to_dict(), "max_seq_length": self.max_seq_length,
                **self.prompts.to_dict(), "do_lower_case": self.do_lower_case}


def is_sentence_transformers(directory: str | epath.Path) -> bool:
    return (epath.Path(directory) / MODULES_FILE).exists()


def _json(path: epath.Path, kind: type = dict) -> Any:
    if kind is dict:
        return paths.read_json_object(path, ConversionError)
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(value, kind):
        raise ConversionError(f"{path}: expected a JSON {kind.__name__}, got "
                              f"{type(value).__name__}")
    return value


def _optional_json(path: epath.Path) -> dict[str, Any]:
    return _json(path) if path.exists() else {}


def _class_name(module: dict[str, Any]) -> str | None:
    """Transformer / Pooling / Normalize / ... for sentence-transformers' own module types
    (every version's module path), None for other code (custom modules)."""
    kind = module.get("type")
    if not isinstance(kind, str) or not kind.startswith("sentence_transformers."):
        return None
    return kind.rsplit(".", 1)[-1]


def _modules(path: epath.Path) -> list[dict[str, Any]]:
    modules = _json(path, list)
    for i, module in enumerate(modules):
        if not (isinstance(module, dict) and isinstance(module.get("type"), str)
                and isinstance(module.get("path"), str)):
            raise ConversionError(f"{path}: module {i} is not an object with \"type\" and "
                                  "\"path\" strings")
        if module["path"].startswith("/") or ".." in module["path"].split("/"):
            raise ConversionError(f"{path}: module {i} path {module['path']!r} is not inside "
                                  "the directory")
    return modules


def _pooling_mode(path: epath.Path, fields: dict[str, Any], hidden_size: int) -> str:
    mode = fields.get("pooling_mode")
    if mode is None:  # the older flags; none set is mean (as sentence-transformers reads it)
        modes = [m for key, m in LEGACY_MODES.items() if fields.get(key)] or ["mean"]
    else:
        modes = [mode] if isinstance(mode, str) else mode
    if not isinstance(modes, list) or not modes or not all(isinstance(m, str) for m in modes):
        raise ConversionError(f"{path}: pooling_mode={mode!r} is not a mode name")
    if len(modes) > 1:
        raise ConversionError(f"{path}: pooling modes {' + '.join(modes)} at once (their "
                              f"vectors concatenated) are not supported; {SUPPORTED}")
    if modes[0] not in MODES:
        raise ConversionError(f"{path}: pooling mode {modes[0]!r} is not supported; "
                              f"{SUPPORTED}")
    dimension = fields.get("embedding_dimension", fields.get("word_embedding_dimension"))
    if dimension is not None and dimension != hidden_size:
        raise ConversionError(f"{path}: embedding dimension {dimension} but the Transformer's "
                              f"hidden_size is {hidden_size}")
    return modes[0]


def _transformer_settings(directory: epath.Path, bert: dict[str, Any]) -> tuple[int, bool]:
    """(max_seq_length, do_lower_case) as sentence-transformers' Transformer module sets them:
    sentence_bert_config.json, else the tokenizer's model_max_length; never beyond the
    position embeddings."""
    path = directory / SBERT_CONFIG_FILE
    fields = _optional_json(path)
    task = fields.get("transformer_task", "feature-extraction")
    if task != "feature-extraction":
        raise ConversionError(f"{path}: transformer_task {task!r} is not supported (bertjax "
                              "pools the encoder's token vectors: feature-extraction)")
    text = (fields.get("modality_config") or {}).get("text") or {}
    output = text.get("method_output_name", "last_hidden_state")
    if output != "last_hidden_state":
        raise ConversionError(f"{path}: the Transformer's output {output!r} is not supported "
                              "(bertjax pools last_hidden_state)")
    positions = int(bert.get("max_position_embeddings", 512))
    length = fields.get("max_seq_length")
    if length is None:
        kwargs = fields.get("processor_kwargs") or fields.get("tokenizer_args") or {}
        length = kwargs.get("model_max_length")
    if length is None:
        tokenizer_config = _optional_json(directory / "tokenizer_config.json")
        length = tokenizer_config.get("model_max_length")
    if not isinstance(length, (int, float)) or isinstance(length, bool) or length < 3:
        length = positions
    return min(int(length), positions), bool(fields.get("do_lower_case", False))


def _prompts(directory: epath.Path) -> Prompts:
    """config_sentence_transformers.json's prompts and default prompt name (none without it)."""
    path = directory / ST_CONFIG_FILE
    fields = _optional_json(path)
    model_type = fields.get("model_type", "SentenceTransformer")
    if model_type != "SentenceTransformer":
        raise ConversionError(f"{path}: model_type {model_type!r} is not supported (a "
                              "SentenceTransformer is)")
    try:
        return Prompts.from_dict(fields)
    except ConfigError as e:
        raise ConversionError(f"{path}: {e}") from None


def read_directory(directory: str | epath.Path) -> SentenceTransformerDir:
    """Parses DIR/modules.json and the files of its modules; ConversionError (one line naming
    the file) for anything bertjax's BertForEmbedding does not compute the same way."""
    directory = epath.Path(directory)
    modules_path = directory / MODULES_FILE
    modules = _modules(modules_path)
    names = [_class_name(m) for m in modules]

    def unsupported(i: int, why: str) -> ConversionError:
        return ConversionError(f"{modules_path}: module {i} ({modules[i]['type']}) {why}; "
                               f"{SUPPORTED}")

    if not modules or names[0] != "Transformer":
        if not modules:
            raise ConversionError(f"{modules_path}: no modules; {SUPPORTED}")
        raise unsupported(0, "is not a Transformer")
    transformer = directory / modules[0]["path"]
    config_path = transformer / "config.json"
    if not config_path.exists():
        raise ConversionError(f"{modules_path}: the Transformer module's {config_path} does "
                              "not exist")
    bert = _json(config_path)
    model_type = bert.get("model_type", "bert")
    if model_type not in TRANSFORMER_TYPES:
        raise ConversionError(f"{config_path}: model_type={model_type!r} is not supported "
                              f"(bertjax converts BERT and ModernBERT); {SUPPORTED}")
    max_seq_length, do_lower_case = _transformer_settings(transformer, bert)

    if len(modules) < 2:
        raise ConversionError(f"{modules_path}: no Pooling module after the Transformer; "
                              f"{SUPPORTED}")
    if names[1] != "Pooling":
        raise unsupported(1, "is not supported after the Transformer")
    pooling_path = directory / modules[1]["path"] / "config.json"
    pooling_fields = _optional_json(pooling_path)
    mode = _pooling_mode(pooling_path, pooling_fields, int(bert.get("hidden_size", 768)))

    normalize = False
    for i in range(2, len(modules)):
        if names[i] == "Normalize" and not normalize:
            normalize = True
            continue
        raise unsupported(i, "is not supported after the Pooling")
    include_prompt = pooling_fields.get("include_prompt", True) is not False
    return SentenceTransformerDir(transformer, Pooling(mode, normalize, include_prompt),
                                  max_seq_length, do_lower_case, model_type,
                                  _prompts(directory))


def read_modules(directory: str | epath.Path) -> tuple[epath.Path, Pooling]:
    """(the Transformer module's directory: config.json + weights, its Pooling)."""
    found = read_directory(directory)
    return found.transformer_directory, found.pooling


def wordpiece_vocab(path: str | epath.Path) -> list[str]:
    """The tokens (in id order) of a tokenizer.json's WordPiece model: the vocabulary of a
    directory that transformers 5 saved without vocab.txt."""
    path = epath.Path(path)
    model = _json(path).get("model") or {}
    if model.get("type") != "WordPiece" or not isinstance(model.get("vocab"), dict):
        raise ConversionError(f"{path}: not a WordPiece tokenizer (model type "
                              f"{model.get('type')!r}); pass --vocab=vocab.txt")
    prefix = model.get("continuing_subword_prefix", "##")
    if prefix != "##":
        raise ConversionError(f"{path}: continuing_subword_prefix {prefix!r} is not '##'")
    by_id = {i: token for token, i in model["vocab"].items()}
    if sorted(by_id) != list(range(len(model["vocab"]))):
        raise ConversionError(f"{path}: the WordPiece ids are not 0..{len(model['vocab']) - 1}")
    return [by_id[i] for i in range(len(by_id))]


def tokenizer_lower_case(directory: str | epath.Path) -> tuple[bool | None, str]:
    """(do_lower_case, the file that says so) of a Hugging Face tokenizer directory:
    tokenizer_config.json's do_lower_case, else tokenizer.json's BertNormalizer; (None, "")
    where neither says."""
    directory = epath.Path(directory)
    path = directory / "tokenizer_config.json"
    value = _optional_json(path).get("do_lower_case")
    if isinstance(value, bool):
        return value, str(path)
    path = directory / "tokenizer.json"
    normalizer = _optional_json(path).get("normalizer") or {}
    if normalizer.get("type") == "BertNormalizer" and isinstance(normalizer.get("lowercase"),
                                                                  bool):
        return normalizer["lowercase"], str(path)
    return None, ""


def write_modules(
    output_directory: str | epath.Path,
    pooling: Pooling,
    max_seq_length: int,
    do_lower_case: bool,
    embedding_dimension: int | None = None,
    prompts: Prompts | None = None,
) -> list[str]:
    """Makes a Hugging Face BertModel directory (config.json, weights, vocab.txt,
    tokenizer_config.json at its root, as `to_hf` writes it) a sentence-transformers one:
    `SentenceTransformer(output_directory)` then computes BertForEmbedding(config, pooling),
    with `prompts` (encode's prompt_name, its default prompt; default none), texts cut to
    max_seq_length tokens and, with do_lower_case, lower-cased before the tokenizer.

    embedding_dimension: the hidden size (default: config.json's hidden_size). Returns the
    files written, relative to the directory."""
    output = epath.Path(output_directory)
    prompts = prompts or Prompts()
    if embedding_dimension is None:
        embedding_dimension = int(_json(output / "config.json")["hidden_size"])
    modules = [{"idx": 0, "name": "0", "path": "", "type": MODULE_TYPES["Transformer"]},
               {"idx": 1, "name": "1", "path": POOLING_DIR, "type": MODULE_TYPES["Pooling"]}]
    if pooling.normalize:
        modules.append({"idx": 2, "name": "2", "path": NORMALIZE_DIR,
                        "type": MODULE_TYPES["Normalize"]})
    pooling_config = {"word_embedding_dimension": embedding_dimension,
                      **{key: mode == pooling.mode for key, mode in LEGACY_MODES.items()},
                      "include_prompt": bool(pooling.include_prompt)}
    files = {
        MODULES_FILE: modules,
        f"{POOLING_DIR}/config.json": pooling_config,
        SBERT_CONFIG_FILE: {"max_seq_length": int(max_seq_length),
                            "do_lower_case": bool(do_lower_case)},
        ST_CONFIG_FILE: {"model_type": "SentenceTransformer", "prompts": prompts.loaded,
                         "default_prompt_name": prompts.default_name,
                         "similarity_fn_name": "cosine"},
    }
    if pooling.normalize:
        files[f"{NORMALIZE_DIR}/config.json"] = {}
    for name, value in files.items():
        path = output / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value, indent=2) + "\n")
    return list(files)

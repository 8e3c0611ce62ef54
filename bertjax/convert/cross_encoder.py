"""sentence-transformers CrossEncoder directories ↔ bertjax checkpoint directories.

A CrossEncoder (a reranker) is a transformers BertForSequenceClassification with one label
over `[CLS] query [SEP] passage [SEP]`; its predict applies an activation to the logit:
config_sentence_transformers.json's "activation_fn" (sentence-transformers 6), else
config.json's "sentence_transformers" / "sbert_ce_default_activation_function" (4 / 5, and
before 4), else Sigmoid for one label. Texts are cut to its max length: sentence_bert_config
.json's max_seq_length, else the tokenizer's model_max_length, never beyond the positions.

from_hf keeps the classifier beside the encoder (checkpoint_dir.CLASSIFIER_FILE) and the
activation and max length in conversion.json (`record`); `Reranker.from_checkpoint` scores
with them and the reranking family fine-tunes from them. to_hf writes a finished reranking
run (or such a checkpoint directory) back with the files sentence-transformers 6 writes
(`write_modules`), and the activation where 4 and 5 read it. Activations other than Sigmoid
and Identity, several labels, modules after the Transformer, a default prompt and text
lower-casing stop with one line naming the file. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from etils import epath

from bertjax import paths
from bertjax.convert.mapping import ConversionError

MODULES_FILE = "modules.json"
SBERT_CONFIG_FILE = "sentence_bert_config.json"
ST_CONFIG_FILE = "config_sentence_transformers.json"
# torch's class names (sentence-transformers' `fullname`) → the activations bertjax applies.
TORCH_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.Identity": "identity",
}
ACTIVATIONS = ("sigmoid", "identity")
TORCH_NAMES = {"sigmoid": "torch.nn.modules.activation.Sigmoid",
               "identity": "torch.nn.modules.linear.Identity"}
# What sentence-transformers 6 writes for a sequence-classification Transformer module.
TRANSFORMER_TYPE = "sentence_transformers.base.modules.transformer.Transformer"
SEQUENCE_CLASSIFICATION = "sequence-classification"


@dataclasses.dataclass(frozen=True)
class CrossEncoderDir:
    """What a CrossEncoder directory says beyond its BertForSequenceClassification weights."""

    transformer_directory: epath.Path  # config.json + weights (+ tokenizer)
    activation: str  # ACTIVATIONS: what predict applies to the logit
    max_seq_length: int  # tokens of a (query, passage) pair, [CLS] and [SEP]s included
    notes: tuple[str, ...] = ()

    def record(self) -> dict[str, Any]:
        """What conversion.json keeps (checkpoint_dir.sentence_record, own_activation)."""
        return {"model_type": "CrossEncoder", "activation": self.activation,
                "max_seq_length": self.max_seq_length}


def _optional(path: epath.Path) -> dict[str, Any]:
    return paths.read_json_object(path, ConversionError) if path.exists() else {}


def _transformer_directory(directory: epath.Path) -> epath.Path:
    """The Transformer module's directory: modules.json's one module (none: DIR itself, as
    sentence-transformers 4 and 5 save a CrossEncoder)."""
    path = directory / MODULES_FILE
    if not path.exists():
        return directory
    try:
        modules = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: invalid JSON ({e})") from None
    if (not isinstance(modules, list) or len(modules) != 1 or not isinstance(modules[0], dict)
            or not str(modules[0].get("type", "")).startswith("sentence_transformers.")
            or not str(modules[0].get("type")).endswith(".Transformer")
            or not isinstance(modules[0].get("path"), str)):
        raise ConversionError(f"{path}: a CrossEncoder of one Transformer module is supported "
                              "(bertjax scores with its sequence-classification head alone)")
    where = modules[0]["path"]
    if where.startswith("/") or ".." in where.split("/"):
        raise ConversionError(f"{path}: module path {where!r} is not inside the directory")
    return directory / where


def is_cross_encoder(directory: str | epath.Path) -> bool:
    """Whether `directory` was saved by sentence-transformers' CrossEncoder (any version)."""
    directory = epath.Path(directory)
    if _optional(directory / ST_CONFIG_FILE).get("model_type") == "CrossEncoder":
        return True
    try:
        weights = _transformer_directory(directory)
    except ConversionError:
        return False
    if _optional(weights / SBERT_CONFIG_FILE).get("transformer_task") == SEQUENCE_CLASSIFICATION:
        return True
    config = _optional(weights / "config.json")
    return (isinstance(config.get("sentence_transformers"), dict)
            and "activation_fn" in config["sentence_transformers"]) or bool(
        config.get("sbert_ce_default_activation_function"))


def _activation(directory: epath.Path, weights: epath.Path, notes: list[str]) -> str:
    """The activation CrossEncoder(directory).predict applies, in its order of precedence;
    a path outside torch is not trusted (sentence-transformers then takes the next one)."""
    config = _optional(weights / "config.json")
    candidates = [(directory / ST_CONFIG_FILE,
                   _optional(directory / ST_CONFIG_FILE).get("activation_fn")),
                  (weights / "config.json",
                   (config.get("sentence_transformers") or {}).get("activation_fn")),
                  (weights / "config.json", config.get("sbert_ce_default_activation_function"))]
    for path, name in candidates:
        if not name:
            continue
        if not str(name).startswith("torch."):
            notes.append(f"{path}: activation {name!r} is custom code, which CrossEncoder "
                         "does not run without trust_remote_code; the next setting applies")
            continue
        if name not in TORCH_ACTIVATIONS:
            raise ConversionError(f"{path}: activation {name!r} is not supported (bertjax "
                                  "applies Sigmoid or Identity)")
        return TORCH_ACTIVATIONS[name]
    return "sigmoid"  # CrossEncoder's default for one label


def _max_seq_length(weights: epath.Path, sbert: dict[str, Any], positions: int) -> int:
    """sentence_bert_config.json's max_seq_length (or its processor's model_max_length), else
    the tokenizer's model_max_length, never beyond the position embeddings."""
    length = sbert.get("max_seq_length")
    if length is None:
        kwargs = sbert.get("processor_kwargs") or sbert.get("tokenizer_args") or {}
        length = kwargs.get("model_max_length")
    if length is None:
        length = _optional(weights / "tokenizer_config.json").get("model_max_length")
    if not isinstance(length, (int, float)) or isinstance(length, bool) or length < 3:
        length = positions
    return min(int(length), positions)


def read_directory(directory: str | epath.Path) -> CrossEncoderDir:
    """Parses a CrossEncoder directory; ConversionError (one line naming the file) for
    anything bertjax's reranker does not compute the same way."""
    directory = epath.Path(directory)
    weights = _transformer_directory(directory)
    config_path = weights / "config.json"
    if not config_path.exists():
        raise ConversionError(f"{directory}: no {config_path.name} in {weights}")
    config = paths.read_json_object(config_path, ConversionError)
    if config.get("model_type", "bert") != "bert":
        raise ConversionError(f"{config_path}: model_type={config['model_type']!r}: bertjax "
                              "converts BERT cross-encoders")
    sbert_path = weights / SBERT_CONFIG_FILE
    sbert = _optional(sbert_path)
    task = sbert.get("transformer_task", SEQUENCE_CLASSIFICATION)
    if task != SEQUENCE_CLASSIFICATION:
        raise ConversionError(f"{sbert_path}: transformer_task {task!r} is not "
                              f"{SEQUENCE_CLASSIFICATION!r}")
    if sbert.get("do_lower_case"):
        raise ConversionError(f"{sbert_path}: do_lower_case=true (texts lower-cased before "
                              "the tokenizer) is not supported for cross-encoders")
    st_config = _optional(directory / ST_CONFIG_FILE)
    if st_config.get("default_prompt_name"):
        raise ConversionError(f"{directory / ST_CONFIG_FILE}: a default prompt "
                              f"({st_config['default_prompt_name']!r}) is not supported for "
                              "cross-encoders")
    notes: list[str] = []
    activation = _activation(directory, weights, notes)
    positions = int(config.get("max_position_embeddings", 512))
    return CrossEncoderDir(weights, activation, _max_seq_length(weights, sbert, positions),
                           tuple(notes))


def classifier(params: dict[str, Any], source: str) -> dict[str, Any]:
    """The one-label classifier of converted BertForSequenceClassification params."""
    head = params.get("classifier")
    if head is None:
        raise ConversionError(f"{source}: no classifier.weight / classifier.bias (a "
                              "CrossEncoder's BertForSequenceClassification head)")
    if tuple(head["bias"].shape) != (1,):
        raise ConversionError(f"{source}: the classifier has {head['bias'].shape[0]} outputs; "
                              "a reranker scores a pair with one")
    return head


def write_modules(output_directory: str | epath.Path, activation: str,
                  max_seq_length: int) -> list[str]:
    """Makes a transformers BertForSequenceClassification directory (as to_hf writes it) a
    CrossEncoder one: the files sentence-transformers 6 writes, the activation also in
    config.json (where 4 and 5 read it) and the max length as the tokenizer's
    model_max_length. Returns the files written or changed, relative to the directory."""
    if activation not in ACTIVATIONS:
        raise ConversionError(f"activation {activation!r} is not one of {' | '.join(ACTIVATIONS)}")
    output = epath.Path(output_directory)
    torch_name = TORCH_NAMES[activation]
    files: dict[str, Any] = {
        MODULES_FILE: [{"idx": 0, "name": "0", "path": "", "type": TRANSFORMER_TYPE}],
        SBERT_CONFIG_FILE: {"transformer_task": SEQUENCE_CLASSIFICATION,
                            "modality_config": {"text": {"method": "forward",
                                                         "method_output_name": "logits"}},
                            "module_output_name": "scores"},
        ST_CONFIG_FILE: {"model_type": "CrossEncoder", "activation_fn": torch_name,
                         "prompts": {}, "default_prompt_name": None},
    }
    updates = {"config.json": {"sentence_transformers": {"activation_fn": torch_name}},
               "tokenizer_config.json": {"model_max_length": int(max_seq_length)}}
    for name, fields in updates.items():
        if (output / name).exists():
            files[name] = {**_optional(output / name), **fields}
    for name, value in files.items():
        (output / name).write_text(json.dumps(value, indent=2) + "\n")
    return list(files)

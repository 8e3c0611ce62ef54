"""transformers' ModernBERT checkpoints (config.json + model.safetensors) ↔ bertjax's
`bertjax.models.modernbert` parameters.

Reads and writes the ModernBertModel layout (no prefix), the ModernBertForMaskedLM one
(`model.` prefix, `head.*`, `decoder.bias`) and the task heads' (ModernBertFor
SequenceClassification / TokenClassification / QuestionAnswering / MultipleChoice: `model.`,
`head.*`, `classifier.weight` / `classifier.bias`; bertjax's `classifier` group, see
bertjax/models/heads.py), sharded `*.index.json` weights included. Every tensor is mapped by
`tensor_table`; the one other name a file may hold is the tied `decoder.weight` (transformers
does not save it; a copy must equal `model.embeddings.tok_embeddings.weight`). Anything else is
an error naming it. Layouts:

    Wqkv.weight [3·hidden, hidden]    → wqkv/kernel [hidden, 3, heads, head_dim]
                                        (rows: q | k | v, each head-major)
    attn.Wo.weight [hidden, hidden]   → attn/wo/kernel [heads, head_dim, hidden]
    mlp.Wi.weight [2·inter, hidden]   → mlp/wi/kernel [hidden, 2, inter]
                                        (rows: the activated half, then the gate)
    mlp.Wo.weight [hidden, inter]     → mlp/wo/kernel [inter, hidden]
    head.dense.weight [hidden, hidden] → head/dense/kernel, transposed
    classifier.weight [labels, hidden] → classifier/kernel [hidden, labels], transposed

torch `nn.Linear` weights are [out, in]; bertjax kernels are [in, out] with the axes split, so
every mapping is a transpose and a reshape, values untouched.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from bertjax import paths
from bertjax.convert.huggingface import SAFETENSORS, weights_files
from bertjax.convert.mapping import ConversionError
from bertjax.errors import CheckpointError, ConfigError
from bertjax.models.modernbert import ModernConfig

PREFIX = "model."  # the encoder inside a head class; ModernBertModel's own keys have none
TIED_DECODER = "decoder.weight"
TOKEN_EMBEDDINGS = "embeddings.tok_embeddings.weight"

MASKED_LM = "ModernBertForMaskedLM"
ENCODER = "ModernBertModel"
# transformers' classes → the bertjax parameter groups each holds. The four task classes
# share one layout (the classifier's outputs: num_labels, or 1 for multiple choice).
ARCHITECTURES = {
    ENCODER: ("model",),
    MASKED_LM: ("model", "head", "decoder_bias"),
    "ModernBertForSequenceClassification": ("model", "head", "classifier"),
    "ModernBertForTokenClassification": ("model", "head", "classifier"),
    "ModernBertForQuestionAnswering": ("model", "head", "classifier"),
    "ModernBertForMultipleChoice": ("model", "head", "classifier"),
}


@dataclasses.dataclass(frozen=True)
class ModernTensor:
    """One parameter: its bertjax path and shape, its transformers name (without the `model.`
    prefix for the encoder) and shape, and whether the latter is an [out, in] weight."""

    path: tuple[str, ...]
    hf_name: str
    shape: tuple[int, ...]
    hf_shape: tuple[int, ...]
    transposed: bool = False
    group: str = "model"  # the top-level parameter group (ARCHITECTURES)

    def to_bertjax(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray((array.T if self.transposed else array).reshape(self.shape))

    def to_hf(self, array: Any) -> np.ndarray:
        array = np.asarray(array)
        if self.transposed:
            return np.ascontiguousarray(array.reshape(self.hf_shape[::-1]).T)
        return np.ascontiguousarray(array.reshape(self.hf_shape))


def tensor_table(config: ModernConfig, num_labels: int = 0) -> list[ModernTensor]:
    """Every parameter of ModernBertForMaskedLM(config), in transformers' order, and with
    num_labels > 0 a task head's classifier of that many outputs."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    heads, head_dim = config.num_heads, config.head_dim
    table = [
        ModernTensor(("model", "embeddings", "tok_embeddings", "embedding"), TOKEN_EMBEDDINGS,
                     (vocab, hidden), (vocab, hidden)),
        ModernTensor(("model", "embeddings", "norm", "scale"), "embeddings.norm.weight",
                     (hidden,), (hidden,)),
    ]
    for i in range(config.num_layers):
        ours, theirs = ("model", f"layers_{i}"), f"layers.{i}"

        def add(path, name, shape, hf_shape, transposed=True, ours=ours, theirs=theirs):
            table.append(ModernTensor((*ours, *path), f"{theirs}.{name}", shape, hf_shape,
                                      transposed))

        if i:  # layer 0's attention norm is the identity
            add(("attn_norm", "scale"), "attn_norm.weight", (hidden,), (hidden,), False)
        add(("attn", "wqkv", "kernel"), "attn.Wqkv.weight", (hidden, 3, heads, head_dim),
            (3 * hidden, hidden))
        add(("attn", "wo", "kernel"), "attn.Wo.weight", (heads, head_dim, hidden),
            (hidden, hidden))
        add(("mlp_norm", "scale"), "mlp_norm.weight", (hidden,), (hidden,), False)
        add(("mlp", "wi", "kernel"), "mlp.Wi.weight", (hidden, 2, inter), (2 * inter, hidden))
        add(("mlp", "wo", "kernel"), "mlp.Wo.weight", (inter, hidden), (hidden, inter))
    table += [
        ModernTensor(("model", "final_norm", "scale"), "final_norm.weight", (hidden,),
                     (hidden,)),
        ModernTensor(("head", "dense", "kernel"), "head.dense.weight", (hidden, hidden),
                     (hidden, hidden), transposed=True, group="head"),
        ModernTensor(("head", "norm", "scale"), "head.norm.weight", (hidden,), (hidden,),
                     group="head"),
        ModernTensor(("decoder_bias",), "decoder.bias", (vocab,), (vocab,),
                     group="decoder_bias"),
    ]
    if num_labels:
        table += [
            ModernTensor(("classifier", "kernel"), "classifier.weight", (hidden, num_labels),
                         (num_labels, hidden), transposed=True, group="classifier"),
            ModernTensor(("classifier", "bias"), "classifier.bias", (num_labels,),
                         (num_labels,), group="classifier"),
        ]
    return table


def _file_name(spec: ModernTensor, prefixed: bool) -> str:
    return PREFIX + spec.hf_name if prefixed and spec.group == "model" else spec.hf_name


def _num_labels(tensors: Mapping[str, Any], source: str) -> int:
    """The classifier's outputs in transformers' tensors (0: none)."""
    for name, axis in (("classifier.bias", 0), ("classifier.weight", 0)):
        if name in tensors:
            shape = np.shape(tensors[name])
            if len(shape) != (1 if name.endswith("bias") else 2):
                raise ConversionError(f"{source}: tensor {name} has shape {tuple(shape)}")
            return int(shape[axis])
    return 0


# ---------------------------------------------------------------------------------------------
# Reading


def read_config(directory: epath.Path) -> ModernConfig:
    path = directory / "config.json"
    if not path.exists():
        raise ConversionError(f"--input {directory}: no config.json")
    values = paths.read_json_object(path, ConversionError, f"--input {path}")
    try:
        return ModernConfig.from_hf(values)
    except ConfigError as e:
        raise ConversionError(f"--input {path}: {e}") from None


def read_tensors(directory: epath.Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for path in weights_files(directory):
        if not path.name.endswith(".safetensors"):
            raise ConversionError(f"--input {path}: ModernBERT is read from safetensors only")
        if not path.exists():
            raise ConversionError(f"{path}: no such file (listed in the weights index)")
        from safetensors import SafetensorError, safe_open

        try:  # the flax reader: NumPy cannot name bfloat16, ml_dtypes can
            with safe_open(str(path), framework="flax") as f:
                tensors.update({name: np.asarray(f.get_tensor(name)) for name in f.keys()})
        except SafetensorError as e:
            raise ConversionError(f"{path}: unreadable safetensors file ({e})") from None
    return tensors


def import_params(config: ModernConfig, tensors: Mapping[str, np.ndarray],
                  source: str) -> dict[str, Any]:
    """Nested bertjax params from transformers' named tensors: `model` always; `head` and
    `decoder_bias` where the source is a ModernBertForMaskedLM; `head` and `classifier` where
    it is a task head's class. A missing, misshapen or unknown tensor raises ConversionError
    naming it as the source spells it."""
    tensors = dict(tensors)
    prefixed = any(name.startswith(PREFIX) for name in tensors)
    num_labels = _num_labels(tensors, source)
    table = tensor_table(config, num_labels)
    if TIED_DECODER in tensors:  # a copy of what it is tied to: checked, then dropped
        embeddings = tensors.get(PREFIX + TOKEN_EMBEDDINGS)
        if embeddings is None or not np.array_equal(tensors[TIED_DECODER], embeddings):
            raise ConversionError(f"{source}: tensor {TIED_DECODER} differs from "
                                  f"{PREFIX + TOKEN_EMBEDDINGS}; bertjax ties the decoder to "
                                  "the token embeddings")
        del tensors[TIED_DECODER]
    present = {s.group for s in table if s.group != "model" and s.hf_name in tensors}
    if {"decoder_bias", "classifier"} <= present:
        raise ConversionError(f"{source}: holds both an MLM decoder (decoder.bias) and a "
                              "classifier (classifier.*), which no ModernBERT class has")
    groups = {"model"}
    if present:  # a head class: its prediction head, and the decoder or the classifier
        groups |= {"head", "classifier" if "classifier" in present else "decoder_bias"}
    params: dict[str, Any] = {}
    for spec in (s for s in table if s.group in groups):
        name = _file_name(spec, prefixed)
        if name not in tensors:
            raise ConversionError(f"{source}: missing tensor {name}")
        array = np.asarray(tensors.pop(name))
        if array.shape != spec.hf_shape:
            raise ConversionError(f"{source}: tensor {name} has shape {tuple(array.shape)} but "
                                  f"config.json implies {spec.hf_shape}")
        if not np.issubdtype(array.dtype, np.floating) and array.dtype.kind != "V":
            raise ConversionError(f"{source}: tensor {name} has dtype {array.dtype}, expected "
                                  "floating point")
        tree = params
        for key in spec.path[:-1]:
            tree = tree.setdefault(key, {})
        tree[spec.path[-1]] = spec.to_bertjax(array)
    if tensors:
        raise ConversionError(
            f"{source}: tensor(s) {', '.join(sorted(tensors))} are not parameters of "
            f"{' / '.join(ARCHITECTURES)}")
    return params


def read_hf(directory: str | epath.Path) -> tuple[ModernConfig, dict[str, Any]]:
    """(config, params) from a directory written by transformers' `save_pretrained` of a
    ModernBertModel, ModernBertForMaskedLM or task head class. params: {"model": ...} for the
    first, plus "head" and "decoder_bias" (`ModernBertForMaskedLM`'s tree) or "head" and
    "classifier" (the heads of bertjax/models/heads.py)."""
    directory = epath.Path(directory)
    config = read_config(directory)
    return config, import_params(config, read_tensors(directory), f"--input {directory}")


# ---------------------------------------------------------------------------------------------
# Writing


def architecture_of(params: Mapping[str, Any]) -> str:
    """The transformers class whose parameters `params` hold (a task head: its sequence
    classification class, the four sharing one layout)."""
    if "classifier" in params:
        return "ModernBertForSequenceClassification"
    return MASKED_LM if "head" in params else ENCODER


def to_hf_state_dict(config: ModernConfig, params: Mapping[str, Any],
                     architecture: str | None = None) -> dict[str, np.ndarray]:
    """bertjax params → {transformers name: array} of `architecture` (default:
    `architecture_of(params)`), the groups it holds (ARCHITECTURES) with its names (the
    `model.` prefix in every class but ModernBertModel); the tied decoder matrix left out, as
    transformers saves it."""
    architecture = architecture or architecture_of(params)
    if architecture not in ARCHITECTURES:
        raise ConversionError(f"--architecture={architecture!r} is not one of "
                              f"{sorted(ARCHITECTURES)}")
    groups = ARCHITECTURES[architecture]
    for group in groups:
        if group not in params:
            raise ConversionError(f"a {architecture} needs the {group!r} parameters, which "
                                  "this model does not have")
    num_labels = np.shape(params["classifier"]["bias"])[0] if "classifier" in groups else 0
    out = {}
    for spec in tensor_table(config, num_labels):
        if spec.group not in groups:
            continue
        tree = params
        for key in spec.path:
            tree = tree[key]
        out[_file_name(spec, architecture != ENCODER)] = spec.to_hf(tree)
    return out


def hf_config(config: ModernConfig, architecture: str, labels: Sequence[str] = (),
              num_labels: int = 0, problem_type: str | None = None,
              extra_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """transformers' config.json of `architecture`: the model's fields, and for a classifier
    of `num_labels` outputs its label names (id2label; default LABEL_i), problem_type and
    `extra_config` (classifier_pooling, classifier_dropout, a SQuAD v2.0 threshold, ...)."""
    values = config.to_hf(architecture)
    if num_labels and architecture != "ModernBertForMultipleChoice":
        names = list(labels) or [f"LABEL_{i}" for i in range(num_labels)]
        if len(names) != num_labels:
            raise ConversionError(f"{len(names)} label names for a classifier of {num_labels} "
                                  "outputs")
        values["id2label"] = dict(enumerate(names))
        values["label2id"] = {name: i for i, name in enumerate(names)}
    if problem_type:
        values["problem_type"] = problem_type
    values.update(extra_config or {})
    return values


def write_hf(output: str | epath.Path, config: ModernConfig, params: Mapping[str, Any],
             overwrite: bool = False, architecture: str | None = None,
             labels: Sequence[str] = (), problem_type: str | None = None,
             extra_config: Mapping[str, Any] | None = None, dtype: str = "float32") -> str:
    """config.json + model.safetensors that transformers' `architecture` (default:
    `architecture_of(params)`) loads, in `dtype`; see `hf_config` for the rest. Returns the
    architecture written."""
    output = epath.Path(output)
    weights = output / SAFETENSORS
    if weights.exists() and not overwrite:
        raise ConversionError(f"--output {weights} already exists (pass --overwrite)")
    architecture = architecture or architecture_of(params)
    tensors = to_hf_state_dict(config, params, architecture)
    num_labels = (np.shape(params["classifier"]["bias"])[0]
                  if "classifier" in ARCHITECTURES[architecture] else 0)
    values = hf_config(config, architecture, labels, num_labels, problem_type, extra_config)
    values["dtype"] = dtype
    output.mkdir(parents=True, exist_ok=True)
    (output / "config.json").write_text(json.dumps(values, indent=2) + "\n")
    save_safetensors(tensors, weights, dtype)
    return architecture


def save_safetensors(tensors: Mapping[str, np.ndarray], path: epath.Path, dtype: str) -> None:
    """`tensors` in `dtype` as a safetensors file transformers reads (a "format" entry in the
    metadata, which it demands)."""
    if dtype == "bfloat16":  # safetensors.numpy cannot write it; its JAX writer can
        import jax.numpy as jnp
        from safetensors.flax import save_file as save_jax

        save_jax({k: jnp.asarray(v, jnp.bfloat16) for k, v in tensors.items()}, str(path),
                 metadata={"format": "pt"})
        return
    from safetensors.numpy import save_file

    save_file({k: np.asarray(v).astype(dtype) for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})


def write_tokenizer(output: str | epath.Path, vocab: epath.Path, do_lower_case: bool,
                    max_length: int) -> list[str]:
    """The vocabulary beside a written model, with the tokenizer_config.json transformers'
    AutoTokenizer reads: a vocab.txt as a BertTokenizer ([CLS] A [SEP], bertjax's layout), a
    tokenizer.json as a PreTrainedTokenizerFast (its own post-processor adds the special
    tokens) naming its special tokens, a SentencePiece model copied (transformers has no
    tokenizer class for a bertjax one). Returns notes for the user."""
    output = epath.Path(output)
    if vocab.name.endswith(".model"):
        vocab.copy(output / vocab.name, overwrite=True)
        return [f"copied the SentencePiece model {vocab.name}; transformers has no tokenizer "
                "class that reads it as bertjax does, so load it with sentencepiece"]
    if vocab.name.endswith(".json"):
        from bertjax.tokenization.bpe import SPECIAL_NAMES, TokenizersTokenizer

        vocab.copy(output / "tokenizer.json", overwrite=True)
        tokenizer = TokenizersTokenizer.from_file(str(vocab))
        tokens = {f"{role}_token": tokenizer.convert_ids_to_tokens(
            [getattr(tokenizer, f"{role}_id")])[0] for role in SPECIAL_NAMES}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokens,
                  "model_max_length": max_length}
    else:
        vocab.copy(output / "vocab.txt", overwrite=True)
        # transformers' AutoTokenizer gives a ModernBERT a PreTrainedTokenizerFast, which
        # reads a tokenizer.json only: the vocabulary as one, as BertTokenizerFast builds it.
        (output / "tokenizer.json").write_text(
            wordpiece_tokenizer_json(vocab, do_lower_case).to_str(pretty=True))
        config = {"tokenizer_class": "BertTokenizer", "do_lower_case": do_lower_case,
                  **{f"{role}_token": f"[{role.upper()}]"
                     for role in ("cls", "sep", "mask", "pad", "unk")},
                  "model_max_length": max_length}
    (output / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return []


def wordpiece_tokenizer_json(vocab: epath.Path, do_lower_case: bool):
    """A WordPiece vocab.txt as a `tokenizers.Tokenizer`: BERT's normaliser (lower-casing and
    accent stripping as do_lower_case says), pre-tokenizer, [CLS] A [SEP] (B [SEP])
    post-processor and decoder."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tokens = vocab.read_text(encoding="utf-8").split("\n")
    ids = {token: i for i, token in enumerate(tokens) if token or i < len(tokens) - 1}
    tokenizer = Tokenizer(models.WordPiece(ids, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=do_lower_case,
                                                      strip_accents=do_lower_case)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.BertProcessing(("[SEP]", ids["[SEP]"]),
                                                         ("[CLS]", ids["[CLS]"]))
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def read_export(path: epath.Path, fields: Mapping[str, Any], architecture: str | None,
                make_model, init_inputs) -> tuple[ModernConfig, dict[str, Any]]:
    """(config, params) of a fine-tuning run exported by `convert to_hf` (transformers'
    ModernBertFor* or, for an embedding run, ModernBertModel weights), checked against the
    run's model (`make_model(config)` called with `init_inputs`): any missing or extra group is
    a CheckpointError."""
    del architecture  # the weights' own groups say which class they are
    config = ModernConfig.from_dict(fields)
    params = import_params(config, read_tensors(path), f"--export {path}")
    model = make_model(config)
    want = jax.eval_shape(lambda: model.init(jax.random.key(0), *init_inputs))["params"]
    if set(params) != set(want):
        raise CheckpointError(f"--export {path}: its weights hold {sorted(params)} but the "
                              f"run's model has {sorted(want)}")
    return config, params


# ---------------------------------------------------------------------------------------------
# What `python -m bertjax.convert` asks of an architecture's conversion module

CHECKPOINT_CLASSES = (MASKED_LM, ENCODER)  # what a checkpoint directory may be written as


def read_model(directory: epath.Path) -> tuple[ModernConfig, dict[str, Any], dict[str, str]]:
    """(config, params, skipped) of a transformers ModernBERT directory: a task head's
    classifier is dropped and listed (no ModernBertForMaskedLM parameter holds it)."""
    config, params = read_hf(directory)
    skipped = {}
    if "classifier" in params:
        del params["classifier"]
        skipped = {name: "a task head's classifier, not a ModernBertForMaskedLM parameter"
                   for name in ("classifier.weight", "classifier.bias")}
    return config, params, skipped


def write_model(output: str | epath.Path, config: ModernConfig, params: Mapping[str, Any],
                vocab: epath.Path, do_lower_case: bool, architecture: str, max_length: int, *,
                dtype: str, overwrite: bool, **task_fields) -> list[str]:
    """`write_hf` and `write_tokenizer` (its model_max_length `max_length`)."""
    write_hf(output, config, params, overwrite, architecture, dtype=dtype, **task_fields)
    return write_tokenizer(output, vocab, do_lower_case, max_length)

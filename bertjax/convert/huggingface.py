"""Hugging Face BERT checkpoints (config.json + model.safetensors / pytorch_model.bin) ↔ bertjax.

Reads the BertModel (no `bert.` prefix, no heads), BertForMaskedLM (no pooler, no NSP) and
BertForPreTraining layouts, with or without the `bert.` prefix, old `LayerNorm.gamma/beta`
names, sharded `*.index.json` weights, and tied `cls.predictions.decoder.*` copies (checked
equal to what they are tied to); errors name tensors as the source spells them. Writes
safetensors that transformers loads. torch is needed only for pytorch_model.bin.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from etils import epath

from bertjax import paths
from bertjax.convert.mapping import (
    HF_ACTIVATIONS,
    ConversionError,
    TensorSpec,
    classifier_specs,
    config_from_reference,
    config_to_hf,
    export_tensors,
    import_tensors,
    qa_outputs_specs,
    reference_specs,
)
from bertjax.errors import CheckpointError
from bertjax.models.bert.config import BertConfig

SAFETENSORS = "model.safetensors"
PYTORCH_BIN = "pytorch_model.bin"
# Which parameter groups each exported architecture holds.
ARCHITECTURES = {
    "BertForPreTraining": ("encoder", "bert/pooler", "mlm", "nsp"),
    "BertForMaskedLM": ("encoder", "mlm"),
    "BertModel": ("encoder", "bert/pooler"),
    # transformers' BertForTokenClassification has no pooler (add_pooling_layer=False).
    "BertForTokenClassification": ("encoder", "classifier"),
    # transformers' BertForQuestionAnswering has no pooler either.
    "BertForQuestionAnswering": ("encoder", "qa_outputs"),
    # A dense layer on the pooled [CLS] vector: num_labels outputs, or one score per choice.
    "BertForSequenceClassification": ("encoder", "bert/pooler", "classifier"),
    "BertForMultipleChoice": ("encoder", "bert/pooler", "classifier"),
}
# The tied MLM decoder as transformers names it: copy name → the name it must equal.
TIED = {
    "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}
_BUFFERS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")


# ---------------------------------------------------------------------------------------------
# Reading


def _torch_to_numpy(tensor) -> np.ndarray:
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16; reinterpret the bits
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _load_file(path: epath.Path) -> dict[str, np.ndarray]:
    if not path.exists():
        raise ConversionError(f"{path}: no such file (listed in the weights index)")
    if path.name.endswith(".safetensors"):
        from safetensors import SafetensorError, safe_open
        from safetensors.numpy import load_file

        try:
            try:
                return load_file(str(path))
            except TypeError:  # bfloat16: NumPy cannot name it, JAX (via ml_dtypes) can
                with safe_open(str(path), framework="flax") as f:
                    return {name: np.asarray(f.get_tensor(name)) for name in f.keys()}
        except SafetensorError as e:  # truncated or not safetensors at all
            raise ConversionError(f"{path}: unreadable safetensors file ({e})") from None
    try:
        import torch
    except ImportError as e:
        raise ConversionError(f"{path}: reading pytorch_model.bin needs torch "
                              "(pip install torch), or convert it to safetensors") from e
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, ValueError) as e:  # truncated zip, not a checkpoint
        raise ConversionError(f"{path}: unreadable PyTorch checkpoint ({e})") from None
    return {name: _torch_to_numpy(t) for name, t in state.items()}


def weights_files(directory: epath.Path) -> list[epath.Path]:
    """The weight file(s) of an HF directory, safetensors preferred; sharded ones via index."""
    for name in (SAFETENSORS, PYTORCH_BIN):
        if (directory / name).exists():
            return [directory / name]
        index = directory / f"{name}.index.json"
        if index.exists():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ConversionError(f"{index}: not a weights index ({e!r})") from None
            return [directory / shard for shard in shards]
    raise ConversionError(f"--input {directory}: no {SAFETENSORS} or {PYTORCH_BIN} found")


def source_naming(names) -> Callable[[str], str]:
    """Maps a BertForPreTraining name to the source's spelling of it: without the `bert.`
    prefix for BertModel files, with `LayerNorm.gamma/beta` for old ones. Errors then name
    tensors exactly as they are in the user's file."""
    names = list(names)
    prefixed = any(name.startswith("bert.") for name in names)
    legacy = any(name.endswith(".LayerNorm.gamma") for name in names)

    def rename(name: str) -> str:
        if not prefixed:
            name = name.removeprefix("bert.")
        if legacy and ".LayerNorm." in name:
            name = name.replace(".LayerNorm.weight", ".LayerNorm.gamma")
            name = name.replace(".LayerNorm.bias", ".LayerNorm.beta")
        return name

    return rename


def read_config(directory: epath.Path) -> BertConfig:
    path = directory / "config.json"
    if not path.exists():
        raise ConversionError(f"--input {directory}: no config.json")
    values = paths.read_json_object(path, ConversionError, f"--input {path}")
    return config_from_reference(values, str(path), HF_ACTIVATIONS)


def read_hf_checkpoint(
    directory: str | epath.Path, config: BertConfig, heads: tuple[str, ...] = ()
) -> tuple[dict[str, Any], dict[str, str]]:
    """(params, {skipped tensor: why}) from an HF directory."""
    directory = epath.Path(directory)
    files = weights_files(directory)
    tensors: dict[str, Any] = {}
    for path in files:
        tensors.update(_load_file(path))
    rename = source_naming(tensors)
    source = f"--input {files[0] if len(files) == 1 else directory}"
    skipped = {}
    for copy, original in TIED.items():
        copy, original = rename(copy), rename(original)
        if copy not in tensors:
            continue
        if original not in tensors and copy.endswith("bias"):
            tensors[original] = tensors[copy]  # some exports keep only the decoder's bias
        elif original in tensors and not np.array_equal(tensors[copy], tensors[original]):
            raise ConversionError(f"{source}: tensor {copy} differs from {original}; bertjax "
                                  "ties the MLM decoder to the word embeddings")
        del tensors[copy]
        skipped[copy] = f"tied to {original}"
    for name in map(rename, _BUFFERS):
        if tensors.pop(name, None) is not None:
            skipped[name] = "buffer, not a parameter"
    params, unused = import_tensors(
        reference_specs(config) + _head_specs(heads, tensors, rename, config),
        tensors, lambda s: rename(s.hf_name),
        lambda s: s.hf_transposed, source, config,
    )
    skipped.update({name: "not a BertForPreTraining parameter" for name in unused})
    return params, skipped


# ---------------------------------------------------------------------------------------------
# Writing


def _head_specs(heads, source, rename, config: BertConfig) -> list[TensorSpec]:
    """Specs of the fine-tuning heads among `heads` that `source` holds (HF tensors by name
    when `rename` is given, otherwise bertjax params); their sizes come from the source."""
    specs = []
    if "qa_outputs" in heads and (rename("qa_outputs.bias") in source if rename is not None
                                  else "qa_outputs" in source):
        specs = qa_outputs_specs(config.hidden_size)
    if "classifier" not in heads:
        return specs
    if rename is not None:
        name = rename("classifier.bias")
        if name not in source:
            return specs
        num_labels = np.shape(source[name])[0]
    elif "classifier" in source:
        num_labels = np.shape(source["classifier"]["bias"])[0]
    else:
        return specs
    return specs + classifier_specs(config.hidden_size, int(num_labels))


def _hf_name(architecture: str):
    def name_of(spec: TensorSpec) -> str:
        if architecture == "BertModel":  # BertModel's own keys carry no prefix
            return spec.hf_name.removeprefix("bert.")
        return spec.hf_name

    return name_of


def export_hf_tensors(
    config: BertConfig, params: Mapping[str, Any], architecture: str, dtype: str
) -> dict[str, np.ndarray]:
    """bertjax params → {HF name: array} for `architecture` (tied copies omitted)."""
    if architecture not in ARCHITECTURES:
        raise ConversionError(f"--architecture={architecture!r} is not one of "
                              f"{sorted(ARCHITECTURES)}")
    groups = ARCHITECTURES[architecture]
    tensors = export_tensors(reference_specs(config) + _head_specs(groups, params, None, config),
                             params, _hf_name(architecture),
                             lambda s: s.hf_transposed, keep=lambda s: s.group in groups)
    return {name: array.astype(dtype) for name, array in tensors.items()}


def _pad_token_id(vocab: epath.Path) -> int:
    if vocab.name.endswith(".txt"):
        for index, line in enumerate(vocab.read_text(encoding="utf-8").split("\n")):
            if line.strip() == "[PAD]":
                return index
    return 0


def write_hf_checkpoint(
    output: str | epath.Path,
    config: BertConfig,
    params: Mapping[str, Any],
    vocab: epath.Path,
    do_lower_case: bool,
    architecture: str = "BertForPreTraining",
    dtype: str = "float32",
    overwrite: bool = False,
    labels: Sequence[str] = (),
    problem_type: str | None = None,
    extra_config: Mapping[str, Any] | None = None,
) -> list[str]:
    """Writes config.json, model.safetensors, the vocabulary and tokenizer_config.json.

    labels: the classifier's label names (config id2label; default LABEL_i); problem_type:
    transformers' "regression" | "single_label_classification" (how it computes the loss);
    extra_config: more config.json fields (e.g. SQuAD v2.0's null_score_diff_threshold).

    Returns notes to show the user (e.g. a SentencePiece vocabulary BertTokenizer cannot read).
    """
    from safetensors.numpy import save_file

    output = epath.Path(output)
    weights = output / SAFETENSORS
    if weights.exists() and not overwrite:
        raise ConversionError(f"--output {weights} already exists (pass --overwrite)")
    tensors = export_hf_tensors(config, params, architecture, dtype)
    hf_config = config_to_hf(config, architecture, _pad_token_id(vocab))
    hf_config["dtype"] = dtype
    if "classifier" in ARCHITECTURES.get(architecture, ()):
        num_labels = np.shape(params["classifier"]["bias"])[0]
        names = list(labels) or [f"LABEL_{i}" for i in range(num_labels)]
        if len(names) != num_labels:
            raise ConversionError(f"{len(names)} label names for a classifier of {num_labels} "
                                  "outputs")
        hf_config["id2label"] = dict(enumerate(names))
        hf_config["label2id"] = {name: i for i, name in enumerate(names)}
    if problem_type:
        hf_config["problem_type"] = problem_type
    hf_config.update(extra_config or {})
    output.mkdir(parents=True, exist_ok=True)
    (output / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    # transformers refuses safetensors files without a "format" entry in the metadata.
    if dtype == "bfloat16":  # safetensors.numpy cannot write it; its JAX writer can
        import jax.numpy as jnp
        from safetensors.flax import save_file as save_jax

        save_jax({k: jnp.asarray(v) for k, v in tensors.items()}, str(weights),
                 metadata={"format": "pt"})
    else:
        save_file(tensors, str(weights), metadata={"format": "pt"})
    notes = []
    if vocab.name.endswith(".model"):
        vocab.copy(output / vocab.name, overwrite=True)
        notes.append(f"copied the SentencePiece model {vocab.name}; transformers' "
                     "BertTokenizer reads only vocab.txt, so load it with sentencepiece")
    else:
        vocab.copy(output / "vocab.txt", overwrite=True)
        tokenizer_config = {"tokenizer_class": "BertTokenizer", "do_lower_case": do_lower_case,
                            "model_max_length": config.max_position_embeddings}
        (output / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return notes


# ---------------------------------------------------------------------------------------------
# A fine-tuning run's export


def read_export(path: epath.Path, fields: Mapping[str, Any], architecture: str | None,
                make_model, init_inputs) -> tuple[BertConfig, dict[str, Any]]:
    """(config, params in the layout config.scan_layers selects) of a fine-tuning run exported
    by `convert to_hf` (`architecture`: its transformers class): the weights checked against
    the run's model (`make_model(config)` called with `init_inputs`); transformers'
    token-classification and QA classes have no pooler, which is filled with zeros (those
    heads never read it)."""
    from bertjax.models import layout

    config = BertConfig.from_dict(fields)
    unrolled = BertConfig.from_dict({**fields, "scan_layers": False})
    heads = ARCHITECTURES.get(architecture, ("classifier", "qa_outputs"))
    params = read_hf_checkpoint(path, unrolled, heads)[0]
    model = make_model(unrolled)
    abstract = nn.unbox(jax.eval_shape(
        lambda: model.init(jax.random.key(0), *init_inputs))["params"])
    params = _fill_absent_pooler(params, abstract, path)
    return config, layout.to_layout(params, config.scan_layers)


def _fill_absent_pooler(params: dict, abstract: dict, directory) -> dict:
    """`params` completed with zeros for the pooler; any other missing or extra parameter is a
    CheckpointError."""
    def merge(have, want, path):
        if not isinstance(want, dict):
            return have
        missing = sorted(set(want) - set(have or {}))
        if missing and path != ("bert",) or set(have or {}) - set(want):
            raise CheckpointError(f"--export {directory}: its weights do not fit the run's "
                                  f"model at {'/'.join(path) or 'the top level'} (missing "
                                  f"{missing}, extra {sorted(set(have or {}) - set(want))})")
        out = {k: merge(have[k], want[k], path + (k,)) for k in want if k in have}
        for k in missing:
            if k != "pooler":
                raise CheckpointError(f"--export {directory}: no bert/{k} weights")
            out[k] = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), want[k])
        return out

    return merge(params, abstract, ())


# ---------------------------------------------------------------------------------------------
# What `python -m bertjax.convert` asks of an architecture's conversion module

CHECKPOINT_CLASSES = tuple(ARCHITECTURES)  # what a checkpoint directory may be written as


def read_model(directory: epath.Path) -> tuple[BertConfig, dict[str, Any], dict[str, str]]:
    """(config, params, skipped) of a transformers BERT directory."""
    config = read_config(directory)
    params, skipped = read_hf_checkpoint(directory, config)
    return config, params, skipped


def write_model(output: str | epath.Path, config: BertConfig, params: Mapping[str, Any],
                vocab: epath.Path, do_lower_case: bool, architecture: str, max_length: int, *,
                dtype: str, overwrite: bool, **task_fields) -> list[str]:
    """`write_hf_checkpoint` (a BERT tokenizer has no model_max_length: `max_length` is
    unused)."""
    del max_length
    return write_hf_checkpoint(output, config, params, vocab, do_lower_case, architecture,
                               dtype, overwrite, **task_fields)

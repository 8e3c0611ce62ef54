"""One table of every BERT tensor: its bertjax path, its TF1 and Hugging Face names, its shapes.

Both converters are driven by this table, so a tensor cannot be mapped in one direction and
forgotten in the other. Layout facts it encodes:

- TF1 stores dense kernels as [in, out]; torch `nn.Linear` stores weights as [out, in].
- bertjax splits the attention projections by head: Q/K/V kernels [hidden, heads, head_dim],
  their biases [heads, head_dim], the attention output kernel [heads, head_dim, hidden]. These
  are reshapes of the [in, out] matrices (head-major columns), so nothing is lost.
- The reference stores the NSP weight as `cls/seq_relationship/output_weights` [2, hidden]
  (already [out, in]); bertjax's `nsp/kernel` is [hidden, 2].
- The MLM decoder is tied to the word embeddings; only its bias (`mlm/output_bias`) is separate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from bertjax.checkpoint_dir import config_summary
from bertjax.errors import CheckpointError
from bertjax.models.bert.architecture import ARCHITECTURE as BERT
from bertjax.models.bert.config import BertConfig

# The name converters (and code that catches their errors) use: a checkpoint that does not
# match what the config implies; the message names the tensor.
ConversionError = CheckpointError


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One parameter. `flat_shape` is the reference 2-D [in, out] (or 1-D) layout."""

    path: tuple[str, ...]  # key path in the BertForPreTraining params dict
    tf_name: str
    hf_name: str  # BertForPreTraining naming (with the `bert.` prefix)
    shape: tuple[int, ...]  # bertjax shape
    flat_shape: tuple[int, ...]
    tf_transposed: bool = False  # the TF tensor is flat_shape reversed
    hf_transposed: bool = False  # the HF tensor is flat_shape reversed
    group: str = "encoder"  # "encoder" or one of BERT.optional_groups

    def external_shape(self, transposed: bool) -> tuple[int, ...]:
        return tuple(reversed(self.flat_shape)) if transposed else self.flat_shape

    def to_bertjax(self, array: np.ndarray, transposed: bool) -> np.ndarray:
        """External tensor → bertjax array (a transpose and/or a reshape; values untouched)."""
        flat = array.T if transposed else array
        return np.ascontiguousarray(flat.reshape(self.shape))

    def from_bertjax(self, array: np.ndarray, transposed: bool) -> np.ndarray:
        flat = np.asarray(array).reshape(self.flat_shape)
        return np.ascontiguousarray(flat.T if transposed else flat)


def reference_specs(config: BertConfig) -> list[TensorSpec]:
    """Every parameter of `BertForPreTraining(config)` (unrolled layers), in reference order."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    heads, head_dim = config.num_heads, config.head_dim
    specs: list[TensorSpec] = []

    def add(path, tf_name, hf_name, shape, flat_shape=None, group="encoder", **kw):
        specs.append(TensorSpec(tuple(path), tf_name, hf_name, tuple(shape),
                                tuple(flat_shape or shape), group=group, **kw))

    def dense(path, tf, hf, n_in, n_out, kernel_shape=None, bias_shape=None, group="encoder"):
        add((*path, "kernel"), f"{tf}/kernel", f"{hf}.weight", kernel_shape or (n_in, n_out),
            (n_in, n_out), hf_transposed=True, group=group)
        add((*path, "bias"), f"{tf}/bias", f"{hf}.bias", bias_shape or (n_out,), (n_out,),
            group=group)

    def layer_norm(path, tf, hf, group="encoder"):
        add((*path, "scale"), f"{tf}/gamma", f"{hf}.weight", (hidden,), group=group)
        add((*path, "bias"), f"{tf}/beta", f"{hf}.bias", (hidden,), group=group)

    emb = ("bert", "embeddings")
    for name, rows in (("word_embeddings", vocab),
                       ("position_embeddings", config.max_position_embeddings),
                       ("token_type_embeddings", config.type_vocab_size)):
        add((*emb, name, "embedding"), f"bert/embeddings/{name}",
            f"bert.embeddings.{name}.weight", (rows, hidden))
    layer_norm((*emb, "layer_norm"), "bert/embeddings/LayerNorm", "bert.embeddings.LayerNorm")

    for i in range(config.num_layers):
        path = ("bert", "encoder", f"layer_{i}")
        tf, hf = f"bert/encoder/layer_{i}", f"bert.encoder.layer.{i}"
        for name in ("query", "key", "value"):
            dense((*path, "attention", name), f"{tf}/attention/self/{name}",
                  f"{hf}.attention.self.{name}", hidden, hidden,
                  kernel_shape=(hidden, heads, head_dim), bias_shape=(heads, head_dim))
        dense((*path, "attention", "output"), f"{tf}/attention/output/dense",
              f"{hf}.attention.output.dense", hidden, hidden,
              kernel_shape=(heads, head_dim, hidden))
        layer_norm((*path, "attention_layer_norm"), f"{tf}/attention/output/LayerNorm",
                   f"{hf}.attention.output.LayerNorm")
        dense((*path, "intermediate"), f"{tf}/intermediate/dense", f"{hf}.intermediate.dense",
              hidden, inter)
        dense((*path, "output"), f"{tf}/output/dense", f"{hf}.output.dense", inter, hidden)
        layer_norm((*path, "output_layer_norm"), f"{tf}/output/LayerNorm",
                   f"{hf}.output.LayerNorm")

    dense(("bert", "pooler", "dense"), "bert/pooler/dense", "bert.pooler.dense", hidden, hidden,
          group="bert/pooler")
    dense(("mlm", "transform"), "cls/predictions/transform/dense",
          "cls.predictions.transform.dense", hidden, hidden, group="mlm")
    layer_norm(("mlm", "transform_layer_norm"), "cls/predictions/transform/LayerNorm",
               "cls.predictions.transform.LayerNorm", group="mlm")
    add(("mlm", "output_bias"), "cls/predictions/output_bias", "cls.predictions.bias", (vocab,),
        group="mlm")
    add(("nsp", "kernel"), "cls/seq_relationship/output_weights", "cls.seq_relationship.weight",
        (hidden, 2), tf_transposed=True, hf_transposed=True, group="nsp")
    add(("nsp", "bias"), "cls/seq_relationship/output_bias", "cls.seq_relationship.bias", (2,),
        group="nsp")
    return specs


def classifier_specs(hidden: int, num_labels: int) -> list[TensorSpec]:
    """The fine-tuning `classifier` head (token classification: a dense layer per position):
    bertjax `classifier/kernel` [hidden, num_labels] and `bias`; transformers'
    `classifier.weight` [num_labels, hidden] and `classifier.bias`. Group "classifier"."""
    return [TensorSpec(("classifier", "kernel"), "output_weights", "classifier.weight",
                       (hidden, num_labels), (hidden, num_labels), tf_transposed=True,
                       hf_transposed=True, group="classifier"),
            TensorSpec(("classifier", "bias"), "output_bias", "classifier.bias", (num_labels,),
                       (num_labels,), group="classifier")]


def qa_outputs_specs(hidden: int) -> list[TensorSpec]:
    """The SQuAD head `qa_outputs` (start and end logits per position): bertjax
    `qa_outputs/kernel` [hidden, 2] and `bias` [2]; transformers' `qa_outputs.weight` [2, hidden]
    and `qa_outputs.bias`; the reference run_squad.py's `cls/squad/output_weights` [2, hidden]
    and `cls/squad/output_bias`. Group "qa_outputs"."""
    return [TensorSpec(("qa_outputs", "kernel"), "cls/squad/output_weights", "qa_outputs.weight",
                       (hidden, 2), (hidden, 2), tf_transposed=True, hf_transposed=True,
                       group="qa_outputs"),
            TensorSpec(("qa_outputs", "bias"), "cls/squad/output_bias", "qa_outputs.bias", (2,),
                       (2,), group="qa_outputs")]


def import_tensors(
    specs: list[TensorSpec],
    tensors: Mapping[str, Any],
    name_of: Callable[[TensorSpec], str],
    transposed_of: Callable[[TensorSpec], bool],
    source: str,
    config: BertConfig,
) -> tuple[dict[str, Any], list[str]]:
    """Builds the nested bertjax params from named external tensors.

    tensors: name → array-like (read lazily: `tensors[name]` is called once per used name).
    Returns (params, unused tensor names); an optional group the source lacks entirely is left
    out (save_pretrained initialises and reports it). A required tensor that is missing, a
    partly present optional group, or any unexpected shape raises ConversionError.
    """
    by_group: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        by_group.setdefault(spec.group, []).append(spec)
    params: dict[str, Any] = {}
    used = set()
    for group, group_specs in by_group.items():
        present = [s for s in group_specs if name_of(s) in tensors]
        if not present and group in BERT.optional_groups:
            continue
        for spec in group_specs:
            name = name_of(spec)
            if name not in tensors:
                have = ", ".join(name_of(s) for s in present[:1])
                why = f" although {have} is there" if group != "encoder" and have else ""
                raise ConversionError(f"{source}: missing tensor {name}{why}")
            array = np.asarray(tensors[name])
            want = spec.external_shape(transposed_of(spec))
            if array.shape != want:
                raise ConversionError(
                    f"{source}: tensor {name} has shape {tuple(array.shape)} but the config "
                    f"({config_summary(config)}) implies {want}"
                )
            if not np.issubdtype(array.dtype, np.floating) and array.dtype.kind != "V":
                raise ConversionError(
                    f"{source}: tensor {name} has dtype {array.dtype}, expected floating point"
                )
            _set(params, spec.path, spec.to_bertjax(array, transposed_of(spec)))
            used.add(name)
    unused = sorted(set(tensors) - used)
    return params, unused


def export_tensors(
    specs: list[TensorSpec],
    params: Mapping[str, Any],
    name_of: Callable[[TensorSpec], str],
    transposed_of: Callable[[TensorSpec], bool],
    keep: Callable[[TensorSpec], bool] = lambda spec: True,
) -> dict[str, np.ndarray]:
    """The inverse of `import_tensors`: bertjax params → {external name: array}."""
    return {
        name_of(spec): spec.from_bertjax(_get(params, spec.path), transposed_of(spec))
        for spec in specs
        if keep(spec)
    }


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: Mapping, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


# ---------------------------------------------------------------------------------------------
# bert_config.json / Hugging Face config.json ↔ BertConfig

# Google's modeling.py computes "gelu" with the tanh approximation (the same function Hugging
# Face calls "gelu_new"); Hugging Face's "gelu" is the exact erf form.
TF_ACTIVATIONS = {"gelu": "gelu_tanh", "relu": "relu"}
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_fast": "gelu_tanh", "relu": "relu"}
HF_ACTIVATION_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}

_REFERENCE_FIELDS = {  # reference key → BertConfig field
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "intermediate_size": "intermediate_size",
    "hidden_dropout_prob": "hidden_dropout_prob",
    "attention_probs_dropout_prob": "attention_dropout_prob",
    "max_position_embeddings": "max_position_embeddings",
    "type_vocab_size": "type_vocab_size",
    "initializer_range": "initializer_range",
    "layer_norm_eps": "layer_norm_eps",
}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size")


def config_from_reference(
    values: Mapping[str, Any], source: str, activations: Mapping[str, str]
) -> BertConfig:
    """BertConfig from a bert_config.json / HF config.json dict; bad fields are named."""
    for key in _REQUIRED:
        if key not in values:
            raise ConversionError(f"{source}: missing field {key!r}")
    if values.get("model_type", "bert") != "bert":
        raise ConversionError(f"{source}: model_type={values['model_type']!r} is not 'bert'")
    if values.get("position_embedding_type", "absolute") != "absolute":
        raise ConversionError(f"{source}: position_embedding_type="
                              f"{values['position_embedding_type']!r} is not supported "
                              "(bertjax has absolute position embeddings only)")
    act = values.get("hidden_act", "gelu")
    if act not in activations:
        raise ConversionError(f"{source}: hidden_act={act!r} is not one of {sorted(activations)}")
    fields = {ours: values[theirs] for theirs, ours in _REFERENCE_FIELDS.items()
              if theirs in values}
    fields["hidden_act"] = activations[act]
    try:
        return BertConfig(**fields)
    except ValueError as e:
        raise ConversionError(f"{source}: {e}") from e


def config_to_hf(config: BertConfig, architecture: str, pad_token_id: int = 0) -> dict[str, Any]:
    """A transformers `BertConfig` dict for `config`."""
    if config.causal:
        raise ConversionError("model.causal=True (left-to-right attention) has no Hugging Face "
                              "BERT equivalent")
    values = {"architectures": [architecture], "model_type": "bert"}
    for theirs, ours in _REFERENCE_FIELDS.items():
        values[theirs] = getattr(config, ours)
    values.update(hidden_act=HF_ACTIVATION_NAMES[config.hidden_act],
                  position_embedding_type="absolute", pad_token_id=pad_token_id,
                  tie_word_embeddings=True, is_decoder=False)
    return values

"""transformers' ModernBERT checkpoints (config.json + model.safetensors) ↔ bertjax's
`bertjax.models.modern` parameters.

Reads the ModernBertModel layout (no prefix) and the ModernBertForMaskedLM one (`model.`
prefix, `head.*`, `decoder.bias`), sharded `*.index.json` weights included. Every tensor is
mapped by `tensor_table`; the one other name a file may hold is the tied `decoder.weight`
(transformers does not save it; a copy must equal `model.embeddings.tok_embeddings.weight`).
Anything else (a task head's `classifier.*`, say) is an error naming it. Layouts:

    Wqkv.weight [3·hidden, hidden]    → wqkv/kernel [hidden, 3, heads, head_dim]
                                        (rows: q | k | v, each head-major)
    attn.Wo.weight [hidden, hidden]   → attn/wo/kernel [heads, head_dim, hidden]
    mlp.Wi.weight [2·inter, hidden]   → mlp/wi/kernel [hidden, 2, inter]
                                        (rows: the activated half, then the gate)
    mlp.Wo.weight [hidden, inter]     → mlp/wo/kernel [inter, hidden]
    head.dense.weight [hidden, hidden] → head/dense/kernel, transposed

torch `nn.Linear` weights are [out, in]; bertjax kernels are [in, out] with the axes split, so
every mapping is a transpose and a reshape, values untouched.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from etils import epath

from bertjax import paths
from bertjax.convert.huggingface import SAFETENSORS, weights_files
from bertjax.convert.mapping import ConversionError
from bertjax.errors import ConfigError
from bertjax.models.modern import ModernConfig

PREFIX = "model."  # ModernBertForMaskedLM's encoder; ModernBertModel's own keys have none
TIED_DECODER = "decoder.weight"
TOKEN_EMBEDDINGS = "embeddings.tok_embeddings.weight"


@dataclasses.dataclass(frozen=True)
class ModernTensor:
    """One parameter: its bertjax path and shape, its transformers name (without the `model.`
    prefix for the encoder) and shape, and whether the latter is an [out, in] weight."""

    path: tuple[str, ...]
    hf_name: str
    shape: tuple[int, ...]
    hf_shape: tuple[int, ...]
    transposed: bool = False
    head: bool = False  # ModernBertForMaskedLM only

    def to_bertjax(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray((array.T if self.transposed else array).reshape(self.shape))

    def to_hf(self, array: Any) -> np.ndarray:
        array = np.asarray(array)
        if self.transposed:
            return np.ascontiguousarray(array.reshape(self.hf_shape[::-1]).T)
        return np.ascontiguousarray(array.reshape(self.hf_shape))


def tensor_table(config: ModernConfig) -> list[ModernTensor]:
    """Every parameter of ModernBertForMaskedLM(config), in transformers' order."""
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
                     (hidden, hidden), transposed=True, head=True),
        ModernTensor(("head", "norm", "scale"), "head.norm.weight", (hidden,), (hidden,),
                     head=True),
        ModernTensor(("decoder_bias",), "decoder.bias", (vocab,), (vocab,), head=True),
    ]
    return table


def _file_name(spec: ModernTensor, masked_lm: bool) -> str:
    return spec.hf_name if spec.head or not masked_lm else PREFIX + spec.hf_name


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


def _read_tensors(directory: epath.Path) -> dict[str, np.ndarray]:
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
    """Nested bertjax params from transformers' named tensors: `model` always, `head` and
    `decoder_bias` where the source is a ModernBertForMaskedLM. A missing, misshapen or
    unknown tensor raises ConversionError naming it as the source spells it."""
    tensors = dict(tensors)
    masked_lm = any(name.startswith(PREFIX) for name in tensors)
    table = tensor_table(config)
    if TIED_DECODER in tensors:  # a copy of what it is tied to: checked, then dropped
        embeddings = tensors.get(PREFIX + TOKEN_EMBEDDINGS)
        if embeddings is None or not np.array_equal(tensors[TIED_DECODER], embeddings):
            raise ConversionError(f"{source}: tensor {TIED_DECODER} differs from "
                                  f"{PREFIX + TOKEN_EMBEDDINGS}; bertjax ties the decoder to "
                                  "the token embeddings")
        del tensors[TIED_DECODER]
    head_present = [s for s in table if s.head and s.hf_name in tensors]
    wanted = [s for s in table if not s.head or (masked_lm and head_present)]
    params: dict[str, Any] = {}
    for spec in wanted:
        name = _file_name(spec, masked_lm)
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
            f"{source}: tensor(s) {', '.join(sorted(tensors))} are not ModernBertModel / "
            "ModernBertForMaskedLM parameters (task heads are not read yet)")
    return params


def read_hf(directory: str | epath.Path) -> tuple[ModernConfig, dict[str, Any]]:
    """(config, params) from a directory written by transformers' `save_pretrained` of a
    ModernBertModel or ModernBertForMaskedLM. params: {"model": ...} for the former, plus
    "head" and "decoder_bias" for the latter (`ModernBertForMaskedLM`'s tree)."""
    directory = epath.Path(directory)
    config = read_config(directory)
    return config, import_params(config, _read_tensors(directory), f"--input {directory}")


# ---------------------------------------------------------------------------------------------
# Writing


def to_hf_state_dict(config: ModernConfig, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """bertjax params → {transformers name: array}: ModernBertForMaskedLM's names where
    params hold the MLM head, else ModernBertModel's; the tied decoder matrix left out, as
    transformers saves it."""
    masked_lm = "head" in params
    out = {}
    for spec in tensor_table(config):
        if spec.head and not masked_lm:
            continue
        tree = params
        for key in spec.path:
            tree = tree[key]
        out[_file_name(spec, masked_lm)] = spec.to_hf(tree)
    return out


def write_hf(output: str | epath.Path, config: ModernConfig, params: Mapping[str, Any],
             overwrite: bool = False) -> None:
    """config.json + model.safetensors that transformers' ModernBertForMaskedLM (params with
    the head) or ModernBertModel loads."""
    from safetensors.numpy import save_file

    output = epath.Path(output)
    weights = output / SAFETENSORS
    if weights.exists() and not overwrite:
        raise ConversionError(f"--output {weights} already exists (pass --overwrite)")
    architecture = "ModernBertForMaskedLM" if "head" in params else "ModernBertModel"
    tensors = to_hf_state_dict(config, params)
    output.mkdir(parents=True, exist_ok=True)
    (output / "config.json").write_text(json.dumps(config.to_hf(architecture), indent=2) + "\n")
    # transformers refuses safetensors files without a "format" entry in the metadata.
    save_file(tensors, str(weights), metadata={"format": "pt"})

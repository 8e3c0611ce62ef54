"""A ModernBERT's configuration: `ModernConfig` (every field that fixes its parameters and
computation; defaults are ModernBERT-base's), its presets, transformers' config.json mapping
(`from_hf` / `to_hf`) and its parameter count."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any, ClassVar

from bertjax.errors import ConfigError
from bertjax.models.layers import REMAT_POLICIES
from bertjax.models.record import TypedConfig

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
DTYPES = ("float32", "bfloat16", "float16", "float64")
ATTENTION_IMPLS = ("auto", "einsum", "xla", "splash")
GLOBAL, LOCAL = "full_attention", "sliding_attention"  # transformers' layer_types names

MODEL_TYPE = "modernbert"  # config.json's model_type (BERT's config.json has none)

# Published shapes (answerdotai/ModernBERT-base, -large); everything else is the default.
# modern_tiny / modern_mini: the shapes of BERT's tiny / mini (2 x 128, 4 x 256) with ModernBERT's
# GeGLU width ratio (1.5 H), for demos and tests.
MODERN_PRESETS: dict[str, dict[str, int]] = {
    "modern_tiny": dict(num_layers=2, hidden_size=128, num_heads=2, intermediate_size=192),
    "modern_mini": dict(num_layers=4, hidden_size=256, num_heads=4, intermediate_size=384),
    "modern_base": dict(num_layers=22, hidden_size=768, num_heads=12, intermediate_size=1152),
    "modern_large": dict(num_layers=28, hidden_size=1024, num_heads=16, intermediate_size=2624),
}


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass(frozen=True)
class ModernConfig(TypedConfig):
    """Everything that fixes a ModernBERT's parameters and computation; defaults are
    ModernBERT-base's. `from_hf` / `to_hf` map transformers' config.json."""

    MODEL_TYPE: ClassVar[str] = MODEL_TYPE
    PRESETS: ClassVar[dict[str, dict[str, int]]] = MODERN_PRESETS

    vocab_size: int = 50368
    hidden_size: int = 768
    num_layers: int = 22
    num_heads: int = 12
    intermediate_size: int = 1152
    # RoPE has no table: this only bounds the lengths the model was trained for.
    max_position_embeddings: int = 8192
    norm_eps: float = 1e-5
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    local_attention: int = 128  # the whole window: local_attention // 2 on each side
    global_attn_every_n_layers: int = 3
    hidden_act: str = "gelu"  # the GeGLU's activation (exact erf GELU)
    head_act: str = "gelu"  # the MLM head's (transformers' classifier_activation)
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0  # on the probabilities and on the output projection
    mlp_dropout: float = 0.0
    initializer_range: float = 0.02
    initializer_cutoff_factor: float = 2.0  # truncation at ± this many stddevs
    # Special tokens, kept for the transformers config (the model itself reads none).
    pad_token_id: int | None = 50283
    bos_token_id: int | None = 50281
    eos_token_id: int | None = 50282
    cls_token_id: int | None = 50281
    sep_token_id: int | None = 50282
    dtype: str = "float32"  # compute dtype of activations
    param_dtype: str = "float32"
    # "auto" | "einsum" (the reference, dense masks) | "xla" (jax.nn.dot_product_attention with
    # the window and padding as structure) | "splash" (our Pallas TPU kernels, skipping the
    # blocks outside the window or across documents); see the module docstring. Not in config.json.
    attention_impl: str = "auto"
    remat_policy: str = "none"  # rematerialise each layer: none | full | dots (as BertConfig)

    def __post_init__(self):
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                      "intermediate_size", "max_position_embeddings", "local_attention",
                      "global_attn_every_n_layers"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ConfigError(f"model.{field}={value!r} must be a positive integer")
        for field in ("embedding_dropout", "attention_dropout", "mlp_dropout"):
            value = getattr(self, field)
            if not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
                raise ConfigError(f"model.{field}={value!r} must be in [0, 1)")
        for field in ("norm_eps", "global_rope_theta", "local_rope_theta", "initializer_range",
                      "initializer_cutoff_factor"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
                raise ConfigError(f"model.{field}={value!r} must be positive")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"model.hidden_size={self.hidden_size} is not divisible by "
                              f"model.num_heads={self.num_heads}")
        if self.head_dim % 2:  # RoPE rotates pairs of features
            raise ConfigError(f"model.hidden_size={self.hidden_size} / model.num_heads="
                              f"{self.num_heads} gives an odd head_dim {self.head_dim}; "
                              "rotary embeddings need an even one")
        for field in ("pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id",
                      "sep_token_id"):
            value = getattr(self, field)
            # Only the padding id must be in the vocabulary (torch's padding_idx demands it);
            # transformers merely warns about the others.
            limit = self.vocab_size if field == "pad_token_id" else float("inf")
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, numbers.Integral)
                                      or not 0 <= value < limit):
                raise ConfigError(f"model.{field}={value!r} must be None or a token id"
                                  + (f" below model.vocab_size={self.vocab_size}"
                                     if field == "pad_token_id" else ""))
        for field, allowed in (("hidden_act", ACTIVATIONS), ("head_act", ACTIVATIONS),
                               ("dtype", DTYPES), ("param_dtype", DTYPES),
                               ("attention_impl", ATTENTION_IMPLS),
                               ("remat_policy", REMAT_POLICIES)):
            if getattr(self, field) not in allowed:
                raise ConfigError(f"model.{field}={getattr(self, field)!r} is not one of "
                                  f"{allowed}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def scan_layers(self) -> bool:
        """The layers are always unrolled (they alternate two kinds; BertConfig's field)."""
        return False

    @property
    def window_radius(self) -> int:
        """How far a local layer's token sees on each side (transformers' `sliding_window`)."""
        return self.local_attention // 2

    @property
    def layer_types(self) -> tuple[str, ...]:
        """transformers' `layer_types`: global every n-th layer from layer 0, local between."""
        return tuple(GLOBAL if i % self.global_attn_every_n_layers == 0 else LOCAL
                     for i in range(self.num_layers))

    @classmethod
    def from_hf(cls, values: Mapping[str, Any], **overrides: Any) -> ModernConfig:
        """From transformers' ModernBERT config.json (as a dict): the current format
        (`layer_types`, `rope_parameters` per layer type) or the first one
        (`global_attn_every_n_layers`, `global_rope_theta` / `local_rope_theta`). What this
        model does not compute (biases, another RoPE type, an untied decoder) raises
        ConfigError naming the config.json field."""
        return cls(**{**_fields_from_hf(values), **overrides})

    def to_hf(self, architecture: str = "ModernBertForMaskedLM") -> dict[str, Any]:
        """transformers' config.json for this config. Both RoPE spellings are written:
        `rope_parameters` for transformers 5, the thetas for the 4.x releases that read them."""
        values = {
            "architectures": [architecture],
            "model_type": "modernbert",
            **{hf: getattr(self, field) for hf, field in _HF_FIELDS.items()},
            "hidden_activation": _HF_ACTIVATION_NAMES[self.hidden_act],
            "classifier_activation": _HF_ACTIVATION_NAMES[self.head_act],
            "layer_types": list(self.layer_types),
            "rope_parameters": {
                GLOBAL: {"rope_type": "default", "rope_theta": self.global_rope_theta},
                LOCAL: {"rope_type": "default", "rope_theta": self.local_rope_theta},
            },
            "global_rope_theta": self.global_rope_theta,
            "local_rope_theta": self.local_rope_theta,
            "tie_word_embeddings": True,
            "dtype": self.param_dtype,
        }
        values.update({flag: want for flag, want in _HF_FIXED.items()})
        return values


# transformers' config.json key → ModernConfig field, where only the name differs.
_HF_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_position_embeddings",
    "norm_eps": "norm_eps",
    "local_attention": "local_attention",
    "global_attn_every_n_layers": "global_attn_every_n_layers",
    "embedding_dropout": "embedding_dropout",
    "attention_dropout": "attention_dropout",
    "mlp_dropout": "mlp_dropout",
    "initializer_range": "initializer_range",
    "initializer_cutoff_factor": "initializer_cutoff_factor",
    "pad_token_id": "pad_token_id",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "cls_token_id": "cls_token_id",
    "sep_token_id": "sep_token_id",
}
_HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size")
# Architecture switches this model has one setting of: config.json key → the value it computes.
_HF_FIXED = {"norm_bias": False, "attention_bias": False, "mlp_bias": False,
             "classifier_bias": False, "decoder_bias": True}
# transformers' ACT2FN names → ours (transformers' "gelu" is the exact erf form).
_HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                   "gelu_fast": "gelu_tanh", "relu": "relu", "silu": "silu", "swish": "silu"}
_HF_ACTIVATION_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu",
                        "silu": "silu"}


def _fields_from_hf(values: Mapping[str, Any]) -> dict[str, Any]:
    """ModernConfig fields from a transformers config.json dict (see ModernConfig.from_hf)."""
    if values.get("model_type", "modernbert") != "modernbert":
        raise ConfigError(f"config.json model_type={values['model_type']!r} is not "
                          "'modernbert'")
    for key in _HF_REQUIRED:
        if key not in values:
            raise ConfigError(f"config.json has no {key}")
    fields = {field: values[hf] for hf, field in _HF_FIELDS.items() if hf in values}
    for hf, want in _HF_FIXED.items():
        if values.get(hf, want) != want:
            raise ConfigError(f"config.json {hf}={values[hf]!r} is not supported (bertjax's "
                              f"ModernBERT computes {hf}={want})")
    if values.get("tie_word_embeddings", True) is not True:
        raise ConfigError("config.json tie_word_embeddings=false is not supported (the MLM "
                          "decoder is the token embedding matrix)")
    for hf, field in (("hidden_activation", "hidden_act"),
                      ("classifier_activation", "head_act")):
        if hf in values:
            if values[hf] not in _HF_ACTIVATIONS:
                raise ConfigError(f"config.json {hf}={values[hf]!r} is not one of "
                                  f"{sorted(_HF_ACTIVATIONS)}")
            fields[field] = _HF_ACTIVATIONS[values[hf]]
    if values.get("rope_scaling") not in (None, {}):
        raise ConfigError(f"config.json rope_scaling={values['rope_scaling']!r} is not "
                          "supported (only default RoPE)")
    rope = values.get("rope_parameters") or {}
    for layer_type, field in ((GLOBAL, "global_rope_theta"), (LOCAL, "local_rope_theta")):
        params = rope.get(layer_type) or {}
        if params.get("rope_type", "default") != "default":
            raise ConfigError(f"config.json rope_parameters.{layer_type}.rope_type="
                              f"{params['rope_type']!r} is not supported (only 'default')")
        theta = params.get("rope_theta", values.get(field))
        if theta is not None:
            fields[field] = theta
    if values.get("layer_types") is not None:
        fields["global_attn_every_n_layers"] = _period(values["layer_types"],
                                                       values["num_hidden_layers"])
    return fields


def _period(layer_types: Any, num_layers: int) -> int:
    """The n of `layer_types` = global every n-th layer from layer 0 (ConfigError if none)."""
    types = list(layer_types) if isinstance(layer_types, (list, tuple)) else None
    if types is None or len(types) != num_layers or set(types) - {GLOBAL, LOCAL}:
        raise ConfigError(f"config.json layer_types={layer_types!r} must list {num_layers} "
                          f"of {GLOBAL!r} / {LOCAL!r}")
    later = [i for i, kind in enumerate(types) if kind == GLOBAL and i > 0]
    period = later[0] if later else num_layers
    if types != [GLOBAL if i % period == 0 else LOCAL for i in range(num_layers)]:
        raise ConfigError(f"config.json layer_types={types!r} is not global attention every "
                          "n-th layer from layer 0, the only pattern supported")
    return period


def num_params(config: ModernConfig, masked_lm: bool = True) -> int:
    """Parameters of ModernBertForMaskedLM (masked_lm) or ModernBertModel with `config`, as
    transformers counts them (the tied decoder matrix once)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    per_layer = (3 * hidden * hidden + hidden * hidden  # wqkv, wo
                 + 2 * hidden * inter + inter * hidden  # wi, wo
                 + 2 * hidden)  # attn_norm, mlp_norm
    encoder = (config.vocab_size * hidden + hidden  # embeddings and their norm
               + config.num_layers * per_layer - hidden  # layer 0 has no attn_norm
               + hidden)  # final_norm
    head = hidden * hidden + hidden + config.vocab_size  # dense, norm, decoder bias
    return encoder + (head if masked_lm else 0)

"""BERT model hyper-parameters and the paper's size presets."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from bertjax.errors import ConfigError  # noqa: F401  (re-exported: models.config.ConfigError)
from bertjax.models.kernels.flash_attention import MAX_SEQ, TILE_LANES, heads_per_tile
from bertjax.models.layers import REMAT_POLICIES

# (num_layers, hidden_size, num_heads); intermediate size is 4H for every preset.
# tiny..medium are the "small BERTs" released with the paper's code; base and large are Table 1.
PRESETS: dict[str, tuple[int, int, int]] = {
    "tiny": (2, 128, 2),
    "mini": (4, 256, 4),
    "small": (4, 512, 8),
    "medium": (8, 512, 8),
    "base": (12, 768, 12),
    "large": (24, 1024, 16),
}

ACTIVATIONS = ("gelu", "gelu_tanh", "relu")


ATTENTION_IMPLS = ("auto", "einsum", "xla", "cudnn", "flash", "flash_jax")
DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Everything that fixes the model's parameters and computation.

    Field names match `config.model` in `experiments/`, so `BertConfig(**config.model)` works.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"  # exact erf GELU, as the paper
    hidden_dropout_prob: float = 0.1
    attention_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    dtype: str = "float32"  # compute dtype of activations
    param_dtype: str = "float32"
    # "auto": on a TPU "flash" where its kernels take the model (`for_tpu`); elsewhere
    # jax.nn.dot_product_attention (fused kernels) unless attention dropout is active, which
    # the fused kernels cannot apply, then einsum; "einsum": the plain reference path;
    # "xla" / "cudnn": force that dot_product_attention implementation; "flash": this
    # project's Pallas TPU kernel (interpreted off TPU), attention dropout drawn inside it
    # (bertjax.models.kernels.dropout_attention); "flash_jax": JAX's Pallas flash-attention kernels,
    # without attention dropout.
    attention_impl: str = "auto"
    causal: bool = False  # left-to-right attention (the LTR ablation)
    remat_policy: str = "none"  # rematerialise each layer: none | full | dots
    scan_layers: bool = False  # nn.scan over layers: params stacked on a leading `layers` axis

    def __post_init__(self):
        # The one validated source of truth for model sizes: a bad value stops here, naming
        # its field, before anything is built (num_layers=0 would train a model with no encoder).
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                      "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ConfigError(f"model.{field}={value!r} must be a positive integer")
        for field in ("hidden_dropout_prob", "attention_dropout_prob"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise ConfigError(f"model.{field}={getattr(self, field)} must be in [0, 1)")
        for field in ("initializer_range", "layer_norm_eps"):
            if not getattr(self, field) > 0:
                raise ConfigError(f"model.{field}={getattr(self, field)} must be positive")
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_heads={self.num_heads}"
            )
        for field, allowed in (
            ("hidden_act", ACTIVATIONS),
            ("attention_impl", ATTENTION_IMPLS),
            ("remat_policy", REMAT_POLICIES),
            ("dtype", DTYPES),
            ("param_dtype", DTYPES),
        ):
            if getattr(self, field) not in allowed:
                raise ConfigError(
                    f"model.{field}={getattr(self, field)!r} is not one of {allowed}"
                )

        if self.attention_impl == "flash_jax" and self.attention_dropout_prob > 0:
            raise ConfigError(
                f"model.attention_dropout_prob={self.attention_dropout_prob} must be 0 with "
                "model.attention_impl='flash_jax' (JAX's flash kernels apply no attention "
                "dropout; 'flash' does)"
            )

        if self.attention_impl == "flash":
            if not self.heads_fill_tiles:
                raise ConfigError(
                    f"model.attention_impl='flash' needs heads that fill {TILE_LANES}-lane "
                    f"tiles (head_dim {self.head_dim}, {self.num_heads} heads); use "
                    "model.attention_impl='auto'"
                )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def heads_fill_tiles(self) -> bool:
        """Whether the flash kernel's grid steps, groups of heads side by side, fill its
        128-lane tiles (or hold every head)."""
        width = heads_per_tile(self.num_heads, self.head_dim) * self.head_dim
        return width % TILE_LANES == 0 or width == self.hidden_size

    def for_tpu(self) -> BertConfig:
        """This config as a TPU runs it: "auto" attention becomes "flash" (this project's
        Pallas kernels, attention dropout drawn inside them: the fastest path the compiled
        schedules show at 128 and 512 tokens, docs/tpu_aot.md) where the kernels take the
        model (heads that fill tiles, sequences of one block); anything else is unchanged."""
        if (self.attention_impl == "auto" and self.heads_fill_tiles
                and self.max_position_embeddings <= MAX_SEQ):
            return dataclasses.replace(self, attention_impl="flash")
        return self

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> BertConfig:
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        num_layers, hidden, heads = PRESETS[name]
        fields = dict(
            num_layers=num_layers,
            hidden_size=hidden,
            num_heads=heads,
            intermediate_size=4 * hidden,
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_dict(cls, values: Any) -> BertConfig:
        """From a dict or ConfigDict; an unknown key is named in the error."""
        values = dict(values)
        if values.get("model_type") == "bert":
            del values["model_type"]
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown model config field(s): {', '.join(unknown)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

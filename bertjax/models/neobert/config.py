"""A NeoBERT-style encoder's configuration: RMSNorm, SwiGLU, RoPE, pre-norm layers and no
biases. Its presets are this project's shapes, not a released checkpoint's."""

from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar

from bertjax.errors import ConfigError
from bertjax.models.layers import REMAT_POLICIES
from bertjax.models.record import TypedConfig

MODEL_TYPE = "neobert"  # config.json's model_type
DTYPES = ("float32", "bfloat16", "float16", "float64")
ATTENTION_IMPLS = ("auto", "einsum", "xla")

# SwiGLU width 8/3·H rounded up to a multiple of 8 (its parameters then match a 4H GELU MLP's).
NEO_PRESETS: dict[str, dict[str, int]] = {
    "neo_tiny": dict(num_layers=2, hidden_size=128, num_heads=2, intermediate_size=344),
    "neo_mini": dict(num_layers=4, hidden_size=256, num_heads=4, intermediate_size=688),
    "neo_base": dict(num_layers=28, hidden_size=768, num_heads=12, intermediate_size=2048),
}


@dataclasses.dataclass(frozen=True)
class NeoConfig(TypedConfig):
    """Everything that fixes the encoder's parameters and computation."""

    MODEL_TYPE: ClassVar[str] = MODEL_TYPE
    PRESETS: ClassVar[dict[str, dict[str, int]]] = NEO_PRESETS

    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 28
    num_heads: int = 12
    intermediate_size: int = 2048  # SwiGLU's hidden width
    # RoPE has no table: this only bounds the lengths the model was trained for.
    max_position_embeddings: int = 4096
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    dropout: float = 0.0  # after the embeddings and on each residual branch
    initializer_range: float = 0.02
    dtype: str = "float32"  # compute dtype of activations
    param_dtype: str = "float32"
    # "einsum" (the reference, a dense mask) | "xla" (jax.nn.dot_product_attention) | "auto"
    # (the "xla" path: the same values).
    attention_impl: str = "auto"
    remat_policy: str = "none"

    def __post_init__(self):
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                      "intermediate_size", "max_position_embeddings"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ConfigError(f"model.{field}={value!r} must be a positive integer")
        if not isinstance(self.dropout, numbers.Real) or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout!r} must be in [0, 1)")
        for field in ("norm_eps", "rope_theta", "initializer_range"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
                raise ConfigError(f"model.{field}={value!r} must be positive")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ConfigError(f"model.hidden_size={self.hidden_size} / model.num_heads="
                              f"{self.num_heads} must give an even head_dim (RoPE rotates "
                              "pairs of features)")
        for field, allowed in (("dtype", DTYPES), ("param_dtype", DTYPES),
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
        """The layers are always unrolled (BertConfig's field)."""
        return False

"""ModernBERT (Warner et al., 2024): `ModernConfig` (config.py), the encoder and its masked-LM
model (modules.py) and its FLOPs (flops.py)."""

from bertjax.models.layers import apply_rope, rope_tables
from bertjax.models.modernbert.config import (
    GLOBAL,
    LOCAL,
    MODEL_TYPE,
    MODERN_PRESETS,
    ModernConfig,
    num_params,
)
from bertjax.models.modernbert.modules import (
    ModernBertForMaskedLM,
    ModernBertModel,
    ModernEmbeddings,
    ModernLayer,
    ModernPredictionHead,
    attention_masks,
)

__all__ = [
    "GLOBAL", "LOCAL", "MODEL_TYPE", "MODERN_PRESETS", "ModernBertForMaskedLM",
    "ModernBertModel", "ModernConfig", "ModernEmbeddings", "ModernLayer",
    "ModernPredictionHead", "apply_rope", "attention_masks", "num_params",
    "rope_tables",
]

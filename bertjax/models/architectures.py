"""The two model architectures, BERT (`BertConfig`) and ModernBERT (`ModernConfig`), told apart
by one field: a config.json or config.model with model_type="modernbert" is a ModernBERT, any
other (BERT's has no model_type) a BERT."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bertjax.models.config import BertConfig
from bertjax.models.modern import MODEL_TYPE, ModernBertForMaskedLM, ModernConfig
from bertjax.models.pretraining import BertForPreTraining

ModelConfig = BertConfig | ModernConfig


def is_modern(fields: Mapping[str, Any] | ModelConfig) -> bool:
    """Whether a config (dataclass, dict or ConfigDict) is a ModernBERT's."""
    if isinstance(fields, ModernConfig):
        return True
    if isinstance(fields, BertConfig):
        return False
    return fields.get("model_type", "bert") == MODEL_TYPE


def model_config(fields: Mapping[str, Any]) -> ModelConfig:
    """BertConfig or ModernConfig from its fields (their from_dict checks them)."""
    return (ModernConfig if is_modern(fields) else BertConfig).from_dict(fields)


def pretraining_model(config: ModelConfig) -> BertForPreTraining | ModernBertForMaskedLM:
    """The model pre-training trains: BERT with its MLM and NSP heads, or ModernBERT with its
    MLM head."""
    return ModernBertForMaskedLM(config) if is_modern(config) else BertForPreTraining(config)

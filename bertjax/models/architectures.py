"""The encoder architectures, one record each (`Architecture`, models/record.py), keyed by
config.model.model_type; a config without one is a BERT. A new architecture is a folder
(config, modules, FLOPs, its record) and one line here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bertjax.errors import ConfigError
from bertjax.models.bert.architecture import ARCHITECTURE as BERT
from bertjax.models.modernbert.architecture import ARCHITECTURE as MODERNBERT
from bertjax.models.neobert.architecture import ARCHITECTURE as NEOBERT
from bertjax.models.record import Architecture

ARCHITECTURES: dict[str, Architecture] = {
    "bert": BERT,
    "modernbert": MODERNBERT,
    "neobert": NEOBERT,
}

ModelConfig = Any  # an architecture's config dataclass (BertConfig, ModernConfig, ...)


def architecture(config: Mapping[str, Any] | ModelConfig) -> Architecture:
    """The record of a config: a config dataclass, or its fields (dict or ConfigDict) by their
    model_type ("bert" when absent)."""
    for record in ARCHITECTURES.values():
        if isinstance(config, record.config_class):
            return record
    name = config.get("model_type", "bert") if hasattr(config, "get") else None
    if name not in ARCHITECTURES:
        raise ConfigError(f"model_type={name!r} is not one of {' | '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def model_config(fields: Mapping[str, Any]) -> ModelConfig:
    """The config dataclass of `fields` (its from_dict checks them)."""
    return architecture(fields).config_class.from_dict(fields)


def pretraining_model(config: ModelConfig):
    """The model pre-training trains (BERT: MLM and NSP heads; ModernBERT: its MLM head)."""
    return architecture(config).pretraining_model(config)

"""BERT modules (Flax linen). Imports nothing from training and never TensorFlow."""

from bertjax.models.architectures import ModelConfig, is_modern, model_config, pretraining_model
from bertjax.models.bert import BertModel, Embeddings, Encoder, EncoderLayer, Pooler
from bertjax.models.config import PRESETS, BertConfig
from bertjax.models.pretraining import (
    BertForPreTraining,
    MaskedLMHead,
    gather_positions,
    pretraining_denominators,
    pretraining_loss,
)

__all__ = [
    "PRESETS",
    "BertConfig",
    "BertForPreTraining",
    "BertModel",
    "Embeddings",
    "Encoder",
    "EncoderLayer",
    "MaskedLMHead",
    "Pooler",
    "ModelConfig",
    "gather_positions",
    "is_modern",
    "model_config",
    "pretraining_denominators",
    "pretraining_loss",
    "pretraining_model",
]

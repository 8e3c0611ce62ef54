"""BERT modules (Flax linen). Imports nothing from training and never TensorFlow."""

from bertjax.models.architectures import (
    ARCHITECTURES,
    ModelConfig,
    architecture,
    model_config,
    pretraining_model,
)
from bertjax.models.bert.config import PRESETS, BertConfig
from bertjax.models.bert.modules import BertModel, Embeddings, Encoder, EncoderLayer, Pooler
from bertjax.models.bert.pretraining import (
    BertForPreTraining,
    MaskedLMHead,
    pretraining_denominators,
    pretraining_loss,
)
from bertjax.models.layers import gather_positions

__all__ = [
    "ARCHITECTURES",
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
    "architecture",
    "model_config",
    "pretraining_denominators",
    "pretraining_loss",
    "pretraining_model",
]

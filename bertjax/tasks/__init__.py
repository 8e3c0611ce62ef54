"""Fine-tuning task families: heads (Flax linen on bertjax.models.BertModel), losses, metrics
and post-processing. Never imports TensorFlow."""

from bertjax.tasks.classification import (
    BertForSequenceClassification,
    classification_loss,
    regression_loss,
)
from bertjax.tasks.multiple_choice import BertForMultipleChoice, multiple_choice_loss

__all__ = [
    "BertForMultipleChoice",
    "BertForSequenceClassification",
    "classification_loss",
    "multiple_choice_loss",
    "regression_loss",
]

"""Sequence classification and regression (GLUE, users' own data): one output layer on C.

The paper's fine-tuning head: C = the pooled final [CLS] vector, dropout 0.1, then one dense
layer to `num_labels` (truncated-normal 0.02 init); softmax cross-entropy for classification,
mean squared error for regression (num_labels = 1, e.g. STS-B). Losses in float32.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import BertConfig, BertModel
from bertjax.models.bert import dense

Array = jax.Array


class BertForSequenceClassification(nn.Module):
    """params: {"bert": BertModel params, "classifier": {kernel [hidden, num_labels], bias}}."""

    config: BertConfig
    num_labels: int

    @nn.compact
    def __call__(
        self,
        input_ids: Array,
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
        *,
        deterministic: bool = True,
    ) -> Array:
        """input_ids, segment_ids, input_mask: [batch, seq] int → logits [batch, num_labels]."""
        outputs = BertModel(self.config, name="bert")(
            input_ids, segment_ids, input_mask, deterministic=deterministic
        )
        pooled = nn.Dropout(self.config.hidden_dropout_prob)(
            outputs["pooled_output"], deterministic=deterministic
        )
        logits = dense(self.config, self.num_labels, ("embed", "classes"), "classifier")(pooled)
        return nn.with_logical_constraint(logits, ("batch", "classes"))


def _weighted_mean(values: Array, weights: Array | None) -> Array:
    if weights is None:
        return jnp.mean(values)
    weights = weights.astype(jnp.float32)
    return jnp.sum(values * weights) / jnp.maximum(jnp.sum(weights), 1e-6)


def classification_loss(
    logits: Array, labels: Array, weights: Array | None = None
) -> tuple[Array, dict[str, Array]]:
    """Softmax cross-entropy. logits [batch, K]; labels [batch] int; weights [batch] (0 = pad)."""
    logits = logits.astype(jnp.float32)
    labels = labels.reshape(-1).astype(jnp.int32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, labels[:, None], axis=-1)[:, 0]
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    loss = _weighted_mean(nll, weights)
    return loss, {"loss": loss, "accuracy": _weighted_mean(correct, weights)}


def regression_loss(
    logits: Array, labels: Array, weights: Array | None = None
) -> tuple[Array, dict[str, Array]]:
    """Mean squared error. logits [batch, 1]; labels [batch] float; weights [batch] (0 = pad)."""
    predictions = logits.astype(jnp.float32).reshape(-1)
    loss = _weighted_mean(jnp.square(predictions - labels.reshape(-1).astype(jnp.float32)),
                          weights)
    return loss, {"loss": loss}


def predictions(logits: Any, regression: bool):
    """Host post-processing: class ids [batch] (argmax) or scores [batch] (regression)."""
    import numpy as np

    logits = np.asarray(logits, np.float32)
    return logits.reshape(-1) if regression else logits.argmax(axis=-1)

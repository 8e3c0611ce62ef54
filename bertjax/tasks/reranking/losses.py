"""Cross-encoder losses over the raw logits, in float32, as sentence-transformers' CrossEncoder
losses compute them with their default (identity) activation:

  bce_loss        BinaryCrossEntropyLoss   (query, passage, label in [0, 1])
  listwise_loss   softmax cross-entropy of the positive among its own negatives
                  (MultipleNegativesRankingLoss with num_negatives=0, scale=1 and an
                  identity activation: no in-batch negatives, no scaled sigmoid)
  mse_loss        MSELoss                  (query, passage, a teacher's score)
  margin_mse_loss MarginMSELoss            (query, positive, negative, the teacher's margin)

Each is a weighted mean over the real rows of a batch: weights [batch] are 0 on the filler
rows that pad a partial last batch, whose logits are replaced by zeros first, so that nothing
they hold (however large) reaches the loss or its gradients. `denominator`: the sum of the
weights of the whole batch, where accumulated micro-batches each compute a share of it
(bertjax.train.step); None: of these weights. Each returns (loss, {"loss", ...}).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def weight_sum(weights: Array) -> Array:
    """[] float32: the sum of the row weights [batch] (at least 1e-6: a batch of filler rows
    gives a loss of 0, not NaN)."""
    return jnp.maximum(jnp.sum(weights.astype(jnp.float32)), 1e-6)


def _real(logits: Array, weights: Array) -> tuple[Array, Array]:
    """(logits [batch, ...] in float32 with zeros on the filler rows, weights in float32)."""
    weights = weights.astype(jnp.float32)
    real = (weights > 0).reshape((-1,) + (1,) * (logits.ndim - 1))
    return jnp.where(real, logits.astype(jnp.float32), 0.0), weights


def _mean(values: Array, weights: Array, denominator: Array | None) -> Array:
    """Σ values · weights / denominator (values [batch])."""
    total = weight_sum(weights) if denominator is None else denominator
    return jnp.sum(jnp.where(weights > 0, values, 0.0) * weights) / total


def bce_loss(logits: Array, labels: Array, weights: Array, denominator: Array | None = None
             ) -> tuple[Array, dict[str, Array]]:
    """Binary cross-entropy with logits: softplus(x) − y·x. logits [batch], labels [batch] in
    [0, 1], weights [batch]. Metrics: loss, accuracy (the logit's sign agrees with a label
    rounded to 0 or 1)."""
    logits, weights = _real(logits, weights)
    labels = labels.astype(jnp.float32)
    loss = _mean(jax.nn.softplus(logits) - labels * logits, weights, denominator)
    correct = ((logits > 0) == (labels > 0.5)).astype(jnp.float32)
    return loss, {"loss": loss, "accuracy": _mean(correct, weights, denominator)}


def listwise_loss(logits: Array, weights: Array, denominator: Array | None = None
                  ) -> tuple[Array, dict[str, Array]]:
    """Softmax cross-entropy of each row's positive: logits [batch, 1 + negatives], the
    positive at index 0; weights [batch]. Metrics: loss, accuracy (the positive scores
    highest)."""
    logits, weights = _real(logits, weights)
    nll = jax.nn.logsumexp(logits, axis=-1) - logits[:, 0]
    loss = _mean(nll, weights, denominator)
    correct = (jnp.argmax(logits, axis=-1) == 0).astype(jnp.float32)
    return loss, {"loss": loss, "accuracy": _mean(correct, weights, denominator)}


def mse_loss(logits: Array, targets: Array, weights: Array, denominator: Array | None = None
             ) -> tuple[Array, dict[str, Array]]:
    """Mean squared error of the logits [batch] to a teacher's scores [batch]."""
    logits, weights = _real(logits, weights)
    loss = _mean(jnp.square(logits - targets.astype(jnp.float32)), weights, denominator)
    return loss, {"loss": loss}


def margin_mse_loss(logits: Array, margins: Array, weights: Array,
                    denominator: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """Margin MSE: logits [batch, 2] (positive, negative) whose difference should equal the
    teacher's margin [batch] (its positive score minus its negative score)."""
    logits, weights = _real(logits, weights)
    difference = logits[:, 0] - logits[:, 1]
    loss = _mean(jnp.square(difference - margins.astype(jnp.float32)), weights, denominator)
    return loss, {"loss": loss}

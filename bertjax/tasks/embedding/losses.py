"""Contrastive and scored-pair losses over sentence vectors, in float32.

The step is jitted over the global batch, so the similarity matrix of `in_batch_loss` spans
every data-parallel device and host: each anchor's negatives are the positives and hard
negatives of the whole global batch (the compiler gathers the vectors; gradients are those of
the one-device loss). Filler rows (weight 0) are neither anchors nor candidates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bertjax.models.embedding import l2_normalize

Array = jax.Array


def cosine_matrix(a: Array, b: Array) -> Array:
    """a [n, hidden], b [m, hidden] → cosines [n, m]."""
    return l2_normalize(a.astype(jnp.float32)) @ l2_normalize(b.astype(jnp.float32)).T


def in_batch_loss(vectors: Array, weights: Array, scale: float = 20.0,
                  symmetric: bool = False, denominator: Array | None = None
                  ) -> tuple[Array, dict[str, Array]]:
    """Multiple-negatives ranking (InfoNCE) loss.

    vectors [batch, columns, hidden]: column 0 the anchors, column 1 their positives, columns
    2.. hard negatives; weights [batch] (0: a filler row). Each anchor's candidates are every
    real row's positive and hard negatives; the loss is the cross-entropy of its own positive
    among them at `scale` × cosine, averaged over real anchors (or summed over `denominator`).
    symmetric: also each positive against every anchor, the two cross-entropies averaged.
    Metrics: loss, accuracy (the positive ranks first among the candidates)."""
    batch, columns, _ = vectors.shape
    real = weights > 0
    anchors, positives = vectors[:, 0], vectors[:, 1]
    candidates = jnp.swapaxes(vectors[:, 1:], 0, 1).reshape((columns - 1) * batch, -1)
    candidate_real = jnp.tile(real, columns - 1)
    scores = scale * cosine_matrix(anchors, candidates)  # [batch, (columns - 1) * batch]
    scores = jnp.where(candidate_real[None, :], scores, -jnp.inf)
    rows = jnp.arange(batch)
    positive = scores[rows, rows]
    log_z = jax.nn.logsumexp(scores, axis=-1)
    if symmetric:
        backward = scale * cosine_matrix(positives, anchors)  # [batch, batch]
        backward = jnp.where(real[None, :], backward, -jnp.inf)
        log_z = (log_z + jax.nn.logsumexp(backward, axis=-1)) / 2
    nll = jnp.where(real, log_z - positive, 0.0)
    w = weights.astype(jnp.float32)
    if denominator is None:
        denominator = jnp.maximum(jnp.sum(w), 1e-6)
    loss = jnp.sum(nll * w) / denominator
    correct = (jnp.argmax(scores, axis=-1) == rows).astype(jnp.float32)
    return loss, {"loss": loss, "accuracy": jnp.sum(correct * w) / denominator}


def cosent_loss(vectors: Array, scores: Array, weights: Array, scale: float = 20.0
                ) -> tuple[Array, dict[str, Array]]:
    """CoSENT loss of scored pairs: log(1 + Σ exp(scale · (cos_k − cos_l))) over the pairs of
    rows with score_k < score_l. vectors [batch, 2, hidden], scores [batch] float, weights
    [batch] (0: filler). Metrics: loss."""
    a, b = l2_normalize(vectors[:, 0].astype(jnp.float32)), l2_normalize(
        vectors[:, 1].astype(jnp.float32))
    cosine = scale * jnp.sum(a * b, axis=-1)  # [batch]
    real = weights > 0
    ranked_wrong = (scores[:, None] < scores[None, :]) & real[:, None] & real[None, :]
    differences = jnp.where(ranked_wrong, cosine[:, None] - cosine[None, :], -jnp.inf)
    loss = jax.nn.logsumexp(jnp.concatenate([jnp.zeros((1,)), differences.reshape(-1)]))
    return loss, {"loss": loss}


def cosine_loss(vectors: Array, scores: Array, weights: Array,
                denominator: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """Mean squared error between the cosine of each pair and its score (in [-1, 1] or
    [0, 1]). vectors [batch, 2, hidden], scores, weights [batch]."""
    a, b = vectors[:, 0], vectors[:, 1]
    cosine = jnp.sum(l2_normalize(a.astype(jnp.float32)) * l2_normalize(b.astype(jnp.float32)),
                     axis=-1)
    w = weights.astype(jnp.float32)
    if denominator is None:
        denominator = jnp.maximum(jnp.sum(w), 1e-6)
    loss = jnp.sum(jnp.square(cosine - scores.astype(jnp.float32)) * w) / denominator
    return loss, {"loss": loss}

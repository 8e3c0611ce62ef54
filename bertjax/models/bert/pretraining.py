"""BERT with its pre-training heads (masked LM, next sentence prediction) and their losses."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import dense as dense_lib
from bertjax.models.bert.config import BertConfig
from bertjax.models.bert.modules import BertModel, activation, dense, layer_norm, zeros_init
from bertjax.models.layers import gather_positions

Array = jax.Array


class MaskedLMHead(nn.Module):
    """dense + GELU + LayerNorm, then the tied word-embedding matrix (transposed) + a bias."""

    config: BertConfig

    @nn.compact
    def __call__(self, hidden: Array, word_embeddings: nn.Embed) -> Array:
        """hidden: [batch, n, hidden] → logits [batch, n, vocab]."""
        cfg = self.config
        h = dense(cfg, cfg.hidden_size, ("embed", "embed_out"), "transform")(hidden)
        h = layer_norm(cfg, "transform_layer_norm")(activation(cfg.hidden_act)(h))
        bias = self.param("output_bias", zeros_init(("vocab",)), (cfg.vocab_size,), cfg.param_dtype)
        embedding = jnp.asarray(word_embeddings.embedding, h.dtype)  # [vocab, hidden]
        logits = dense_lib.dense(h, embedding.T, jnp.asarray(bias, h.dtype))
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


class BertForPreTraining(nn.Module):
    """The encoder plus the MLM and NSP heads.

    MLM logits are computed only at `masked_lm_positions` (gathered before the vocabulary
    projection), so the [seq, vocab] product over unmasked tokens is never formed.
    """

    config: BertConfig

    @nn.compact
    def __call__(
        self,
        input_ids: Array,
        segment_ids: Array | None,
        input_mask: Array | None,
        masked_lm_positions: Array,
        *,
        packing_ids: Array | None = None,
        position_ids: Array | None = None,
        deterministic: bool = True,
    ) -> dict[str, Array]:
        """input_ids, segment_ids, input_mask: [batch, seq]; masked_lm_positions: [batch, n].

        Returns `mlm_logits` [batch, n, vocab] and `nsp_logits` [batch, 2].
        """
        bert = BertModel(self.config, name="bert")
        outputs = bert(
            input_ids,
            segment_ids,
            input_mask,
            packing_ids=packing_ids,
            position_ids=position_ids,
            deterministic=deterministic,
        )
        masked = gather_positions(outputs["sequence_output"], masked_lm_positions)
        mlm_logits = MaskedLMHead(self.config, name="mlm")(masked, bert.embeddings.word_embeddings)
        nsp_logits = dense(self.config, 2, ("embed", "classes"), "nsp")(outputs["pooled_output"])
        return {"mlm_logits": mlm_logits, "nsp_logits": nsp_logits}


def pretraining_denominators(batch: dict[str, Any]) -> dict[str, Array]:
    """The normalisers of `pretraining_loss`'s terms over `batch`, each [] float32: "mlm_loss"
    (sum of masked_lm_weights + 1e-5, the reference's: an all-padding batch gives 0, not NaN),
    "mlm_accuracy" (that sum, at least 1e-5) and, where the batch has next_sentence_labels,
    "nsp" (the number of rows). They depend on the batch only, never on the parameters."""
    weight_sum = jnp.sum(batch["masked_lm_weights"].astype(jnp.float32))
    out = {"mlm_loss": weight_sum + 1e-5, "mlm_accuracy": jnp.maximum(weight_sum, 1e-5)}
    if "next_sentence_labels" in batch:
        out["nsp"] = jnp.asarray(batch["next_sentence_labels"].size, jnp.float32)
    return out


@jax.custom_vjp
def softmax_cross_entropy(logits: Array, labels: Array) -> Array:
    """−log softmax(logits)[label] in float32: logits [..., classes] of any float dtype, labels
    [...] int → [...].

    Its gradient, softmax − one-hot, is one elementwise pass over the logits (kept in their
    own dtype) and the saved log-sum-exp; autodiff of log_softmax and take_along_axis makes
    several float32 passes over the [predictions, vocab] logits and scatters the one-hot.
    """
    return _cross_entropy_fwd(logits, labels)[0]


def _cross_entropy_fwd(logits, labels):
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1)
    picked = jnp.take_along_axis(x, labels[..., None], axis=-1)[..., 0]
    return lse - picked, (logits, labels, lse)


def _cross_entropy_bwd(residuals, grad):
    logits, labels, lse = residuals
    x = logits.astype(jnp.float32)
    one_hot = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) == labels[..., None]
    d_logits = (jnp.exp(x - lse[..., None]) - one_hot) * grad[..., None]
    return d_logits.astype(logits.dtype), None


softmax_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def pretraining_loss(
    outputs: dict[str, Array], batch: dict[str, Any], nsp_weight: float = 1.0,
    denominators: dict[str, Array] | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Loss = weighted-mean MLM NLL + nsp_weight × mean NSP NLL, all in float32; the MLM
    terms alone where `outputs` has no nsp_logits.

    batch: masked_lm_ids [batch, n] int, masked_lm_weights [batch, n] float,
      next_sentence_labels [batch] or [batch, 1] int (0 = IsNext, 1 = NotNext).
    denominators: `pretraining_denominators` of the batch the means run over; None = of
      `batch` itself. Given those of a larger batch that `batch` is a part of, the loss and
      every metric are this part's share of the larger batch's values (shares add up).
    """
    if denominators is None:
        denominators = pretraining_denominators(batch)
    mlm_logits = outputs["mlm_logits"]
    ids = batch["masked_lm_ids"].astype(jnp.int32)
    weights = batch["masked_lm_weights"].astype(jnp.float32)
    mlm_nll = softmax_cross_entropy(mlm_logits, ids)
    mlm_loss = jnp.sum(mlm_nll * weights) / denominators["mlm_loss"]
    mlm_correct = (jnp.argmax(mlm_logits, axis=-1) == ids).astype(jnp.float32)
    mlm_accuracy = jnp.sum(mlm_correct * weights) / denominators["mlm_accuracy"]

    if "nsp_logits" not in outputs:  # a model with an MLM head only (ModernBERT)
        return mlm_loss, {"loss": mlm_loss, "mlm_loss": mlm_loss, "mlm_accuracy": mlm_accuracy}
    nsp_logits = outputs["nsp_logits"].astype(jnp.float32)
    labels = batch["next_sentence_labels"].reshape(-1).astype(jnp.int32)
    nsp_log_probs = jax.nn.log_softmax(nsp_logits, axis=-1)
    nsp_picked = jnp.take_along_axis(nsp_log_probs, labels[:, None], axis=-1)
    # sum / count is jnp.mean's own expression (the same bits).
    nsp_loss = -(jnp.sum(nsp_picked) / denominators["nsp"])
    nsp_correct = (jnp.argmax(nsp_logits, axis=-1) == labels).astype(jnp.float32)
    nsp_accuracy = jnp.sum(nsp_correct) / denominators["nsp"]

    loss = mlm_loss + nsp_weight * nsp_loss
    metrics = {
        "loss": loss,
        "mlm_loss": mlm_loss,
        "mlm_accuracy": mlm_accuracy,
        "nsp_loss": nsp_loss,
        "nsp_accuracy": nsp_accuracy,
    }
    return loss, metrics

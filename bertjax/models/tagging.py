"""The flax heads of the tagging family (bertjax/tasks/tagging/): a score per position.

`BertForTokenClassification` fine-tunes the encoder with a dense layer over every final hidden
vector (paper Sec. 5.3; optionally "+ BiLSTM" before it, Table 5). `FeatureBasedTagger` reads
frozen, cached encoder layers instead (the feature-based approach, Table 7): a mix of the
layers, a two-layer BiLSTM and a dense classifier; the encoder is not part of it.

Given a `ModernConfig`, `BertForTokenClassification` is transformers'
ModernBertForTokenClassification (bertjax/models/heads.py): every final hidden vector through
`head` (dense, activation, LayerNorm), dropout and `classifier`; params {"model", "head",
"classifier"}.

Modules only: the loss, the readers and the metrics live in the task family.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import heads
from bertjax.models.architectures import ModelConfig
from bertjax.models.bilstm import BiLSTMHead, bidirectional_lstm

Array = jax.Array


class BertForTokenClassification(nn.Module):
    """params: {"bert": BertModel params, "classifier": {kernel [hidden, num_labels], bias}}
    (transformers' BertForTokenClassification: dropout, then one dense layer per position);
    for a ModernConfig {"model", "head", "classifier"} (ModernBertForTokenClassification).
    bilstm_units > 0 (BERT only): "+ BiLSTM", a randomly initialised BiLSTM ("bilstm") before
    the dropout. classifier_dropout: None = the encoder's hidden dropout (heads.head_dropout)."""

    config: ModelConfig
    num_labels: int
    bilstm_units: int = 0
    classifier_dropout: float | None = None

    @nn.compact
    def __call__(self, input_ids: Array, segment_ids: Array | None = None,
                 input_mask: Array | None = None, *, packing_ids: Array | None = None,
                 deterministic: bool = True) -> Array:
        """input_ids, segment_ids, input_mask: [batch, seq] → logits [batch, seq, num_labels].
        packing_ids [batch, seq] (rows of packed examples, `heads.encode`): every position is
        scored as in its example's own row; not with the BiLSTM, whose recurrence would run
        across examples (the task refuses it)."""
        cfg = self.config
        heads.check_head_options(cfg, bilstm_units=self.bilstm_units)
        hidden, _ = heads.encode(cfg, input_ids, segment_ids, input_mask,
                                 deterministic=deterministic, packing_ids=packing_ids)
        if self.bilstm_units:
            hidden = BiLSTMHead(self.bilstm_units, cfg.initializer_range, cfg.dtype,
                                name="bilstm")(hidden, input_mask)
        logits = heads.output_layer(cfg, hidden, self.num_labels, deterministic=deterministic,
                                    classifier_dropout=self.classifier_dropout)
        return nn.with_logical_constraint(logits, ("batch", "length", "classes"))


def combine_layers(features: Array, mode: str, weights: Array | None = None,
                   scale: Array | None = None) -> Array:
    """features [batch, seq, n_layers, hidden] → [batch, seq, hidden] (single, weighted:
    scale * Σ softmax(weights)_i layer_i) or [batch, seq, n_layers * hidden] (concat)."""
    if mode == "single":
        return features[:, :, 0]
    if mode == "concat":
        return features.reshape(features.shape[:2] + (-1,))
    mix = jax.nn.softmax(weights.astype(jnp.float32))
    return scale * jnp.einsum("bsnh,n->bsh", features, mix)


class FeatureBasedTagger(nn.Module):
    """Cached BERT layers → (mix) → 2-layer BiLSTM → dropout → dense classifier per position.

    params: {"lstm_<layer>_forward" / "_backward", "classifier", and for weighted sums
    "layer_weights" [num_inputs], "layer_scale" []}."""

    num_labels: int
    num_inputs: int  # layers in the cache rows
    mode: str  # single | weighted | concat
    lstm_units: int = 768  # per direction (the paper's BERT-base setting)
    lstm_layers: int = 2
    dropout: float = 0.1
    initializer_range: float = 0.02

    @nn.compact
    def __call__(self, features: Array, input_mask: Array, *, deterministic: bool = True
                 ) -> Array:
        """features [batch, seq, num_inputs, hidden]; input_mask [batch, seq] (rows padded at
        the end) → logits [batch, seq, num_labels] float32."""
        x = features.astype(jnp.float32)
        weights = scale = None
        if self.mode == "weighted":
            weights = self.param("layer_weights", nn.initializers.zeros, (self.num_inputs,))
            scale = self.param("layer_scale", nn.initializers.ones, ())
        x = combine_layers(x, self.mode, weights, scale)
        lengths = jnp.sum(input_mask, axis=-1).astype(jnp.int32)
        x = bidirectional_lstm(x, lengths, units=self.lstm_units, num_layers=self.lstm_layers,
                               dropout=self.dropout, deterministic=deterministic)
        init = nn.initializers.truncated_normal(self.initializer_range)
        return nn.Dense(self.num_labels, kernel_init=init, name="classifier")(x)

"""Sequence-level fine-tuning heads (flax modules only; losses and metrics live in
bertjax/tasks/classification/task.py).

The paper's head: C = the pooled final [CLS] vector [batch, hidden], dropout, then one dense
layer (truncated-normal init). Classification and regression give logits [batch, num_labels]
(num_labels = 1 for regression, e.g. STS-B). Multiple choice (SWAG) encodes each choice as
its own `[CLS] context [SEP] ending [SEP]` sequence and scores it as C·v with one learned
vector v: logits [batch, choices], a softmax across the choices.

Given a `ModernConfig` the same modules are transformers' ModernBertForSequenceClassification /
ModernBertForMultipleChoice (bertjax/models/heads.py): the final hidden states pooled
(`classifier_pooling`: "cls" the first token, "mean" the mean over real tokens), then `head`
(dense, activation, LayerNorm), dropout (`classifier_dropout`) and `classifier` (with a bias);
params {"model", "head", "classifier"}. Segment ids are not read.

Packed fine-tuning (config.data.pack, classification and regression): several examples per row,
`packing_ids` and `example_starts` given; each example is pooled inside its row (BERT: the
pooler on its [CLS]; ModernBERT: its first token or the mean over its tokens) and the logits are
[rows, slots, num_labels].
"""

from __future__ import annotations

import flax.linen as nn
import jax

from bertjax.errors import ConfigError
from bertjax.models import heads
from bertjax.models.architectures import ModelConfig
from bertjax.models.bilstm import BiLSTMHead
from bertjax.models.layers import sequence_rows

Array = jax.Array


class BertForSequenceClassification(nn.Module):
    """params: {"bert": BertModel params, "classifier": {kernel [hidden, num_labels], bias}};
    for a ModernConfig {"model", "head", "classifier"} (the module docstring).

    bilstm_units > 0 (BERT only): the "+ BiLSTM" head (paper Table 5): a randomly initialised
    BiLSTM ("bilstm") reads the final hidden vectors, and the classifier its two final states
    [2 * bilstm_units] instead of the pooled [CLS] vector.
    classifier_pooling: "cls" | "mean" (ModernBERT only); classifier_dropout: the dropout
    before the classifier (None: the encoder's hidden dropout, heads.head_dropout).
    """

    config: ModelConfig
    num_labels: int
    bilstm_units: int = 0
    classifier_pooling: str = "cls"
    classifier_dropout: float | None = None

    @property
    def pooled_only(self) -> bool:
        """Whether the head reads the pooled token alone (BertModel's `pooled_only`)."""
        return not self.bilstm_units

    @nn.compact
    def __call__(
        self,
        input_ids: Array,
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
        *,
        packing_ids: Array | None = None,
        example_starts: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        """input_ids, segment_ids, input_mask: [batch, seq] int → logits [batch, num_labels].

        Packed rows (data_pipeline/packed_finetune.py): packing_ids [rows, seq] int (slot s's
        example has id s + 1) and example_starts [rows, slots] int → logits [rows, slots,
        num_labels], each example's as it would be alone in a row (heads.encode_packed)."""
        cfg = self.config
        heads.check_head_options(cfg, self.classifier_pooling, self.bilstm_units)
        if example_starts is not None:
            if self.bilstm_units:
                raise ConfigError("config.data.pack: the + BiLSTM head (config.task."
                                  "bilstm_units) reads a whole row; packing is for pooled heads")
            pooled = heads.encode_packed(cfg, input_ids, segment_ids, input_mask, packing_ids,
                                         example_starts, deterministic=deterministic,
                                         pooling=self.classifier_pooling)
            logits = heads.output_layer(cfg, pooled, self.num_labels,
                                        deterministic=deterministic,
                                        classifier_dropout=self.classifier_dropout)
            return nn.with_logical_constraint(logits, ("batch", None, "classes"))
        sequence, pooled = heads.encode(cfg, input_ids, segment_ids, input_mask,
                                        deterministic=deterministic,
                                        pooled_only=self.pooled_only,
                                        pooling=self.classifier_pooling)
        if self.bilstm_units:
            pooled = BiLSTMHead(self.bilstm_units, cfg.initializer_range, cfg.dtype,
                                summarize=True, name="bilstm")(sequence, input_mask)
        logits = heads.output_layer(cfg, pooled, self.num_labels, deterministic=deterministic,
                                    classifier_dropout=self.classifier_dropout)
        return nn.with_logical_constraint(logits, ("batch", "classes"))


class BertForMultipleChoice(nn.Module):
    """params: {"bert": BertModel params, "classifier": {kernel [hidden, 1], bias [1]}}; for a
    ModernConfig {"model", "head", "classifier"} (transformers' ModernBertForMultipleChoice)."""

    config: ModelConfig
    classifier_pooling: str = "cls"
    classifier_dropout: float | None = None
    pooled_only = True  # the head reads the pooled token alone (BertModel's `pooled_only`)

    @nn.compact
    def __call__(
        self,
        input_ids: Array,
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
        *,
        deterministic: bool = True,
    ) -> Array:
        """input_ids, segment_ids, input_mask: [batch, choices, seq] → logits [batch, choices]."""
        heads.check_head_options(self.config, self.classifier_pooling)
        batch, choices, _ = input_ids.shape
        _, pooled = heads.encode(self.config, sequence_rows(input_ids),
                                 sequence_rows(segment_ids), sequence_rows(input_mask),
                                 deterministic=deterministic, pooled_only=self.pooled_only,
                                 pooling=self.classifier_pooling)
        # The vector v; a bias would be the same for every choice and cancel in the softmax,
        # but it is kept so the head is the same dense layer as classification's.
        scores = heads.output_layer(self.config, pooled, 1, deterministic=deterministic,
                                    classifier_dropout=self.classifier_dropout)
        return scores.reshape(batch, choices)

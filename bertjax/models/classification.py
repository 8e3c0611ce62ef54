"""Sequence-level fine-tuning heads (flax modules only; losses and metrics live in
bertjax/tasks/classification/task.py).

The paper's head: C = the pooled final [CLS] vector [batch, hidden], dropout, then one dense
layer (truncated-normal init). Classification and regression give logits [batch, num_labels]
(num_labels = 1 for regression, e.g. STS-B). Multiple choice (SWAG) encodes each choice as
its own `[CLS] context [SEP] ending [SEP]` sequence and scores it as C·v with one learned
vector v: logits [batch, choices], a softmax across the choices.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from bertjax.models.bert import BertModel, dense, sequence_rows
from bertjax.models.bilstm import BiLSTMHead
from bertjax.models.config import BertConfig

Array = jax.Array


class BertForSequenceClassification(nn.Module):
    """params: {"bert": BertModel params, "classifier": {kernel [hidden, num_labels], bias}}.

    bilstm_units > 0: the "+ BiLSTM" head (paper Table 5): a randomly initialised BiLSTM
    ("bilstm") reads the final hidden vectors, and the classifier its two final states
    [2 * bilstm_units] instead of the pooled [CLS] vector.
    """

    config: BertConfig
    num_labels: int
    bilstm_units: int = 0

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
        deterministic: bool = True,
    ) -> Array:
        """input_ids, segment_ids, input_mask: [batch, seq] int → logits [batch, num_labels]."""
        outputs = BertModel(self.config, name="bert")(
            input_ids, segment_ids, input_mask, deterministic=deterministic,
            pooled_only=self.pooled_only,
        )
        pooled = outputs["pooled_output"]
        if self.bilstm_units:
            cfg = self.config
            pooled = BiLSTMHead(self.bilstm_units, cfg.initializer_range, cfg.dtype,
                                summarize=True, name="bilstm")(
                outputs["sequence_output"], input_mask)
        pooled = nn.Dropout(self.config.hidden_dropout_prob)(pooled, deterministic=deterministic)
        logits = dense(self.config, self.num_labels, ("embed", "classes"), "classifier")(pooled)
        return nn.with_logical_constraint(logits, ("batch", "classes"))


class BertForMultipleChoice(nn.Module):
    """params: {"bert": BertModel params, "classifier": {kernel [hidden, 1], bias [1]}}."""

    config: BertConfig
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
        batch, choices, _ = input_ids.shape
        outputs = BertModel(self.config, name="bert")(
            sequence_rows(input_ids), sequence_rows(segment_ids), sequence_rows(input_mask),
            deterministic=deterministic, pooled_only=self.pooled_only,
        )
        pooled = nn.Dropout(self.config.hidden_dropout_prob)(
            outputs["pooled_output"], deterministic=deterministic
        )
        # The vector v; a bias would be the same for every choice and cancel in the softmax,
        # but it is kept so the head is the same dense layer as classification's.
        scores = dense(self.config, 1, ("embed", "classes"), "classifier")(pooled)
        return scores.reshape(batch, choices)

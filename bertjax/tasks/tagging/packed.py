"""The token-classification head over packed rows (config.data.pack, bertjax/tasks/packing.py).

`PackedTokenClassification` is `bertjax.models.tagging.BertForTokenClassification` (the same
parameters: {"bert", "classifier"}, a ModernBERT's {"model", "head", "classifier"}, so its
checkpoints, exports and predictions are that class's) with a `packing_ids` argument: the
encoder then attends within each packed example and restarts its positions there (BertModel /
ModernBertModel's own packing), and every position is scored as in the example's own row.
Without packing_ids it computes what BertForTokenClassification does. The "+ BiLSTM" head is
not packed (its recurrence would run across a row's examples; tasks/checks.py refuses it).
"""

from __future__ import annotations

import flax.linen as nn
import jax

from bertjax.models import heads, is_modern
from bertjax.models.architectures import ModelConfig
from bertjax.models.bert import BertModel
from bertjax.models.modern import ModernBertModel

Array = jax.Array


class PackedTokenClassification(nn.Module):
    """BertForTokenClassification's parameters and logits, over rows of packed examples."""

    config: ModelConfig
    num_labels: int
    classifier_dropout: float | None = None

    @nn.compact
    def __call__(self, input_ids: Array, segment_ids: Array | None = None,
                 input_mask: Array | None = None, *, packing_ids: Array | None = None,
                 deterministic: bool = True) -> Array:
        """input_ids, segment_ids, input_mask, packing_ids (slot + 1 per token, 0 padding):
        [rows, seq] int → logits [rows, seq, num_labels]."""
        cfg = self.config
        # The encoders are created here under the names heads.encode gives them, so the
        # parameter tree is BertForTokenClassification's.
        if is_modern(cfg):
            hidden = ModernBertModel(cfg, name="model")(
                input_ids, input_mask, packing_ids=packing_ids, deterministic=deterministic)
        else:
            hidden = BertModel(cfg, name="bert")(
                input_ids, segment_ids, input_mask, packing_ids=packing_ids,
                deterministic=deterministic)["sequence_output"]
        logits = heads.output_layer(cfg, hidden, self.num_labels, deterministic=deterministic,
                                    classifier_dropout=self.classifier_dropout)
        return nn.with_logical_constraint(logits, ("batch", "length", "classes"))

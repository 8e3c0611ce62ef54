"""Multiple choice (SWAG): each choice is `[CLS] context [SEP] ending [SEP]`; its score is
C·v (C = pooled [CLS] vector, v one learned vector); softmax across the choices."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import BertConfig, BertModel
from bertjax.models.bert import dense
from bertjax.tasks.classification import classification_loss

Array = jax.Array


class BertForMultipleChoice(nn.Module):
    """params: {"bert": BertModel params, "classifier": {kernel [hidden, 1], bias [1]}}."""

    config: BertConfig

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
        batch, choices, seq = input_ids.shape

        def flat(x):  # every choice is encoded as its own sequence
            return None if x is None else x.reshape(batch * choices, seq)

        outputs = BertModel(self.config, name="bert")(
            flat(input_ids), flat(segment_ids), flat(input_mask), deterministic=deterministic
        )
        pooled = nn.Dropout(self.config.hidden_dropout_prob)(
            outputs["pooled_output"], deterministic=deterministic
        )
        # The vector v; a bias would be the same for every choice and cancel in the softmax,
        # but it is kept so the head is the same dense layer as classification's.
        scores = dense(self.config, 1, ("embed", "classes"), "classifier")(pooled)
        return scores.reshape(batch, choices)


def multiple_choice_loss(
    logits: Array, labels: Array, weights: Array | None = None
) -> tuple[Array, dict[str, Array]]:
    """Softmax cross-entropy across choices. logits [batch, choices]; labels [batch] int."""
    return classification_loss(jnp.asarray(logits), labels, weights)

"""The span-QA head of SQuAD (paper Sec. 4.2-4.3): a start vector S and an end vector E (one
dense layer `qa_outputs` to 2 logits per token, as the reference and transformers'
`BertForQuestionAnswering`); score(i, j) = S·T_i + E·T_j for j ≥ i. The "+ BiLSTM" variant
(paper Table 5) puts a randomly initialised BiLSTM (models/bilstm.py) between the encoder and
`qa_outputs`. Modules only: the span loss, post-processing and metrics are the task family's
(tasks/squad/).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models.bert import BertModel, dense
from bertjax.models.bilstm import BiLSTMHead
from bertjax.models.config import BertConfig

Array = jax.Array


class BertForQuestionAnswering(nn.Module):
    """params: {"bert": BertModel params, "qa_outputs": {kernel [hidden, 2], bias [2]}}.

    bilstm_units > 0: "+ BiLSTM" (paper Table 5): a randomly initialised BiLSTM ("bilstm")
    between the encoder and qa_outputs (kernel [2 * bilstm_units, 2]).
    """

    config: BertConfig
    bilstm_units: int = 0

    @nn.compact
    def __call__(self, input_ids: Array, segment_ids: Array | None = None,
                 input_mask: Array | None = None, *, deterministic: bool = True
                 ) -> tuple[Array, Array]:
        """input_ids, segment_ids, input_mask: [batch, seq] int → (start_logits, end_logits),
        each [batch, seq] float32."""
        outputs = BertModel(self.config, name="bert")(
            input_ids, segment_ids, input_mask, deterministic=deterministic)
        sequence = outputs["sequence_output"]
        if self.bilstm_units:
            sequence = BiLSTMHead(self.bilstm_units, self.config.initializer_range,
                                  self.config.dtype, name="bilstm")(sequence, input_mask)
        logits = dense(self.config, 2, ("embed", "classes"), "qa_outputs")(
            sequence).astype(jnp.float32)
        logits = nn.with_logical_constraint(logits, ("batch", "length", "classes"))
        return logits[..., 0], logits[..., 1]

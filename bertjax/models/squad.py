"""The span-QA head of SQuAD (paper Sec. 4.2-4.3): a start vector S and an end vector E (one
dense layer `qa_outputs` to 2 logits per token, as the reference and transformers'
`BertForQuestionAnswering`); score(i, j) = S·T_i + E·T_j for j ≥ i. The "+ BiLSTM" variant
(paper Table 5) puts a randomly initialised BiLSTM (models/bilstm.py) between the encoder and
`qa_outputs`. Modules only: the span loss, post-processing and metrics are the task family's
(tasks/squad/).

Given a `ModernConfig`, `BertForQuestionAnswering` is transformers'
ModernBertForQuestionAnswering (bertjax/models/heads.py): every final hidden vector through
`head` (dense, activation, LayerNorm), dropout and `classifier` (kernel [hidden, 2], bias);
params {"model", "head", "classifier"}.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import heads
from bertjax.models.architectures import ModelConfig
from bertjax.models.bilstm import BiLSTMHead

Array = jax.Array


class BertForQuestionAnswering(nn.Module):
    """params: {"bert": BertModel params, "qa_outputs": {kernel [hidden, 2], bias [2]}}; for a
    ModernConfig {"model", "head", "classifier"} (the module docstring).

    bilstm_units > 0 (BERT only): "+ BiLSTM" (paper Table 5): a randomly initialised BiLSTM
    ("bilstm") between the encoder and qa_outputs (kernel [2 * bilstm_units, 2]).
    classifier_dropout (ModernBERT; BERT's QA head has no dropout): None = its mlp_dropout.
    """

    config: ModelConfig
    bilstm_units: int = 0
    classifier_dropout: float | None = None

    @nn.compact
    def __call__(self, input_ids: Array, segment_ids: Array | None = None,
                 input_mask: Array | None = None, *, deterministic: bool = True
                 ) -> tuple[Array, Array]:
        """input_ids, segment_ids, input_mask: [batch, seq] int → (start_logits, end_logits),
        each [batch, seq] float32."""
        cfg = self.config
        heads.check_head_options(cfg, bilstm_units=self.bilstm_units)
        sequence, _ = heads.encode(cfg, input_ids, segment_ids, input_mask,
                                   deterministic=deterministic)
        if self.bilstm_units:
            sequence = BiLSTMHead(self.bilstm_units, cfg.initializer_range, cfg.dtype,
                                  name="bilstm")(sequence, input_mask)
        logits = heads.output_layer(cfg, sequence, 2, deterministic=deterministic,
                                    classifier_dropout=self.classifier_dropout,
                                    bert_name="qa_outputs", bert_dropout=False)
        logits = nn.with_logical_constraint(logits.astype(jnp.float32),
                                            ("batch", "length", "classes"))
        return logits[..., 0], logits[..., 1]

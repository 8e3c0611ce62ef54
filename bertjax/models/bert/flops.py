"""Model FLOPs of BERT's forward pass."""

from __future__ import annotations

from bertjax.models.bert.config import BertConfig


def forward_flops(cfg: BertConfig, seq_len: int, max_predictions: int,
                  pooled_only: bool = False) -> float:
    """Matmul FLOPs of one forward pass of BertForPreTraining on one sequence.

    Per layer and token: Q/K/V/O projections 8H², FFN 4·H·I, attention scores and the
    weighted sum 4·s·H. The MLM head runs only on `max_predictions` positions: 2H² + 2HV each.
    Embedding look-ups, LayerNorm, softmax, pooler and NSP are negligible and not counted.
    pooled_only: the final layer computed for one token (BertModel's `pooled_only`): keys and
    values of every token (4H² each), the rest for that token only.
    """
    h, i, s = cfg.hidden_size, cfg.intermediate_size, seq_len
    per_layer = s * (8 * h * h + 4 * h * i) + 4 * s * s * h
    final = per_layer
    if pooled_only:
        final = s * 4 * h * h + (4 * h * h + 4 * h * i) + 4 * s * h
    mlm = max_predictions * (2 * h * h + 2 * h * cfg.vocab_size)
    return float((cfg.num_layers - 1) * per_layer + final + mlm)

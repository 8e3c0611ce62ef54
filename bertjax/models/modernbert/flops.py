"""Model FLOPs of ModernBERT's forward pass, local layers counted over their window."""

from __future__ import annotations

from bertjax.models.modernbert.config import LOCAL, ModernConfig


def window_keys(seq_len: int, radius: int | None) -> int:
    """Query-key pairs of one attention map over `seq_len` tokens: all of them (radius None, a
    global layer), or those at |q - k| <= radius (a local layer's window, cut at the ends)."""
    if radius is None or radius >= seq_len - 1:
        return seq_len * seq_len
    # Every query sees 2r + 1 keys, less those past either end: r(r + 1) / 2 at each.
    return seq_len * (2 * radius + 1) - radius * (radius + 1)


def attention_flops(cfg: ModernConfig, seq_len: int, all_global: bool = False) -> float:
    """Forward FLOPs of the scores and the weighted sum of every layer on one sequence
    (4 · head_dim · heads per query-key pair), local layers counted over their window only
    (all_global: as if every layer were global, what the local layers are measured against)."""
    pairs = sum(window_keys(seq_len, None if all_global or kind != LOCAL else cfg.window_radius)
                for kind in cfg.layer_types)
    return float(4 * cfg.hidden_size * pairs)


def forward_flops(cfg: ModernConfig, seq_len: int, max_predictions: int,
                  pooled_only: bool = False) -> float:
    """Matmul FLOPs of one forward pass of ModernBertForMaskedLM on one sequence: per layer and
    token the fused Q/K/V and output projections 8H², the GeGLU 6·H·I (wi to 2I, wo back);
    attention per `attention_flops`; the head on `max_predictions` positions 2H² + 2HV.
    (`pooled_only` is BERT's; every ModernBERT layer runs on every token.)"""
    del pooled_only
    h, i = cfg.hidden_size, cfg.intermediate_size
    dense = cfg.num_layers * seq_len * (8 * h * h + 6 * h * i)
    head = max_predictions * (2 * h * h + 2 * h * cfg.vocab_size)
    return float(dense + head) + attention_flops(cfg, seq_len)


def attention_report(cfg: ModernConfig, stages: list[tuple[int, float]]) -> list[str]:
    """Local layers against all-global attention, per (sequence length, model FLOPs per
    example of a training step): the training FLOPs of attention (scores and weighted sums,
    forward + backward) each way and the share of an all-global step that the window saves."""
    lines = [f"Local attention ({cfg.layer_types.count(LOCAL)} of {cfg.num_layers} layers, "
             f"window {cfg.window_radius} each side) against every layer global, per sequence:"]
    for seq_len, flops_per_example in stages:
        local = 3 * attention_flops(cfg, seq_len)
        dense = 3 * attention_flops(cfg, seq_len, all_global=True)
        whole = flops_per_example + dense - local
        lines.append(f"  {seq_len:>6} tokens: attention {local / 1e9:,.1f} GFLOP instead of "
                     f"{dense / 1e9:,.1f}; the step's model FLOPs {(dense - local) / whole:.1%} "
                     "fewer")
    return lines

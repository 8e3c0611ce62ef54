"""Model FLOPs of BERT and ModernBERT training and the peak throughput of known accelerators
(for MFU)."""

from __future__ import annotations

from bertjax.models.config import BertConfig
from bertjax.models.modern import LOCAL, ModernConfig

# Dense bf16 peak, TFLOP/s per device (chip for TPU, GPU otherwise), matched against
# jax.Device.device_kind. Longer keys first so that "v5p" is not taken for "v5".
PEAK_BF16_TFLOPS = {
    "TPU v6 lite": 918.0,  # v6e
    "TPU v5 lite": 197.0,  # v5e
    "TPU v5p": 459.0,
    "TPU v5": 459.0,
    "TPU v4": 275.0,
    "B200": 2250.0,
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
}


def peak_flops_per_device(device_kind: str) -> float | None:
    """Peak FLOP/s of one device, or None if the kind is unknown (MFU is then not reported)."""
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key.lower() in device_kind.lower():
            return tflops * 1e12
    return None


def forward_flops_per_sequence(cfg: BertConfig, seq_len: int, max_predictions: int,
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


def window_keys(seq_len: int, radius: int | None) -> int:
    """Query-key pairs of one attention map over `seq_len` tokens: all of them (radius None, a
    global layer), or those at |q - k| <= radius (a local layer's window, cut at the ends)."""
    if radius is None or radius >= seq_len - 1:
        return seq_len * seq_len
    # Every query sees 2r + 1 keys, less those past either end: r(r + 1) / 2 at each.
    return seq_len * (2 * radius + 1) - radius * (radius + 1)


def modern_attention_flops(cfg: ModernConfig, seq_len: int, all_global: bool = False) -> float:
    """Forward FLOPs of the scores and the weighted sum of every layer on one sequence
    (4 · head_dim · heads per query-key pair), local layers counted over their window only
    (all_global: as if every layer were global, what the local layers are measured against)."""
    pairs = sum(window_keys(seq_len, None if all_global or kind != LOCAL else cfg.window_radius)
                for kind in cfg.layer_types)
    return float(4 * cfg.hidden_size * pairs)


def modern_forward_flops_per_sequence(cfg: ModernConfig, seq_len: int,
                                      max_predictions: int) -> float:
    """Matmul FLOPs of one forward pass of ModernBertForMaskedLM on one sequence: per layer and
    token the fused Q/K/V and output projections 8H², the GeGLU 6·H·I (wi to 2I, wo back);
    attention per `modern_attention_flops`; the head on `max_predictions` positions 2H² + 2HV."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    dense = cfg.num_layers * seq_len * (8 * h * h + 6 * h * i)
    head = max_predictions * (2 * h * h + 2 * h * cfg.vocab_size)
    return float(dense + head) + modern_attention_flops(cfg, seq_len)


def train_flops_per_sequence(cfg: BertConfig | ModernConfig, seq_len: int,
                             max_predictions: int) -> float:
    """Forward + backward ≈ 3 × forward (the backward pass costs two matmuls per forward one)."""
    if isinstance(cfg, ModernConfig):
        return 3.0 * modern_forward_flops_per_sequence(cfg, seq_len, max_predictions)
    return 3.0 * forward_flops_per_sequence(cfg, seq_len, max_predictions)

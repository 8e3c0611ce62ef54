"""Model FLOPs of training (each architecture counts its forward pass:
`Architecture.forward_flops`) and the peak throughput of known accelerators (for MFU)."""

from __future__ import annotations

from bertjax.models import ModelConfig, architecture

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


def train_flops_per_sequence(cfg: ModelConfig, seq_len: int, max_predictions: int) -> float:
    """Forward + backward ≈ 3 × forward (the backward pass costs two matmuls per forward one)."""
    return 3.0 * architecture(cfg).forward_flops(cfg, seq_len, max_predictions)

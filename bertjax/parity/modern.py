"""ModernBERT pre-training parity: bertjax's ModernBertForMaskedLM, trained by the one train
step on the trainer's packed batches, against transformers' ModernBertForMaskedLM (eager
attention) + torch.optim.AdamW on the same examples one per row.

The model has three layers (global, local, local) and a 16-token window (radius 8), so the
32-token examples of the parity corpus reach past it: local attention, RoPE with two thetas,
GeGLU, pre-norm and the tied decoder all take part. Rows:
  MLM, one example per row: bertjax on the unpacked rows against transformers.
  packed = unpacked: bertjax on the packed rows against bertjax on their unpacked copies (the
    per-prediction mean, hence every step, must be the same: documents never see each other,
    positions restart in each).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from bertjax.errors import ConfigError
from bertjax.models.modernbert import ModernConfig
from bertjax.parity import harness
from bertjax.parity.pretraining import _packed_batches, default_optimizer, param_tolerance

ARCHITECTURE = "ModernBertForMaskedLM"
REFERENCE = "transformers ModernBertForMaskedLM (eager) + torch.optim.AdamW"


def small_config(vocab_size: int) -> ModernConfig:
    """3 layers (global, local, local), hidden 64, 2 heads, GeGLU 96, window 16, float32."""
    return ModernConfig(vocab_size=vocab_size, hidden_size=64, num_layers=3, num_heads=2,
                        intermediate_size=96, local_attention=16, max_position_embeddings=128,
                        pad_token_id=0, bos_token_id=2, cls_token_id=2, eos_token_id=3,
                        sep_token_id=3, attention_impl="einsum")


def torch_model(config: ModernConfig, params: Any):
    """transformers' ModernBertForMaskedLM with bertjax's params, float32, eager attention; the
    decoder matrix must be the token embeddings (tied)."""
    import torch
    import transformers

    from bertjax.convert.modernbert import to_hf_state_dict

    values = config.to_hf(ARCHITECTURE)
    values.pop("architectures")
    hf_config = transformers.ModernBertConfig(**values)
    hf_config._attn_implementation = "eager"
    model = transformers.ModernBertForMaskedLM(hf_config)
    state = {name: torch.from_numpy(np.array(a, np.float32))  # a writable copy
             for name, a in to_hf_state_dict(config, params, ARCHITECTURE).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if [m for m in missing if m != "decoder.weight"] or unexpected:
        raise ConfigError(f"{ARCHITECTURE}: tensors not loaded {missing}, not in the model "
                          f"{unexpected}")
    if model.decoder.weight is not model.model.embeddings.tok_embeddings.weight:
        raise ConfigError(f"{ARCHITECTURE}: decoder.weight is not tied to the embeddings")
    return model.float().train()


def hf_loss(model, batch) -> dict:
    """transformers' own MLM loss from `labels` (the masked positions' tokens, -100 elsewhere)."""
    import torch

    labels = torch.full_like(batch["input_ids"], -100)
    rows = torch.arange(labels.shape[0])[:, None].expand_as(batch["masked_lm_positions"])
    real = batch["masked_lm_weights"] > 0
    labels[rows[real], batch["masked_lm_positions"][real]] = batch["masked_lm_ids"][real]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["input_mask"], labels=labels)
    return {"loss": out.loss}


def param_rel_diff(config: ModernConfig, params: Any, state: dict[str, np.ndarray]
                   ) -> dict[str, float]:
    """{transformers tensor name: max|ours - theirs| / max|theirs|} after training."""
    from bertjax.convert.modernbert import to_hf_state_dict

    diffs = {}
    for name, a in to_hf_state_dict(config, params, ARCHITECTURE).items():
        b = np.asarray(state[name], np.float64)
        diffs[name] = float(np.max(np.abs(np.asarray(a, np.float64) - b))
                            / max(float(np.max(np.abs(b))), 1e-30))
    return diffs


def run_mlm(steps: int, workdir: pathlib.Path, optimizer=None) -> list[harness.Row]:
    import flax.linen as nn
    import jax

    from bertjax.convert.modernbert import to_hf_state_dict
    from bertjax.models.modernbert import ModernBertForMaskedLM
    from bertjax.tasks.pretraining.objective import init_params, step_fns

    vocab_size, packed, unpacked = _packed_batches(steps, workdir, "mlm")
    config = small_config(vocab_size)
    model = ModernBertForMaskedLM(config)
    params = jax.tree.map(np.asarray, nn.unbox(init_params(model, jax.random.key(0))))
    _, loss_fn = step_fns(model, nsp_weight=0.0, packed=True)
    optimizer = optimizer or default_optimizer(steps)
    ours, final = harness.train_bertjax(params, loss_fn, optimizer, unpacked, steps)
    theirs, state = harness.train_torch(torch_model(config, params), unpacked, hf_loss,
                                        optimizer, steps)
    ours_packed, final_packed = harness.train_bertjax(params, loss_fn, optimizer, packed, steps)
    tolerance = param_tolerance(optimizer, theirs)
    keys = ("loss",)
    unpacked_state = to_hf_state_dict(config, final, ARCHITECTURE)
    return [
        harness.Row("ModernBERT MLM (global + local layers, RoPE, GeGLU), one example per row",
                    REFERENCE, {k: ours[k] for k in keys}, {k: theirs[k] for k in keys},
                    param_rel_diff=param_rel_diff(config, final, state),
                    param_tolerance=tolerance),
        harness.Row("ModernBERT MLM: packed rows = the same examples unpacked",
                    "bertjax on the unpacked rows", {k: ours_packed[k] for k in keys},
                    {k: ours[k] for k in keys},
                    param_rel_diff=param_rel_diff(config, final_packed, unpacked_state),
                    param_tolerance=tolerance),
    ]


JOBS: dict[str, Callable[[int, pathlib.Path], list[harness.Row]]] = {
    "pretraining_modern_mlm": run_mlm,
}

"""The NeoBERT-style encoder's `Architecture` record: its heads pool the final hidden states
("cls" or "mean") and put dropout and a dense layer with a bias (`classifier`, drawn as a new
BERT head is) on them; it pre-trains with the masked-LM objective on packed rows; no checkpoint
interop."""

from __future__ import annotations

import flax.linen as nn
import jax

from bertjax.models.dense import Dense
from bertjax.models.neobert.config import NEO_PRESETS, NeoConfig
from bertjax.models.neobert.modules import NeoBertForMaskedLM, NeoBertModel
from bertjax.models.record import Architecture, masked_encoder_calls

Array = jax.Array


encode, encode_packed = masked_encoder_calls(NeoBertModel)


def output_layer(config: NeoConfig, x: Array, features: int, *, deterministic: bool,
                 rate: float, name: str = "classifier", dropout: bool = True) -> Array:
    """Dropout (unless `dropout` is false), then the dense layer `name` (kernel ~ normal(0,
    initializer_range), bias zeros)."""
    if dropout:
        x = nn.Dropout(rate)(x, deterministic=deterministic)
    return Dense(features, kernel_axes=("embed", "classes"), bias_axes=("classes",),
                 stddev=config.initializer_range, dtype=config.dtype,
                 param_dtype=config.param_dtype, truncated=False, name=name)(x)


def hidden_states(config: NeoConfig, params, input_ids: Array, segment_ids: Array | None,
                  input_mask: Array | None) -> Array:
    """[num_layers + 1, batch, seq, hidden]: the embeddings' output, each layer's, the last
    final-normed."""
    del segment_ids
    return NeoBertModel(config).apply({"params": params}, input_ids, input_mask,
                                      return_all_layers=True)


def forward_flops(cfg: NeoConfig, seq_len: int, max_predictions: int,
                  pooled_only: bool = False) -> float:
    """Matmul FLOPs of one forward pass of NeoBertForMaskedLM on one sequence: per layer and
    token Q/K/V/O 8H², SwiGLU 6·H·I, attention 4·s·H; the tied decoder on `max_predictions`
    positions 2HV."""
    del pooled_only
    h, i, s = cfg.hidden_size, cfg.intermediate_size, seq_len
    per_layer = s * (8 * h * h + 6 * h * i) + 4 * s * s * h
    return float(cfg.num_layers * per_layer + max_predictions * 2 * h * cfg.vocab_size)


ARCHITECTURE = Architecture(
    name="neobert",
    title="a NeoBERT",
    config_class=NeoConfig,
    encoder_group="model",
    encoder_class="NeoBertModel",
    encoder=NeoBertModel,
    encoder_args=lambda ids, segment_ids, mask: (ids, mask),
    pretraining_model=NeoBertForMaskedLM,
    pretraining_args=lambda b: (b["input_ids"], b["input_mask"], b["masked_lm_positions"]),
    encode=encode,
    encode_packed=encode_packed,
    output_layer=output_layer,
    hidden_states=hidden_states,
    head_dropout=lambda config: config.dropout,
    forward_flops=forward_flops,
    objectives=("mlm",),
    optional_groups=("decoder_bias",),
    size_fields=("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size"),
    embedding_table="model/embeddings/embedding",
    scans_layers=False,
    poolings=("cls", "mean"),
    # BERT's hidden dropout (the shipped fine-tuning configs set it) is its one dropout; it has
    # no attention dropout.
    translated_fields={"hidden_dropout_prob": ("dropout",), "attention_dropout_prob": ()},
    presets=tuple(NEO_PRESETS),
)

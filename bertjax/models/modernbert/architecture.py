"""ModernBERT's `Architecture` record: its encoder, heads and masked-LM model as shared code
calls them (transformers' ModernBertFor* classes, parameter for parameter).

Heads: `ModernBertModel` "model" gives the final hidden states (no segment ids, no pooler); a
sequence head pools them (`layers.pool`: "cls" the first token, "mean" the mean over real
tokens: transformers' classifier_pooling); the output layer is `head` (ModernPredictionHead:
dense without bias, activation, LayerNorm without bias) on the pooled vector or on every token,
dropout (classifier_dropout), then `classifier`, a dense layer with a bias. params: {"model",
"head", "classifier"}."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import dense as dense_lib
from bertjax.models.layers import Dropout
from bertjax.models.modernbert.config import MODERN_PRESETS, ModernConfig
from bertjax.models.modernbert.flops import attention_report, forward_flops
from bertjax.models.modernbert.modules import (
    ModernBertForMaskedLM,
    ModernBertModel,
    ModernEmbeddings,
    ModernLayer,
    ModernPredictionHead,
    _init,
)
from bertjax.models.record import Architecture, masked_encoder_calls

Array = jax.Array

# transformers' BERT classes (what the task families name their heads) → ModernBERT's.
HF_CLASSES = {
    "BertModel": "ModernBertModel",
    "BertForPreTraining": "ModernBertForMaskedLM",
    "BertForMaskedLM": "ModernBertForMaskedLM",
    "BertForSequenceClassification": "ModernBertForSequenceClassification",
    "BertForTokenClassification": "ModernBertForTokenClassification",
    "BertForQuestionAnswering": "ModernBertForQuestionAnswering",
    "BertForMultipleChoice": "ModernBertForMultipleChoice",
}


encode, encode_packed = masked_encoder_calls(ModernBertModel)


class ModernClassifier(nn.Module):
    """transformers' `classifier` of the ModernBertFor* heads: x [..., hidden] → [...,
    features], kernel [hidden, features] ("embed", "classes") initialised as transformers does
    (truncated normal, stddev hidden^-0.5), bias [features] zeros."""

    config: ModernConfig
    features: int

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        kernel = self.param("kernel", _init(cfg, cfg.hidden_size ** -0.5, ("embed", "classes")),
                            (x.shape[-1], self.features), jnp.dtype(cfg.param_dtype))
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                                               ("classes",)),
                          (self.features,), jnp.dtype(cfg.param_dtype))
        dtype = jnp.dtype(cfg.dtype)
        return dense_lib.dense(x.astype(dtype), kernel.astype(dtype), bias.astype(dtype))


def output_layer(config: ModernConfig, x: Array, features: int, *, deterministic: bool,
                 rate: float, name: str = "classifier", dropout: bool = True) -> Array:
    """`head`, dropout, `classifier` (transformers' names, whatever BERT's head calls its
    layer)."""
    del name, dropout
    x = ModernPredictionHead(config, name="head")(x)
    x = Dropout(rate)(x, deterministic=deterministic)
    return ModernClassifier(config, features, name="classifier")(x)


def hidden_states(config: ModernConfig, params, input_ids: Array, segment_ids: Array | None,
                  input_mask: Array | None) -> Array:
    """[num_layers + 1, batch, seq, hidden]: the embeddings' output, each layer's, the last the
    final-normed output (transformers' hidden_states[-1]). The others are captured from the
    modules, so they are computed as they always are."""
    del segment_ids
    # Unrematerialised layers: the capture filter then sees the layer modules themselves.
    config = dataclasses.replace(config, remat_policy="none")
    wanted = (ModernEmbeddings, ModernLayer)
    last, state = ModernBertModel(config).apply(
        {"params": params}, input_ids, input_mask, mutable=["intermediates"],
        capture_intermediates=lambda module, method: (method == "__call__"
                                                      and isinstance(module, wanted)))
    captured = state["intermediates"]
    layers = [captured["embeddings"]["__call__"][0]]
    layers += [captured[f"layers_{i}"]["__call__"][0] for i in range(config.num_layers - 1)]
    return jnp.stack(layers + [last])


def vocab_fields(tokenizer) -> dict[str, int]:
    """The special-token ids config.json records (the model reads none of them): [PAD], [CLS]
    (also bos) and [SEP] (also eos), or <pad>, <s>, </s>."""
    return dict(pad_token_id=tokenizer.pad_id, cls_token_id=tokenizer.cls_id,
                bos_token_id=tokenizer.cls_id, sep_token_id=tokenizer.sep_id,
                eos_token_id=tokenizer.sep_id)


ARCHITECTURE = Architecture(
    name="modernbert",
    title="a ModernBERT",
    config_class=ModernConfig,
    encoder_group="model",
    encoder_class="ModernBertModel",
    encoder=ModernBertModel,
    encoder_args=lambda ids, segment_ids, mask: (ids, mask),
    pretraining_model=ModernBertForMaskedLM,
    pretraining_args=lambda b: (b["input_ids"], b["input_mask"], b["masked_lm_positions"]),
    encode=encode,
    encode_packed=encode_packed,
    output_layer=output_layer,
    hidden_states=hidden_states,
    head_dropout=lambda config: config.mlp_dropout,
    forward_flops=forward_flops,
    objectives=("mlm",),
    optional_groups=("head", "decoder_bias"),  # ModernBertModel checkpoints lack them
    # RoPE has no position table: max_position_embeddings fixes no shape.
    size_fields=("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size"),
    embedding_table="model/embeddings/tok_embeddings",
    scans_layers=False,
    poolings=("cls", "mean"),
    pretrained_head_groups=("head",),
    presets=tuple(MODERN_PRESETS),
    # BERT's fine-tuning dropout fields (the shipped configs set them) → the ModernBERT
    # fields that take their place: the hidden dropout after the embeddings and inside the
    # MLP, the attention dropout on its probabilities and output.
    translated_fields={"hidden_dropout_prob": ("embedding_dropout", "mlp_dropout"),
                       "attention_dropout_prob": ("attention_dropout",)},
    # ModernBERT-base: 50,280 tokens, 50,368 rows (a multiple of 64).
    padded_vocab=True,
    phase_fields=("global_rope_theta",),
    hf_classes=HF_CLASSES,
    conversion="bertjax.convert.modernbert",
    vocab_fields=vocab_fields,
    attention_report=attention_report,
    # Global and local layers differ in cost: no one per-layer figure extrapolates.
    mixed_layers=lambda config: True,
    # "auto" is splash on a TPU.
    tpu_kernels=lambda config: (None, (None, config.window_radius)
                                if config.attention_impl in ("auto", "splash") else None),
)

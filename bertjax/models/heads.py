"""What every fine-tuning head shares across the two architectures: the encoder, the pooled
vector and the output layer (`encode`, `output_layer`), so that each head of
classification.py / tagging.py / squad.py / embedding.py is written once for both.

BERT (a `BertConfig`, the heads' parameters unchanged): `BertModel` "bert" gives the final
hidden states and the pooler's tanh [CLS] vector; the output layer is dropout
(hidden_dropout_prob, or the head's classifier_dropout) and one dense layer (`classifier`,
`qa_outputs`).

ModernBERT (a `ModernConfig`, transformers' ModernBertFor* classes parameter for parameter):
`ModernBertModel` "model" gives the final hidden states (it has no segment ids and no pooler);
a sequence head pools them (`pool`: "cls" the first token, "mean" the mean over real tokens:
transformers' classifier_pooling); the output layer is `head` (ModernPredictionHead: dense
without bias, activation, LayerNorm without bias) on the pooled vector or on every token,
dropout (classifier_dropout), then `classifier`, a dense layer with a bias. params:
{"model", "head", "classifier"}.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.errors import ConfigError
from bertjax.models import dense as dense_lib
from bertjax.models import modern
from bertjax.models.architectures import ModelConfig, is_modern
from bertjax.models.bert import BertModel, Dropout, dense

Array = jax.Array

POOLINGS = ("cls", "mean")  # transformers' ModernBERT classifier_pooling
# transformers' BERT classes (what the task families name their heads) → the ModernBERT class
# these modules are given a ModernConfig.
MODERN_ARCHITECTURES = {
    "BertModel": "ModernBertModel",
    "BertForPreTraining": "ModernBertForMaskedLM",
    "BertForMaskedLM": "ModernBertForMaskedLM",
    "BertForSequenceClassification": "ModernBertForSequenceClassification",
    "BertForTokenClassification": "ModernBertForTokenClassification",
    "BertForQuestionAnswering": "ModernBertForQuestionAnswering",
    "BertForMultipleChoice": "ModernBertForMultipleChoice",
}


def encoder_name(config: ModelConfig) -> str:
    """The encoder's parameter group in a head: "model" (ModernBERT), "bert" (BERT)."""
    return "model" if is_modern(config) else "bert"


def check_head_options(config: ModelConfig, pooling: str = "cls", bilstm_units: int = 0
                       ) -> None:
    """ConfigError naming the config.task field a head cannot take for this architecture."""
    if pooling not in POOLINGS:
        raise ConfigError(f"config.task.classifier_pooling={pooling!r} is not one of "
                          f"{' | '.join(POOLINGS)}")
    if not is_modern(config) and pooling != "cls":
        raise ConfigError(f"config.task.classifier_pooling={pooling!r} is for a ModernBERT; a "
                          "BERT's head reads its pooler (the [CLS] vector)")
    if is_modern(config) and bilstm_units:
        raise ConfigError(f"config.task.bilstm_units={bilstm_units}: the + BiLSTM head is for "
                          "a BERT (a ModernBERT's heads are transformers' ModernBertFor*)")


def pool(hidden: Array, input_mask: Array | None, mode: str) -> Array:
    """hidden [batch, seq, hidden], input_mask [batch, seq] (1 = real token) → [batch, hidden]:
    "cls" the first token (the rows are right-padded, where transformers' first real token is
    the first), "mean" the mean over the real tokens (a row without one, a filler row, gives
    zeros instead of transformers' 0 / 0)."""
    if mode == "cls":
        return hidden[:, 0]
    if mode != "mean":
        raise ConfigError(f"config.task.classifier_pooling={mode!r} is not one of "
                          f"{' | '.join(POOLINGS)}")
    mask = (jnp.ones(hidden.shape[:2], hidden.dtype) if input_mask is None
            else input_mask.astype(hidden.dtype))[..., None]
    return jnp.sum(hidden * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1)


def encode(config: ModelConfig, input_ids: Array, segment_ids: Array | None,
           input_mask: Array | None, *, deterministic: bool, pooled_only: bool = False,
           pooling: str = "cls", packing_ids: Array | None = None) -> tuple[Array, Array]:
    """The encoder of a head, created in the calling module (`encoder_name`): input_ids,
    segment_ids (BERT only), input_mask, packing_ids (packed rows: example slot + 1, 0 on
    padding; attention and positions stay within each example) [batch, seq] int →
    (sequence_output [batch, seq, hidden], pooled [batch, hidden]). BERT: pooled is the
    pooler's output, and with `pooled_only` the final layer is computed for [CLS] alone
    (sequence_output [batch, 1, hidden]). ModernBERT: pooled is `pool(sequence_output,
    input_mask, pooling)`. Over packed rows only sequence_output is per example."""
    if is_modern(config):
        hidden = modern.ModernBertModel(config, name="model")(
            input_ids, input_mask, packing_ids=packing_ids, deterministic=deterministic)
        return hidden, pool(hidden, input_mask, pooling)
    outputs = BertModel(config, name="bert")(input_ids, segment_ids, input_mask,
                                             packing_ids=packing_ids,
                                             deterministic=deterministic,
                                             pooled_only=pooled_only)
    return outputs["sequence_output"], outputs["pooled_output"]


def pool_packed(hidden: Array, packing_ids: Array, example_starts: Array, mode: str) -> Array:
    """The pooled vector of each example of packed rows: hidden [rows, seq, hidden],
    packing_ids [rows, seq] (slot s's example has id s + 1, padding 0), example_starts
    [rows, slots] (each example's first position) → [rows, slots, hidden]: "cls" each example's
    first token, "mean" the mean over its tokens (an empty slot gives zeros), what `pool` gives
    the example alone in a row."""
    if mode == "cls":
        return jnp.take_along_axis(hidden, example_starts[..., None], axis=1)
    if mode != "mean":
        raise ConfigError(f"config.task.classifier_pooling={mode!r} is not one of "
                          f"{' | '.join(POOLINGS)}")
    slots = jnp.arange(1, example_starts.shape[1] + 1)
    member = (packing_ids[:, None, :] == slots[None, :, None]).astype(hidden.dtype)
    total = jnp.einsum("rks,rsh->rkh", member, hidden)  # [rows, slots, hidden]
    return total / jnp.maximum(jnp.sum(member, axis=-1), 1)[..., None]


def encode_packed(config: ModelConfig, input_ids: Array, segment_ids: Array | None,
                  input_mask: Array, packing_ids: Array, example_starts: Array, *,
                  deterministic: bool, pooling: str = "cls") -> Array:
    """`encode`'s pooled vectors for packed rows (data_pipeline/packed_finetune.py): input_ids,
    segment_ids, input_mask, packing_ids [rows, seq] int, example_starts [rows, slots] int →
    pooled [rows, slots, hidden], each example's as `encode` gives it alone in a row. The
    encoder (created in the calling module, `encoder_name`) attends within each example and
    restarts its positions there. BERT: the pooler on each example's [CLS] (its first token);
    ModernBERT: `pool_packed`."""
    if is_modern(config):
        hidden = modern.ModernBertModel(config, name="model")(
            input_ids, input_mask, packing_ids=packing_ids, deterministic=deterministic)
        return pool_packed(hidden, packing_ids, example_starts, pooling)
    if config.causal:  # its pooled token is the last one; packed rows have no such index
        raise ConfigError("config.data.pack: a causal (left-to-right) BERT pools its last "
                          "token; packed fine-tuning pools each example's first")
    bert = BertModel(config, name="bert")
    # The whole final layer: the examples' [CLS] tokens are spread over the rows.
    sequence = bert(input_ids, segment_ids, input_mask, packing_ids=packing_ids,
                    deterministic=deterministic)["sequence_output"]
    first = pool_packed(sequence, packing_ids, example_starts, "cls")  # [rows, slots, hidden]
    rows, slots, hidden = first.shape
    # The encoder's own pooler (params bert/pooler), on one token per example.
    return bert.pooler(first.reshape(rows * slots, 1, hidden)).reshape(rows, slots, hidden)


def head_dropout(config: ModelConfig, classifier_dropout: float | None) -> float:
    """The dropout before the output layer: `classifier_dropout` where given, else the
    encoder's hidden dropout (BERT's hidden_dropout_prob, as transformers' BERT heads; a
    ModernBERT's mlp_dropout)."""
    if classifier_dropout is not None:
        return float(classifier_dropout)
    return config.mlp_dropout if is_modern(config) else config.hidden_dropout_prob


class ModernClassifier(nn.Module):
    """transformers' `classifier` of the ModernBertFor* heads: x [..., hidden] → [...,
    features], kernel [hidden, features] ("embed", "classes") initialised as transformers does
    (truncated normal, stddev hidden^-0.5), bias [features] zeros."""

    config: modern.ModernConfig
    features: int

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        kernel = self.param("kernel", modern._init(cfg, cfg.hidden_size ** -0.5,
                                                   ("embed", "classes")),
                            (x.shape[-1], self.features), jnp.dtype(cfg.param_dtype))
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                                               ("classes",)),
                          (self.features,), jnp.dtype(cfg.param_dtype))
        dtype = jnp.dtype(cfg.dtype)
        return dense_lib.dense(x.astype(dtype), kernel.astype(dtype), bias.astype(dtype))


def output_layer(config: ModelConfig, x: Array, features: int, *, deterministic: bool,
                 classifier_dropout: float | None = None, bert_name: str = "classifier",
                 bert_dropout: bool = True) -> Array:
    """x [..., hidden] (a pooled vector or every token's) → [..., features], created in the
    calling module. BERT: dropout (unless `bert_dropout` is false: its QA head has none), then
    the dense layer `bert_name`. ModernBERT: `head`, dropout, `classifier`."""
    rate = head_dropout(config, classifier_dropout)
    if is_modern(config):
        x = modern.ModernPredictionHead(config, name="head")(x)
        x = Dropout(rate)(x, deterministic=deterministic)
        return ModernClassifier(config, features, name="classifier")(x)
    if bert_dropout:
        x = nn.Dropout(rate)(x, deterministic=deterministic)
    # A new head starts as transformers' Bert*For* heads do: kernel ~ normal(0, 0.02), not
    # the 2-sigma truncated draw of pre-training (std 0.0176). On rare-entity tagging the
    # smaller start never left all-`O` within 3 epochs (docs/reproducing.md).
    return dense(config, features, ("embed", "classes"), bert_name, truncated=False)(x)


def hidden_states(config: ModelConfig, params, input_ids: Array, segment_ids: Array | None,
                  input_mask: Array | None) -> Array:
    """Every layer's output of the encoder (`params`: its own group, "bert" / "model"):
    [num_layers + 1, batch, seq, hidden], index 0 the embeddings' output, i the output of layer
    i. A ModernBERT's last is its final-normed output (ModernBertModel's, and transformers'
    hidden_states[-1]); its others are captured from its modules, so modern.py computes them
    as it always does."""
    if not is_modern(config):
        return BertModel(config).apply({"params": params}, input_ids, segment_ids, input_mask,
                                       return_all_layers=True)["hidden_states"]
    # Unrematerialised layers: the capture filter then sees the layer modules themselves.
    config = dataclasses.replace(config, remat_policy="none")
    wanted = (modern.ModernEmbeddings, modern.ModernLayer)
    last, state = modern.ModernBertModel(config).apply(
        {"params": params}, input_ids, input_mask, mutable=["intermediates"],
        capture_intermediates=lambda module, method: (method == "__call__"
                                                      and isinstance(module, wanted)))
    captured = state["intermediates"]
    layers = [captured["embeddings"]["__call__"][0]]
    layers += [captured[f"layers_{i}"]["__call__"][0] for i in range(config.num_layers - 1)]
    return jnp.stack(layers + [last])

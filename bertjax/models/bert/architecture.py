"""BERT's `Architecture` record: its encoder, heads and pre-training model as shared code
calls them.

Heads: `BertModel` "bert" gives the final hidden states and the pooler's tanh [CLS] vector; the
output layer is dropout (hidden_dropout_prob, or the head's classifier_dropout) and one dense
layer (`classifier`, `qa_outputs`)."""

from __future__ import annotations

import flax.linen as nn
import jax

from bertjax.errors import ConfigError
from bertjax.models.bert.config import PRESETS, BertConfig
from bertjax.models.bert.flops import forward_flops
from bertjax.models.bert.modules import BertModel, dense
from bertjax.models.bert.pretraining import BertForPreTraining
from bertjax.models.layers import pool_packed
from bertjax.models.record import Architecture

Array = jax.Array


def encode(config: BertConfig, input_ids: Array, segment_ids: Array | None,
           input_mask: Array | None, *, deterministic: bool, pooled_only: bool = False,
           pooling: str = "cls", packing_ids: Array | None = None) -> tuple[Array, Array]:
    """(sequence_output [batch, seq, hidden], the pooler's output [batch, hidden]); with
    `pooled_only` the final layer is computed for [CLS] alone (sequence_output [batch, 1,
    hidden])."""
    del pooling  # a BERT's pooled vector is its pooler's
    outputs = BertModel(config, name="bert")(input_ids, segment_ids, input_mask,
                                             packing_ids=packing_ids,
                                             deterministic=deterministic,
                                             pooled_only=pooled_only)
    return outputs["sequence_output"], outputs["pooled_output"]


def encode_packed(config: BertConfig, input_ids: Array, segment_ids: Array | None,
                  input_mask: Array, packing_ids: Array, example_starts: Array, *,
                  deterministic: bool, pooling: str = "cls") -> Array:
    """The pooler on each packed example's [CLS] (its first token): [rows, slots, hidden]."""
    del pooling
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


def output_layer(config: BertConfig, x: Array, features: int, *, deterministic: bool,
                 rate: float, name: str = "classifier", dropout: bool = True) -> Array:
    """Dropout (unless `dropout` is false: the QA head has none), then the dense layer
    `name`."""
    if dropout:
        x = nn.Dropout(rate)(x, deterministic=deterministic)
    # A new head starts as transformers' Bert*For* heads do: kernel ~ normal(0, 0.02), not
    # the 2-sigma truncated draw of pre-training (std 0.0176). On rare-entity tagging the
    # smaller start never left all-`O` within 3 epochs (docs/reproducing.md).
    return dense(config, features, ("embed", "classes"), name, truncated=False)(x)


def hidden_states(config: BertConfig, params, input_ids: Array, segment_ids: Array | None,
                  input_mask: Array | None) -> Array:
    """[num_layers + 1, batch, seq, hidden]: the embeddings' output, then each layer's."""
    return BertModel(config).apply({"params": params}, input_ids, segment_ids, input_mask,
                                   return_all_layers=True)["hidden_states"]


ARCHITECTURE = Architecture(
    name="bert",
    title="a BERT",
    config_class=BertConfig,
    encoder_group="bert",
    encoder_class="BertModel",
    encoder=BertModel,
    encoder_args=lambda ids, segment_ids, mask: (ids, segment_ids, mask),
    pretraining_model=BertForPreTraining,
    pretraining_args=lambda b: (b["input_ids"], b["segment_ids"], b["input_mask"],
                                b["masked_lm_positions"]),
    encode=encode,
    encode_packed=encode_packed,
    output_layer=output_layer,
    hidden_states=hidden_states,
    head_dropout=lambda config: config.hidden_dropout_prob,
    forward_flops=forward_flops,
    objectives=("mlm_nsp", "mlm", "ltr"),
    optional_groups=("bert/pooler", "mlm", "nsp"),
    size_fields=("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                 "max_position_embeddings", "type_vocab_size"),
    embedding_table="bert/embeddings/word_embeddings",
    scans_layers=True,
    bilstm=True,
    presets=tuple(PRESETS),
    conversion="bertjax.convert.huggingface",
    tpu_kernels=lambda config: ((config.attention_dropout_prob, config.causal)
                                if config.for_tpu().attention_impl == "flash" else None, None),
)

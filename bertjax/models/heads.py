"""What every fine-tuning head shares across architectures: the encoder, the pooled vector and
the output layer (`encode`, `output_layer`), so that each head of classification.py /
tagging.py / squad.py / embedding.py is written once for all of them. Each call goes to the
config's `Architecture` record (models/architectures.py), which says what its encoder and
output layer are."""

from __future__ import annotations

import jax

from bertjax.models.architectures import ModelConfig, architecture

Array = jax.Array


def encoder_name(config: ModelConfig) -> str:
    """The encoder's parameter group in a head ("bert", a ModernBERT's "model")."""
    return architecture(config).encoder_group


def check_head_options(config: ModelConfig, pooling: str = "cls", bilstm_units: int = 0
                       ) -> None:
    """ConfigError naming the config.task field a head cannot take for this architecture."""
    architecture(config).check_head_options(pooling, bilstm_units)


def encode(config: ModelConfig, input_ids: Array, segment_ids: Array | None,
           input_mask: Array | None, *, deterministic: bool, pooled_only: bool = False,
           pooling: str = "cls", packing_ids: Array | None = None) -> tuple[Array, Array]:
    """The encoder of a head, created in the calling module (`encoder_name`): input_ids,
    segment_ids (where the architecture reads them), input_mask, packing_ids (packed rows:
    example slot + 1, 0 on padding; attention and positions stay within each example)
    [batch, seq] int → (sequence_output [batch, seq, hidden], pooled [batch, hidden]). BERT:
    pooled is the pooler's output, and with `pooled_only` the final layer is computed for [CLS]
    alone (sequence_output [batch, 1, hidden]); others pool with `pooling` (layers.pool). Over
    packed rows only sequence_output is per example."""
    return architecture(config).encode(
        config, input_ids, segment_ids, input_mask, deterministic=deterministic,
        pooled_only=pooled_only, pooling=pooling, packing_ids=packing_ids)


def encode_packed(config: ModelConfig, input_ids: Array, segment_ids: Array | None,
                  input_mask: Array, packing_ids: Array, example_starts: Array, *,
                  deterministic: bool, pooling: str = "cls") -> Array:
    """`encode`'s pooled vectors for packed rows (data_pipeline/packed_finetune.py): input_ids,
    segment_ids, input_mask, packing_ids [rows, seq] int, example_starts [rows, slots] int →
    pooled [rows, slots, hidden], each example's as `encode` gives it alone in a row."""
    return architecture(config).encode_packed(
        config, input_ids, segment_ids, input_mask, packing_ids, example_starts,
        deterministic=deterministic, pooling=pooling)


def head_dropout(config: ModelConfig, classifier_dropout: float | None) -> float:
    """The dropout before the output layer: `classifier_dropout` where given, else the
    encoder's hidden dropout (BERT's hidden_dropout_prob, as transformers' BERT heads; a
    ModernBERT's mlp_dropout)."""
    if classifier_dropout is not None:
        return float(classifier_dropout)
    return architecture(config).head_dropout(config)


def output_layer(config: ModelConfig, x: Array, features: int, *, deterministic: bool,
                 classifier_dropout: float | None = None, bert_name: str = "classifier",
                 bert_dropout: bool = True) -> Array:
    """x [..., hidden] (a pooled vector or every token's) → [..., features], created in the
    calling module. BERT: dropout (unless `bert_dropout` is false: its QA head has none), then
    the dense layer `bert_name`. ModernBERT: `head`, dropout, `classifier`."""
    return architecture(config).output_layer(
        config, x, features, deterministic=deterministic,
        rate=head_dropout(config, classifier_dropout), name=bert_name, dropout=bert_dropout)


def hidden_states(config: ModelConfig, params, input_ids: Array, segment_ids: Array | None,
                  input_mask: Array | None) -> Array:
    """Every layer's output of the encoder (`params`: its own group, "bert" / "model"):
    [num_layers + 1, batch, seq, hidden], index 0 the embeddings' output, i the output of layer
    i."""
    return architecture(config).hidden_states(config, params, input_ids, segment_ids,
                                              input_mask)

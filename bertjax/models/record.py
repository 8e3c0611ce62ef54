"""`Architecture`: what shared code (checkpoints, heads, tasks, serving, the cost instrument)
asks of an encoder architecture. Each architecture's folder builds one
(`models/<name>/architecture.py`); `models/architectures.py` lists them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from bertjax.errors import ConfigError
from bertjax.models.layers import pool, pool_packed

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One encoder architecture. Configs are frozen dataclasses with `from_dict` / `to_dict`
    and the fields num_layers, hidden_size, num_heads, vocab_size, max_position_embeddings,
    initializer_range, dtype, param_dtype, attention_impl, remat_policy.

    The module fields share one call signature across architectures:
      encode(config, input_ids, segment_ids, input_mask, *, deterministic, pooled_only,
             pooling, packing_ids) → (sequence [batch, seq, hidden], pooled [batch, hidden]),
        the encoder created in the calling module under `encoder_group`;
      encode_packed(config, input_ids, segment_ids, input_mask, packing_ids, example_starts, *,
             deterministic, pooling) → pooled [rows, slots, hidden];
      output_layer(config, x [..., hidden], features, *, deterministic, rate, name,
             dropout) → [..., features], created in the calling module;
      hidden_states(config, encoder params, input_ids, segment_ids, input_mask)
             → [num_layers + 1, batch, seq, hidden];
      encoder(config) → a module whose `encoder_args(ids, segment_ids, mask)` call gives the
             final hidden states (its params are the `encoder_group` of every model);
      pretraining_model(config) → the pre-training module, called with
             `pretraining_args(batch)` (batch: input_ids, segment_ids, input_mask,
             masked_lm_positions) and packing_ids= / deterministic= keywords; see the methods
             `init_pretraining` and `pretraining_outputs`.
    """

    name: str  # config.model.model_type (a config.json without one is a BERT)
    title: str  # for messages: "a BERT"
    config_class: type
    encoder_group: str  # the encoder's parameter group in every model ("bert", "model")
    encoder_class: str  # transformers' class of the encoder alone
    encoder: Callable[[Any], Any]
    encoder_args: Callable[[Array, Array, Array], tuple]
    pretraining_model: Callable[[Any], Any]
    pretraining_args: Callable[[Mapping[str, Array]], tuple]
    encode: Callable[..., tuple[Array, Array]]
    encode_packed: Callable[..., Array]
    output_layer: Callable[..., Array]
    hidden_states: Callable[..., Array]
    head_dropout: Callable[[Any], float]  # the dropout before a head's output layer
    forward_flops: Callable[..., float]  # (config, seq_len, max_predictions, pooled_only)
    # Pre-training objectives it supports (tasks.pretraining.rules.OBJECTIVES).
    objectives: tuple[str, ...]
    # Parameter groups a source checkpoint may lack (then initialised and reported).
    optional_groups: tuple[str, ...]
    size_fields: tuple[str, ...]  # the config fields that fix parameter shapes
    embedding_table: str  # the word-embedding parameter, for vocabulary errors
    scans_layers: bool  # whether `scan_layers` stacks its layers (else always unrolled)
    # Heads: the poolings of a sequence head (the first is the default), the + BiLSTM head,
    # heads whose pre-trained groups carry over besides the encoder (a prediction head).
    poolings: tuple[str, ...] = ("cls",)
    bilstm: bool = False
    pretrained_head_groups: tuple[str, ...] = ()
    # config.model fields of another architecture that fine-tuning configs set, and the fields
    # of this one that take their place (BERT's dropout fields in the shipped configs).
    translated_fields: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # The embedding table may have more rows than the tokenizer has entries.
    padded_vocab: bool = False
    # Pre-training phases may set these config.model fields (beyond the sequence length).
    phase_fields: tuple[str, ...] = ()
    # transformers' BERT class names (the task families' exports) → this architecture's.
    hf_classes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Preset names `config_class.from_preset` takes.
    presets: tuple[str, ...] = ()
    # Its module under bertjax.convert (None: no checkpoint interop).
    conversion: str | None = None
    # config.model fields a pre-training vocabulary fixes: tokenizer → {field: value} (e.g. the
    # special-token ids a config.json records).
    vocab_fields: Callable[[Any], dict[str, Any]] | None = None
    # Report lines on attention (e.g. local windows' savings), per (config, seq_len) list.
    attention_report: Callable[..., list[str]] | None = None
    # Whether layers of this config differ in cost (no per-layer figure extrapolates).
    mixed_layers: Callable[[Any], bool] = lambda config: False
    # The Pallas kernels a config runs on a TPU, for the cost instrument (aot/measure.measure):
    # config → (flash: (attention dropout rate, causal) | None, splash: the layers' window
    # radii | None).
    tpu_kernels: Callable[[Any], tuple[Any, Any]] = lambda config: (None, None)

    def init_pretraining(self, config, rng: Array) -> Any:
        """Boxed params of the pre-training model of `config` (shapes independent of the
        sequence length)."""
        ids, positions = jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 1), jnp.int32)
        batch = {"input_ids": ids, "segment_ids": ids, "input_mask": ids,
                 "masked_lm_positions": positions}
        model = self.pretraining_model(config)
        return model.init(rng, *self.pretraining_args(batch))["params"]

    def pretraining_outputs(self, model, variables, batch: Mapping[str, Array],
                            **kwargs) -> dict[str, Array]:
        """{"mlm_logits" [batch, n, vocab], and "nsp_logits" [batch, 2] where the model has
        an NSP head} of the pre-training `model` on a batch; packing_ids passed where the batch
        has them."""
        if "packing_ids" in batch:
            kwargs = {"packing_ids": batch["packing_ids"], **kwargs}
        out = model.apply(variables, *self.pretraining_args(batch), **kwargs)
        return out if isinstance(out, Mapping) else {"mlm_logits": out}

    def check_head_options(self, pooling: str = "cls", bilstm_units: int = 0) -> None:
        """ConfigError naming the config.task field a head cannot take here."""
        if pooling not in self.poolings:
            raise ConfigError(f"config.task.classifier_pooling={pooling!r}: {self.title}'s heads "
                              f"pool with {' | '.join(self.poolings)}")
        if bilstm_units and not self.bilstm:
            raise ConfigError(f"config.task.bilstm_units={bilstm_units}: the + BiLSTM head is "
                              f"not one of {self.title}'s")

    def hf_class(self, bert_class: str) -> str:
        """transformers' class of this architecture for a BERT class name."""
        return self.hf_classes.get(bert_class, bert_class)

    def model_overrides(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """config.model's overrides of a checkpoint's config: fields of another architecture
        that the shipped configs set are translated (`translated_fields`) unless config.model
        gives the target field itself; any other unknown field is a ConfigError naming it."""
        known = {f.name for f in dataclasses.fields(self.config_class)}
        out = {k: v for k, v in fields.items() if k in known}
        for name, value in fields.items():
            if name in known or name == "model_type":
                continue
            if name not in self.translated_fields:
                raise ConfigError(f"config.model.{name}: {self.title} (config.init_checkpoint) "
                                  "has no such field")
            for target in self.translated_fields[name]:
                out.setdefault(target, value)
        return out


class TypedConfig:
    """`from_preset` / `from_dict` / `to_dict` of an architecture's frozen dataclass config
    whose config.json names its `MODEL_TYPE` (every one but BERT's, whose has none); the class
    sets MODEL_TYPE and PRESETS {name: fields} as ClassVars."""

    MODEL_TYPE: ClassVar[str]
    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]]

    @classmethod
    def from_preset(cls, name: str, **overrides: Any):
        if name not in cls.PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of "
                              f"{sorted(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, values: Any):
        """From a dict or ConfigDict (`to_dict`'s, with or without model_type); an unknown key
        is named in the error."""
        values = dict(values)
        kind = values.pop("model_type", cls.MODEL_TYPE)
        if kind != cls.MODEL_TYPE:
            raise ConfigError(f"model.model_type={kind!r} is not {cls.MODEL_TYPE!r}")
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"unknown model config field(s): {', '.join(unknown)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The fields and model_type, which tells a config.json or a config.model of this
        architecture from another's (bertjax.models.model_config)."""
        return {"model_type": self.MODEL_TYPE, **dataclasses.asdict(self)}


def masked_encoder_calls(encoder: type) -> tuple[Callable[..., tuple[Array, Array]],
                                                  Callable[..., Array]]:
    """`Architecture.encode` and `encode_packed` of an encoder module that reads no segment
    ids, called as encoder(config, name="model")(input_ids, input_mask, packing_ids=...,
    deterministic=...) → [batch, seq, hidden] (ModernBERT's, NeoBERT's)."""
    def encode(config, input_ids: Array, segment_ids: Array | None, input_mask: Array | None,
               *, deterministic: bool, pooled_only: bool = False, pooling: str = "cls",
               packing_ids: Array | None = None) -> tuple[Array, Array]:
        """(final hidden states [batch, seq, hidden], `pool(..., pooling)` [batch, hidden]);
        segment ids are unread, `pooled_only` is BERT's."""
        del segment_ids, pooled_only
        hidden = encoder(config, name="model")(input_ids, input_mask, packing_ids=packing_ids,
                                               deterministic=deterministic)
        return hidden, pool(hidden, input_mask, pooling)

    def encode_packed(config, input_ids: Array, segment_ids: Array | None, input_mask: Array,
                      packing_ids: Array, example_starts: Array, *, deterministic: bool,
                      pooling: str = "cls") -> Array:
        """Each packed example's pooled vector (`pool_packed`): [rows, slots, hidden]."""
        del segment_ids
        hidden = encoder(config, name="model")(input_ids, input_mask, packing_ids=packing_ids,
                                               deterministic=deterministic)
        return pool_packed(hidden, packing_ids, example_starts, pooling)

    return encode, encode_packed

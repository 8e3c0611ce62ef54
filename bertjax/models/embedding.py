"""Sentence embeddings: the encoder's final token vectors pooled into one vector per text
(flax module and pure pooling functions; losses live in bertjax/tasks/embedding/losses.py).

Pooling reads real tokens only (input_mask): "mean" (sentence-transformers' default), "cls"
(the final [CLS] vector, not the NSP pooler's tanh layer) or "max"; `normalize` scales each
vector to unit length, so a dot product is the cosine. `Pooling` is the record a checkpoint
directory keeps beside its weights (POOLING_FILE), read from a sentence-transformers
directory's modules.json and 1_Pooling/config.json by `bertjax.convert from_hf`; `Prompts`,
the text sentence-transformers prepends to the inputs (its config_sentence_transformers.json),
is kept beside it in conversion.json.

Given a `ModernConfig`, `BertForEmbedding` pools a ModernBertModel's final hidden states
(params {"model"}), as sentence-transformers does over a ModernBERT Transformer module.

Packed rows (config.data.pack, bertjax/tasks/embedding/packed.py): several texts a row, each
attending within itself with positions from 0 (packing_ids), pooled per slot (`pool_slots`)
and gathered back into the columns (`slot_vectors`): the vectors each text gets alone in a
row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.errors import ConfigError
from bertjax.models import heads
from bertjax.models.architectures import ModelConfig
from bertjax.models.layers import pool_packed, sequence_rows

Array = jax.Array

POOLING_FILE = "pooling.json"  # in a checkpoint directory: how its texts become vectors
MODES = ("mean", "cls", "max")


@dataclasses.dataclass(frozen=True)
class Pooling:
    """How the token vectors of a text become its vector: `mode` over real tokens, then unit
    length if `normalize`. `include_prompt` false (sentence-transformers' Pooling setting):
    a text that starts with a prompt is pooled from the first token after it ([CLS] and the
    prompt's tokens attend but are not pooled; "cls" takes that first token)."""

    mode: str = "mean"
    normalize: bool = False
    include_prompt: bool = True

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"pooling mode {self.mode!r} is not one of {' | '.join(MODES)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> Pooling:
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"unknown pooling field(s): {', '.join(sorted(unknown))}")
        return cls(**fields)


# What a SentenceTransformer's prompts always hold (empty where its config says nothing), so
# encode_query always takes the "query" prompt and encode_document the "document" one: never
# the default prompt, and never encode_document's later candidates "passage" and "corpus".
ROLES = ("query", "document")


@dataclasses.dataclass(frozen=True)
class Prompts:
    """Text that sentence-transformers' encode() prepends to every input, by name
    (config_sentence_transformers.json's `prompts`), and the name encode() uses when it is
    given none (`default_prompt_name`)."""

    texts: dict[str, str] = dataclasses.field(default_factory=dict)
    default_name: str | None = None

    def __post_init__(self):
        if not (isinstance(self.texts, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.texts.items())):
            raise ConfigError(f"prompts={self.texts!r} is not an object of names to texts")
        if self.default_name is not None and self.default_name not in self.loaded:
            raise ConfigError(f"default_prompt_name={self.default_name!r} is not one of the "
                              f"prompts ({', '.join(self.loaded)})")

    @property
    def loaded(self) -> dict[str, str]:
        """The prompts as a SentenceTransformer holds them once loaded (ROLES always)."""
        return {**{role: "" for role in ROLES}, **self.texts}

    def text(self, name: str | None = None, prompt: str | None = None,
             role: str | None = None, where: str = "prompt_name") -> str:
        """What sentence-transformers prepends: `prompt` where given (even ""), else the
        prompt called `name`, else for role "query" / "document" that role's prompt
        (encode_query / encode_document), else the default prompt (encode), else "".
        `where` names the setting that gave `name`, for the error of an unknown name."""
        if prompt is not None:
            return prompt
        prompts = self.loaded
        name = name if name is not None else role if role is not None else self.default_name
        if name is None:
            return ""
        if name not in prompts:
            raise ConfigError(f"{where}={name!r} is not one of the model's prompts "
                              f"({', '.join(prompts)})")
        return prompts[name]

    def to_dict(self) -> dict[str, Any]:
        """sentence-transformers' own keys: `prompts`, `default_prompt_name`."""
        return {"prompts": dict(self.texts), "default_prompt_name": self.default_name}

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> Prompts:
        """From a record with sentence-transformers' keys (others ignored; none: no prompts).
        A null prompt is empty, as a SentenceTransformer loads it."""
        texts = fields.get("prompts") or {}
        if isinstance(texts, dict):
            texts = {name: "" if text is None else text for name, text in texts.items()}
        return cls(texts, fields.get("default_prompt_name"))


def pool(tokens: Array, input_mask: Array, mode: str, pool_from: Array | None = None
         ) -> Array:
    """tokens [n, seq, hidden], input_mask [n, seq] (1 = real token) → [n, hidden] float32;
    pool_from [n]: the first position pooled (Pooling.include_prompt false; "cls" takes it).

    A row with no real token (a filler row) gives zeros."""
    tokens = tokens.astype(jnp.float32)
    if pool_from is not None:
        input_mask = input_mask * (jnp.arange(input_mask.shape[1]) >= pool_from[:, None])
    mask = input_mask.astype(jnp.float32)[..., None]
    if mode == "cls":
        if pool_from is None:
            return tokens[:, 0]
        first = jnp.argmax(input_mask > 0, axis=1)  # 0 where nothing is left to pool
        return jnp.take_along_axis(tokens, first[:, None, None], axis=1)[:, 0]
    if mode == "mean":
        return jnp.sum(tokens * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1e-9)
    if mode == "max":
        masked = jnp.where(mask > 0, tokens, -jnp.inf)
        return jnp.where(jnp.sum(mask, axis=1) > 0, jnp.max(masked, axis=1), 0.0)
    raise ConfigError(f"pooling mode {mode!r} is not one of {' | '.join(MODES)}")


def pool_slots(tokens: Array, packing_ids: Array, example_starts: Array, mode: str) -> Array:
    """`pool` of each text of packed rows: tokens [rows, seq, hidden], packing_ids [rows, seq]
    (slot s's text has id s + 1, padding 0), example_starts [rows, slots] → [rows, slots,
    hidden] float32; an empty slot gives zeros ("cls": its row's first token, never read)."""
    tokens = tokens.astype(jnp.float32)
    if mode != "max":
        return pool_packed(tokens, packing_ids, example_starts, mode)
    rows, _, hidden = tokens.shape
    slots = example_starts.shape[1]
    # Each token's segment is its row's slot; padding goes to one more segment, dropped.
    segment = jnp.where(packing_ids > 0, jnp.arange(rows)[:, None] * slots + packing_ids - 1,
                        rows * slots)
    best = jax.ops.segment_max(tokens.reshape(-1, hidden), segment.reshape(-1),
                               num_segments=rows * slots + 1)[:-1]
    best = jnp.where(jnp.isfinite(best), best, 0.0)  # an empty slot's max is -inf
    return best.reshape(rows, slots, hidden)


def slot_vectors(pooled: Array, text_slots: Array, groups: int = 1) -> Array:
    """pooled [rows, slots, hidden], text_slots [batch, columns] → [batch, columns, hidden]:
    batch row p's texts are in group p % groups, whose rows are every groups-th row from
    row p % groups, text_slots counting within the group (local row * slots + slot; -1: a
    filler row's text, zeros)."""
    slots, hidden = pooled.shape[1:]
    group = jnp.arange(text_slots.shape[0])[:, None] % groups
    index = ((text_slots // slots) * groups + group) * slots + text_slots % slots
    vectors = jnp.take(pooled.reshape(-1, hidden), jnp.where(text_slots >= 0, index, 0), axis=0)
    return jnp.where(text_slots[..., None] >= 0, vectors, 0.0)


def l2_normalize(vectors: Array, eps: float = 1e-12) -> Array:
    """[..., hidden] → the same at unit length (a zero vector stays zero, and so does its
    gradient: the norm is floored before the square root, whose derivative at 0 is infinite
    and would make a filler row's zero vector NaN every gradient of its batch)."""
    norm = jnp.sqrt(jnp.maximum(jnp.sum(jnp.square(vectors), axis=-1, keepdims=True), eps * eps))
    return vectors / norm


def padded_vectors(config: ModelConfig, mode: str, input_ids: Array, segment_ids: Array | None,
                   input_mask: Array | None, deterministic: bool,
                   pool_from: Array | None = None) -> Array:
    """Texts in columns, one a row: [batch, columns, seq] → [batch, columns, hidden] float32,
    not normalised (pool_from [batch, columns]: `pool`'s); the encoder created in the calling
    module (heads.encode)."""
    batch, columns, _ = input_ids.shape
    mask = sequence_rows(jnp.ones_like(input_ids) if input_mask is None else input_mask)
    tokens, _ = heads.encode(  # BERT's cls: [rows, 1, hidden], the [CLS] token's alone
        config, sequence_rows(input_ids), sequence_rows(segment_ids), mask,
        deterministic=deterministic, pooled_only=mode == "cls" and pool_from is None)
    starts = None if pool_from is None else pool_from.reshape(-1)
    return pool(tokens, mask[:, :tokens.shape[1]], mode, starts).reshape(batch, columns, -1)


def packed_vectors(config: ModelConfig, mode: str, input_ids: Array, segment_ids: Array | None,
                   input_mask: Array, packing_ids: Array, example_starts: Array,
                   text_slots: Array, groups: int, deterministic: bool) -> Array:
    """Texts packed several a row ([rows, seq]; module docstring) → [batch, columns, hidden]
    float32 (text_slots [batch, columns] in `groups`, `slot_vectors`), not normalised; each
    text attends within itself, its positions from 0, as alone in a row (heads.encode with
    packing_ids)."""
    tokens, _ = heads.encode(config, input_ids, segment_ids, input_mask,
                             deterministic=deterministic, packing_ids=packing_ids)
    return slot_vectors(pool_slots(tokens, packing_ids, example_starts, mode), text_slots,
                        groups)


class BertForEmbedding(nn.Module):
    """params: {"bert": BertModel params} (the pooler's weights are kept but unused); for a
    ModernConfig {"model": ModernBertModel params}.

    Texts come in columns (anchor, positive, negatives...; or the two texts of a scored
    pair): input_ids, segment_ids, input_mask [batch, columns, seq] → [batch, columns, hidden]
    float32, every text encoded on its own; pool_from [batch, columns]: each text's first
    pooled position (`pool`; texts with a prompt under Pooling.include_prompt false). Packed
    rows: input_ids, segment_ids, input_mask, packing_ids [rows, seq], example_starts [rows,
    slots], text_slots [batch, columns] in packing_groups groups (`slot_vectors`) → the same
    [batch, columns, hidden]."""

    config: ModelConfig
    pooling: Pooling = Pooling()

    @nn.compact
    def __call__(
        self,
        input_ids: Array,
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
        *,
        packing_ids: Array | None = None,
        example_starts: Array | None = None,
        text_slots: Array | None = None,
        packing_groups: int = 1,
        pool_from: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        if packing_ids is not None:
            if pool_from is not None:  # refused before a run starts (tasks/checks.py)
                raise ConfigError("packed rows do not leave a prompt out of the pooling")
            vectors = packed_vectors(self.config, self.pooling.mode, input_ids, segment_ids,
                                     input_mask, packing_ids, example_starts, text_slots,
                                     packing_groups, deterministic)
        else:
            vectors = padded_vectors(self.config, self.pooling.mode, input_ids, segment_ids,
                                     input_mask, deterministic, pool_from)
        if self.pooling.normalize:
            vectors = l2_normalize(vectors)
        return nn.with_logical_constraint(vectors, ("batch", None, "embed"))


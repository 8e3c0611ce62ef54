"""The pre-training objectives (paper Sec. 3.1 and Table 5) as pure functions: batch shapes,
the masked-LM + NSP loss (or MLM alone on packed rows, or a left-to-right LM's next-token
loss), and held-out evaluation sums.

`config.objective` (rules.objective) picks the variant: "mlm_nsp"; "mlm" (No
NSP, packed rows); "ltr" (a left-to-right LM on packed rows: causal attention, and the
masked-LM head scores every position p against the token at p + 1 — `next_token_targets` —
so the MLM loss, accuracy and perplexity are next-token ones).

`loss_denominators(batch)` gives the normalisers of the loss's terms over a batch
(bertjax.models.pretraining_denominators); the train step computes them once over the global
batch, so that accumulated micro-batches sum to the one-batch loss and gradient.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from bertjax.models import architecture, pretraining_denominators, pretraining_loss

Batch = dict[str, jax.Array]


def batch_spec(
    batch_size: int, seq_len: int, max_predictions: int, packed: bool = False,
    ltr: bool = False,
) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of a pre-training batch (the reference TFRecord features).

    packed: rows of several examples (data_pipeline/packed_input.py): `packing_ids`
    [batch, seq] instead of `next_sentence_labels` (no NSP). ltr: unmasked packed rows (no
    masked_lm_* features; the targets are the next tokens).
    """
    i32, f32 = jnp.int32, jnp.float32
    spec = {
        "input_ids": jax.ShapeDtypeStruct((batch_size, seq_len), i32),
        "input_mask": jax.ShapeDtypeStruct((batch_size, seq_len), i32),
        "segment_ids": jax.ShapeDtypeStruct((batch_size, seq_len), i32),
        "masked_lm_positions": jax.ShapeDtypeStruct((batch_size, max_predictions), i32),
        "masked_lm_ids": jax.ShapeDtypeStruct((batch_size, max_predictions), i32),
        "masked_lm_weights": jax.ShapeDtypeStruct((batch_size, max_predictions), f32),
        "next_sentence_labels": jax.ShapeDtypeStruct((batch_size,), i32),
    }
    if packed or ltr:
        del spec["next_sentence_labels"]
        spec["packing_ids"] = jax.ShapeDtypeStruct((batch_size, seq_len), i32)
    if ltr:
        for key in ("masked_lm_positions", "masked_lm_ids", "masked_lm_weights"):
            del spec[key]
    return spec


def next_token_targets(batch: Batch) -> Batch:
    """Left-to-right LM targets in the masked-LM layout: position p predicts the token at p + 1.

    batch: input_ids, input_mask, packing_ids [batch, seq]. Returns masked_lm_positions
    [batch, seq - 1] (0 .. seq - 2), masked_lm_ids [batch, seq - 1] (the next tokens) and
    masked_lm_weights [batch, seq - 1] float32: 1 where both tokens are real and in the same
    packed example (an example's last token predicts nothing).
    """
    ids = batch["input_ids"]
    real = batch["input_mask"].astype(bool)
    same = batch["packing_ids"][:, 1:] == batch["packing_ids"][:, :-1]
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1] - 1, dtype=jnp.int32),
                                 (ids.shape[0], ids.shape[1] - 1))
    return {"masked_lm_positions": positions, "masked_lm_ids": ids[:, 1:],
            "masked_lm_weights": (real[:, 1:] & real[:, :-1] & same).astype(jnp.float32)}


def init_params(model, rng: jax.Array) -> Any:
    """Boxed (logically partitioned) parameters of a pre-training model (its architecture's
    `pretraining_model`); shapes do not depend on the sequence length."""
    return architecture(model.config).init_pretraining(model.config, rng)


def model_outputs(model, params, batch: Batch, packed: bool, **kwargs) -> dict[str, jax.Array]:
    """The model applied to a batch: {"mlm_logits" [batch, n, vocab], and BERT's
    "nsp_logits" [batch, 2]}. Packed batches pass `packing_ids` (attention within each
    example, positions restarting at each). A ModernBERT reads no segment ids."""
    if not packed:
        batch = {k: v for k, v in batch.items() if k != "packing_ids"}
    return architecture(model.config).pretraining_outputs(model, {"params": params}, batch,
                                                           **kwargs)


def _with_dummy_labels(batch: Batch) -> Batch:
    # A packed row has no sentence pair: NSP (weight 0) is scored against label 0.
    return dict(batch, next_sentence_labels=jnp.zeros(batch["input_ids"].shape[:1], jnp.int32))


def loss_and_metrics(outputs, batch: Batch, nsp_weight: float, packed: bool,
                     denominators: dict[str, jax.Array] | None = None):
    """`pretraining_loss`; a packed row has no sentence pair, so NSP (weight 0) gets a dummy
    label and its metrics are left out. denominators: `loss_denominators` of the batch the means
    run over (None = of `batch`); packed ones have no "nsp" term (its weight is 0)."""
    if not packed:
        return pretraining_loss(outputs, batch, nsp_weight, denominators)
    batch = _with_dummy_labels(batch)
    if denominators is not None:
        denominators = dict(denominators, nsp=pretraining_denominators(batch)["nsp"])
    loss, metrics = pretraining_loss(outputs, batch, 0.0, denominators)
    return loss, {k: v for k, v in metrics.items() if not k.startswith("nsp_")}


def loss_denominators(batch: Batch, *, packed: bool, ltr: bool = False) -> dict[str, jax.Array]:
    """The normalisers of the loss's terms over `batch` ({term: [] float32}, see
    bertjax.models.pretraining_denominators): the masked-LM weights (ltr: the next-token
    weights of `next_token_targets`), and the rows for NSP unless packed."""
    if ltr:
        batch = dict(batch, **next_token_targets(batch))
    out = pretraining_denominators(batch)
    if packed:
        out.pop("nsp", None)
    return out


def loss_fn(params, batch: Batch, rng, denominators=None, *, model, nsp_weight: float,
            packed: bool, ltr: bool = False):
    """The train step's loss (bertjax.train.step.LossFn); rng None = no dropout. ltr: the
    next-token loss of a (causal) model on unmasked packed rows. denominators: see
    `loss_and_metrics`."""
    if ltr:
        batch = dict(batch, **next_token_targets(batch))
    kwargs = {} if rng is None else {"deterministic": False, "rngs": {"dropout": rng}}
    outputs = model_outputs(model, params, batch, packed, **kwargs)
    return loss_and_metrics(outputs, batch, nsp_weight, packed, denominators)


def step_fns(model, nsp_weight: float = 1.0, packed: bool = False,
             ltr: bool = False):
    """(init_params(rng), loss_fn(params, batch, rng, denominators=None)) for
    bertjax.train.step; the job's denominators are `functools.partial(loss_denominators,
    packed=packed, ltr=ltr)`."""
    return (functools.partial(init_params, model),
            functools.partial(loss_fn, model=model, nsp_weight=nsp_weight, packed=packed,
                              ltr=ltr))


def eval_sums(params, batch: Batch, *, model, nsp_weight: float, packed: bool,
              ltr: bool = False):
    """Sums over a batch, so that batches combine into exact weighted means."""
    _, metrics = loss_fn(params, batch, None, model=model, nsp_weight=nsp_weight, packed=packed,
                         ltr=ltr)
    if ltr:
        batch = dict(batch, **next_token_targets(batch))
    weight = jnp.sum(batch["masked_lm_weights"].astype(jnp.float32))
    norm = pretraining_denominators(batch)
    sums = {
        "mlm_loss_sum": metrics["mlm_loss"] * norm["mlm_loss"],
        "mlm_correct": metrics["mlm_accuracy"] * norm["mlm_accuracy"],
        "mlm_weight": weight,
    }
    if not packed:  # packed rows have no NSP labels
        sums["nsp_correct"] = metrics["nsp_accuracy"] * batch["next_sentence_labels"].size
        sums["nsp_count"] = jnp.asarray(batch["next_sentence_labels"].size, jnp.float32)
    return sums


def eval_metrics(totals: dict[str, float]) -> dict[str, float]:
    """Held-out MLM loss, perplexity and accuracy (and NSP accuracy) from summed batches."""
    if not totals:
        return {}
    mlm_loss = totals["mlm_loss_sum"] / max(totals["mlm_weight"], 1e-5)
    results = {
        "mlm_loss": mlm_loss,
        "perplexity": math.exp(min(mlm_loss, 50.0)),
        "mlm_accuracy": totals["mlm_correct"] / max(totals["mlm_weight"], 1e-5),
    }
    if "nsp_count" in totals:
        results["nsp_accuracy"] = totals["nsp_correct"] / max(totals["nsp_count"], 1.0)
    return results

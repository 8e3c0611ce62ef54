"""Pre-training as a job of the shared loop (bertjax/train/loop.py): masked LM + next sentence
prediction over phases of growing sequence length, held-out MLM evaluation, and the export of
the final model as a bertjax checkpoint directory.

`config.objective` (bertjax.train.configs.objective) picks the paper's Table 5 variants:
"mlm_nsp"; "mlm" (No NSP, packed rows); "ltr" (a left-to-right LM on packed rows: causal
attention, and the masked-LM head scores every position p against the token at p + 1 —
`next_token_targets` — so the MLM loss, accuracy and perplexity are next-token ones).

Data arrives through `make_input(phase, global_batch_size, split="train" | "eval")`, an
iterator of this host's rows of each global batch (NumPy) with `save(prefix)` /
`restore(prefix)`, in one order whatever the number of hosts (the tf.data reader
lives in data_pipeline/, wired in by `python -m bertjax.pretrain`). With
`config.packing.enabled` the batches are packed rows carrying `packing_ids` and no NSP labels.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from etils import epath

from bertjax.errors import ConfigError
from bertjax.models import BertConfig, BertForPreTraining, pretraining_loss
from bertjax.train import configs, multihost
from bertjax.train import flops as flops_lib
from bertjax.train.loop import Stage
from bertjax.train.optimizer import make_optimizer

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


def init_params(model: BertForPreTraining, rng: jax.Array) -> Any:
    """Boxed (logically partitioned) parameters; shapes do not depend on the sequence length."""
    ids = jnp.zeros((1, 8), jnp.int32)
    return model.init(rng, ids, ids, ids, jnp.zeros((1, 1), jnp.int32))["params"]


def model_outputs(model, params, batch: Batch, packed: bool, **kwargs) -> dict[str, jax.Array]:
    """The model applied to a batch; packed batches pass `packing_ids` (block-diagonal
    attention, position ids restarting at each example)."""
    extra = {"packing_ids": batch["packing_ids"]} if packed else {}
    return model.apply(
        {"params": params}, batch["input_ids"], batch["segment_ids"], batch["input_mask"],
        batch["masked_lm_positions"], **extra, **kwargs,
    )


def loss_and_metrics(outputs, batch: Batch, nsp_weight: float, packed: bool):
    """`pretraining_loss`; a packed row has no sentence pair, so NSP (weight 0) gets a dummy
    label and its metrics are left out."""
    if not packed:
        return pretraining_loss(outputs, batch, nsp_weight)
    labels = jnp.zeros(batch["input_ids"].shape[:1], jnp.int32)
    loss, metrics = pretraining_loss(outputs, dict(batch, next_sentence_labels=labels), 0.0)
    return loss, {k: v for k, v in metrics.items() if not k.startswith("nsp_")}


def loss_fn(params, batch: Batch, rng, *, model, nsp_weight: float, packed: bool,
            ltr: bool = False):
    """The train step's loss (bertjax.train.step.LossFn); rng None = no dropout. ltr: the
    next-token loss of a (causal) model on unmasked packed rows."""
    if ltr:
        batch = dict(batch, **next_token_targets(batch))
    kwargs = {} if rng is None else {"deterministic": False, "rngs": {"dropout": rng}}
    outputs = model_outputs(model, params, batch, packed, **kwargs)
    return loss_and_metrics(outputs, batch, nsp_weight, packed)


def step_fns(model: BertForPreTraining, nsp_weight: float = 1.0, packed: bool = False,
             ltr: bool = False):
    """(init_params(rng), loss_fn(params, batch, rng)) for bertjax.train.step."""
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
    sums = {
        "mlm_loss_sum": metrics["mlm_loss"] * (weight + 1e-5),
        "mlm_correct": metrics["mlm_accuracy"] * jnp.maximum(weight, 1e-5),
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


def load_init_params(directory: str, model_cfg: BertConfig) -> dict[str, Any]:
    """Host params of a bertjax checkpoint directory (a phase-1 export or a converted release)
    in this run's layout and dtype; the model sizes must agree. No tokenizer is loaded."""
    from bertjax.pretrained import load_config, load_params

    loaded = load_config(directory)
    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                  "max_position_embeddings", "type_vocab_size"):
        if getattr(loaded, field) != getattr(model_cfg, field):
            raise ConfigError(
                f"config.init_checkpoint={directory}: model.{field} is "
                f"{getattr(loaded, field)} there but {getattr(model_cfg, field)} here")
    return load_params(directory, model_cfg)


class PretrainingJob:
    """Pre-training for bertjax.train.loop.train."""

    best_metric = None

    def __init__(self, config, make_input: Callable[..., Any]):
        self.config = config
        # Checked before anything is written.
        self.objective = configs.objective(config)
        self.packed = configs.packing_enabled(config)
        self.ltr = self.objective == "ltr"
        configs.masking_mix(config)
        # The LTR model attends left to right; its exported config.json records causal=True.
        self.model_config = configs.resolve_model_config(
            dict(config.model, causal=True) if self.ltr else config.model)
        self.model = BertForPreTraining(self.model_config)
        self.phases = configs.plan_phases(config)
        self.batch_size = config.train.batch_size
        self.grad_accum_steps = config.train.grad_accum_steps
        self.total_steps = config.train.num_train_steps
        self.make_input = make_input
        nsp = dict(nsp_weight=config.train.nsp_weight, packed=self.packed, ltr=self.ltr)
        self.init_params, self.loss = step_fns(self.model, **nsp)
        self._eval_sums = jax.jit(functools.partial(eval_sums, model=self.model, **nsp))
        self.stages = [self._stage(p) for p in self.phases]

    def _stage(self, phase: configs.Phase) -> Stage:
        every = self.config.eval.every_steps if phase.eval_data else 0
        return Stage(
            name=phase.name, start=phase.start, end=phase.end,
            make_input=lambda: self.make_input(phase, self.batch_size),
            batch_spec=batch_spec(self.batch_size, phase.seq_len, phase.max_predictions,
                                  self.packed, self.ltr),
            flops_per_example=flops_lib.train_flops_per_sequence(
                self.model_config, phase.seq_len,
                phase.seq_len - 1 if self.ltr else phase.max_predictions),
            tokens_per_example=phase.seq_len,
            description=(f"Phase {phase.name}: steps {phase.start}..{phase.end}, seq "
                         f"{phase.seq_len}, {phase.max_predictions} predictions, data "
                         f"{phase.data or '(none)'}" + (", packed" if self.packed else "")
                         + f", objective {self.objective}"),
            eval_every=every, log_extra={"phase_seq_len": phase.seq_len})

    def optimizer(self):
        return make_optimizer(self.config.optimizer, self.total_steps,
                              phase_starts=[p.start for p in self.phases[1:]])

    def pretrained_params(self) -> dict[str, Any] | None:
        if not self.config.get("init_checkpoint"):
            return None
        return load_init_params(self.config.init_checkpoint, self.model_config)

    def evaluate(self, params, stage: Stage, step: int, runner) -> dict[str, float]:
        phase = next(p for p in self.phases if p.name == stage.name)
        batches = self.make_input(phase, self.batch_size, split="eval")
        totals: dict[str, float] = {}
        for _, sums in runner.run(self._eval_sums, params,
                                  (next(batches) for _ in range(self.config.eval.num_batches))):
            for k, v in sums.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        return dict(eval_metrics(totals), seq_len=phase.seq_len)

    def finish(self, params, runner, workdir: epath.Path, log) -> None:
        """Exports the final params as a bertjax checkpoint directory (with a vocabulary).
        Every process joins the gather and the save (bertjax.train.multihost)."""
        if not self.config.get("vocab"):
            return
        from bertjax.pretrained import save_pretrained

        save_pretrained(workdir / "export", self.model_config, multihost.to_host(params),
                        self.config.vocab, overwrite=True,
                        provenance={"source": "bertjax.pretrain"})
        log(f"Exported the final model to {workdir / 'export'} "
            "(load with bertjax.load_pretrained)")

"""Optimizer rows: bertjax's optimizers against update rules written out independently.

- `adamw` against `torch.optim.AdamW` (the harness's default torch side).
- `bert_adamw` against Google's AdamWeightDecayOptimizer (google-research/bert optimization.py):
  Adam moments WITHOUT bias correction, update = m / (sqrt(v) + eps) + wd · x for the decayed
  parameters, x -= lr · update.
- `lamb` against LAMB (You et al. 2019, Algorithm 2): bias-corrected moments,
  r = m̂ / (sqrt(v̂) + eps) + wd · x, x -= lr · (||x|| / ||r||) · r (ratio 1 where either norm
  is 0); weight decay AND the trust ratio both skipped for LayerNorm and bias parameters, as
  the MLPerf / NVIDIA BERT LAMB does.

The references here work in float64 (moments, update, and a float64 copy of the weights kept
between steps; the torch model's float32 weights are overwritten with the rounded result), name
the excluded parameters by substring of the transformers name, as the reference does
("LayerNorm", "layer_norm", "bias"), and share nothing with bertjax.train.optimizer.

In the rows the reference side is transformers' model (torch gradients, torch clipping, the
harness's own lr schedule) stepped by these NumPy rules; bertjax's side is its real train step.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Mapping

import numpy as np

EXCLUDED = ("LayerNorm", "layer_norm", "bias")
RULES = ("bert_adamw", "adamw", "lamb")


def decays(name: str, excluded: tuple[str, ...] = EXCLUDED) -> bool:
    """The reference's `_do_use_weight_decay`: no substring of `excluded` in the name."""
    return not any(part in name for part in excluded)


def adam_weight_decay_step(x, g, m, v, lr, *, b1, b2, eps, weight_decay, decay: bool):
    """One AdamWeightDecayOptimizer step (no bias correction). Arrays float64, any shape;
    returns (x, m, v)."""
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * g * g
    update = m / (np.sqrt(v) + eps)
    if decay:
        update = update + weight_decay * x
    return x - lr * update, m, v


def lamb_step(x, g, m, v, t: int, lr, *, b1, b2, eps, weight_decay, adapt: bool):
    """One LAMB step (Algorithm 2; `t` counts from 1). adapt: weight decay and the trust
    ratio apply (False for LayerNorm and bias parameters). Returns (x, m, v)."""
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * g * g
    m_hat = m / (1.0 - b1**t)
    v_hat = v / (1.0 - b2**t)
    r = m_hat / (np.sqrt(v_hat) + eps)
    if adapt:
        r = r + weight_decay * x
        x_norm, r_norm = np.linalg.norm(x), np.linalg.norm(r)
        ratio = x_norm / r_norm if x_norm > 0 and r_norm > 0 else 1.0
        r = ratio * r
    return x - lr * r, m, v


def adamw_step(x, g, m, v, t: int, lr, *, b1, b2, eps, weight_decay, decay: bool):
    """One AdamW step (Loshchilov & Hutter, as torch.optim.AdamW): bias-corrected moments,
    decoupled decay on the old weights. Returns (x, m, v)."""
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * g * g
    update = (m / (1.0 - b1**t)) / (np.sqrt(v / (1.0 - b2**t)) + eps)
    if decay:
        update = update + weight_decay * x
    return x - lr * update, m, v


@dataclasses.dataclass
class NumpyOptimizer:
    """`rule` ("bert_adamw", "adamw" or "lamb") over named float64 tensors; the state of a
    tensor is made on its first step."""

    rule: str
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-6
    weight_decay: float = 0.01
    excluded: tuple[str, ...] = EXCLUDED
    t: int = 0
    x: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    m: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    v: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"rule={self.rule!r} is not one of {RULES}")

    def step(self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray],
             lr: float) -> dict[str, np.ndarray]:
        """New params (float64) from params and grads {name: array} at learning rate `lr`.
        A parameter seen before continues from the float64 copy kept here whenever `params`
        holds its float32 rounding (so rounding does not compound over steps)."""
        self.t += 1
        out = {}
        for name, p in params.items():
            p = np.asarray(p)
            kept = self.x.get(name)
            x = kept if kept is not None and np.array_equal(
                kept.astype(p.dtype), p) else p.astype(np.float64)
            g = np.asarray(grads[name], np.float64)
            m = self.m.get(name, np.zeros_like(x))
            v = self.v.get(name, np.zeros_like(x))
            hyper = dict(b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay)
            if self.rule == "bert_adamw":
                x, m, v = adam_weight_decay_step(
                    x, g, m, v, lr, decay=decays(name, self.excluded), **hyper)
            elif self.rule == "adamw":
                x, m, v = adamw_step(
                    x, g, m, v, self.t, lr, decay=decays(name, self.excluded), **hyper)
            else:
                x, m, v = lamb_step(
                    x, g, m, v, self.t, lr, adapt=decays(name, self.excluded), **hyper)
            self.x[name], self.m[name], self.v[name] = x, m, v
            out[name] = x
        return out


def reference_optimizer(optimizer) -> NumpyOptimizer:
    """The NumPy reference for `optimizer` (a bertjax `config.optimizer`)."""
    return NumpyOptimizer(optimizer.name, optimizer.b1, optimizer.b2, optimizer.eps,
                          optimizer.weight_decay)


def torch_step_fn(reference: NumpyOptimizer) -> Callable:
    """harness.train_torch's `step_fn(named_params, lr)`: the torch gradients (already
    clipped) stepped by `reference`, the float32 weights overwritten in place."""
    import torch

    def step_fn(named_params, lr: float) -> None:
        with torch.no_grad():
            params = {n: p.detach().cpu().numpy() for n, p in named_params.items()
                      if p.grad is not None}
            grads = {n: named_params[n].grad.detach().cpu().numpy() for n in params}
            new = reference.step(params, grads, float(lr))
            for name, value in new.items():
                named_params[name].copy_(torch.from_numpy(value.astype(np.float32)))

    return step_fn


def clip_by_global_norm(grads: Mapping[str, np.ndarray], clip_norm: float
                        ) -> dict[str, np.ndarray]:
    """The reference's clip_by_global_norm (float64): scaled by clip / max(norm, clip)."""
    grads = {n: np.asarray(g, np.float64) for n, g in grads.items()}
    norm = np.sqrt(sum(np.sum(g * g) for g in grads.values()))
    if not clip_norm or clip_norm <= 0 or norm <= clip_norm:
        return grads
    return {n: g * (clip_norm / norm) for n, g in grads.items()}


def pure_check(params, grads, optimizer, total_steps: int) -> dict[str, float]:
    """The same gradient sequence through bertjax's `make_optimizer(optimizer)` and through
    the NumPy reference (with the reference's own clipping and `harness.reference_lr`), no
    model and no torch (schedule "reference" needs no torch).

    params: a bertjax param tree {..: array}; grads: a sequence of trees like it.
    Returns {"/"-joined param path: max|ours - reference| / max|reference|} after the last step.
    """
    import flax
    import jax
    import optax

    from bertjax.parity import harness
    from bertjax.train.optimizer import make_optimizer

    tx, _ = make_optimizer(optimizer, total_steps)
    update = jax.jit(tx.update)
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    ours, state = params, tx.init(params)
    reference = reference_optimizer(optimizer)
    lr_at = harness.reference_lr(optimizer, total_steps)
    flat = lambda tree: {"/".join(k): v for k, v in  # noqa: E731
                         flax.traverse_util.flatten_dict(tree).items()}
    theirs = flat(params)
    for step, g in enumerate(grads):
        updates, state = update(g, state, ours)
        ours = optax.apply_updates(ours, updates)
        clipped = clip_by_global_norm(flat(g), optimizer.clip_norm)
        theirs = reference.step(theirs, clipped, lr_at(step))
    ours = {n: np.asarray(v, np.float64) for n, v in flat(ours).items()}
    return {n: float(np.max(np.abs(ours[n] - theirs[n])) / max(np.max(np.abs(theirs[n])), 1e-30))
            for n in theirs}


# ---------------------------------------------------------------------------------------------
# The rows: pre-training MLM + NSP on a small BERT, real gradients on both sides

VOCAB, SEQ_LEN, BATCH, MAX_PREDICTIONS = 512, 64, 8, 10
# Per optimizer: the overrides of harness.optimizer_config and the reference's description.
SETTINGS = {
    "adamw": (dict(name="adamw", schedule="from_peak", learning_rate=1e-3),
              "torch.optim.AdamW (transformers BertForPreTraining, torch gradients)"),
    "bert_adamw": (dict(name="bert_adamw", schedule="reference", learning_rate=1e-3),
                   "AdamWeightDecayOptimizer in NumPy float64 (torch gradients)"),
    "lamb": (dict(name="lamb", schedule="reference", learning_rate=5e-3),
             "LAMB Algorithm 2 in NumPy float64, LN/bias excluded (torch gradients)"),
}


def pretraining_batches(steps: int, batch_size: int = BATCH, seq_len: int = SEQ_LEN,
                        max_predictions: int = MAX_PREDICTIONS, seed: int = 0
                        ) -> list[dict[str, np.ndarray]]:
    """`steps` pre-training batches from bertjax's synthetic input, with a varying number of
    real predictions per row (the rest padded with weight 0, as the reference data pads), so
    that a padding slip or a wrong weighted mean shows."""
    from bertjax.train.synthetic import SyntheticInput

    source = SyntheticInput(batch_size, seq_len, max_predictions, VOCAB, seed=seed)
    rng = np.random.default_rng([seed, 1])
    batches = []
    for index in range(steps):
        batch = dict(source.global_batch(index))
        real = rng.integers(max_predictions // 2, max_predictions + 1, batch_size)
        keep = np.arange(max_predictions)[None] < real[:, None]
        # Padded predictions: position 0, id 0, weight 0 (create_pretraining_data's padding).
        batch["masked_lm_positions"] = np.where(keep, batch["masked_lm_positions"], 0)
        batch["masked_lm_ids"] = np.where(keep, batch["masked_lm_ids"], 0).astype(np.int32)
        batch["masked_lm_weights"] = keep.astype(np.float32)
        batches.append(batch)
    return batches


def torch_pretraining_loss(model, batch) -> dict:
    """transformers BertForPreTraining's MLM + NSP loss, as google-research/bert computes it:
    the masked positions' NLL weighted by masked_lm_weights / (sum of weights + 1e-5), plus
    the mean NSP NLL."""
    import torch

    out = model(input_ids=batch["input_ids"], token_type_ids=batch["segment_ids"],
                attention_mask=batch["input_mask"])
    positions = batch["masked_lm_positions"]
    logits = torch.gather(out.prediction_logits, 1,
                          positions[..., None].expand(-1, -1, out.prediction_logits.shape[-1]))
    nll = -torch.gather(torch.log_softmax(logits, -1), 2,
                        batch["masked_lm_ids"][..., None])[..., 0]
    weights = batch["masked_lm_weights"]
    mlm = (nll * weights).sum() / (weights.sum() + 1e-5)
    nsp = torch.nn.functional.cross_entropy(out.seq_relationship_logits,
                                            batch["next_sentence_labels"].reshape(-1))
    return {"loss": mlm + nsp, "mlm_loss": mlm, "nsp_loss": nsp}


@dataclasses.dataclass
class Setup:
    """What both sides of an optimizer row share: the model, its initial (boxed) params, the
    optimizer config and the batches."""

    name: str
    config: object  # BertConfig
    params: object
    optimizer: object  # ml_collections.ConfigDict
    batches: list
    steps: int


def setup(name: str, steps: int, *, seed: int = 0, **overrides) -> Setup:
    """`name`'s row setup for `steps` steps (warmup 10% of them); `overrides` go to the
    optimizer config."""
    import jax

    from bertjax.models import BertForPreTraining
    from bertjax.parity import harness
    from bertjax.tasks import pretraining

    settings, _ = SETTINGS[name]
    optimizer = harness.optimizer_config(
        **dict(settings, warmup_steps=max(1, steps // 10), **overrides))
    config = harness.small_config(VOCAB)
    params = pretraining.init_params(BertForPreTraining(config), jax.random.key(seed))
    return Setup(name, config, params, optimizer, pretraining_batches(steps, seed=seed), steps)


def run_ours(s: Setup):
    """bertjax's side: its real train step. Returns (history, final params)."""
    from bertjax.models import BertForPreTraining
    from bertjax.parity import harness
    from bertjax.tasks import pretraining

    _, loss_fn = pretraining.step_fns(BertForPreTraining(s.config))
    return harness.train_bertjax(s.params, loss_fn, s.optimizer, s.batches, s.steps)


def run_theirs(s: Setup):
    """The reference side: transformers' model and torch gradients, stepped by torch's AdamW
    (adamw) or by the NumPy reference. Returns (history, final state_dict)."""
    from bertjax.parity import harness

    model = harness.torch_model("BertForPreTraining", s.config, s.params)
    step_fn = None if s.name == "adamw" else torch_step_fn(reference_optimizer(s.optimizer))
    return harness.train_torch(model, s.batches, torch_pretraining_loss, s.optimizer, s.steps,
                               step_fn=step_fn)


def make_row(s: Setup, ours, theirs) -> object:
    """The harness.Row of the two sides' (history, final params) pairs."""
    from bertjax.parity import harness

    keys = ("loss", "mlm_loss", "nsp_loss", "grad_norm")
    return harness.Row(
        job=f"optimizer {s.name} (MLM+NSP, seq {SEQ_LEN}, batch {BATCH})",
        reference=SETTINGS[s.name][1],
        ours={k: ours[0][k] for k in keys},
        theirs={k: theirs[0][k] for k in keys},
        param_rel_diff=harness.param_rel_diff(s.config, ours[1], "BertForPreTraining",
                                              theirs[1]),
    )


def optimizer_row(name: str, steps: int, **overrides):
    """One row: `name` in bertjax against its reference, same weights and batches."""
    s = setup(name, steps, **overrides)
    return make_row(s, run_ours(s), run_theirs(s))


def _job(name: str) -> Callable[[int, pathlib.Path], list]:
    return lambda steps, workdir: [optimizer_row(name, steps)]


JOBS: dict[str, Callable[[int, pathlib.Path], list]] = {
    f"optimizer_{name}": _job(name) for name in SETTINGS}

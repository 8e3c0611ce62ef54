"""The two training loops of a parity job and the record comparing them.

bertjax's side is the real training path: `bertjax.train.optimizer.make_optimizer` and the
jitted, sharded `bertjax.train.step` train step. The reference side is transformers' model in
eager float32 with `torch.optim.AdamW`; its param groups, learning-rate schedules and clipping
are written here independently of bertjax's (a slip in bertjax's mask or schedule must show as
a loss difference, not be copied). A row module builds the batches once (NumPy, bertjax's own
pipeline) and feeds the same list to both loops.

API changes (for the row modules):
  - `optimizer_config(**overrides)`: the ConfigDict both trainers read (adamw, from_peak).
  - `train_bertjax(init_params, ...)` also takes boxed params (`nn.LogicallyPartitioned`
    leaves, e.g. `model.init(...)["params"]`): their logical axes then shard over `mesh`.
    Unboxed params are replicated. The history also has "grad_norm" and "learning_rate".
  - `train_torch` history also has "grad_norm" (before clipping) and "learning_rate".
  - `torch_model("BertLMHeadModel", ...)` exports the BertForMaskedLM tensors (same layout).
  - `Row.passed()` for seed rows: see `Row.seed_t`.
  - `Row.param_tolerance` (default inf): also a bound on `max_param_diff()`. A weight decay
    applied to LayerNorm moves the loss by ~1e-6 relative over 20 steps (far under 1e-4) but
    the LayerNorm gains by lr * weight_decay per step, which this bound sees.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from bertjax.errors import ConfigError
from bertjax.models import BertConfig

# Export layout of transformers classes that bertjax's converter does not name itself.
_EXPORT_AS = {"BertLMHeadModel": "BertForMaskedLM"}
# Tied copies transformers holds as the same Parameter (checked after loading).
_TIED = {
    "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}
# Tensors whose true gradient is zero: softmax is invariant to the key bias (q·(k + b) adds
# the same q·b to every score of a query), so both sides see rounding noise there, which Adam
# normalises into full-size steps. Reported, but left out of Row.max_param_diff.
GRADIENT_FREE = ("attention.self.key.bias",)
SEED_SMOOTHING = 10  # steps of moving average of the plotted seed bands
SEED_WINDOWS = 3  # a seed row's steps are cut into this many windows, compared one by one
# The largest |Welch t| allowed between the sides in any window. With 8 seeds a side, two
# sets of seeds of one framework exceed 4 in about 1 window in 1,000 (t with ~14 degrees of
# freedom); a band rule (each mean inside the other's 3-seed spread at 95% of the steps) failed
# bertjax against itself in 3 of 6 pairs of seed sets, transformers in 2 of 6.
SEED_T = 4.0


# ---------------------------------------------------------------------------------------------
# The record


def seed_band(curves: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, low, high) of seed curves [seeds, steps] for the plot, each smoothed by a
    trailing moving average of SEED_SMOOTHING steps. The band is min..max over seeds widened
    to mean ± 3 sd, the seeds' variance pooled over 3 × SEED_SMOOTHING neighbouring steps."""
    smoothed = np.stack([_moving_average(np.asarray(c, np.float64), SEED_SMOOTHING)
                         for c in curves])
    mean = smoothed.mean(0)
    var = smoothed.var(0, ddof=1) if len(smoothed) > 1 else np.zeros_like(mean)
    sd = np.sqrt(_moving_average(var, 3 * SEED_SMOOTHING))
    return mean, np.minimum(smoothed.min(0), mean - 3 * sd), np.maximum(smoothed.max(0),
                                                                        mean + 3 * sd)


def _moving_average(x: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to `window` steps (fewer at the start)."""
    cumsum = np.cumsum(np.insert(x, 0, 0.0))
    counts = np.minimum(np.arange(1, len(x) + 1), window)
    return (cumsum[1:] - cumsum[np.arange(1, len(x) + 1) - counts]) / counts


def welch_t(a: np.ndarray, b: np.ndarray) -> float:
    """Welch's t of the means of two samples [n] (a − b; 0 when both are constant and equal)."""
    se = np.sqrt(np.var(a, ddof=1) / len(a) + np.var(b, ddof=1) / len(b))
    diff = float(np.mean(a) - np.mean(b))
    return float(diff / se) if se > 0 else (0.0 if diff == 0 else math.copysign(math.inf, diff))


def window_t(ours: Sequence[Sequence[float]], theirs: Sequence[Sequence[float]],
             windows: int) -> list[float]:
    """Welch's t (ours − theirs) per window: the steps [steps] of the curves [seeds, steps] cut
    into `windows` equal runs, each seed's mean loss over a run one sample."""
    a, b = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    n = min(a.shape[1], b.shape[1])
    edges = np.linspace(0, n, windows + 1).round().astype(int)
    return [welch_t(a[:, lo:hi].mean(1), b[:, lo:hi].mean(1))
            for lo, hi in zip(edges[:-1], edges[1:], strict=True)]


@dataclasses.dataclass
class Row:
    """One line of the parity table: bertjax's and the reference's per-step losses."""

    job: str
    reference: str
    ours: dict[str, list[float]]
    theirs: dict[str, list[float]]
    param_rel_diff: dict[str, float] = dataclasses.field(default_factory=dict)
    tolerances: tuple[float, float] = (1e-4, 1e-3)
    note: str = ""
    param_tolerance: float = math.inf
    ours_seeds: list[list[float]] = dataclasses.field(default_factory=list)
    theirs_seeds: list[list[float]] = dataclasses.field(default_factory=list)
    seed_windows: int = SEED_WINDOWS
    x_label: str = "step"  # what a seed curve runs over ("batch": one value per batch)

    @property
    def seeded(self) -> bool:
        return bool(self.ours_seeds and self.theirs_seeds)

    @property
    def steps(self) -> int:
        if self.seeded:
            return min(len(c) for c in self.ours_seeds + self.theirs_seeds)
        return min(len(self.ours.get("loss", [])), len(self.theirs.get("loss", [])))

    def max_rel_diff(self, key: str = "loss", first: int | None = None) -> float:
        """max over steps of |ours - theirs| / |theirs| (the first `first` steps, or all)."""
        n = min(len(self.ours[key]), len(self.theirs[key]))
        n = n if first is None else min(n, first)
        if n == 0:
            return math.nan
        a = np.asarray(self.ours[key][:n], np.float64)
        b = np.asarray(self.theirs[key][:n], np.float64)
        return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))

    def max_param_diff(self) -> float:
        """Largest per-tensor relative difference, GRADIENT_FREE tensors left out."""
        values = [v for k, v in self.param_rel_diff.items()
                  if not any(free in k for free in GRADIENT_FREE)]
        return max(values) if values else math.nan

    def seed_t(self) -> list[float]:
        """Seed rows: Welch's t of the two sides per window (`window_t`)."""
        return window_t(self.ours_seeds, self.theirs_seeds, self.seed_windows)

    def passed(self) -> bool:
        """Exact rows: both loss tolerances (a NaN fails) and param_tolerance. Seed rows: the
        sides' seed means within SEED_T standard errors of each other in every window."""
        if self.seeded:
            return bool(max(abs(t) for t in self.seed_t()) <= SEED_T)
        first, every = self.max_rel_diff(first=50), self.max_rel_diff()
        params_ok = not self.param_rel_diff or self.max_param_diff() <= self.param_tolerance
        return bool(first <= self.tolerances[0] and every <= self.tolerances[1] and params_ok)


# ---------------------------------------------------------------------------------------------
# Configs


def small_config(vocab_size: int, **overrides: Any) -> BertConfig:
    """2 layers, hidden 64, 2 heads, intermediate 256, dropout 0, float32, 128 positions."""
    fields = dict(vocab_size=vocab_size, hidden_size=64, num_layers=2, num_heads=2,
                  intermediate_size=256, hidden_dropout_prob=0.0, attention_dropout_prob=0.0,
                  max_position_embeddings=128, dtype="float32", param_dtype="float32")
    fields.update(overrides)
    return BertConfig(**fields)


def optimizer_config(**overrides: Any) -> ml_collections.ConfigDict:
    """`config.optimizer` for both trainers: adamw with the from_peak schedule (transformers'
    linear warmup + decay), weight decay 0.01 off LayerNorm and biases, clipping 1.0."""
    fields = dict(name="adamw", learning_rate=1e-3, schedule="from_peak", warmup_steps=10,
                  weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-6, clip_norm=1.0)
    fields.update(overrides)
    return ml_collections.ConfigDict(fields)


# ---------------------------------------------------------------------------------------------
# bertjax's side


def _boxed(params: Any) -> Any:
    """Params with logical axes: boxed leaves kept, plain ones replicated."""
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
    if any(is_box(x) for x in jax.tree.leaves(params, is_leaf=is_box)):
        return params
    return jax.tree.map(lambda x: nn.LogicallyPartitioned(jnp.asarray(x), (None,) * np.ndim(x)),
                        params)


def _host(tree: Any) -> Any:
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def train_bertjax(
    init_params: Any,
    loss_fn: Callable,
    optimizer: ml_collections.ConfigDict,
    batches: Sequence[dict[str, np.ndarray]],
    total_steps: int,
    *,
    grad_accum_steps: int = 1,
    denominators: Callable | None = None,
    mesh=None,
    rules=None,
    rng_seed: int = 0,
) -> tuple[dict[str, list[float]], Any]:
    """bertjax's real training path, one step per batch.

    init_params: the param tree to start from (unboxed, or boxed to shard over `mesh`).
    loss_fn(params, batch, rng, denominators=None) -> (loss [], metrics {name: []})
      (bertjax.train.step.LossFn); denominators: the job's normalisers of a batch, which make k
      accumulated micro-batches one batch (bertjax.train.step.DenominatorsFn).
    optimizer: `config.optimizer` for make_optimizer; `total_steps` fixes the schedule.
    mesh/rules: default one device, batch over "data". Batches may change shape between steps
    (a phase switch recompiles and keeps the optimizer state and the global step).
    Returns ({"loss", every metric, "grad_norm", "learning_rate": per-step floats}, final
    unboxed params as NumPy).
    """
    from bertjax.train import sharding as sharding_lib
    from bertjax.train import step as step_lib
    from bertjax.train.optimizer import make_optimizer

    if mesh is None:
        mesh = sharding_lib.make_mesh({"data": 1}, jax.devices()[:1])
    rules = (("batch", "data"),) if rules is None else rules
    tx, schedule = make_optimizer(optimizer, total_steps)
    boxed = _boxed(init_params)
    init_fn = lambda rng: boxed  # noqa: E731  (constant: the given weights)
    _, shardings = step_lib.state_shardings(init_fn, tx, mesh, rules)
    params = _host(nn.unbox(boxed))  # fresh buffers: the step donates its state
    state = step_lib.TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
        rng=jax.random.split(jax.random.key(rng_seed))[1])
    state = jax.device_put(state, shardings)

    def with_loss(params, batch, rng, denominators=None):
        loss, metrics = loss_fn(params, batch, rng, denominators)
        return loss, dict(metrics, loss=loss)

    batch_sharding = sharding_lib.batch_sharding(mesh, rules)
    step = step_lib.jit_train_step(with_loss, tx, schedule, shardings, batch_sharding,
                                   grad_accum_steps, denominators)
    history: dict[str, list[float]] = {}
    for batch in batches:
        state, metrics = step(state, jax.device_put(dict(batch), batch_sharding))
        for key, value in jax.device_get(metrics).items():
            history.setdefault(key, []).append(float(value))
    return history, _host(state.params)


# ---------------------------------------------------------------------------------------------
# The reference side


def torch_model(architecture: str, config: BertConfig, params: Any, **config_overrides: Any):
    """transformers' `architecture` in float32 with eager attention and bertjax's `params`.

    The weights are `export_hf_tensors(config, params, architecture, "float32")`, loaded
    strictly: every tensor of the model is given except the tied decoder copies, which must
    then be the very tensors they are tied to. config_overrides: transformers config fields
    (e.g. is_decoder=True for BertLMHeadModel, problem_type, num_labels).
    """
    import torch
    import transformers

    from bertjax.convert.huggingface import export_hf_tensors
    from bertjax.convert.mapping import config_to_hf

    if not hasattr(transformers, architecture):
        raise ConfigError(f"architecture={architecture!r} is not a transformers class")
    export_as = _EXPORT_AS.get(architecture, architecture)
    values = config_to_hf(dataclasses.replace(config, causal=False), architecture)
    values.pop("architectures")
    if "classifier" in params and architecture != "BertForMultipleChoice":
        values["num_labels"] = int(np.shape(params["classifier"]["bias"])[0])
    values.update(config_overrides)
    hf_config = transformers.BertConfig(**values)
    hf_config._attn_implementation = "eager"
    model = getattr(transformers, architecture)(hf_config)
    tensors = export_hf_tensors(config, _host(nn.unbox(params)), export_as, "float32")
    state = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m not in _TIED]
    if missing or unexpected:
        raise ConfigError(f"{architecture}: tensors not loaded {missing}, not in the model "
                          f"{unexpected}")
    named = dict(model.named_parameters(remove_duplicate=False))
    for copy, original in _TIED.items():
        if copy in named and named[copy] is not named[original]:
            raise ConfigError(f"{architecture}: {copy} is not tied to {original}")
    return model.float().train()


def to_torch(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """NumPy batch → torch tensors: integers as int64 (long), floats as float32."""
    import torch

    def convert(x):
        x = np.asarray(x)
        if np.issubdtype(x.dtype, np.integer):
            return torch.from_numpy(x.astype(np.int64))
        if np.issubdtype(x.dtype, np.floating):
            return torch.from_numpy(x.astype(np.float32))
        return torch.from_numpy(x)

    return {key: convert(value) for key, value in batch.items()}


def reference_lr(optimizer: ml_collections.ConfigDict, total_steps: int) -> Callable[[int], float]:
    """The learning rate before update `step` (0-based), written from the references:
    from_peak = transformers' get_linear_schedule_with_warmup; reference = google-research/bert
    (polynomial decay, power 1, counted from step 0; the warmup ramp replaces it while
    step < warmup)."""
    peak, warmup = float(optimizer.learning_rate), int(optimizer.warmup_steps)
    if optimizer.schedule == "from_peak":
        import torch
        import transformers

        dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
        lr_lambda = transformers.get_linear_schedule_with_warmup(
            dummy, warmup, total_steps).lr_lambdas[0]
        return lambda step: peak * float(lr_lambda(step))
    if optimizer.schedule == "reference":
        def google(step: int) -> float:
            if step < warmup:
                return peak * step / warmup
            return peak * (1.0 - min(step, total_steps) / total_steps)

        return google
    raise ConfigError(f"optimizer.schedule={optimizer.schedule!r} is not one of "
                      "('reference', 'from_peak')")


def _no_decay(name: str) -> bool:
    # BERT's "LayerNorm", a ModernBERT's "norm" / "*_norm" modules.
    return "bias" in name or "LayerNorm" in name or "norm." in name


def train_torch(
    model,
    batches: Sequence[dict[str, np.ndarray]],
    loss_fn: Callable,
    optimizer: ml_collections.ConfigDict,
    total_steps: int,
    *,
    step_fn: Callable | None = None,
) -> tuple[dict[str, list[float]], dict[str, np.ndarray]]:
    """The reference: loss_fn(model, torch_batch) -> {"loss": tensor, components...}; backward;
    clip_grad_norm_(clip_norm); torch.optim.AdamW with (decay, no-decay) param groups by name
    ('bias', 'LayerNorm', 'norm.'), or `step_fn(named_params, lr)` instead of AdamW.

    Returns ({"loss", components, "grad_norm", "learning_rate": per-step floats}, final
    state_dict as NumPy).
    """
    import torch

    if step_fn is None and optimizer.name != "adamw":
        raise ConfigError(f"optimizer.name={optimizer.name!r}: torch's side runs AdamW; pass "
                          "step_fn for another update rule")
    lr_at = reference_lr(optimizer, total_steps)
    named = dict(model.named_parameters())  # tied copies appear once
    groups = [
        {"params": [p for n, p in named.items() if not _no_decay(n)],
         "weight_decay": float(optimizer.weight_decay)},
        {"params": [p for n, p in named.items() if _no_decay(n)], "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW(groups, lr=0.0, betas=(optimizer.b1, optimizer.b2),
                              eps=optimizer.eps) if step_fn is None else None
    model.train()
    history: dict[str, list[float]] = {}
    for step, batch in enumerate(batches):
        lr = lr_at(step)
        for p in named.values():
            p.grad = None
        outputs = loss_fn(model, to_torch(batch))
        outputs["loss"].backward()
        params = [p for p in named.values() if p.grad is not None]
        if optimizer.clip_norm and optimizer.clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, optimizer.clip_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        with torch.no_grad():
            if adamw is None:
                step_fn(named, lr)
            else:
                for group in adamw.param_groups:
                    group["lr"] = lr
                adamw.step()
        for key, value in outputs.items():
            history.setdefault(key, []).append(float(value.detach()))
        history.setdefault("grad_norm", []).append(float(norm))
        history.setdefault("learning_rate", []).append(lr)
    state = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    return history, state


def param_rel_diff(config: BertConfig, params: Any, architecture: str,
                   state_dict: dict[str, np.ndarray]) -> dict[str, float]:
    """{HF tensor name: max|ours - theirs| / max|theirs|} after training."""
    from bertjax.convert.huggingface import export_hf_tensors

    ours = export_hf_tensors(config, _host(nn.unbox(params)),
                             _EXPORT_AS.get(architecture, architecture), "float32")
    diffs = {}
    for name, a in ours.items():
        b = np.asarray(state_dict[name], np.float64)
        diffs[name] = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
    return diffs

"""Optimizers (optax) and learning-rate schedules of the BERT recipe."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp
import optax

from bertjax.errors import ConfigError


def weight_decay_mask(params: Any) -> Any:
    """True for parameters that get weight decay: not LayerNorm parameters, not biases.

    The single home of this rule (the reference excludes "LayerNorm" and "bias" variables).
    """
    flat = flax.traverse_util.flatten_dict(params)
    # BERT's layer norms are "*layer_norm", a ModernBERT's "norm" / "*_norm".
    mask = {
        path: not (path[-1] in ("bias", "output_bias", "decoder_bias")
                   or any(p.endswith("norm") for p in path[:-1]))
        for path in flat
    }
    return flax.traverse_util.unflatten_dict(mask)


OPTIMIZERS = ("bert_adamw", "adamw", "lamb", "stable_adamw")
SCHEDULES = ("reference", "from_peak", "wsd")
DECAY_SHAPES = ("linear", "1-sqrt")


def learning_rate_schedule(
    peak: float, warmup_steps: int, total_steps: int, kind: str = "reference",
    decay_steps: int = 0, decay_shape: str = "linear",
) -> optax.Schedule:
    """Linear warmup from 0, then a decay to 0 at `total_steps`.

    kind="reference": linear decay counted from step 0 (polynomial decay over all steps) and the
      warmup ramp replaces it while step < warmup, so right after warmup
      lr = peak * (1 - warmup / total), as google-research/bert does.
    kind="from_peak": linear decay from the peak at the end of warmup down to 0 at total_steps.
    kind="wsd": warmup-stable-decay (trapezoidal): the peak until the last `decay_steps`, which
      decay to 0 at total_steps, linearly or as 1 - sqrt(fraction of the decay done)
      (`decay_shape` "1-sqrt", Hägele et al., 2024; ModernBERT's); decay_steps 0: no decay.
    """
    if kind not in SCHEDULES:
        raise ConfigError(f"optimizer.schedule={kind!r} is not one of {SCHEDULES}")
    if decay_shape not in DECAY_SHAPES:
        raise ConfigError(f"optimizer.decay_shape={decay_shape!r} is not one of {DECAY_SHAPES}")
    if kind == "wsd" and not 0 <= decay_steps <= total_steps - warmup_steps:
        raise ConfigError(f"optimizer.decay_steps={decay_steps} must be in [0, "
                          f"num_train_steps - warmup_steps = {total_steps - warmup_steps}]")

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * step / max(warmup_steps, 1)
        if kind == "reference":
            decayed = peak * (1.0 - jnp.minimum(step, total_steps) / total_steps)
        elif kind == "from_peak":
            frac = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
            decayed = peak * (1.0 - jnp.clip(frac, 0.0, 1.0))
        else:
            frac = jnp.clip((step - (total_steps - decay_steps)) / max(decay_steps, 1), 0.0, 1.0)
            decayed = peak * (1.0 - (jnp.sqrt(frac) if decay_shape == "1-sqrt" else frac))
        return jnp.where(step < warmup_steps, warm, decayed)

    return schedule


class ScaleByStableAdamState(NamedTuple):
    count: jax.Array
    mu: Any
    nu: Any


def scale_by_stable_adamw(
    b1: float = 0.9, b2: float = 0.98, eps: float = 1e-6, weight_decay: float = 0.0,
    mask=weight_decay_mask,
) -> optax.GradientTransformation:
    """StableAdamW (Wortsman et al., 2023): bias-corrected AdamW whose step, weight decay
    included, is divided per tensor by max(1, RMS(g² / v̂)), the ratio of the current squared
    gradient to its running estimate (Adafactor's update clipping): a tensor whose gradient
    suddenly outgrows its second moment, where Adam's step would spike, takes a smaller one.
    No learning rate here (chain optax.scale_by_learning_rate). State in float32."""

    def init_fn(params):
        zeros = lambda p: jnp.zeros_like(p, dtype=jnp.float32)
        return ScaleByStableAdamState(count=jnp.zeros([], jnp.int32),
                                      mu=jax.tree.map(zeros, params),
                                      nu=jax.tree.map(zeros, params))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_stable_adamw needs the params")
        count = state.count + 1
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), state.nu, updates)
        t = count.astype(jnp.float32)
        correct1, correct2 = 1 - b1 ** t, 1 - b2 ** t
        treedef = jax.tree.structure(updates)
        decays = jax.tree.unflatten(treedef, jax.tree.leaves(mask(params)))

        def step(g, m, v, p, decay):
            v_hat = v / correct2
            rms = jnp.sqrt(jnp.mean(jnp.square(g) / jnp.maximum(v_hat, eps * eps)))
            u = (m / correct1) / (jnp.sqrt(v_hat) + eps)
            if decay and weight_decay:
                u = u + weight_decay * p
            return (u / jnp.maximum(1.0, rms)).astype(p.dtype)

        new = jax.tree.map(step, updates, mu, nu, params, decays)
        return new, ScaleByStableAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


class ScaleByAdamNoBiasCorrectionState(NamedTuple):
    mu: Any
    nu: Any


def scale_by_adam_no_bias_correction(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6
) -> optax.GradientTransformation:
    """Adam moments without bias correction: update = m / (sqrt(v) + eps), as the reference."""

    def init_fn(params):
        zeros = lambda p: jnp.zeros_like(p, dtype=jnp.float32)
        return ScaleByAdamNoBiasCorrectionState(
            mu=jax.tree.map(zeros, params), nu=jax.tree.map(zeros, params)
        )

    def update_fn(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), state.nu, updates)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
        return updates, ScaleByAdamNoBiasCorrectionState(mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


def scale_by_trust_ratio_masked(mask=weight_decay_mask) -> optax.GradientTransformation:
    """LAMB's layer adaptation (You et al. 2019, Algorithm 2): update · ||x|| / ||update||, ratio 1
    where either norm is 0, applied only where `mask(params)` is True.

    optax.lamb scales every parameter; the reference LAMB (MLPerf / NVIDIA BERT) skips layer
    adaptation for the parameters it does not decay (LayerNorm, biases), so the same mask serves
    both. No state (as optax.scale_by_trust_ratio), so the optimizer state keeps its structure.
    """
    trust = optax.scale_by_trust_ratio()

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_trust_ratio_masked needs the params")
        scaled, _ = trust.update(updates, state, params)
        treedef = jax.tree.structure(updates)
        flags = jax.tree.unflatten(treedef, jax.tree.leaves(mask(params)))
        return jax.tree.map(lambda f, s, u: s if f else u, flags, scaled, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def with_phase_rewarmup(
    schedule: optax.Schedule, phase_starts: Sequence[int], warmup_steps: int
) -> optax.Schedule:
    """Multiplies `schedule` by a linear ramp 0 → 1 over `warmup_steps` from each phase start."""
    if not phase_starts or warmup_steps <= 0:
        return schedule

    def rewarmed(step):
        step = jnp.asarray(step, jnp.float32)
        factor = jnp.ones((), jnp.float32)
        for start in phase_starts:
            ramp = jnp.clip((step - start) / warmup_steps, 0.0, 1.0)
            factor = jnp.where(step >= start, ramp, factor)
        return schedule(step) * factor

    return rewarmed


def with_phase_scales(
    schedule: optax.Schedule, scales: Sequence[tuple[int, float]]
) -> optax.Schedule:
    """Multiplies `schedule` by `scale` from each `start` of `scales` [(start, scale)] in step
    order until the next start; 1 before the first."""
    if all(scale == 1.0 for _, scale in scales):
        return schedule  # bit for bit the schedule without phase peaks

    def scaled(step):
        step = jnp.asarray(step, jnp.float32)
        factor = jnp.ones((), jnp.float32)
        for start, scale in scales:
            factor = jnp.where(step >= start, jnp.float32(scale), factor)
        return schedule(step) * factor

    return scaled


def phase_scales(schedule: optax.Schedule, phase_peaks: Sequence[tuple[int, float]],
                 phase_starts: Sequence[int], warmup_steps: int, phase_warmup_steps: int
                 ) -> list[tuple[int, float]]:
    """[(start, scale)] of each phase in `phase_peaks` [(start, peak learning rate; 0: none)]:
    peak / the schedule's value where the phase's warm-up ends: `phase_warmup_steps` after
    the start of a later phase (one in `phase_starts`; 0: its start), `warmup_steps` for the
    first; 1 where the phase has no peak of its own."""
    scales = []
    for start, peak in phase_peaks:
        if not peak:
            scales.append((start, 1.0))
            continue
        end = start + phase_warmup_steps if start in phase_starts else warmup_steps
        base = float(schedule(end))
        if base <= 0:
            raise ConfigError(f"a phase learning_rate={peak:g} from step {start}: the schedule "
                              f"is 0 where the phase's warm-up ends (step {end})")
        scales.append((start, peak / base))
    return scales


def make_optimizer(
    config: Any, total_steps: int, phase_starts: Sequence[int] = (),
    phase_peaks: Sequence[tuple[int, float]] = (),
) -> tuple[optax.GradientTransformation, Any]:
    """From `config.optimizer`: returns (transformation, schedule).

    One schedule spans all phases (the step is global); `phase_warmup_steps` > 0 re-warms up at
    the start of each later phase in `phase_starts`. phase_peaks [(start, learning rate)]: a
    phase with a learning rate > 0 has the schedule from its start (to the next phase's)
    scaled so that it is that learning rate where the phase's warm-up ends (`phase_scales`):
    with LAMB's from-peak decay, phase 2 re-warms up to its own peak and decays linearly from
    there to 0 at the last step. 0: the schedule as is.
    """
    opt = config
    schedule = learning_rate_schedule(
        opt.learning_rate, opt.warmup_steps, total_steps, opt.schedule,
        opt.get("decay_steps", 0), opt.get("decay_shape", "linear"))
    phase_warmup = opt.get("phase_warmup_steps", 0)
    schedule = with_phase_scales(schedule, phase_scales(
        schedule, phase_peaks, phase_starts, opt.warmup_steps, phase_warmup))
    schedule = with_phase_rewarmup(schedule, phase_starts, phase_warmup)
    if opt.name == "bert_adamw":
        core = optax.chain(
            scale_by_adam_no_bias_correction(opt.b1, opt.b2, opt.eps),
            optax.add_decayed_weights(opt.weight_decay, mask=weight_decay_mask),
            optax.scale_by_learning_rate(schedule),
        )
    elif opt.name == "adamw":
        core = optax.adamw(
            schedule, opt.b1, opt.b2, opt.eps, weight_decay=opt.weight_decay,
            mask=weight_decay_mask,
        )
    elif opt.name == "lamb":
        # optax.lamb's pieces, with layer adaptation skipped where decay is (see above).
        core = optax.chain(
            optax.scale_by_adam(opt.b1, opt.b2, opt.eps),
            optax.add_decayed_weights(opt.weight_decay, mask=weight_decay_mask),
            scale_by_trust_ratio_masked(weight_decay_mask),
            optax.scale_by_learning_rate(schedule),
        )
    elif opt.name == "stable_adamw":
        core = optax.chain(
            scale_by_stable_adamw(opt.b1, opt.b2, opt.eps, opt.weight_decay),
            optax.scale_by_learning_rate(schedule),
        )
    else:
        raise ConfigError(f"optimizer.name={opt.name!r} is not one of {OPTIMIZERS}")
    if opt.clip_norm and opt.clip_norm > 0:
        core = optax.chain(optax.clip_by_global_norm(opt.clip_norm), core)
    return core, schedule

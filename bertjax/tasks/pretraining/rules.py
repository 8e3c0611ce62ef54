"""Pre-training's rules: the phase plan (each phase's steps, lengths, batch and peak), the
objective (config.objective) and packing. Each raises ConfigError naming the field."""

from __future__ import annotations

import dataclasses

from bertjax.errors import ConfigError
from bertjax.models.layers import REMAT_POLICIES
from bertjax.validate import is_int


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    start: int  # first global step of the phase
    end: int  # one past its last step
    seq_len: int
    max_predictions: int
    data: str
    eval_data: str
    remat_policy: str = ""  # "": the model's (config.model.remat_policy); else none | full | dots
    # Resolved by plan_phases: the phase's own where it sets one, else config.train's.
    batch_size: int = 0  # global, in sequences
    grad_accum_steps: int = 1  # micro-batches per step
    # The phase's peak: the schedule from its start is scaled to reach it where the phase's
    # warm-up ends (optimizer.make_optimizer's phase_peaks); 0.0: the global schedule as is.
    learning_rate: float = 0.0
    batch_field: str = "config.train.batch_size"  # the field that set batch_size (in errors)
    # A ModernBERT's RoPE theta of the global layers in this phase (its context extension
    # raises it); 0.0: config.model.global_rope_theta.
    global_rope_theta: float = 0.0


def plan_phases(config) -> list[Phase]:
    """Pre-training phases in name order with their global step ranges; `steps` wins over
    `fraction`, and the last phase takes what is left. Every range is checked here, naming the
    field: a fraction outside (0, 1] or phases that overrun the total would otherwise run
    "step 15/10" with a negative learning rate. A phase's batch_size / grad_accum_steps of 0
    resolve to config.train's; its learning_rate (0: none) is checked against its warm-up."""
    total = config.train.num_train_steps
    if not is_int(total) or total < 0:
        raise ConfigError(f"config.train.num_train_steps={total!r} must be an integer >= 0")
    max_positions = config.get("model", {}).get("max_position_embeddings")
    phases, start = [], 0
    items = sorted(config.phases.items())
    if not items:
        raise ConfigError("config.phases is empty; give at least one phase")
    for i, (name, p) in enumerate(items):
        field = f"config.phases.{name}"
        _check_phase(field, p, max_positions)
        if p.get("steps"):
            steps = int(p.steps)
        elif i == len(items) - 1:
            steps = total - start  # the last phase takes what is left, whatever the rounding
        else:
            steps = int(round(p.fraction * total))
        if start + steps > total or steps < 0:
            raise ConfigError(
                f"{field} ends at step {start + steps} but config.train.num_train_steps={total}; "
                "lower its steps or fraction (or those of the phases before it)")
        batch, accum, batch_field = _phase_batch(field, p, config.train)
        learning_rate = _phase_peak(field, p, start, start + steps, first=not phases,
                                    optimizer=config.get("optimizer") or {})
        phases.append(Phase(name, start, start + steps, int(p.seq_len), int(p.max_predictions),
                            p.get("data", ""), p.get("eval_data", ""),
                            p.get("remat_policy", ""), batch, accum, learning_rate,
                            batch_field, float(p.get("global_rope_theta", 0.0))))
        start += steps
    if start != total:
        raise ConfigError(
            f"config.phases cover {start} steps but config.train.num_train_steps={total}"
        )
    return phases


def _check_phase(field: str, phase, max_positions: int | None) -> None:
    """Ranges of one phase: steps >= 0, fraction in (0, 1], 1 <= max_predictions <= seq_len
    <= the model's positions."""
    steps = phase.get("steps", 0)
    if not is_int(steps) or steps < 0:
        raise ConfigError(f"{field}.steps={steps!r} must be an integer >= 0 (0: use fraction)")
    fraction = phase.get("fraction", 0.0)
    if not steps and not 0.0 < fraction <= 1.0:
        raise ConfigError(f"{field}.fraction={fraction!r} must be in (0, 1]")
    seq_len = phase.get("seq_len")
    if not is_int(seq_len) or seq_len < 1:
        raise ConfigError(f"{field}.seq_len={seq_len!r} must be a positive integer")
    if max_positions is not None and seq_len > max_positions:
        raise ConfigError(f"{field}.seq_len={seq_len} exceeds "
                          f"config.model.max_position_embeddings={max_positions}")
    predictions = phase.get("max_predictions")
    if not is_int(predictions) or not 1 <= predictions <= seq_len:
        raise ConfigError(f"{field}.max_predictions={predictions!r} must be in "
                          f"[1, seq_len={seq_len}]")
    theta = phase.get("global_rope_theta", 0.0)
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta >= 0:
        raise ConfigError(f"{field}.global_rope_theta={theta!r} must be a number >= 0 "
                          "(0: config.model.global_rope_theta)")
    remat = phase.get("remat_policy", "")
    if remat and remat not in REMAT_POLICIES:
        raise ConfigError(f"{field}.remat_policy={remat!r} is not one of "
                          f"{' | '.join(REMAT_POLICIES)} (or \"\": config.model.remat_policy)")


def _phase_batch(field: str, phase, train) -> tuple[int, int, str]:
    """(global batch, micro-batches per step, the field that set the batch) of one phase: its
    own batch_size / grad_accum_steps where > 0, else config.train's. The batch must split into
    the micro-batches (its split over the mesh is checked by check_batch_size)."""
    own_batch, own_accum = phase.get("batch_size", 0), phase.get("grad_accum_steps", 0)
    for name, value in (("batch_size", own_batch), ("grad_accum_steps", own_accum)):
        if not is_int(value) or value < 0:
            raise ConfigError(f"{field}.{name}={value!r} must be an integer >= 0 "
                              f"(0: config.train.{name})")
    batch_field = f"{field}.batch_size" if own_batch else "config.train.batch_size"
    accum_field = f"{field}.grad_accum_steps" if own_accum else "config.train.grad_accum_steps"
    batch = own_batch or train.batch_size
    accum = own_accum or train.get("grad_accum_steps", 1)
    if batch % accum:
        raise ConfigError(f"{batch_field}={batch} is not divisible by {accum_field}={accum}")
    return batch, accum, batch_field


def _phase_peak(field: str, phase, start: int, end: int, first: bool, optimizer) -> float:
    """A phase's own peak learning rate (0.0: none). It is the learning rate where the phase's
    warm-up ends (the schedule's warm-up for the first phase, config.optimizer.
    phase_warmup_steps after the start for later ones): that step must fall inside the phase,
    or the phase would never reach it."""
    value = phase.get("learning_rate", 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(f"{field}.learning_rate={value!r} must be a number >= 0 "
                          "(0: the schedule of config.optimizer.learning_rate as is)")
    if not value:
        return 0.0
    where = "warmup_steps" if first else "phase_warmup_steps"
    warmup = optimizer.get(where, 0)
    if start + warmup >= end:
        raise ConfigError(f"{field}.learning_rate={value:g} is the peak where the phase's "
                          f"warm-up ends, but config.optimizer.{where}={warmup} is not below "
                          f"its {end - start} steps")
    return float(value)


OBJECTIVES = ("mlm_nsp", "mlm", "ltr")


def objective(config) -> str:
    """config.objective (default "mlm_nsp"): masked LM + NSP on sentence pairs; "mlm": masked LM
    alone on packed single-segment rows (the paper's "No NSP"); "ltr": a left-to-right LM on
    packed rows, causal attention, every next token predicted ("LTR & No NSP")."""
    value = config.get("objective", "mlm_nsp")
    if value not in OBJECTIVES:
        raise ConfigError(f"config.objective={value!r} is not one of {' | '.join(OBJECTIVES)}")
    return value


def packing_enabled(config) -> bool:
    """Whether pre-training batches are packed rows: always for the "mlm" and "ltr"
    objectives, and with config.packing.enabled. Packing has no sentence pairs, so NSP must be
    off."""
    if objective(config) != "mlm_nsp":
        return True
    packed = bool(config.get("packing") and config.packing.get("enabled"))
    if packed and config.train.nsp_weight != 0:
        raise ConfigError(
            f"config.packing.enabled=True needs config.train.nsp_weight=0.0 (packed rows hold "
            f"no sentence pairs), got {config.train.nsp_weight}"
        )
    return packed

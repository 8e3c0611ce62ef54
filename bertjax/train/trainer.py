"""The pre-training loop: phases, sharded steps, checkpoints, preemption, metrics, evaluation.

Data arrives through `make_input(phase_name, phase_config, per_host_batch_size)`, which returns
an iterator of per-host NumPy batches with `save(prefix)` / `restore(prefix)`; this module never
imports TensorFlow (the tf.data reader lives in `data_pipeline/`). With
`config.packing.enabled` the batches are packed rows carrying `packing_ids` and no NSP labels.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from bertjax.models import BertConfig, BertForPreTraining
from bertjax.models.config import ConfigError
from bertjax.train import flops as flops_lib
from bertjax.train import metrics as metrics_lib
from bertjax.train import sharding as sharding_lib
from bertjax.train import step as step_lib
from bertjax.train.checkpoints import Checkpointer
from bertjax.train.optimizer import make_optimizer


class TrainingError(RuntimeError):
    """Training cannot continue (e.g. a NaN loss); the message says why and what was kept."""


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    start: int  # first global step of the phase
    end: int  # one past its last step
    seq_len: int
    max_predictions: int
    data: str
    eval_data: str


def plan_phases(config) -> list[Phase]:
    """Phases in name order with their global step ranges; `steps` wins over `fraction`."""
    total = config.train.num_train_steps
    phases, start = [], 0
    items = sorted(config.phases.items())
    for i, (name, p) in enumerate(items):
        if p.get("steps"):
            steps = int(p.steps)
        elif i == len(items) - 1:
            steps = total - start  # the last phase takes what is left, whatever the rounding
        else:
            steps = int(round(p.fraction * total))
        phases.append(Phase(name, start, start + steps, int(p.seq_len), int(p.max_predictions),
                            p.get("data", ""), p.get("eval_data", "")))
        start += steps
    if start != total:
        raise ConfigError(
            f"config.phases cover {start} steps but config.train.num_train_steps={total}"
        )
    return phases


def packing_enabled(config) -> bool:
    """Whether batches are packed rows; packing has no sentence pairs, so NSP must be off."""
    packed = bool(config.get("packing") and config.packing.get("enabled"))
    if packed and config.train.nsp_weight != 0:
        raise ConfigError(
            f"config.packing.enabled=True needs config.train.nsp_weight=0.0 (packed rows hold "
            f"no sentence pairs), got {config.train.nsp_weight}"
        )
    return packed


def resolve_model_config(config) -> BertConfig:
    """config.model as a BertConfig. dtype "auto" computes in bfloat16 on TPU/GPU and in float32
    on CPU; an explicit "bfloat16" is honoured everywhere (fast on CPUs with AMX/AVX512-BF16)."""
    fields = config.model.to_dict()
    if fields.get("dtype") == "auto":
        fields["dtype"] = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return BertConfig.from_dict(fields)


def check_batch_size(config, mesh) -> None:
    data_parallel = mesh.shape["data"] * mesh.shape["fsdp"]
    batch, accum = config.train.batch_size, config.train.grad_accum_steps
    if batch % accum or (batch // accum) % data_parallel:
        raise ConfigError(
            f"config.train.batch_size={batch} with grad_accum_steps={accum} does not divide "
            f"evenly over the {data_parallel} data-parallel devices (data x fsdp)"
        )
    if batch % jax.process_count():
        raise ConfigError(
            f"config.train.batch_size={batch} is not divisible by the "
            f"{jax.process_count()} processes"
        )


class _PreemptionFlag:
    """Set by SIGTERM (how TPU VMs announce preemption); checked after every step."""

    def __init__(self):
        self.raised = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.raised = True

    def any_process(self) -> bool:
        if jax.process_count() == 1:
            return self.raised
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.array(self.raised))))

    def restore(self):
        signal.signal(signal.SIGTERM, self._previous)


def _eval_step(model, nsp_weight, packed=False):
    def step(params, batch):
        outputs = step_lib.model_outputs(model, params, batch, packed)
        _, metrics = step_lib.loss_and_metrics(outputs, batch, nsp_weight, packed)
        weight = jnp.sum(batch["masked_lm_weights"].astype(jnp.float32))
        # Sums, so that batches combine into exact weighted means.
        sums = {
            "mlm_loss_sum": metrics["mlm_loss"] * (weight + 1e-5),
            "mlm_correct": metrics["mlm_accuracy"] * jnp.maximum(weight, 1e-5),
            "mlm_weight": weight,
        }
        if not packed:  # packed rows have no NSP labels
            sums["nsp_correct"] = metrics["nsp_accuracy"] * batch["next_sentence_labels"].size
            sums["nsp_count"] = jnp.asarray(batch["next_sentence_labels"].size, jnp.float32)
        return sums
    return jax.jit(step)


def evaluate(eval_fn, params, batches, to_global) -> dict[str, float]:
    totals: dict[str, float] = {}
    for batch in batches:
        for k, v in eval_fn(params, to_global(batch)).items():
            totals[k] = totals.get(k, 0.0) + float(v)
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


def _host_metrics(metrics) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


def load_init_params(directory: str, model_cfg: BertConfig, shardings) -> Any:
    """Params of a bertjax checkpoint directory (e.g. the export of phase 1 or a converted
    release), in this run's layout and dtype, placed with this run's shardings."""
    from bertjax.pretrained import load_pretrained

    loaded_cfg, params, _ = load_pretrained(
        directory, scan_layers=model_cfg.scan_layers, param_dtype=model_cfg.param_dtype)
    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                  "max_position_embeddings", "type_vocab_size"):
        if getattr(loaded_cfg, field) != getattr(model_cfg, field):
            raise ConfigError(
                f"config.init_checkpoint={directory}: model.{field} is "
                f"{getattr(loaded_cfg, field)} there but {getattr(model_cfg, field)} here")
    return jax.device_put(params, shardings)


def export(directory: epath.Path, config, params, log=print) -> None:
    """Writes the final params as a bertjax checkpoint directory (bertjax.load_pretrained)."""
    from jax.experimental import multihost_utils

    from bertjax.pretrained import save_pretrained

    if jax.process_count() > 1:
        params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() == 0:
        save_pretrained(directory, resolve_model_config(config), params, config.vocab,
                        overwrite=True, provenance={"source": "bertjax.pretrain"})
        log(f"Exported the final model to {directory} (load with bertjax.load_pretrained)")


def train(config, workdir: str, make_input: Callable[..., Any], log=print) -> str:
    """Runs (or resumes) pre-training in `workdir`. Returns "done" or "preempted"."""
    packed = packing_enabled(config)  # checked before anything is written
    workdir_path = epath.Path(workdir)
    workdir_path.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        (workdir_path / "config.json").write_text(config.to_json_best_effort(indent=2))

    model_cfg = resolve_model_config(config)
    model = BertForPreTraining(model_cfg)
    mesh = sharding_lib.make_mesh(config.mesh)
    check_batch_size(config, mesh)
    phases = plan_phases(config)
    total_steps = config.train.num_train_steps
    tx, schedule = make_optimizer(
        config.optimizer, total_steps, phase_starts=[p.start for p in phases[1:]]
    )
    abstract, state_sharding = step_lib.state_shardings(
        model, tx, mesh, config.logical_axis_rules
    )
    batch_sharding = sharding_lib.batch_sharding(mesh, config.logical_axis_rules)
    train_step = step_lib.jit_train_step(
        model, tx, schedule, state_sharding, batch_sharding,
        grad_accum_steps=config.train.grad_accum_steps, nsp_weight=config.train.nsp_weight,
        packed=packed,
    )
    eval_fn = _eval_step(model, config.train.nsp_weight, packed)

    def to_global(batch):
        return {k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(v))
                for k, v in batch.items()}

    ckpt_cfg = config.checkpoint
    checkpointer = Checkpointer(workdir, ckpt_cfg.max_to_keep, ckpt_cfg.async_save)
    latest = checkpointer.latest_step()
    if latest is not None:
        state, _ = checkpointer.restore(latest, abstract, state_sharding)
        log(f"Resumed from {workdir_path / 'checkpoints' / str(latest)} at step {latest}")
    else:
        state = step_lib.create_train_state(
            model, tx, jax.random.PRNGKey(config.seed), state_sharding
        )
        if config.get("init_checkpoint"):
            state = state.replace(params=load_init_params(
                config.init_checkpoint, model_cfg, state_sharding.params))
            log(f"Initialised parameters from {config.init_checkpoint} (optimizer state fresh)")
    step = int(state.step)
    writer = metrics_lib.MetricsWriter(workdir)
    peak = flops_lib.peak_flops_per_device(jax.devices()[0].device_kind)
    per_host_batch = config.train.batch_size // jax.process_count()
    preemption = _PreemptionFlag()
    start_time = time.time()
    last_good_step = latest
    try:
        for phase in phases:
            if step >= phase.end:
                continue
            inputs = make_input(phase, per_host_batch)
            if latest is not None and phase.start < latest:
                inputs.restore(checkpointer.data_state_prefix(latest, phase.name))
            flops = flops_lib.train_flops_per_sequence(model_cfg, phase.seq_len,
                                                       phase.max_predictions)
            throughput = metrics_lib.Throughput(flops, peak)
            throughput.reset(step)
            log(f"Phase {phase.name}: steps {phase.start}..{phase.end}, seq {phase.seq_len}, "
                f"{phase.max_predictions} predictions, data {phase.data or '(none)'}"
                + (", packed" if packed else ""))
            while step < phase.end:
                state, metrics = train_step(state, to_global(next(inputs)))
                step += 1
                log_now = step % config.log_every_steps == 0 or step == phase.end
                save_now = step % ckpt_cfg.every_steps == 0 or step == phase.end
                preempted = preemption.any_process()
                if log_now or save_now or preempted:
                    host = _host_metrics(metrics)
                    if not math.isfinite(host["loss"]):
                        kept = f"step {last_good_step}" if last_good_step is not None else "none"
                        raise TrainingError(
                            f"loss is {host['loss']} at step {step}; stopping without saving "
                            f"(last good checkpoint: {kept})"
                        )
                if log_now:
                    host.update(throughput.measure(step, config.train.batch_size, phase.seq_len))
                    host["phase_seq_len"] = phase.seq_len
                    writer.write(step, host)
                    log(metrics_lib.progress_line(step, total_steps, host,
                                                  time.time() - start_time,
                                                  host.get("steps_per_second")))
                if save_now or preempted:
                    checkpointer.save(step, state, {"phase": phase.name, "step": step},
                                      inputs, phase.name)
                    last_good_step = step
                if preempted:
                    checkpointer.wait()
                    log(f"SIGTERM: saved step {step}; exiting so the run can resume")
                    return "preempted"
                if (phase.eval_data and config.eval.every_steps
                        and (step % config.eval.every_steps == 0 or step == phase.end)):
                    batches = make_input(phase, per_host_batch, split="eval")
                    results = evaluate(eval_fn, state.params,
                                       (next(batches) for _ in range(config.eval.num_batches)),
                                       to_global)
                    results["seq_len"] = phase.seq_len
                    writer.write(step, results, split="eval")
                    log(f"eval at step {step}: " + json.dumps(
                        {k: round(v, 4) for k, v in results.items()}))
        checkpointer.wait()
        if config.get("vocab"):
            export(workdir_path / "export", config, state.params, log)
        return "done"
    finally:
        preemption.restore()
        checkpointer.close()
        writer.close()

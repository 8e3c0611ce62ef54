"""Pre-training as a job of the shared loop (bertjax/train/loop.py): phases of growing
sequence length, held-out MLM evaluation, and the export of the final model as a bertjax
checkpoint directory.

Data arrives through `make_input(phase, global_batch_size, split="train" | "eval")`
(`bertjax.tasks.pretraining.input.make_input_fn`), an iterator of this host's rows of each
global batch (NumPy) with `save(prefix)` / `restore(prefix)`, in one order whatever the
number of hosts. With `config.packing.enabled` the batches are packed rows carrying
`packing_ids` and no NSP labels.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
from etils import epath

from bertjax.checkpoint_dir import check_sizes, load_config, load_params, save_pretrained
from bertjax.models import ModelConfig, pretraining_model
from bertjax.tasks.pretraining import checks, rules
from bertjax.tasks.pretraining.input import make_input_fn, masking_mix
from bertjax.tasks.pretraining.objective import (
    batch_spec,
    eval_metrics,
    eval_sums,
    loss_denominators,
    step_fns,
)
from bertjax.train import configs, loop, multihost
from bertjax.train import flops as flops_lib
from bertjax.train.loop import Job, Stage
from bertjax.train.optimizer import make_optimizer


def load_init_params(directory: str, model_cfg: ModelConfig) -> dict[str, Any]:
    """Host params of a bertjax checkpoint directory (a phase-1 export or a converted release)
    in this run's layout and dtype; the model sizes must agree. No tokenizer is loaded."""
    check_sizes(load_config(directory), model_cfg, f"config.init_checkpoint={directory}")
    return load_params(directory, model_cfg)


class PretrainingJob(Job):
    """Pre-training for bertjax.train.loop.train."""

    best_metric = None

    def __init__(self, config, make_input: Callable[..., Any]):
        self.config = config
        # Checked before anything is written.
        self.objective = rules.objective(config)
        self.packed = rules.packing_enabled(config)
        self.ltr = self.objective == "ltr"
        masking_mix(config)
        # The LTR model attends left to right; its exported config.json records causal=True.
        self.model_config = configs.resolve_model_config(
            dict(config.model, causal=True) if self.ltr else config.model)
        self.model = pretraining_model(self.model_config)
        self.phases = rules.plan_phases(config)
        # The defaults of the phases (each stage has its phase's own: Stage.batch_size).
        self.batch_size = config.train.batch_size
        self.grad_accum_steps = config.train.grad_accum_steps
        self.grad_reduce_dtype = configs.grad_reduce_dtype(config)
        self.total_steps = config.train.num_train_steps
        self.make_input = make_input
        nsp = dict(nsp_weight=config.train.nsp_weight, packed=self.packed, ltr=self.ltr)
        self._nsp = nsp
        self.init_params, self.loss = step_fns(self.model, **nsp)
        # Normalisers over the global batch: accumulated micro-batches sum to one batch.
        self.denominators = functools.partial(loss_denominators, packed=self.packed,
                                              ltr=self.ltr)
        self._eval_sums = {
            p.name: jax.jit(functools.partial(
                eval_sums, model=pretraining_model(self._phase_model_config(p)), **nsp))
            for p in self.phases}
        self.stages = [self._stage(p) for p in self.phases]

    def _stage(self, phase: rules.Phase) -> Stage:
        every = self.config.eval.every_steps if phase.eval_data else 0
        return Stage(
            name=phase.name, start=phase.start, end=phase.end,
            make_input=lambda: self.make_input(phase, phase.batch_size),
            batch_spec=batch_spec(phase.batch_size, phase.seq_len, phase.max_predictions,
                                  self.packed, self.ltr),
            flops_per_example=flops_lib.train_flops_per_sequence(
                self._phase_model_config(phase), phase.seq_len,
                phase.seq_len - 1 if self.ltr else phase.max_predictions),
            tokens_per_example=phase.seq_len,
            description=self._describe(phase),
            eval_every=every,
            log_extra={"phase_seq_len": phase.seq_len, "phase_batch_size": phase.batch_size},
            loss=self._phase_loss(phase), batch_size=phase.batch_size,
            grad_accum_steps=phase.grad_accum_steps, batch_field=phase.batch_field)

    def _describe(self, phase: rules.Phase) -> str:
        """The line logged at the phase's start."""
        accum = (f" in {phase.grad_accum_steps} micro-batches" if phase.grad_accum_steps > 1
                 else "")
        peak = f", peak learning rate {phase.learning_rate:g}" if phase.learning_rate else ""
        return (f"Phase {phase.name}: steps {phase.start}..{phase.end}, seq {phase.seq_len}, "
                f"{phase.max_predictions} predictions, batch {phase.batch_size}{accum}{peak}, "
                f"data {phase.data or '(none)'}" + (", packed" if self.packed else "")
                + f", objective {self.objective}")

    def _phase_model_config(self, phase: rules.Phase) -> ModelConfig:
        """The model config of a phase: its own remat policy and (a ModernBERT's context
        extension) global RoPE theta where it sets them; the same parameters either way."""
        changes = {}
        if phase.remat_policy:
            changes["remat_policy"] = phase.remat_policy
        if phase.global_rope_theta:
            changes["global_rope_theta"] = phase.global_rope_theta
        return dataclasses.replace(self.model_config, **changes)

    def _phase_loss(self, phase: rules.Phase) -> Callable | None:
        """The loss of a phase's own model (_phase_model_config); None where it is the
        model's."""
        model_config = self._phase_model_config(phase)
        if model_config == self.model_config:
            return None
        return step_fns(pretraining_model(model_config), **self._nsp)[1]

    def optimizer(self):
        return make_optimizer(self.config.optimizer, self.total_steps,
                              phase_starts=[p.start for p in self.phases[1:]],
                              phase_peaks=[(p.start, p.learning_rate) for p in self.phases])

    def pretrained_params(self) -> dict[str, Any] | None:
        if not self.config.get("init_checkpoint"):
            return None
        return load_init_params(self.config.init_checkpoint, self.model_config)

    def evaluate(self, params, stage: Stage, step: int, runner) -> dict[str, float]:
        phase = next(p for p in self.phases if p.name == stage.name)
        batches = self.make_input(phase, phase.batch_size, split="eval")
        totals: dict[str, float] = {}
        for _, sums in runner.run(self._eval_sums[phase.name], params,
                                  (next(batches) for _ in range(self.config.eval.num_batches))):
            for k, v in sums.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        return dict(eval_metrics(totals), seq_len=phase.seq_len)

    def finish(self, params, runner, workdir: epath.Path, log) -> None:
        """Exports the final params as a bertjax checkpoint directory (with a vocabulary).
        Every process joins the gather and the save (bertjax.train.multihost)."""
        if not self.config.get("vocab"):
            return
        save_pretrained(workdir / "export", self.model_config, multihost.to_host(params),
                        self.config.vocab, overwrite=True,
                        provenance={"source": "bertjax.pretrain"})
        log(f"Exported the final model to {workdir / 'export'} "
            "(load with bertjax.load_pretrained)")


def make_job(config) -> PretrainingJob:
    """The job of a checked config (checks.check), reading its phases' TFRecords."""
    return PretrainingJob(config, make_input_fn(config))


def train(config, workdir: str, vocab_size_given: bool = False, log=print) -> dict[str, Any]:
    """Pre-trains (or resumes) in `workdir` after completing the config (checks.resolve) and
    checking everything it can before step 0 (checks.check: a bad phase-2 pattern must not
    surface after all of phase 1); exports the final model to workdir/export when config.vocab
    is set. Returns the loop's summary ({"status", ...}, bertjax.train.loop.train)."""
    tokenizer = checks.resolve(config, vocab_size_given, log)
    checks.check(config, workdir, tokenizer)
    return loop.train(make_job(config), config, workdir, log=log)

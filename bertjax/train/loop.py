"""The training loop every job shares: pre-training and each fine-tuning task.

A job (bertjax/tasks/) declares what differs; this loop does the rest, once:
  sharded state init (or resume from the latest checkpoint, or params from a pre-trained
  checkpoint), the jitted step, stages of steps fed by saveable inputs, logging + metrics +
  throughput, evaluation, checkpoints (last N + the best by the job's metric, the inputs'
  positions inside them), preemption, divergence, and the job's final outputs from the best
  (or last) parameters. `workdir/results.json` records the evaluations and the best step.

Faults: a resume is checked before anything in the workdir changes (the run recorded in
`run_config.json` must match on the fields that fix the checkpoint, `workdir.RESUME_FIELDS`; a
checkpoint that fails to restore falls back to the one before, see checkpoints.py), and
`run_config.json` / `results.json` are replaced whole, never left half-written. Batches are taken
in a background thread (`InputWatch`), so SIGTERM and Ctrl-C work while the input is slow, and
an input that gives nothing for `config.train.input_timeout_s` seconds stops the run with one
line. On a multi-process run the processes tell each other before every step whether their
batch came (`multihost.statuses`: a few round trips to the coordination service), so
every process names the stalled one instead of waiting for it in the step's collectives; a
preemption (SIGTERM to any one process) stops them all at the same step (orbax's
`reached_preemption`). On a single process, Ctrl-C once training runs saves and stops too, then
raises `Interrupted` (a KeyboardInterrupt: a script or notebook cell stops as on any Ctrl-C);
a second Ctrl-C quits unsaved. Besides every `config.checkpoint.every_steps` steps, a run saves
once `config.checkpoint.every_minutes` have passed since its last save (process 0's clock, so
every process saves the same step), kept until the next save (a stop-gap, checkpoints.py).

The job's interface is `Job` (bertjax/tasks/pretraining/job.py and bertjax/tasks/base.py
subclass it). Data arrives as iterators of per-host NumPy batches with `save(prefix)` /
`restore(prefix)`; this module never imports TensorFlow.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from etils import epath

from bertjax.errors import TrainingError
from bertjax.train import configs, multihost, profiling
from bertjax.train import flops as flops_lib
from bertjax.train import metrics as metrics_lib
from bertjax.train import sharding as sharding_lib
from bertjax.train import step as step_lib
from bertjax.train import workdir as workdir_lib
from bertjax.train.checkpoints import DEFAULT_TIMEOUT_S, Checkpointer
from bertjax.train.signals import StopSignals

DEFAULT_INPUT_TIMEOUT_S = 600.0
SIGTERM_GRACE_S = 5.0  # after SIGTERM (or Ctrl-C), how long a pending batch may still take
_POLL_S = 0.1
clock = time.monotonic  # of time-based saves (a test's fake clock replaces it)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped training after saving `step` (None: stopped unsaved, while waiting for
    the input); the message says where the run stands. Commands print it as their last line."""

    def __init__(self, message: str, step: int | None):
        super().__init__(message)
        self.step = step


@dataclasses.dataclass
class Stage:
    """A contiguous range of global steps [start, end) fed by one input (a pre-training
    phase; fine-tuning has one stage)."""

    name: str
    start: int
    end: int
    make_input: Callable[[], Any]  # per-host batches, with save(prefix) / restore(prefix)
    batch_spec: dict[str, jax.ShapeDtypeStruct]  # the largest global batch (dry runs)
    flops_per_example: float  # model FLOPs of one training example (MFU)
    tokens_per_example: int
    description: str
    eval_every: int = 0  # 0: no evaluation; otherwise every N steps and at the stage's end
    log_extra: dict[str, float] = dataclasses.field(default_factory=dict)
    loss: Callable | None = None  # the stage's own (e.g. another remat policy); None: the job's
    # The stage's global batch (sequences) and micro-batches per step; 0: the job's
    # batch_size / grad_accum_steps (step.stage_batch). A pre-training phase may set its own.
    batch_size: int = 0
    grad_accum_steps: int = 0
    batch_field: str = "config.train.batch_size"  # the config field of batch_size (in errors)


class Job:
    """What a training job declares for `train`; the loop, the step (train/step.py) and the dry
    run read these members and nothing else, and the defaults are these.

    batch_size, grad_accum_steps: the defaults of the stages, which may set their own.
    denominators(batch) -> {term: [] float32}: the loss's normalisers (train/step.py:
    accumulated micro-batches then sum to one batch); None: micro-batches average.
    init_params(rng) -> boxed params; loss(params, batch, rng, denominators=None) -> (loss,
    metrics); optimizer() -> (optax transform, schedule); pretrained_params() -> {group: host
    arrays} | None (a params-only init checkpoint); evaluate(params, stage, step, runner) ->
    {metric: float} (runner: `Runner`); finish(params, runner, workdir, log): exports, test
    predictions.
    """

    model_config: Any  # BertConfig
    model: Any  # the Flax module
    batch_size: int
    grad_accum_steps: int = 1
    total_steps: int
    stages: list[Stage]
    best_metric: str | None = None  # None: no best checkpoint (pre-training)
    evaluate_at_start: bool = False  # a fresh run logs the starting params' scores first
    denominators: Callable[[dict], dict] | None = None
    grad_reduce_dtype: str = step_lib.DEFAULT_GRAD_REDUCE_DTYPE
    phases: tuple = ()  # pre-training's phases (the dry run names their own flags)

    def init_params(self, rng):
        raise NotImplementedError

    def loss(self, params, batch, rng, denominators=None):
        raise NotImplementedError

    def optimizer(self):
        raise NotImplementedError

    def pretrained_params(self) -> dict[str, Any] | None:
        return None

    def evaluate(self, params, stage: Stage, step: int, runner) -> dict[str, float]:
        return {}

    def finish(self, params, runner, workdir: epath.Path, log) -> None:
        pass


# Batches read ahead of the one dispatched, for their programs to compile meanwhile: at most
# this many, holding at most this many bytes (pre-training's evaluation batches are large).
COMPILE_LOOKAHEAD = 64
COMPILE_LOOKAHEAD_BYTES = 64 << 20


def batch_signature(batch: dict[str, np.ndarray]) -> tuple:
    """What fixes a batch's compiled program: its arrays' names, shapes and dtypes."""
    return tuple((k, np.shape(v), np.asarray(v).dtype.str) for k, v in sorted(batch.items()))


def compiled_ahead(batches: Iterable[dict[str, np.ndarray]],
                   compile_for: Callable[[int, dict[str, np.ndarray]], Any],
                   key: Callable[[int, dict[str, np.ndarray]], Hashable]
                   ) -> Iterator[dict[str, np.ndarray]]:
    """`batches` in order, each once the program it runs is compiled. `compile_for(i, batch)`
    (e.g. `jitted.lower(...).compile()`, which fills the jitted function's cache) runs in
    background threads for the first batch of each `key(i, batch)` among the next
    COMPILE_LOOKAHEAD (and COMPILE_LOOKAHEAD_BYTES): an input's batch shapes then compile side
    by side (XLA compiles without the GIL) and while the earlier batches run, instead of one at
    a time as each is reached."""
    workers = max(1, min(os.cpu_count() or 1, 8))
    pool = ThreadPoolExecutor(workers, thread_name_prefix="compile")
    compiling: dict[Hashable, Future] = {}
    ahead: collections.deque = collections.deque()  # (key, batch, bytes)
    held = 0

    def first():
        nonlocal held
        k, batch, size = ahead.popleft()
        held -= size
        compiling[k].result()  # its compile's error, if any, is raised here
        return batch

    try:
        for i, batch in enumerate(batches):
            k = key(i, batch)
            if k not in compiling:
                compiling[k] = pool.submit(compile_for, i, batch)
            size = sum(np.asarray(v).nbytes for v in jax.tree.leaves(batch))
            ahead.append((k, batch, size))
            held += size
            while len(ahead) > COMPILE_LOOKAHEAD or (held > COMPILE_LOOKAHEAD_BYTES
                                                     and len(ahead) > 1):
                yield first()
        while ahead:
            yield first()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class Runner:
    """Runs a jitted function over per-host batches and brings the outputs to every host.

    rules: the logical-axis rules, in force (with the batch sharding's mesh) while `fn` is
    traced, as for the train step (sharding.in_force)."""

    def __init__(self, batch_sharding, rules: sharding_lib.Rules | None = None):
        self.batch_sharding = batch_sharding
        self.rules = rules

    def to_global(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
                for k, v in batch.items()}

    to_host = staticmethod(multihost.to_host)

    def _in_force(self):
        return (sharding_lib.in_force(self.batch_sharding.mesh, self.rules)
                if self.rules is not None else contextlib.nullcontext())

    def run(self, fn, params, batches: Iterable[dict[str, np.ndarray]]
            ) -> Iterator[tuple[dict[str, np.ndarray], Any]]:
        """(global batch on the host, fn(params, batch) on the host) for every batch. The next
        batch is built and dispatched before a batch's outputs are fetched: the host's work
        (and the transfer) overlaps the device's; a jitted `fn` is compiled for the batch
        shapes ahead (`compiled_ahead`)."""
        if hasattr(fn, "lower"):
            def compile_for(i, batch):
                with self._in_force():
                    fn.lower(params, self.to_global(batch)).compile()

            batches = compiled_ahead(batches, compile_for, lambda i, b: batch_signature(b))
        pending = None
        for batch in batches:
            global_batch = self.to_global(batch)
            with self._in_force():
                outputs = fn(params, global_batch)  # asynchronous dispatch
            if pending is not None:
                yield self.to_host(pending[0]), self.to_host(pending[1])
            pending = global_batch, outputs
        if pending is not None:
            yield self.to_host(pending[0]), self.to_host(pending[1])


def best_entry(history: list[dict[str, float]], metric: str) -> dict[str, float]:
    """The evaluation with the highest `metric`, the latest on ties (as orbax's BestN keeps)."""
    return max(history, key=lambda h: (h[metric], h["step"]))


def _host_metrics(metrics) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


def _kept(last_saved: int | None) -> str:
    return f"step {last_saved}" if last_saved is not None else "none"


class _InputStalled(Exception):
    pass


class InputWatch:
    """Takes batches from `inputs` in a background thread, one when asked (none ahead, so the
    input's saved position stays that of the training step), while the caller keeps checking
    `stop_requested` (SIGTERM, or Ctrl-C once training runs) and the time; before that,
    Ctrl-C interrupts the wait."""

    def __init__(self, inputs: Iterator, timeout_s: float, stop_requested: Callable[[], bool]):
        self.inputs, self.timeout_s, self.stop_requested = inputs, timeout_s, stop_requested
        self._asked: queue.Queue[bool] = queue.Queue()
        self._answers: queue.Queue[tuple[Any, BaseException | None]] = queue.Queue()
        # A daemon: a thread stuck in a stalled read must not keep the process alive.
        threading.Thread(target=self._serve, name="input", daemon=True).start()

    def _serve(self) -> None:
        while self._asked.get():
            try:
                self._answers.put((next(self.inputs), None))
            except BaseException as e:  # re-raised in the caller's thread
                self._answers.put((None, e))

    def next(self) -> dict[str, np.ndarray] | None:
        """The next batch; None if a stop was requested and no batch came within
        SIGTERM_GRACE_S after it. Raises _InputStalled after `timeout_s` without a batch."""
        self._asked.put(True)
        start, stop_seen = time.monotonic(), None
        while True:
            try:
                batch, error = self._answers.get(timeout=_POLL_S)
            except queue.Empty:
                now = time.monotonic()
                if stop_seen is None and self.stop_requested():
                    stop_seen = now
                if stop_seen is not None and now - stop_seen > SIGTERM_GRACE_S:
                    return None
                if now - start > self.timeout_s:
                    raise _InputStalled() from None
                continue
            if error is not None:
                raise error
            return batch

    def close(self) -> None:
        self._asked.put(False)  # ends the thread once it is idle


@dataclasses.dataclass
class _Run:
    """What the stages of one `train` call share: the job, its compiled step, the checkpoint
    manager, the metrics writer, and the evaluation history so far."""

    job: Any
    config: Any
    workdir: epath.Path
    log: Callable[[str], Any]
    runner: Runner
    train_steps: dict[str, Callable]  # stage name → its jitted step
    abstract: Any
    state_sharding: Any
    checkpointer: Checkpointer
    signals: StopSignals
    writer: metrics_lib.MetricsWriter
    profiler: profiling.StepProfiler
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    last_saved: int | None = None
    start_time: float = 0.0  # time.time() when the first stage starts
    saved_at: float = 0.0  # `clock()` at the last save (or the start): time-based saves

    def start(self, tx) -> tuple[Any, dict[str, Any]]:
        """(state, {stage name: its input at the resumed step}): the newest checkpoint that
        restores, else a fresh state (with the job's pre-trained params, if any)."""
        job, checkpointer = self.job, self.checkpointer

        def restore(step: int):
            """State, meta and (when `step` is inside a stage) that stage's input at `step`."""
            state, meta = checkpointer.restore(step, self.abstract, self.state_sharding)
            stage = next((s for s in job.stages if s.start < step < s.end), None)
            inputs = stage.make_input() if stage else None
            if inputs is not None:
                checkpointer.restore_data(step, inputs)
            return state, meta, stage, inputs

        resumed = checkpointer.restore_newest(restore, self.log)
        if resumed is not None:
            self.last_saved, (state, meta, stage, inputs) = resumed
            self.history = meta.get("history", [])
            self.log(f"Resumed from {checkpointer.directory / str(self.last_saved)} at step "
                     f"{self.last_saved}")
            return state, ({stage.name: inputs} if stage is not None else {})
        state = step_lib.create_train_state(job.init_params, tx,
                                            jax.random.key(self.config.seed),
                                            self.state_sharding, configs.rng_impl(self.config))
        pretrained = job.pretrained_params()
        if pretrained:
            state = step_lib.replace_params(state, pretrained, self.state_sharding)
            self.log(f"Initialised parameters from {self.config.init_checkpoint} (optimizer "
                     "state fresh)")
        return state, {}

    def run_stage(self, stage: Stage, state, inputs, peak: float) -> tuple[Any, str]:
        """Trains `stage` from the state's step to its end; (state, "done" | "preempted")."""
        config = self.config
        timeout = float(config.get("train", {}).get("input_timeout_s", DEFAULT_INPUT_TIMEOUT_S))
        watch = InputWatch(inputs, timeout, self.signals.requested)
        throughput = metrics_lib.Throughput(stage.flops_per_example, peak)
        step = first = int(state.step)
        throughput.reset(step)
        self.log(stage.description)
        if step == 0 and self.job.evaluate_at_start and stage.eval_every:
            # Not in the history: no checkpoint holds these params to be kept as the best.
            results = self.job.evaluate(state.params, stage, 0, self.runner)
            multihost.write_from_main(functools.partial(self.writer.write, 0, results,
                                                        split="eval"))
            self.log("eval before training (the starting checkpoint): " + json.dumps(
                {k: round(v, 4) for k, v in results.items()}))
        ctrl_c = contextlib.ExitStack()
        try:
            while step < stage.end:
                if step == first + 1:  # compiled: Ctrl-C saves from here (before, it quits)
                    ctrl_c.enter_context(self.signals.ctrl_c_saves())
                try:
                    batch, stalled = watch.next(), False
                except _InputStalled:
                    batch, stalled = None, True
                stalled_on, save_due = self.agree_before_step(stage, step, stalled, timeout)
                if stalled_on:
                    where = (f" on process {', '.join(map(str, stalled_on))}"
                             if jax.process_count() > 1 else "")
                    raise TrainingError(
                        f"the input of {stage.name}{where} gave no batch for {timeout:g} s "
                        f"(config.train.input_timeout_s) before step {step + 1}; stopping "
                        f"without saving (last checkpoint: {_kept(self.last_saved)})")
                if batch is None:
                    # The input has moved on (its batch is pending): its position would not fit.
                    line = (f"while waiting for the input of step {step + 1}: exiting without "
                            f"saving (last checkpoint: {_kept(self.last_saved)})")
                    if not self.signals.sigterm_received:
                        raise Interrupted(f"Ctrl-C {line}", None)
                    self.log(f"SIGTERM {line}")
                    return state, "preempted"
                self.profiler.before(step + 1)
                state, metrics = self.train_steps[stage.name](state, self.runner.to_global(batch))
                step += 1
                if step == first + 1:  # steps/s and the ETA count steps, not the compile
                    throughput.reset(step)
                self.profiler.after(step, metrics)
                if self.after_step(stage, step, state, metrics, inputs, throughput, save_due):
                    return state, "preempted"
            return state, "done"
        finally:
            ctrl_c.close()
            watch.close()

    def agree_before_step(self, stage: Stage, step: int, stalled: bool, timeout: float
                          ) -> tuple[list[int], bool]:
        """(the processes whose input gave no batch for step + 1 (`stalled`: this one's),
        whether step + 1 saves because time passed: process 0 decides). On a multi-process run
        every process learns both at once: it names a stalled process instead of waiting in
        the step's collectives for it, and saves the same step as the others."""
        due = time_to_save(self.config, self.saved_at, clock())
        if jax.process_count() == 1:
            return ([0] if stalled else []), due
        # A stalled process joins after its own timeout; one that died ends the job sooner
        # (the coordination service's heartbeat timeout, config.distributed.timeout_s).
        wait = timeout + multihost.distributed_timeout_s(self.config)
        tag = f"input/{stage.name}/{step + 1}"
        status = ("stalled" if stalled else "ok") + (" save" if due else "")
        shared = multihost.statuses(tag, status, wait)
        return ([i for i, s in enumerate(shared) if s.split()[0] == "stalled"],
                shared[0].endswith(" save"))

    def check_finite(self, host: dict[str, float], stage: Stage, step: int) -> None:
        """TrainingError where the step's loss or gradient norm is NaN or infinite: its
        parameters are then lost, so nothing is saved."""
        bad = {k: host[k] for k in ("loss", "grad_norm")
               if k in host and not math.isfinite(host[k])}
        if bad:
            what = " and ".join(f"{k} is {v}" for k, v in bad.items())
            raise TrainingError(
                f"{what} at step {step} ({stage.name}'s batch {step - stage.start} of "
                f"{stage.end - stage.start}); stopping without saving (last good checkpoint: "
                f"{_kept(self.last_saved)}); a batch whose rows the loss cannot take (e.g. "
                "its epoch's last, partial one) or too high a config.optimizer.learning_rate")

    def save_before_failing(self, stage: Stage, step: int, state, inputs, error) -> None:
        """A failed evaluation must not cost the trained state: saved (as a checkpoint without
        metrics) before the error goes on, and the log says where."""
        path = self.checkpointer.directory / str(step)
        self.checkpointer.save(step, state, {"stage": stage.name, "history": self.history},
                               inputs, metrics=None, stopgap=False)
        self.checkpointer.wait()
        self.last_saved = step
        self.log(f"evaluation at step {step} failed ({type(error).__name__}: {error}); the "
                 f"trained state is saved in {path}: rerun the same command to resume there "
                 "and evaluate again")

    def after_step(self, stage: Stage, step: int, state, metrics, inputs, throughput,
                   save_due: bool = False) -> bool:
        """Logging, evaluation and checkpointing after `step`; True once preempted (saved).
        save_due: time to save (`time_to_save`). Raises Interrupted once saved after Ctrl-C."""
        config, job, checkpointer = self.config, self.job, self.checkpointer
        at_end = step == stage.end
        log_now = step % config.log_every_steps == 0 or at_end
        eval_now = bool(stage.eval_every) and (step % stage.eval_every == 0 or at_end)
        preempted = self.signals.requested() or checkpointer.reached_preemption(step)
        kept = step % config.checkpoint.every_steps == 0 or at_end or eval_now or preempted
        save_now = kept or save_due
        if log_now or save_now:
            host = _host_metrics(metrics)
            self.check_finite(host, stage, step)
        if log_now:
            host.update(throughput.measure(step, step_lib.stage_batch(job, stage)[0],
                                           stage.tokens_per_example))
            host.update(stage.log_extra)
            # Process 0 writes; a failed write stops every process alike.
            multihost.write_from_main(functools.partial(self.writer.write, step, host))
            self.log(metrics_lib.progress_line(step, job.total_steps, host,
                                               time.time() - self.start_time,
                                               host.get("steps_per_second")))
        results = None
        if eval_now:
            try:
                results = job.evaluate(state.params, stage, step, self.runner)
            except Exception as e:
                self.save_before_failing(stage, step, state, inputs, e)
                raise
            multihost.write_from_main(functools.partial(self.writer.write, step, results,
                                                        split="eval"))
            self.history.append({"step": step, **results})
            self.log(f"eval at step {step}: " + json.dumps(
                {k: round(v, 4) for k, v in results.items()}))
        signals = self.signals
        ctrl_c = preempted and signals.ctrl_c_received and not signals.sigterm_received
        path = checkpointer.directory / str(step)
        if ctrl_c:
            self.log(f"Ctrl-C: saving step {step} to {path} (Ctrl-C again to quit without "
                     "saving)")
        if save_now:
            checkpointer.save(step, state, {"stage": stage.name, "history": self.history},
                              inputs, metrics=results, stopgap=not kept)
            self.last_saved, self.saved_at = step, clock()
        if preempted:
            checkpointer.wait()
            if ctrl_c:
                raise Interrupted(f"Ctrl-C: saved step {step} to {path}; run the same command "
                                  "to resume", step)
            self.log(f"SIGTERM: saved step {step}; exiting so the run can resume")
        return preempted

    def finish(self, state) -> dict[str, Any]:
        """The job's final outputs from the best (or last) params; the summary."""
        job, checkpointer = self.job, self.checkpointer
        summary: dict[str, Any] = {"status": "done", "total_steps": job.total_steps,
                                   "history": self.history}
        params = state.params
        if job.best_metric and self.history:
            best = best_entry(self.history, job.best_metric)
            summary.update(primary_metric=job.best_metric, best_step=best["step"],
                           best={k: v for k, v in best.items() if k != "step"})
            self.log(f"best {job.best_metric} {best[job.best_metric]:.4f} at step "
                     f"{best['step']}; checkpoint {checkpointer.directory / str(best['step'])}")
            if best["step"] != int(state.step):
                del state
                params = checkpointer.restore(best["step"], self.abstract,
                                              self.state_sharding)[0].params
        job.finish(params, self.runner, self.workdir, self.log)
        if job.best_metric:
            workdir_lib.write_json(self.workdir / workdir_lib.RESULTS_FILE, summary)
        return summary


def time_to_save(config, saved_at: float, now: float) -> bool:
    """Whether config.checkpoint.every_minutes (0 or absent: never) have passed since
    `saved_at` (seconds, as `now`)."""
    minutes = float(config.checkpoint.get("every_minutes", 0) or 0)
    return minutes > 0 and now - saved_at >= minutes * 60


def train(job: Job, config, workdir: str, log=print) -> dict[str, Any]:
    """Runs (or resumes) `job` in `workdir`.

    Returns {"status": "done" | "preempted", "total_steps", "history", and with a best metric:
    "primary_metric", "best_step", "best"}. Ctrl-C once steps run raises `Interrupted` after
    saving (single process; a second Ctrl-C: a plain KeyboardInterrupt, unsaved).
    """
    workdir_path = epath.Path(workdir)
    workdir_path.mkdir(parents=True, exist_ok=True)
    config_record = json.loads(config.to_json_best_effort())

    mesh = sharding_lib.make_mesh(config.mesh)
    configs.check_stage_batches(job, mesh)
    rules = config.logical_axis_rules
    tx, schedule = job.optimizer()
    abstract, state_sharding = step_lib.state_shardings(
        job.init_params, tx, mesh, rules, configs.rng_impl(config),
        config.train.get("shard_optimizer_state", False))
    runner = Runner(sharding_lib.batch_sharding(mesh, rules), rules)
    train_steps = step_lib.stage_train_steps(job, tx, schedule, state_sharding,
                                             runner.batch_sharding, rules)
    ckpt = config.checkpoint
    run = _Run(job, config, workdir_path, log, runner, train_steps, abstract, state_sharding,
               Checkpointer(workdir, ckpt.max_to_keep, ckpt.get("async_save", True),
                            job.best_metric, ckpt.get("timeout_s", DEFAULT_TIMEOUT_S),
                            multihost.distributed_timeout_s(config)),
               StopSignals(), metrics_lib.MetricsWriter(workdir),
               profiling.StepProfiler(profiling.steps_of(config), workdir, log))
    try:
        # Nothing in the workdir changes until the resume is known to work.
        if run.checkpointer.all_steps():
            workdir_lib.check_resumable(workdir_path, config_record)
        state, ready_inputs = run.start(tx)
        workdir_lib.write_json(workdir_path / workdir_lib.CONFIG_FILE, config_record)
        peak = flops_lib.peak_flops_per_device(jax.devices()[0].device_kind)
        run.start_time, run.saved_at = time.time(), clock()
        for stage in job.stages:
            if int(state.step) >= stage.end:
                continue
            inputs = ready_inputs.pop(stage.name, None)
            if inputs is None:
                inputs = stage.make_input()
            state, status = run.run_stage(stage, state, inputs, peak)
            if status == "preempted":
                run.checkpointer.wait()
                return {"status": "preempted", "total_steps": job.total_steps,
                        "history": run.history}
        run.checkpointer.wait()
        return run.finish(state)
    except KeyboardInterrupt as e:
        if run.signals.ctrl_c_received and not isinstance(e, Interrupted):
            run.checkpointer.abandon()  # a second Ctrl-C: quit without finishing the save
        raise
    except Exception as e:
        if multihost.lost_process(e) is not None:
            run.checkpointer.abandon()  # its pending save waits for the lost process
        raise
    finally:
        run.profiler.stop()
        run.checkpointer.close()
        run.signals.restore()
        run.writer.close()

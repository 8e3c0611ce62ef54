"""The one-matrix least-squares job on which the loop tests run `loop.train`, in-process and
in the Python subprocesses they start (tests/train/test_faults.py, test_interrupt.py,
test_multihost_faults.py, tests/test_bad_input.py); it compiles in well under a second. It
holds RegressionInput (batch i a pure function of i, its position saved as JSON, optionally
stalling), RegressionJob, make_config, run, the readers of a run's workdir (losses,
steps_on_disk), and a fake `loop.clock` (Clock) with the input that moves it (timed_input)."""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from conftest import records_by_step

from bertjax.train import loop


class RegressionInput:
    """Batch i is a pure function of i (so a resumed run sees the same batches); its position
    is saved as JSON. Asking for batch `stall_at` blocks on `release` (a stalled input)."""

    def __init__(self, stall_at=None, release=None):
        self.index, self.stall_at, self.release = 0, stall_at, release

    def __iter__(self):
        return self

    def __next__(self):
        if self.index == self.stall_at:
            self.release()
        rng = np.random.default_rng(self.index)
        self.index += 1
        x = rng.normal(size=(8, 4)).astype(np.float32)
        return {"x": x, "y": x @ np.arange(8, dtype=np.float32).reshape(4, 2)}

    def save(self, prefix):
        with open(prefix + ".json", "w") as f:
            json.dump({"index": self.index}, f)

    def restore(self, prefix):
        with open(prefix + ".json") as f:
            self.index = json.load(f)["index"]


class RegressionJob(loop.Job):
    """Least squares on [8, 4] batches; `pad` adds an unused [pad, pad] matrix to make the
    checkpoint bigger (the disk-full test)."""

    model_config, grad_accum_steps, best_metric, batch_size = None, 1, None, 8

    def __init__(self, total_steps, make_input=RegressionInput, pad=0):
        self.total_steps, self.pad = total_steps, pad
        self.stages = [loop.Stage("main", 0, total_steps, make_input, {}, 0.0, 4, "Stage main")]

    def init_params(self, rng):
        params = {"w": nn.LogicallyPartitioned(jax.random.normal(rng, (4, 2)),
                                               ("embed", "classes"))}
        if self.pad:
            params["pad"] = nn.LogicallyPartitioned(jax.random.normal(rng, (self.pad, self.pad)),
                                                    ("embed", "classes"))
        return params

    def loss(self, params, batch, rng):
        loss = jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
        return loss, {"loss": loss}

    def optimizer(self):
        return optax.adam(0.05), optax.constant_schedule(0.05)

    def pretrained_params(self):
        return None

    def finish(self, params, runner, workdir, log):
        pass


def make_config(every=2, hidden_size=4, optimizer="adam", **train):
    return ml_collections.ConfigDict(dict(
        seed=0, log_every_steps=1, model=dict(hidden_size=hidden_size, dtype="float32"),
        optimizer=dict(name=optimizer), train=dict(batch_size=8, **train),
        mesh=dict(data=-1, fsdp=1, tensor=1),
        logical_axis_rules=(("batch", ("data", "fsdp")), ("embed", "fsdp"), ("classes", None)),
        checkpoint=dict(every_steps=every, max_to_keep=5, async_save=True)))


def run(workdir, steps, config=None, **job):
    lines = []
    summary = loop.train(RegressionJob(steps, **job), config or make_config(), str(workdir),
                         log=lines.append)
    return summary, lines


def losses(workdir):
    """step → train loss, the last record of each step winning."""
    return {step: record["loss"] for step, record in records_by_step(workdir).items()}


def steps_on_disk(workdir):
    return sorted(os.listdir(os.path.join(workdir, "checkpoints")))


# ------------------------------------------------------------ a fake clock (time-based saves)


class Clock:
    """A fake `loop.clock`: each batch taken moves it on by `per_batch_s`."""

    def __init__(self, per_batch_s):
        self.now, self.per_batch_s = 0.0, per_batch_s

    def __call__(self):
        return self.now


def timed_input(clock, **stall):
    class TimedInput(RegressionInput):
        def __next__(self):
            clock.now += clock.per_batch_s
            return super().__next__()

    return lambda: TimedInput(**stall)

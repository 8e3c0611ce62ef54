"""Commands run as subprocesses and what they leave: `python -m bertjax.pretrain` arguments for
a small model (MODEL, pretrain_args), a command started in the background (start) and waited
on (wait_for), a workdir's latest checkpoint step (latest_checkpoint) and its params
(final_params), and the one `error:` line of a failed run (one_line_error); used by the trainer,
training-core and interrupt tests (tests/train/) and the phase-batch tests (tests/pipeline/)."""

import os
import subprocess
import sys
import time

import numpy as np
from conftest import ROOT

# A small model whose axes divide by 8 (so every mesh of tests/train/test_trainer.py can
# shard it).
MODEL = ["--config.model.num_layers=2", "--config.model.hidden_size=64",
         "--config.model.num_heads=8", "--config.model.intermediate_size=256",
         "--config.model.vocab_size=128", "--config.model.dtype=float32"]


def pretrain_args(workdir, steps, phase1_steps=None, every=5, extra=()):
    phase1_steps = steps if phase1_steps is None else phase1_steps
    return ["-m", "bertjax.pretrain", "--config=experiments/pretrain.py:tiny",
            f"--workdir={workdir}", *MODEL,
            "--config.phases.phase1.data=synthetic", "--config.phases.phase2.data=synthetic",
            "--config.phases.phase1.seq_len=32", "--config.phases.phase1.max_predictions=5",
            "--config.phases.phase2.seq_len=64", "--config.phases.phase2.max_predictions=10",
            f"--config.train.num_train_steps={steps}",
            f"--config.phases.phase1.steps={phase1_steps}",
            f"--config.phases.phase2.steps={steps - phase1_steps}",
            "--config.train.batch_size=16", "--config.log_every_steps=1",
            f"--config.checkpoint.every_steps={every}", "--config.optimizer.warmup_steps=3",
            "--config.optimizer.learning_rate=1e-3", *extra]


def start(args, env=None, quiet=False):
    """`python <args>` started from the project root, stdout and stderr together in a pipe
    (quiet: discarded; for a run that is waited on, then killed, unread: a run writing more
    than a pipe holds would block on its log and never reach what the test waits for)."""
    output = subprocess.DEVNULL if quiet else subprocess.PIPE
    return subprocess.Popen([sys.executable, *args], cwd=ROOT,
                            env=dict(os.environ, **(env or {})),
                            stdout=output, stderr=subprocess.STDOUT, text=True)


def wait_for(predicate, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def latest_checkpoint(workdir):
    root = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(root):
        return None
    steps = [int(d) for d in os.listdir(root) if d.isdigit()]
    return max(steps, default=None)


def final_params(workdir, step):
    """The params of checkpoint `step`, restored onto this process's one device, flattened."""
    import flax
    import jax
    import orbax.checkpoint as ocp

    path = os.path.join(workdir, "checkpoints", str(step), "state")
    checkpointer = ocp.StandardCheckpointer()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                          checkpointer.metadata(path).item_metadata.tree)
    restored = checkpointer.restore(path, target)
    return {k: np.asarray(v)
            for k, v in flax.traverse_util.flatten_dict(restored["params"], sep="/").items()}


def one_line_error(proc):
    """The single `error: ...` line of a failed run (library log lines aside), no traceback."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]

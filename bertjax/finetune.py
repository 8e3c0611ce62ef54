r"""Fine-tune a pre-trained BERT: GLUE, SWAG, or your own files.

  python -m bertjax.finetune --config=experiments/glue.py:mrpc --workdir=runs/mrpc \
      --config.init_checkpoint=checkpoints/bert-base-uncased --config.data.dir=glue_data
  python -m bertjax.finetune --config=experiments/finetune_files.py:classification ...
  python -m bertjax.finetune --config=experiments/glue.py:mrpc --dry_run --topology=v5e-8 \
      --config.init_checkpoint=checkpoints/bert-base-uncased --config.data.dir=glue_data

The task (config.task.family) is a plug-in of bertjax/tasks/; the run is the shared training
loop (bertjax/train/loop.py), as pre-training's: a device mesh from `config.mesh`, parameters
sharded by their logical axis names, the reference optimizer (warmup over 10% of the steps,
then linear decay), `metrics.jsonl` + TensorBoard and the progress line. The dev metric is
computed every epoch (or `eval.every_steps`); checkpoints under `workdir/checkpoints` keep the
last `checkpoint.max_to_keep` steps and the best by dev metric, and a rerun (after SIGKILL, or
SIGTERM, which saves and exits 0) resumes exactly. Test predictions come from the best
checkpoint (GLUE: leaderboard files `workdir/submission/<TASK>.tsv`). `workdir/results.json`
holds the best dev metrics (read by `bertjax.finetune_grid`).
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any

from bertjax import cli


def train_and_evaluate(config, workdir: str, log=print) -> dict[str, Any]:
    """Fine-tunes (or resumes), evaluates, keeps the best checkpoint, writes test predictions.

    Returns {"status", "best_step", "best": dev metrics of the best checkpoint,
    "primary_metric", "history", "total_steps"}.
    """
    from bertjax import validate
    from bertjax.tasks import FineTuningJob, get_task
    from bertjax.train import loop

    validate.finetuning(config, workdir)  # before the data is read or anything is written
    job = FineTuningJob(get_task(config), config, log=log)
    return loop.train(job, config, workdir, log=log)


def dry_run_job(config, log=print):
    """The job of `config` for `--dry_run` (its data and checkpoint are read, nothing is
    trained), with the model FLOPs of its stage for MFU: 3 × the encoder's forward pass."""
    import dataclasses

    from bertjax.tasks import FineTuningJob, get_task
    from bertjax.train import flops as flops_lib

    job = FineTuningJob(get_task(config), config, log=log)
    stage = job.stages[0]
    tokens = stage.batch_spec.get("input_ids")
    sequences = 1 if tokens is None else int(math.prod(tokens.shape[1:-1]))  # choices
    forward = flops_lib.forward_flops_per_sequence(job.model_config, stage.tokens_per_example, 0)
    job.stages = [dataclasses.replace(stage, flops_per_example=3.0 * forward * sequences)]
    return job


def main(argv):
    del argv
    config = cli.require(_CONFIG.value, "--config", "experiments/glue.py:mrpc")
    if _DRY_RUN.value:
        from bertjax.train import dry_run as dry_run_lib

        if not dry_run_lib.on_slice(dry_run_job, config, _TOPOLOGY.value, _SWEEP.value,
                                    _SWEEP_SECONDS.value):
            dry_run_lib.run(dry_run_job(config), config)
        return
    if _TOPOLOGY.value or _SWEEP.value:
        sys.exit("error: --topology and --sweep need --dry_run")
    workdir = cli.require(_WORKDIR.value, "--workdir", "runs/mrpc")
    cli.initialize_distributed()
    summary = train_and_evaluate(config, workdir, log=functools.partial(print, flush=True))
    print(f"Fine-tuning {summary['status']}.", flush=True)


if __name__ == "__main__":
    from absl import flags

    _CONFIG, _WORKDIR = cli.define_job_flags("experiments/glue.py:mrpc")
    _DRY_RUN = flags.DEFINE_bool(
        "dry_run", False, "Read the config's data and checkpoint, print parameters, FLOPs and "
        "memory of the compiled train step; exit.")
    _TOPOLOGY = flags.DEFINE_string(
        "topology", None, "With --dry_run: compile for this Cloud TPU slice with the TPU "
        "compiler, on any machine (needs the tpu extra): v5litepod-8, v5p-32, v6e:2x4, ...")
    _SWEEP = flags.DEFINE_bool(
        "sweep", False, "With --dry_run --topology: try meshes, batch sizes, remat and scan; "
        "list those that fit, fastest first, with their flags.")
    _SWEEP_SECONDS = flags.DEFINE_integer("sweep_seconds", 600, "Compile budget of --sweep.")
    cli.run(main)

r"""Fine-tune a pre-trained BERT: GLUE, SWAG, SQuAD, tagging, sentence embeddings, or your own
files.

  python -m bertjax.finetune --config=experiments/glue.py:mrpc --workdir=runs/mrpc \
      --config.init_checkpoint=checkpoints/bert-base-uncased --config.data.dir=glue_data
  python -m bertjax.finetune --config=experiments/finetune_files.py:classification ...
  python -m bertjax.finetune --config=experiments/embedding.py:pairs ...  # docs/embeddings.md
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

from bertjax import cli


def main(argv):
    del argv
    config = cli.require(_CONFIG.value, "--config", "experiments/glue.py:mrpc")
    from bertjax.aot import dry_run
    from bertjax.tasks import dry_run_job, train_and_evaluate

    # The checkpoint fixes the layers: a --topology dry run compiles the full step.
    if dry_run.from_flags(dry_run_job, config, vary_layers=False):
        return
    workdir = cli.require(_WORKDIR.value, "--workdir", "runs/mrpc")
    cli.initialize_distributed(config)
    cli.use_compilation_cache()
    summary = train_and_evaluate(config, workdir, log=functools.partial(print, flush=True))
    print(f"Fine-tuning {summary['status']}.", flush=True)


if __name__ == "__main__":
    _CONFIG, _WORKDIR = cli.define_job_flags("experiments/glue.py:mrpc")
    cli.define_dry_run_flags("the config's data and checkpoint")
    cli.run(main)

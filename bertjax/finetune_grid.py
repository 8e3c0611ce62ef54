r"""The paper's fine-tuning search: every hyper-parameter combination × several seeds.

  python -m bertjax.finetune_grid --config=experiments/glue.py:mrpc --workdir=runs/mrpc_grid \
      --grid='learning_rate=2e-5,3e-5,5e-5 batch_size=16,32 num_epochs=2,3,4' --seeds=5 \
      --config.init_checkpoint=checkpoints/bert-base-uncased --config.data.dir=glue_data

Each run is an ordinary `bertjax.finetune` run (same process, one after another) in its own
directory `workdir/<combination>/seed_<s>`, e.g. `learning_rate=2e-5,batch_size=16,
num_epochs=2/seed_3`; the seeds are config.seed, config.seed + 1, ... A run whose
`results.json` exists is skipped, so an interrupted grid resumes where it stopped, and an
unfinished run resumes from its last checkpoint, exactly. SIGTERM saves the running cell and
stops the grid (exit 0); the next invocation continues it. A run whose loss diverged
(bertjax.errors.TrainingError) is recorded (`diverged.json`) and counted, not fatal: a
too-large learning rate is a normal grid outcome.

The best combination is the one with the highest mean (over seeds) of the task's main dev
metric (`primary_metric` in results.json). `workdir/summary.md` and `workdir/summary.csv`
give, per combination, the mean and sample standard deviation (ddof=1; 0 for one seed) of
every dev metric of the best checkpoint of each run, and n (finished runs). Grid keys are
short names (bertjax/grids/sweep.py: GRID_KEYS) or any dotted config path, e.g.
`optimizer.warmup_proportion=0.1,0.2`.
"""

from __future__ import annotations

import functools
import sys

from absl import flags

from bertjax import cli
from bertjax.grids import sweep


def main(argv):
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}; put the grid in quotes: "
                 "--grid='learning_rate=2e-5,3e-5,5e-5 batch_size=16,32'")
    config = cli.require(_CONFIG.value, "--config", "experiments/glue.py:mrpc")
    workdir = cli.require(_WORKDIR.value, "--workdir", "runs/mrpc_grid")
    grid = cli.require(_GRID.value, "--grid", "'learning_rate=2e-5,3e-5,5e-5'")
    cli.initialize_distributed(config)
    cli.use_compilation_cache()
    sweep.run_grid(config, grid, _SEEDS.value, workdir, log=functools.partial(print, flush=True))


if __name__ == "__main__":
    _CONFIG, _WORKDIR = cli.define_job_flags("experiments/glue.py:mrpc")
    _GRID = flags.DEFINE_string(
        "grid", None, "Space-separated key=v1,v2,... e.g. "
        "'learning_rate=2e-5,3e-5,5e-5 batch_size=16,32 num_epochs=2,3,4'.")
    _SEEDS = flags.DEFINE_integer("seeds", 5, "Runs per combination, seeds config.seed, "
                                  "config.seed+1, ...")
    cli.run(main)

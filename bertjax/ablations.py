r"""The paper's ablations (Devlin et al., 2018, Sec. 5 and App. C) as one-command experiments.

  python -m bertjax.ablations table5 --scale=demo --workdir=runs/table5
  python -m bertjax.ablations table6 --scale=paper --workdir=gs://bucket/table6 \
      --set=pretrain.phases.phase1.data='gs://bucket/seq128/*' ...
  python -m bertjax.ablations steps --scale=small --workdir=runs/steps --seeds=0,1,2
  python -m bertjax.ablations table8 --scale=demo --workdir=runs/table8 --tasks=rotten_tomatoes
  python -m bertjax.ablations table5 --scale=demo --workdir=runs/table5 --random_weights

Tables: table5 (pre-training tasks), table6 (model size), steps (fine-tuning along
pre-training), table8 (masking mixes); grids in experiments/ablations/<table>.py. Scales:
paper, small, demo, test. Every cell is its own resumable run under --workdir (a rerun skips
finished cells; --list prints every cell's state and runs nothing); outputs W/table.md,
W/results.json and plots. --random_weights adds a row fine-tuned from the grid's model at its
initial weights. The grids, their cells and outputs: bertjax/grids/ablations.py.
"""

from __future__ import annotations

import functools
import sys

from absl import flags

from bertjax import cli
from bertjax.grids import ablations


def define_flags() -> None:
    cli.define_distributed_flags()
    flags.DEFINE_enum("scale", "demo", ablations.SCALES, "paper | small | demo | test.")
    flags.DEFINE_string("workdir", None, "Directory of the grid's cells and outputs; a rerun "
                        "resumes it.")
    flags.DEFINE_string("seeds", None, "Comma-separated seeds (default: the grid's).")
    flags.DEFINE_string("tasks", None, "Comma-separated fine-tuning tasks (default: all of "
                        "the grid's).")
    flags.DEFINE_multi_string("set", [], "Grid config override key=value, e.g. "
                              "pretrain.train.num_train_steps=2000 (repeatable).")
    flags.DEFINE_bool("list", False, "Print every cell with its state (done, diverged, "
                      "started, to do) and run nothing.")
    flags.DEFINE_bool("random_weights", False, "Add a row fine-tuned from the grid's model at "
                      "random weights (no pre-training): what each column owes to it.")


def main(argv):
    FLAGS = flags.FLAGS
    if len(argv) != 2:
        sys.exit(f"error: name one table ({', '.join(ablations.TABLES)}), e.g. "
                 "python -m bertjax.ablations table5 --scale=demo --workdir=runs/table5")
    workdir = cli.require(FLAGS.workdir, "--workdir", "runs/table5")
    import jax

    # The cells of a grid compile the same train and eval steps again and again (seeds,
    # variants of equal shape): compile each once, into the workdir.
    jax.config.update("jax_compilation_cache_dir", f"{workdir}/jax_cache")
    grid = ablations.load_grid(argv[1], FLAGS.scale, FLAGS.set)
    if FLAGS.random_weights:
        ablations.add_random_weights_row(grid)
    seeds = ablations.parse_seeds(FLAGS.seeds) if FLAGS.seeds else [int(s) for s in grid.seeds]
    tasks = [t for t in FLAGS.tasks.split(",") if t] if FLAGS.tasks else None
    if FLAGS.list:
        print(ablations.format_states(ablations.cell_states(grid, workdir, seeds, tasks)))
        return
    cli.initialize_distributed()  # a pod slice runs each cell on every host
    ablations.run_table(grid, workdir, seeds, tasks, log=functools.partial(print, flush=True))


if __name__ == "__main__":
    cli.run(main, define_flags)

"""Grids of runs: the paper's ablation tables (`python -m bertjax.ablations`) and the
fine-tuning hyper-parameter search (`python -m bertjax.finetune_grid`), on one runner.

A grid is a list of cells, each an ordinary resumable run (pre-training or fine-tuning) in its
own directory under the grid's workdir, run in this process one after another. A cell is done
when its directory holds results.json (`bertjax.train.workdir.RESULTS_FILE`) or, for a
fine-tuning run whose loss diverged (a normal outcome of a learning-rate grid),
diverged.json; a rerun of the same command skips done cells and resumes an unfinished one
from its last checkpoint (cells.py). Config fields are set from text the same way for
`--set=key=value` and for `--grid` values: typed like the field they replace (overrides.py).
The numbers of a grid are the mean ± sample std over seeds of each cell's dev metric,
written as Markdown tables (and CSV), with matplotlib plots of the ablations (stats.py).

  cells.py      the cell protocol: a cell's state, a fine-tuning cell, the same-config check
  overrides.py  config fields from text; nested dicts merged into a config
  stats.py      mean ± std, summary rows, Markdown / CSV tables, plots
  ablations.py  the paper's ablation grids (Tables 5, 6, 8, Figure 5)
  sweep.py      the fine-tuning grid: hyper-parameter combinations × seeds
"""

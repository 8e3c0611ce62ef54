"""The paper's ablations (Devlin et al., 2018, Sec. 5 and App. C) as grids of cells, run by
`python -m bertjax.ablations <table>`.

Tables (grids in experiments/ablations/<table>.py, `get_config(scale)`):
  table5  pre-training tasks: MLM+NSP, No NSP, LTR & No NSP, LTR & No NSP + BiLSTM;
  table6  model size (#L, #H, #A): held-out MLM perplexity and fine-tuning columns;
  steps   fine-tuning from checkpoints taken along pre-training, masked LM vs left-to-right;
  table8  masking mixes (MASK / SAME / RANDOM) of the chosen tokens.
Scales: paper (BERT-base, the paper's recipe, for a pod slice), small, demo (the `make demo`
corpus and demo tasks on a CPU), test (tiny, for the test suite; its data paths are set with
--set).

Every cell is its own run in its own directory, in this process, one after another:
  W/pretrain/<pre-training>/seed_<s>/    a pre-training run (export/ is the model)
  W/finetune/<row>/<task>/lr_<lr>/seed_<s>/   a fine-tuning run of that model
A finished cell (results.json or diverged.json, cells.py) is skipped, so an interrupted grid
resumes (an unfinished cell resumes from its last checkpoint); `cell_states` gives every
cell's state. Outputs: W/table.md (the paper's layout: mean ± sample std over the seeds of each
cell's dev metric, at the best learning rate of the grid; at paper scale the paper's numbers
beside ours), W/results.json (every number of the table and the cells behind it),
W/loss_curves.png and, for `steps`, W/accuracy_vs_steps.png (stats.py).

The random-weights row (`add_random_weights_row`): the grid's model fine-tuned from its
initial, random weights (W/pretrain/random_weights/seed_<s>/export, no pre-training). At small
scales it shows which columns measure pre-training at all; added to a finished grid, only its
cells run.
"""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Callable
from typing import Any

from bertjax import cli, paths
from bertjax.errors import ConfigError, DataError
from bertjax.grids import cells, overrides, stats
from bertjax.grids.cells import finetune_cell  # a name of this module: tests replace it
from bertjax.train.workdir import RESULTS_FILE, write_json

TABLES = ("table5", "table6", "steps", "table8")
SCALES = ("paper", "small", "demo", "test")
RANDOM_WEIGHTS = "random_weights"  # the pre-training name of the --random_weights row


# ---------------------------------------------------------------------------------------------
# Configs and cells


def slug(name: str) -> str:
    """A directory name for a row name ("LTR & No NSP" → "ltr_no_nsp")."""
    out = "".join(c.lower() if c.isalnum() else "_" for c in name)
    return "_".join(part for part in out.split("_") if part)


def check_data(grid) -> None:
    """Every file the grid reads must exist: one line naming it and the make target that
    fetches it."""
    import glob

    def need(path: str, field: str, hint: str) -> None:
        if path and "://" not in path and not path.startswith("tfds:") and path != "synthetic" \
                and not glob.glob(path):
            raise ConfigError(f"{field}: {path} not found; {hint}")

    hint = grid.get("data_hint", "")
    pretrain = grid.pretrain
    need(pretrain.vocab, "pretrain.vocab", hint)
    for name, phase in pretrain.phases.items():
        for field in ("data", "eval_data"):
            need(phase[field], f"pretrain.phases.{name}.{field}", hint)
    for name, task in grid.tasks.items():
        data = task.config.data
        for field in ("train", "validation", "dir"):
            if field in data:
                need(data[field], f"tasks.{name}.config.data.{field}", task.get("hint", hint))


def pretrain_cell(config, workdir: str, export_steps: list[int], log) -> dict | None:
    """Pre-trains (or resumes) in `workdir`; exports the model at each of `export_steps` and
    at the end. Returns the cell's results (None if preempted). Zero steps (the
    --random_weights row) exports the model at its initial weights."""
    from etils import epath

    from bertjax.tasks import pretraining
    from bertjax.tasks.pretraining import checks
    from bertjax.train import loop

    if not config.vocab:
        raise ConfigError("pretrain.vocab is empty; the runner fine-tunes the exported model, "
                          "which needs its vocabulary")
    if config.train.num_train_steps == 0:
        return random_weights_cell(config, workdir)
    checks.check(config, workdir, checks.resolve(config, log=log))
    job = pretraining.make_job(config)
    summary = loop.train(job, config, workdir, log=log)
    if summary["status"] != "done":
        return None
    root = epath.Path(workdir)
    exports = {str(job.total_steps): str(root / "export")}
    for step in export_steps:
        if step < job.total_steps:
            exports[str(step)] = export_step(job, config, workdir, step)
    history = summary["history"]
    return {"status": "done", "total_steps": job.total_steps, "history": history,
            "final": history[-1] if history else {}, "exports": exports}


def random_weights_cell(config, workdir: str) -> dict:
    """The model of `config` at its initial weights (seed config.seed, as pre-training would
    start), saved as `workdir/export`: the cell behind the --random_weights row."""
    import jax
    from etils import epath

    from bertjax.checkpoint_dir import save_pretrained
    from bertjax.models import BertForPreTraining
    from bertjax.tasks.pretraining import step_fns
    from bertjax.train import configs
    from bertjax.train import step as step_lib

    model_config = configs.resolve_model_config(config.model)
    init_params, _ = step_fns(BertForPreTraining(model_config))
    params = jax.device_get(step_lib.initial_params(init_params, jax.random.PRNGKey(config.seed)))
    directory = epath.Path(workdir) / "export"
    save_pretrained(directory, model_config, params, config.vocab, overwrite=True,
                    provenance={"source": "bertjax.ablations (random weights, no "
                                          f"pre-training, seed {config.seed})"})
    return {"status": "done", "total_steps": 0, "history": [], "final": {},
            "exports": {"0": str(directory)}}


def export_step(job, config, workdir: str, step: int) -> str:
    """The params of checkpoint `step` of a finished pre-training run as a bertjax checkpoint
    directory `workdir/export_step_<step>` (for fine-tuning from part-way through)."""
    from etils import epath

    from bertjax.checkpoint_dir import PARAMS_DIR, save_pretrained
    from bertjax.train import multihost
    from bertjax.train import sharding as sharding_lib
    from bertjax.train import step as step_lib
    from bertjax.train.checkpoints import Checkpointer

    directory = epath.Path(workdir) / f"export_step_{step}"
    if (directory / PARAMS_DIR).exists():  # orbax's save appears whole, and last
        return str(directory)
    tx, _ = job.optimizer()
    mesh = sharding_lib.make_mesh(config.mesh)
    abstract, shardings = step_lib.state_shardings(job.init_params, tx, mesh,
                                                   config.logical_axis_rules)
    checkpointer = Checkpointer(workdir, max_to_keep=10_000, async_save=False)
    try:
        if step not in checkpointer.all_steps():
            raise ConfigError(f"{workdir}: no checkpoint at step {step}; the grid's export "
                              "steps must be multiples of pretrain.checkpoint.every_steps")
        state, _ = checkpointer.restore(step, abstract, shardings)
    finally:
        checkpointer.close()
    save_pretrained(directory, job.model_config, multihost.to_host(state.params), config.vocab,
                    overwrite=True,
                    provenance={"source": f"bertjax.ablations (step {step})"})
    return str(directory)


# ---------------------------------------------------------------------------------------------
# The grid


def pretrain_seeds(grid, seeds: list[int]) -> list[int]:
    """Seeds of the pre-training runs: one per fine-tuning seed, or only the first (paper
    scale: one pre-training, fine-tuning restarts, as the paper's Table 6)."""
    return seeds if grid.get("pretrain_per_seed", True) else seeds[:1]


def plan(grid, workdir: str, seeds: list[int], tasks: list[str]):
    """(pre-training cells, fine-tuning cells) of the grid.

    A pre-training cell: (name, seed, directory, config). A fine-tuning cell: (row, task,
    learning rate, seed, directory, pre-training cell key (name, seed), export step)."""
    from etils import epath

    from bertjax.checkpoint_dir import count_vocab, vocab_path

    root = epath.Path(workdir)
    export_steps = [int(s) for s in grid.get("export_steps", [])]
    used = sorted({row["pretraining"] for row in grid.rows})
    pretrains = []
    for name in used:
        for seed in pretrain_seeds(grid, seeds):
            cfg = overrides.merge(grid.pretrain, dict(grid.pretrainings[name]))
            cfg.seed = seed
            if cfg.vocab and epath.Path(cfg.vocab).exists():  # the model's vocabulary: the data's
                cfg.model.vocab_size = count_vocab(vocab_path(cfg.vocab))
            if export_steps:
                # Keep every checkpoint that will be exported: saves (and the evaluations,
                # which save too) only at multiples of the export steps' spacing, all kept.
                every = math.gcd(*export_steps)
                cfg.checkpoint.every_steps = every
                if cfg.eval.every_steps % every:
                    cfg.eval.every_steps = every
                cfg.checkpoint.max_to_keep = max(cfg.checkpoint.max_to_keep,
                                                 cfg.train.num_train_steps // every + 2)
            pretrains.append((name, seed, root / "pretrain" / name / f"seed_{seed}", cfg))
    finetunes = []
    pre_seeds = pretrain_seeds(grid, seeds)
    for row in grid.rows:
        for task in tasks:
            entry = grid.tasks[task]
            for lr in entry.learning_rates:
                for seed in seeds:
                    pre_seed = seed if seed in pre_seeds else pre_seeds[0]
                    directory = (root / "finetune" / slug(row["name"]) / task / f"lr_{lr:g}"
                                 / f"seed_{seed}")
                    finetunes.append((row, task, float(lr), seed, directory,
                                      (row["pretraining"], pre_seed), row.get("step")))
    return pretrains, finetunes


def finetune_config(grid, row, task: str, lr: float, seed: int, checkpoint: str):
    config = overrides.merge(grid.tasks[task].config, dict(row.get("finetune", {})))
    config.init_checkpoint = checkpoint
    config.optimizer.learning_rate = lr
    config.seed = seed
    return config


def grid_tasks(grid, tasks: list[str] | None) -> list[str]:
    """The tasks asked for (default: all of the grid's, in its column order), checked."""
    tasks = list(tasks or grid.get("task_order") or grid.tasks.keys())
    for task in tasks:
        if task not in grid.tasks:
            raise ConfigError(f"--tasks: unknown task {task!r}; this grid has "
                              f"{', '.join(grid.tasks.keys())}")
    return tasks


def cell_states(grid, workdir: str, seeds: list[int], tasks: list[str] | None = None
                ) -> list[tuple[str, str, str]]:
    """(state, what the cell is, its directory) of every cell, in run order; the state is
    done, diverged, started (an unfinished run to resume) or to do."""
    pretrains, finetunes = plan(grid, workdir, seeds, grid_tasks(grid, tasks))
    return ([(cells.state(d), f"pretrain {name} seed {seed}", str(d))
             for name, seed, d, _ in pretrains]
            + [(cells.state(d), f"finetune {row['name']} / {task} lr {lr:g} seed {seed}", str(d))
               for row, task, lr, seed, d, _, _ in finetunes])


def format_states(states: list[tuple[str, str, str]]) -> str:
    """--list's output: a line per cell, then the count of cells in each state."""
    counts = collections.Counter(state for state, _, _ in states)
    lines = [f"{state:8}  {what}  {directory}" for state, what, directory in states]
    return "\n".join([*lines, f"{len(states)} cells: "
                       + ", ".join(f"{n} {state}" for state, n in counts.items())])


def run_table(grid, workdir: str, seeds: list[int], tasks: list[str] | None = None,
              log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Runs (or resumes) every cell of `grid`, then writes table.md, results.json and the
    plots into `workdir`. Returns {"status", "ran", "skipped", "results"}."""
    from etils import epath

    tasks = grid_tasks(grid, tasks)
    if not seeds:
        raise ConfigError("--seeds is empty")
    check_data(grid)
    root = epath.Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    pretrains, finetunes = plan(grid, workdir, seeds, tasks)
    counts = {"ran": 0, "skipped": 0}
    log(f"{grid.table}: {len(pretrains)} pre-training and {len(finetunes)} fine-tuning cells")
    exports = run_pretrainings(grid, pretrains, counts, log)
    if exports is None or not run_finetunings(grid, finetunes, exports, counts, log):
        return {"status": "preempted", **counts}
    results = collect(grid, workdir, seeds, tasks)
    write_outputs(grid, results, root)
    log(f"{grid.table}: ran {counts['ran']}, skipped {counts['skipped']} finished cell(s); "
        f"table in {root / 'table.md'}")
    return {"status": "done", **counts, "results": results}


def run_pretrainings(grid, pretrains, counts: dict[str, int], log: Callable[[str], Any]
                     ) -> dict[tuple[str, int], dict[str, str]] | None:
    """Runs the unfinished pre-training cells (counted in `counts`); the exports of every cell
    by (name, seed): {step: model directory}, or None when preempted."""
    export_steps = [int(s) for s in grid.get("export_steps", [])]
    exports: dict[tuple[str, int], dict[str, str]] = {}
    for i, (name, seed, directory, cfg) in enumerate(pretrains, 1):
        tag = f"[pretrain {i}/{len(pretrains)} {name} seed {seed}]"
        results_file = directory / RESULTS_FILE
        if not results_file.exists():
            cells.log_start(log, tag, directory)
            result = pretrain_cell(cfg, str(directory), export_steps,
                                   log=lambda s, t=tag: log(f"{t} {s}"))
            if result is None:
                log(f"preempted in {directory}; run the same command to continue")
                return None
            write_json(results_file, result)
            counts["ran"] += 1
        else:
            counts["skipped"] += 1
        exports[(name, seed)] = json.loads(results_file.read_text())["exports"]
    return exports


def run_finetunings(grid, finetunes, exports: dict[tuple[str, int], dict[str, str]],
                    counts: dict[str, int], log: Callable[[str], Any]) -> bool:
    """Runs the unfinished fine-tuning cells (counted in `counts`), each from the export of its
    pre-training at its row's step (default: the last); False when preempted."""
    for i, (row, task, lr, seed, directory, key, step) in enumerate(finetunes, 1):
        tag = f"[finetune {i}/{len(finetunes)} {row['name']} {task} lr {lr:g} seed {seed}]"
        if cells.is_finished(directory):
            counts["skipped"] += 1
            continue
        available = exports[key]
        step_key = str(step) if step else max(available, key=int)
        if step_key not in available:
            raise ConfigError(f"row {row['name']!r}: no export at step {step}; add it to "
                              "export_steps")
        cells.log_start(log, tag, directory)
        config = finetune_config(grid, row, task, lr, seed, available[step_key])
        summary = finetune_cell(config, str(directory), log=lambda s, t=tag: log(f"{t} {s}"))
        if summary["status"] not in ("done", "diverged"):
            log(f"preempted in {directory}; run the same command to continue")
            return False
        counts["ran"] += 1
    return True


# ---------------------------------------------------------------------------------------------
# Results


def collect(grid, workdir: str, seeds: list[int], tasks: list[str]) -> dict[str, Any]:
    """Every number of the table from the cells' results.json files: per row and column, the
    values over seeds at the learning rate with the best mean, and their mean ± std."""
    pretrains, finetunes = plan(grid, workdir, seeds, tasks)
    pre_results = {(name, seed): json.loads((d / RESULTS_FILE).read_text())
                   for name, seed, d, _ in pretrains}
    by_cell: dict[tuple[str, str, float], list[float]] = {}
    for row, task, lr, _, directory, _, _ in finetunes:
        values = by_cell.setdefault((row["name"], task, lr), [])
        if (directory / RESULTS_FILE).exists():
            best = json.loads((directory / RESULTS_FILE).read_text())["best"]
            values.append(float(best[grid.tasks[task].metric]))
    rows = []
    for row in grid.rows:
        by_column: dict[str, Any] = {}
        total = next(r["total_steps"] for (name, _), r in pre_results.items()
                     if name == row["pretraining"])
        step = row.get("step") or total
        for column in grid.get("pretrain_columns", []):
            values = [pretrain_metric(r["history"], column["metric"], step,
                                      column.get("seq_len"))
                      for (name, _), r in pre_results.items() if name == row["pretraining"]]
            values = [v for v in values if v is not None]
            mean, std = stats.mean_std(values)
            by_column[column["name"]] = {"mean": mean, "std": std, "n": len(values),
                                         "values": values, "scale": column.get("scale", 1.0)}
        for task in tasks:
            candidates = [(lr, v) for (name, t, lr), v in by_cell.items()
                          if name == row["name"] and t == task]
            lr, values = max(candidates, key=lambda c: (stats.mean_std(c[1])[0]
                                                        if c[1] else -math.inf))
            mean, std = stats.mean_std(values)
            by_column[grid.tasks[task].column] = {"mean": mean, "std": std, "n": len(values),
                                                  "values": values, "learning_rate": lr,
                                                  "metric": grid.tasks[task].metric,
                                                  "scale": grid.tasks[task].get("scale", 100.0)}
        rows.append({"name": row["name"], "pretraining": row["pretraining"], "step": step,
                     "cells": by_column})
    columns = ([c["name"] for c in grid.get("pretrain_columns", [])]
               + [grid.tasks[t].column for t in tasks])
    losses = {name: train_losses(d) for name, seed, d, _ in pretrains if seed == seeds[0]}
    return {"table": grid.table, "title": grid.title, "scale": grid.scale, "seeds": seeds,
            "columns": columns, "rows": rows, "paper": paper_numbers(grid),
            "loss_curves": losses}


def pretrain_metric(history: list[dict[str, float]], metric: str, step: int,
                    seq_len: int | None = None) -> float | None:
    """A held-out pre-training metric of the model at `step`: the last evaluation at or before
    it (of `seq_len`-token inputs when given: phase 2 evaluates at another length)."""
    evals = [h for h in history if metric in h and h["step"] <= step
             and (seq_len is None or h.get("seq_len") == seq_len)]
    return float(evals[-1][metric]) if evals else None


def paper_numbers(grid) -> dict[str, dict[str, float]]:
    paper = grid.get("paper") or {}
    return {row: dict(values) for row, values in paper.items()}


def train_losses(directory) -> list[tuple[int, float]]:
    """(step, training loss) pairs of a pre-training run's metrics.jsonl."""
    path = directory / "metrics.jsonl"
    if not path.exists():
        return []
    points = []
    for _, record in paths.jsonl_records(path, DataError):
        if record.get("split") == "train" and "loss" in record:
            points.append((int(record["step"]), float(record["loss"])))
    return points


def write_outputs(grid, results: dict[str, Any], root) -> None:
    """results.json, table.md and the plots, from process 0 (every process calls this)."""
    from bertjax.train import multihost

    def write():
        (root / RESULTS_FILE).write_text(json.dumps(results, indent=2) + "\n")
        (root / "table.md").write_text(stats.table_markdown(results, grid))
        stats.plot_loss_curves(results, str(root / "loss_curves.png"))
        if grid.get("export_steps"):
            stats.plot_steps(results, str(root / "accuracy_vs_steps.png"), RANDOM_WEIGHTS)

    multihost.write_from_main(write)


# ---------------------------------------------------------------------------------------------
# A grid from its experiments/ablations file


def load_grid(table: str, scale: str, sets: list[str]):
    """The grid config experiments/ablations/<table>.py:<scale>, with --set overrides."""
    if table not in TABLES:
        raise ConfigError(f"unknown table {table!r}; expected one of {', '.join(TABLES)}")
    if scale not in SCALES:
        raise ConfigError(f"--scale={scale} is not one of {' | '.join(SCALES)}")
    # The grids ship next to bertjax (experiments/ is installed with it), so the command works
    # from any directory.
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    grids = os.path.join(root, "experiments", "ablations")
    grid = cli.load_config(f"{os.path.join(grids, table)}.py:{scale}")
    for item in sets:
        overrides.apply_set(grid, item)
    return grid


def add_random_weights_row(grid) -> None:
    """A last row fine-tuned from the grid's own model (grid.pretrain.model) at random weights."""
    with grid.unlocked():  # a pre-training of zero steps: the initial weights, exported
        grid.pretrainings[RANDOM_WEIGHTS] = {"train": {"num_train_steps": 0}}
    grid.rows = [*grid.rows, dict(name="Random weights (no pre-training)",
                                  pretraining=RANDOM_WEIGHTS, finetune={})]


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds={text}: expected comma-separated integers") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds={text}: give distinct seeds, e.g. 0,1,2")
    return seeds

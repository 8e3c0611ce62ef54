r"""The paper's ablations (Devlin et al., 2018, Sec. 5 and App. C) as one-command experiments.

  python -m bertjax.ablations table5 --scale=demo --workdir=runs/table5
  python -m bertjax.ablations table6 --scale=paper --workdir=gs://bucket/table6 \
      --set=pretrain.phases.phase1.data='gs://bucket/seq128/*' ...
  python -m bertjax.ablations steps --scale=small --workdir=runs/steps --seeds=0,1,2
  python -m bertjax.ablations table8 --scale=demo --workdir=runs/table8 --tasks=rotten_tomatoes
  python -m bertjax.ablations table5 --scale=demo --workdir=runs/table5 --random_weights

Tables (grids in experiments/ablations/<table>.py, `get_config(scale)`):
  table5  pre-training tasks: MLM+NSP, No NSP, LTR & No NSP, LTR & No NSP + BiLSTM;
  table6  model size (#L, #H, #A): held-out MLM perplexity and fine-tuning columns;
  steps   fine-tuning from checkpoints taken along pre-training, masked LM vs left-to-right;
  table8  masking mixes (MASK / SAME / RANDOM) of the chosen tokens.
Scales: paper (BERT-base, the paper's recipe, for a pod slice), small, demo (the `make demo`
corpus and demo tasks on a CPU), test (tiny, for the test suite; its data paths are set with
--set).

Every cell is its own run in its own directory, in this process, one after another:
  W/pretrain/<pre-training>/seed_<s>/    a `bertjax.pretrain` run (export/ is the model)
  W/finetune/<row>/<task>/lr_<lr>/seed_<s>/   a `bertjax.finetune` run of that model
A cell whose results.json exists is skipped, so an interrupted grid resumes (an unfinished
cell resumes from its last checkpoint); --list prints every cell's state and runs nothing.
Outputs: W/table.md (the paper's layout: mean ± sample std over the seeds of each cell's dev
metric, at the best learning rate of the grid; at paper scale the paper's numbers beside ours),
W/results.json (every number of the table and the cells behind it), W/loss_curves.png and, for
`steps`, W/accuracy_vs_steps.png.

--random_weights adds a reference row: the grid's model fine-tuned from its initial, random
weights (W/pretrain/random_weights/seed_<s>/export, no pre-training). At small scales it shows
which columns measure pre-training at all; added to a finished grid, only its cells run.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from absl import flags

from bertjax import cli
from bertjax.errors import ConfigError, TrainingError
from bertjax.train.workdir import DIVERGED_FILE, RESULTS_FILE

TABLES = ("table5", "table6", "steps", "table8")
SCALES = ("paper", "small", "demo", "test")
RANDOM_WEIGHTS = "random_weights"  # the pre-training name of the --random_weights row


# ---------------------------------------------------------------------------------------------
# Configs


def merge(config, overrides: dict) -> Any:
    """A copy of `config` with nested `overrides` ({"model": {"num_layers": 3}}) set."""
    config = config.copy_and_resolve_references()
    _merge_into(config, overrides, "")
    return config


def _merge_into(node, overrides: dict, prefix: str) -> None:
    for key, value in overrides.items():
        if key not in node:
            raise ConfigError(f"grid override {prefix}{key}: no such config field")
        if isinstance(value, dict) or hasattr(value, "items"):
            _merge_into(node[key], dict(value), f"{prefix}{key}.")
        else:
            node[key] = value


def apply_set(config, item: str) -> None:
    """--set=a.b.c=value: sets that field of the grid config, typed like it (JSON for lists)."""
    key, sep, text = item.partition("=")
    if not sep:
        raise ConfigError(f"--set={item}: expected key=value")
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
        if not hasattr(node, "keys") or part not in node:
            raise ConfigError(f"--set={item}: the grid config has no field {key!r}")
        node = node[part]
    if not hasattr(node, "keys") or leaf not in node:
        raise ConfigError(f"--set={item}: the grid config has no field {key!r}")
    current = node[leaf]
    node[leaf] = cli.typed_like(current, text, f"--set={item}: ")


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


# ---------------------------------------------------------------------------------------------
# Cells


def pretrain_cell(config, workdir: str, export_steps: list[int], log) -> dict | None:
    """Pre-trains (or resumes) in `workdir`; exports the model at each of `export_steps` and
    at the end. Returns the cell's results (None if preempted). Zero steps (the
    --random_weights row) exports the model at its initial weights."""
    from etils import epath

    from bertjax import validate
    from bertjax.tasks.pretraining import PretrainingJob, make_input_fn
    from bertjax.train import loop

    if not config.vocab:
        raise ConfigError("pretrain.vocab is empty; the runner fine-tunes the exported model, "
                          "which needs its vocabulary")
    if config.train.num_train_steps == 0:
        return random_weights_cell(config, workdir)
    validate.pretraining(config, workdir)
    job = PretrainingJob(config, make_input_fn(config))
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

    from bertjax.models import BertForPreTraining
    from bertjax.pretrained import save_pretrained
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

    from bertjax.pretrained import PARAMS_DIR, save_pretrained
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


def finetune_cell(config, workdir: str, log) -> dict | None:
    """Fine-tunes (or resumes) in `workdir`; the loop writes results.json. A diverged run is
    recorded in diverged.json (a normal outcome of a learning-rate grid)."""
    from etils import epath

    from bertjax.tasks import train_and_evaluate
    from bertjax.train import multihost

    try:
        summary = train_and_evaluate(config, workdir, log=log)
    except TrainingError as e:
        log(f"diverged: {e}")
        record = json.dumps({"error": str(e)})
        multihost.write_from_main(lambda: (epath.Path(workdir) / DIVERGED_FILE).write_text(
            record))
        return None
    return summary if summary["status"] == "done" else None


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

    from bertjax.pretrained import count_vocab, vocab_path

    root = epath.Path(workdir)
    export_steps = [int(s) for s in grid.get("export_steps", [])]
    used = sorted({row["pretraining"] for row in grid.rows})
    pretrains = []
    for name in used:
        for seed in pretrain_seeds(grid, seeds):
            cfg = merge(grid.pretrain, dict(grid.pretrainings[name]))
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
    config = merge(grid.tasks[task].config, dict(row.get("finetune", {})))
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

    def state(directory) -> str:
        for name, text in ((RESULTS_FILE, "done"), (DIVERGED_FILE, "diverged")):
            if (directory / name).exists():
                return text
        return "started" if directory.exists() else "to do"

    return ([(state(d), f"pretrain {name} seed {seed}", str(d)) for name, seed, d, _ in pretrains]
            + [(state(d), f"finetune {row['name']} / {task} lr {lr:g} seed {seed}", str(d))
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

    from bertjax.train import multihost

    tasks = grid_tasks(grid, tasks)
    if not seeds:
        raise ConfigError("--seeds is empty")
    check_data(grid)
    root = epath.Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    pretrains, finetunes = plan(grid, workdir, seeds, tasks)
    export_steps = [int(s) for s in grid.get("export_steps", [])]
    ran = skipped = 0
    exports: dict[tuple[str, int], dict[str, str]] = {}
    log(f"{grid.table}: {len(pretrains)} pre-training and {len(finetunes)} fine-tuning cells")
    for i, (name, seed, directory, cfg) in enumerate(pretrains, 1):
        tag = f"[pretrain {i}/{len(pretrains)} {name} seed {seed}]"
        results_file = directory / RESULTS_FILE
        if not results_file.exists():
            log(f"{tag} {'resuming' if directory.exists() else 'starting'} in {directory}")
            result = pretrain_cell(cfg, str(directory), export_steps,
                                   log=lambda s, t=tag: log(f"{t} {s}"))
            if result is None:
                log(f"preempted in {directory}; run the same command to continue")
                return {"status": "preempted", "ran": ran, "skipped": skipped}
            multihost.write_from_main(functools.partial(
                results_file.write_text, json.dumps(result, indent=2) + "\n"))
            ran += 1
        else:
            skipped += 1
        exports[(name, seed)] = json.loads(results_file.read_text())["exports"]
    for i, (row, task, lr, seed, directory, key, step) in enumerate(finetunes, 1):
        tag = f"[finetune {i}/{len(finetunes)} {row['name']} {task} lr {lr:g} seed {seed}]"
        if (directory / RESULTS_FILE).exists() or (directory / DIVERGED_FILE).exists():
            skipped += 1
            continue
        available = exports[key]
        step_key = str(step) if step else max(available, key=int)
        if step_key not in available:
            raise ConfigError(f"row {row['name']!r}: no export at step {step}; add it to "
                              "export_steps")
        log(f"{tag} {'resuming' if directory.exists() else 'starting'} in {directory}")
        config = finetune_config(grid, row, task, lr, seed, available[step_key])
        if finetune_cell(config, str(directory), log=lambda s, t=tag: log(f"{t} {s}")) is None \
                and not (directory / DIVERGED_FILE).exists():
            log(f"preempted in {directory}; run the same command to continue")
            return {"status": "preempted", "ran": ran, "skipped": skipped}
        ran += 1
    results = collect(grid, workdir, seeds, tasks)
    write_outputs(grid, results, root)
    log(f"{grid.table}: ran {ran}, skipped {skipped} finished cell(s); table in "
        f"{root / 'table.md'}")
    return {"status": "done", "ran": ran, "skipped": skipped, "results": results}


# ---------------------------------------------------------------------------------------------
# Results


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0.0 for one value; NaN for none)."""
    import numpy as np

    if not values:
        return math.nan, math.nan
    array = np.asarray(values, np.float64)
    return float(array.mean()), float(array.std(ddof=1)) if len(values) > 1 else 0.0


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
        cells: dict[str, Any] = {}
        total = next(r["total_steps"] for (name, _), r in pre_results.items()
                     if name == row["pretraining"])
        step = row.get("step") or total
        for column in grid.get("pretrain_columns", []):
            values = [pretrain_metric(r["history"], column["metric"], step,
                                      column.get("seq_len"))
                      for (name, _), r in pre_results.items() if name == row["pretraining"]]
            values = [v for v in values if v is not None]
            mean, std = mean_std(values)
            cells[column["name"]] = {"mean": mean, "std": std, "n": len(values), "values": values,
                                     "scale": column.get("scale", 1.0)}
        for task in tasks:
            candidates = [(lr, v) for (name, t, lr), v in by_cell.items()
                          if name == row["name"] and t == task]
            lr, values = max(candidates, key=lambda c: (mean_std(c[1])[0]
                                                        if c[1] else -math.inf))
            mean, std = mean_std(values)
            cells[grid.tasks[task].column] = {"mean": mean, "std": std, "n": len(values),
                                              "values": values, "learning_rate": lr,
                                              "metric": grid.tasks[task].metric,
                                              "scale": grid.tasks[task].get("scale", 100.0)}
        rows.append({"name": row["name"], "pretraining": row["pretraining"], "step": step,
                     "cells": cells})
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
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "train" and "loss" in record:
            points.append((int(record["step"]), float(record["loss"])))
    return points


def format_cell(cell: dict[str, Any]) -> str:
    """"84.1 ± 0.2" (a fine-tuning metric, as a percentage) or "3.99 ± 0.01" (perplexity);
    the value alone from one run; "–" when no run finished."""
    if not cell["n"]:
        return "–"
    digits = 2 if "metric" not in cell else 1
    scale = cell["scale"]
    if cell["n"] == 1:
        return f"{cell['mean'] * scale:.{digits}f}"
    return f"{cell['mean'] * scale:.{digits}f} ± {cell['std'] * scale:.{digits}f}"


def table_markdown(results: dict[str, Any], grid) -> str:
    """The paper's layout: a row per variant, a column per task (and pre-training metric)."""
    paper = results["paper"]
    seeds = ",".join(map(str, results["seeds"]))
    restarts = "" if grid.get("pretrain_per_seed", True) else "fine-tuning "
    spread = (f"one run (seed {seeds}; --seeds=0,1,2 gives mean ± std)"
              if len(results["seeds"]) == 1
              else f"mean ± sample std over {restarts}seeds {seeds}")
    lines = [f"# {results['title']}", "",
             f"Scale `{results['scale']}`; fine-tuning columns: the dev metric in percent (at "
             f"the best learning rate of the grid); all cells: {spread}."]
    if paper:
        lines.append("In parentheses: the paper's number (Devlin et al., 2018, BERT-base dev).")
    lines.append("")
    header = [grid.get("row_header", "Variant"), *results["columns"]]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * len(results["columns"])) + "|")
    for row in results["rows"]:
        cells = []
        for column in results["columns"]:
            text = format_cell(row["cells"][column])
            if column in paper.get(row["name"], {}):
                text += f" ({paper[row['name']][column]:g})"
            cells.append(text)
        lines.append("| " + " | ".join([row["name"], *cells]) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(grid, results: dict[str, Any], root) -> None:
    """results.json, table.md and the plots, from process 0 (every process calls this)."""
    from bertjax.train import multihost

    def write():
        (root / RESULTS_FILE).write_text(json.dumps(results, indent=2) + "\n")
        (root / "table.md").write_text(table_markdown(results, grid))
        plot_loss_curves(results, str(root / "loss_curves.png"))
        if grid.get("export_steps"):
            plot_steps(results, str(root / "accuracy_vs_steps.png"))

    multihost.write_from_main(write)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curves(results: dict[str, Any], path: str) -> None:
    """Pre-training loss against step, one line per pre-training variant (first seed)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in sorted(results["loss_curves"].items()):
        if points:
            ax.plot(*zip(*points), label=name)
    ax.set_xlabel("pre-training step")
    ax.set_ylabel("training loss")
    ax.set_title(f"Pre-training loss per variant ({results['table']}, scale {results['scale']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_steps(results: dict[str, Any], path: str) -> None:
    """Fine-tuned dev metric against pre-training steps, one line per pre-training and task."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    task_columns = [c for c in results["columns"]
                    if any("metric" in r["cells"][c] for r in results["rows"])]
    for pretraining in sorted({r["pretraining"] for r in results["rows"]}):
        rows = sorted((r for r in results["rows"] if r["pretraining"] == pretraining),
                      key=lambda r: r["step"])
        for column in task_columns:
            points = [(r["step"], r["cells"][column]["scale"] * r["cells"][column]["mean"])
                      for r in rows
                      if r["cells"][column]["n"]]
            if points and pretraining == RANDOM_WEIGHTS:  # a reference level, not a curve
                ax.axhline(points[0][1], color="gray", linestyle="--",
                           label=f"random weights: {column}")
            elif points:
                ax.plot(*zip(*points), marker="o", label=f"{pretraining}: {column}")
    ax.set_xlabel("pre-training steps")
    ax.set_ylabel("dev metric (%)")
    ax.set_title(results["title"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Command line


def load_grid(table: str, scale: str, sets: list[str]):
    """The grid config experiments/ablations/<table>.py:<scale>, with --set overrides."""
    if table not in TABLES:
        raise ConfigError(f"unknown table {table!r}; expected one of {', '.join(TABLES)}")
    if scale not in SCALES:
        raise ConfigError(f"--scale={scale} is not one of {' | '.join(SCALES)}")
    # The grids ship next to bertjax (experiments/ is installed with it), so the command works
    # from any directory.
    grids = os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments", "ablations")
    grid = cli.load_config(f"{os.path.join(grids, table)}.py:{scale}")
    for item in sets:
        apply_set(grid, item)
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


def define_flags() -> None:
    cli.define_distributed_flags()
    flags.DEFINE_enum("scale", "demo", SCALES, "paper | small | demo | test.")
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
        sys.exit(f"error: name one table ({', '.join(TABLES)}), e.g. "
                 "python -m bertjax.ablations table5 --scale=demo --workdir=runs/table5")
    workdir = cli.require(FLAGS.workdir, "--workdir", "runs/table5")
    import jax

    # The cells of a grid compile the same train and eval steps again and again (seeds,
    # variants of equal shape): compile each once, into the workdir.
    jax.config.update("jax_compilation_cache_dir", f"{workdir}/jax_cache")
    grid = load_grid(argv[1], FLAGS.scale, FLAGS.set)
    if FLAGS.random_weights:
        add_random_weights_row(grid)
    seeds = parse_seeds(FLAGS.seeds) if FLAGS.seeds else [int(s) for s in grid.seeds]
    tasks = [t for t in FLAGS.tasks.split(",") if t] if FLAGS.tasks else None
    if FLAGS.list:
        print(format_states(cell_states(grid, workdir, seeds, tasks)))
        return
    cli.initialize_distributed()  # a pod slice runs each cell on every host
    run_table(grid, workdir, seeds, tasks, log=functools.partial(print, flush=True))


if __name__ == "__main__":
    cli.run(main, define_flags)

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
short names (below) or any dotted config path, e.g. `optimizer.warmup_proportion=0.1,0.2`.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import itertools
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from absl import flags

from bertjax import cli
from bertjax.errors import ConfigError, TrainingError
from bertjax.train import multihost
from bertjax.train.workdir import DIVERGED_FILE, RESULTS_FILE

# Short grid names → the config fields that bertjax.finetune reads (experiments/glue.py).
GRID_KEYS = {
    "learning_rate": "optimizer.learning_rate",
    "batch_size": "train.batch_size",
    "num_epochs": "train.num_epochs",
    "warmup_proportion": "optimizer.warmup_proportion",
    "weight_decay": "optimizer.weight_decay",
    "max_seq_length": "max_seq_length",
    "hidden_dropout_prob": "model.hidden_dropout_prob",
    "attention_dropout_prob": "model.attention_dropout_prob",
}
NOT_METRICS = ("epoch",)  # keys of results.json "best" that are not dev metrics


@dataclasses.dataclass(frozen=True)
class Combination:
    """One point of the grid: ((key, value text), ...) in the order the grid names them."""

    items: tuple[tuple[str, str], ...]

    @property
    def name(self) -> str:
        """The run directory name, e.g. `learning_rate=2e-5,batch_size=16`."""
        return ",".join(f"{k}={v}" for k, v in self.items)


# ---------------------------------------------------------------------------------------------
# The grid


def config_path(key: str, config) -> str:
    """The dotted config field a grid key sets; raises ConfigError for an unknown key."""
    path = GRID_KEYS.get(key, key)
    node = config
    for part in path.split("."):
        if not hasattr(node, "keys") or part not in node:
            raise ConfigError(f"--grid: unknown key {key!r}; use one of {sorted(GRID_KEYS)} "
                              "or a dotted config path such as optimizer.b2")
        node = node[part]
    if hasattr(node, "keys"):
        raise ConfigError(f"--grid: {key!r} names a group of config fields, not one field")
    return path


def parse_grid(text: str, config) -> list[tuple[str, list[str]]]:
    """`'learning_rate=2e-5,3e-5 batch_size=16,32'` → [(key, [value text, ...]), ...].

    Every value is checked against its config field (set_value does the conversion).
    """
    grid, seen = [], set()
    for item in text.split():
        key, sep, values = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--grid: {item!r} is not key=value1,value2,...")
        if key in seen:
            raise ConfigError(f"--grid: key {key!r} is given twice")
        seen.add(key)
        config_path(key, config)
        parsed = [v for v in values.split(",") if v]
        if not parsed:
            raise ConfigError(f"--grid: key {key!r} has no values")
        if len(set(parsed)) != len(parsed):
            raise ConfigError(f"--grid: key {key!r} repeats a value: {values}")
        for value in parsed:
            if "/" in value or value in (".", ".."):
                raise ConfigError(f"--grid: value {value!r} of {key!r} cannot name a directory")
            set_value(config.copy_and_resolve_references(), key, value)
        grid.append((key, parsed))
    if not grid:
        raise ConfigError("--grid is empty; e.g. --grid='learning_rate=2e-5,3e-5 batch_size=32'")
    return grid


def combinations(grid: Sequence[tuple[str, Sequence[str]]]) -> list[Combination]:
    """Every combination (the cartesian product), the last key varying fastest."""
    keys = [k for k, _ in grid]
    return [Combination(tuple(zip(keys, values)))
            for values in itertools.product(*(v for _, v in grid))]


def set_value(config, key: str, text: str) -> None:
    """Sets grid key `key` of `config` (in place) from its text, typed like the field."""
    *parents, leaf = config_path(key, config).split(".")
    node = config
    for part in parents:
        node = node[part]
    current = node[leaf]
    if not isinstance(current, bool | int | float | str):
        raise ConfigError(f"--grid: {key!r} is a {type(current).__name__} field; only "
                          "numbers, booleans and strings can be searched")
    node[leaf] = cli.typed_like(current, text, f"--grid: {key}=")


def run_config(config, combination: Combination, seed: int):
    """A copy of `config` with the combination's values and the seed set."""
    config = config.copy_and_resolve_references()
    for key, text in combination.items:
        set_value(config, key, text)
    config.seed = seed
    return config


# ---------------------------------------------------------------------------------------------
# Statistics and summary files


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0.0 for a single value) of `values`."""
    values = np.asarray(values, np.float64)
    if values.size == 0:
        return math.nan, math.nan
    return float(values.mean()), float(values.std(ddof=1)) if values.size > 1 else 0.0


@dataclasses.dataclass
class Row:
    combination: Combination
    stats: dict[str, tuple[float, float]]  # metric → (mean, std)
    n: int  # finished runs
    diverged: int


def summarise(combos: Sequence[Combination], results: dict[str, list[dict[str, Any]]],
              diverged: dict[str, int]) -> tuple[list[Row], list[str]]:
    """Rows of per-combination statistics, and the metric names (columns) in a stable order.

    `results[combo.name]`: the `best` dict of every finished run of that combination.
    """
    metrics: list[str] = []
    for runs in results.values():
        for run in runs:
            metrics += [m for m in run if m not in NOT_METRICS and m not in metrics]
    rows = []
    for combo in combos:
        runs = results.get(combo.name, [])
        stats = {m: mean_std([r[m] for r in runs if m in r]) for m in metrics}
        rows.append(Row(combo, stats, len(runs), diverged.get(combo.name, 0)))
    return rows, metrics


def best_row(rows: Sequence[Row], primary: str) -> Row | None:
    """The row with the highest mean primary metric (the first one on ties); None if none ran."""
    candidates = [r for r in rows if r.n and not math.isnan(r.stats[primary][0])]
    return max(candidates, key=lambda r: r.stats[primary][0]) if candidates else None


def summary_csv(rows: Sequence[Row], metrics: Sequence[str]) -> str:
    """One line per combination: the grid values, `<metric>_mean`, `<metric>_std`, n, diverged."""
    keys = [k for k, _ in rows[0].combination.items]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*keys, *(f"{m}_{s}" for m in metrics for s in ("mean", "std")), "n",
                     "diverged"])
    for row in rows:
        stats = [repr(x) for m in metrics for x in row.stats[m]]
        writer.writerow([v for _, v in row.combination.items] + stats + [row.n, row.diverged])
    return out.getvalue()


def summary_markdown(rows: Sequence[Row], metrics: Sequence[str], primary: str, seeds: int,
                     title: str) -> str:
    """A Markdown table (mean ± std per metric); the best combination is in bold."""
    best = best_row(rows, primary)
    lines = [f"# {title}", ""]
    if best is None:
        lines += ["No run finished.", ""]
    else:
        mean, std = best.stats[primary]
        lines += [f"Best by mean dev {primary} over {best.n} seed(s): **{best.combination.name}**"
                  f" ({mean:.4f} ± {std:.4f}).", ""]
    lines.append(f"Mean ± sample std over {seeds} seed(s) of the best checkpoint of each run; "
                 "n = finished runs.")
    lines.append("")
    header = ["combination", *metrics, "n"]
    if any(r.diverged for r in rows):
        header.append("diverged")
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
    for row in rows:
        name = f"**{row.combination.name}**" if row is best else row.combination.name
        cells = [name] + [f"{m:.4f} ± {s:.4f}" if not math.isnan(m) else "–"
                          for m, s in (row.stats[k] for k in metrics)] + [str(row.n)]
        if "diverged" in header:
            cells.append(str(row.diverged))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Running the grid


def _canonical_config(config) -> Any:
    return json.loads(config.to_json_best_effort())


def _check_same_config(run_dir, config) -> None:
    """A finished run may be reused only if it ran with exactly this config."""
    stored = run_dir / "config.json"
    if not stored.exists():
        return
    old, new = json.loads(stored.read_text()), _canonical_config(config)
    if old != new:
        flat_old, flat_new = _flatten(old), _flatten(new)
        differ = sorted(k for k in flat_old.keys() | flat_new.keys()
                        if flat_old.get(k) != flat_new.get(k))
        raise ConfigError(f"{run_dir} finished with a different config (differs in "
                          f"{', '.join(differ[:5])}); use a new --workdir or delete that run")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): tree}


def run_grid(config, grid: str, seeds: int, workdir: str, log: Callable[[str], Any] = print,
             train_fn: Callable | None = None) -> dict[str, Any]:
    """Runs (or resumes) the whole grid and writes workdir/summary.{md,csv}.

    Returns {"best": combination name or None, "primary_metric", "ran", "skipped",
    "diverged", "rows": [Row]}. `train_fn(config, workdir, log)` defaults to
    bertjax.tasks.train_and_evaluate.
    """
    from etils import epath

    check = None  # a train_fn given by a test checks what it needs
    if train_fn is None:
        from bertjax import validate
        from bertjax.tasks import train_and_evaluate as train_fn

        check = validate.finetuning
    if seeds < 1:
        raise ConfigError(f"--seeds={seeds} must be at least 1")
    combos = combinations(parse_grid(grid, config))
    seed_list = [config.seed + i for i in range(seeds)]
    root = epath.Path(workdir)
    # Plan first: refuse to mix runs of another config before any compute is spent.
    plan = []
    for combo in combos:
        for seed in seed_list:
            run_dir = root / combo.name / f"seed_{seed}"
            cfg = run_config(config, combo, seed)
            if check:  # every combination's ranges and paths, before any run starts
                check(cfg, str(run_dir))
            done = (run_dir / RESULTS_FILE).exists() or (run_dir / DIVERGED_FILE).exists()
            if done:
                _check_same_config(run_dir, cfg)
            plan.append((combo, seed, run_dir, cfg, done))
    todo = sum(not done for *_, done in plan)
    log(f"grid: {len(combos)} combinations × {seeds} seeds = {len(plan)} runs; "
        f"{len(plan) - todo} already finished, {todo} to run")

    ran = skipped = 0
    for i, (combo, seed, run_dir, cfg, done) in enumerate(plan, 1):
        tag = f"[{i}/{len(plan)} {combo.name} seed {seed}]"
        if done:
            skipped += 1
            continue
        log(f"{tag} {'resuming' if run_dir.exists() else 'starting'} in {run_dir}")
        try:
            summary = train_fn(cfg, str(run_dir), log=lambda s, t=tag: log(f"{t} {s}"))
        except TrainingError as e:
            log(f"{tag} diverged: {e}")
            multihost.write_from_main(functools.partial(
                (run_dir / DIVERGED_FILE).write_text, json.dumps({"error": str(e)}) + "\n"))
            ran += 1
            continue
        if summary["status"] == "preempted":
            log(f"grid: preempted in {run_dir}; run the same command to continue")
            return {"best": None, "primary_metric": None, "ran": ran, "skipped": skipped,
                    "diverged": 0, "rows": [], "status": "preempted"}
        ran += 1
        primary = summary["primary_metric"]
        log(f"{tag} best {primary} {summary['best'][primary]:.4f}")

    results: dict[str, list[dict[str, Any]]] = {}
    diverged: dict[str, int] = {}
    primary = None
    for combo, _, run_dir, _, _ in plan:
        if (run_dir / DIVERGED_FILE).exists():
            diverged[combo.name] = diverged.get(combo.name, 0) + 1
            continue
        stored = json.loads((run_dir / RESULTS_FILE).read_text())
        primary = primary or stored["primary_metric"]
        results.setdefault(combo.name, []).append(stored["best"])
    rows, metrics = summarise(combos, results, diverged)
    best = best_row(rows, primary) if primary else None
    title = f"Fine-tuning grid: {config.task.family} {config.task.name}"

    def write_summary():
        (root / "summary.md").write_text(
            summary_markdown(rows, metrics, primary or "?", seeds, title))
        (root / "summary.csv").write_text(summary_csv(rows, metrics))

    multihost.write_from_main(write_summary)
    log(f"grid: ran {ran}, skipped {skipped} finished run(s); summary in "
        f"{root / 'summary.md'} and {root / 'summary.csv'}")
    if best is not None:
        mean, std = best.stats[primary]
        log(f"grid: best {best.combination.name}: {primary} {mean:.4f} ± {std:.4f} "
            f"(n={best.n})")
    return {"best": best.combination.name if best else None, "primary_metric": primary,
            "ran": ran, "skipped": skipped, "diverged": sum(diverged.values()), "rows": rows,
            "status": "done"}


def main(argv):
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}; put the grid in quotes: "
                 "--grid='learning_rate=2e-5,3e-5 batch_size=16,32'")
    config = cli.require(_CONFIG.value, "--config", "experiments/glue.py:mrpc")
    workdir = cli.require(_WORKDIR.value, "--workdir", "runs/mrpc_grid")
    grid = cli.require(_GRID.value, "--grid", "'learning_rate=2e-5,3e-5,5e-5'")
    cli.initialize_distributed()
    run_grid(config, grid, _SEEDS.value, workdir, log=functools.partial(print, flush=True))


if __name__ == "__main__":
    _CONFIG, _WORKDIR = cli.define_job_flags("experiments/glue.py:mrpc")
    _GRID = flags.DEFINE_string(
        "grid", None, "Space-separated key=v1,v2,... e.g. "
        "'learning_rate=2e-5,3e-5,5e-5 batch_size=16,32 num_epochs=2,3,4'.")
    _SEEDS = flags.DEFINE_integer("seeds", 5, "Runs per combination, seeds config.seed, "
                                  "config.seed+1, ...")
    cli.run(main)

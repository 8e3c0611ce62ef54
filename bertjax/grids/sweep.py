"""The fine-tuning grid (`python -m bertjax.finetune_grid`): every hyper-parameter combination
× several seeds, the paper's fine-tuning search.

Each cell is an ordinary fine-tuning run (`bertjax.tasks.train_and_evaluate`, same process,
one after another) in its own directory `workdir/<combination>/seed_<s>`, e.g.
`learning_rate=2e-5,batch_size=16,num_epochs=2/seed_3`; the seeds are config.seed,
config.seed + 1, ... Finished cells (results.json or diverged.json, cells.py) are skipped, and
reused only with the config they ran with (checked before any run starts). A preempted cell
stops the grid; the next invocation continues it.

The best combination is the one with the highest mean (over seeds) of the task's main dev
metric (`primary_metric` in results.json). `workdir/summary.md` and `workdir/summary.csv`
give, per combination, the mean and sample standard deviation of every dev metric of the best
checkpoint of each run, n (finished runs) and diverged runs (stats.py). Grid keys are short
names (GRID_KEYS) or any dotted config path, e.g. `optimizer.warmup_proportion=0.1,0.2`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any

from etils import epath

from bertjax.errors import ConfigError
from bertjax.grids import cells, overrides, stats
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


@dataclasses.dataclass(frozen=True)
class Combination:
    """One point of the grid: ((key, value text), ...) in the order the grid names them."""

    items: tuple[tuple[str, str], ...]

    @property
    def name(self) -> str:
        """The run directory name, e.g. `learning_rate=2e-5,batch_size=16`."""
        return ",".join(f"{k}={v}" for k, v in self.items)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of the grid: a combination and seed, its directory and config."""

    combination: Combination
    seed: int
    directory: epath.Path
    config: Any
    finished: bool  # when planned


def config_path(key: str, config) -> str:
    """The dotted config field a grid key sets; raises ConfigError for an unknown key."""
    path = GRID_KEYS.get(key, key)
    field = overrides.find_field(config, path)
    if field is None:
        raise ConfigError(f"--grid: unknown key {key!r}; use one of {sorted(GRID_KEYS)} "
                          "or a dotted config path such as optimizer.b2")
    node, leaf = field
    if hasattr(node[leaf], "keys"):
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
    node, leaf = overrides.find_field(config, config_path(key, config))
    if not isinstance(node[leaf], bool | int | float | str):
        raise ConfigError(f"--grid: {key!r} is a {type(node[leaf]).__name__} field; only "
                          "numbers, booleans and strings can be searched")
    overrides.set_from_text(node, leaf, text, f"--grid: {key}=")


def run_config(config, combination: Combination, seed: int):
    """A copy of `config` with the combination's values and the seed set."""
    config = config.copy_and_resolve_references()
    for key, text in combination.items:
        set_value(config, key, text)
    config.seed = seed
    return config


def plan(config, combos: Sequence[Combination], seeds: int, root: epath.Path,
         check: Callable | None) -> list[Cell]:
    """Every cell in run order. Refuses, before any compute is spent, to mix in runs of another
    config, and (with `check`) a combination whose ranges or paths are wrong."""
    planned = []
    for combo in combos:
        for seed in [config.seed + i for i in range(seeds)]:
            run_dir = root / combo.name / f"seed_{seed}"
            cfg = run_config(config, combo, seed)
            if check:  # every combination's ranges and paths, before any run starts
                check(cfg, str(run_dir))
            finished = cells.is_finished(run_dir)
            if finished:
                cells.check_same_config(run_dir, cfg)
            planned.append(Cell(combo, seed, run_dir, cfg, finished))
    return planned


def run_cells(planned: Sequence[Cell], train_fn: Callable | None,
              log: Callable[[str], Any]) -> tuple[str, int, int]:
    """Runs the unfinished cells in order: (status done | preempted, ran, skipped)."""
    ran = skipped = 0
    for i, cell in enumerate(planned, 1):
        tag = f"[{i}/{len(planned)} {cell.combination.name} seed {cell.seed}]"
        if cell.finished:
            skipped += 1
            continue
        cells.log_start(log, tag, cell.directory)
        summary = cells.finetune_cell(cell.config, str(cell.directory),
                                      log=lambda s, t=tag: log(f"{t} {s}"), train_fn=train_fn)
        if summary["status"] == "preempted":
            log(f"grid: preempted in {cell.directory}; run the same command to continue")
            return "preempted", ran, skipped
        ran += 1
        if summary["status"] != "diverged":
            primary = summary["primary_metric"]
            log(f"{tag} best {primary} {summary['best'][primary]:.4f}")
    return "done", ran, skipped


def summarise(planned: Sequence[Cell], combos: Sequence[Combination]):
    """(rows, metrics, primary metric or None, diverged count per combination) of the cells'
    results.json / diverged.json files."""
    results: dict[str, list[dict[str, Any]]] = {}
    diverged: dict[str, int] = {}
    primary = None
    for cell in planned:
        name = cell.combination.name
        if (cell.directory / DIVERGED_FILE).exists():
            diverged[name] = diverged.get(name, 0) + 1
            continue
        stored = json.loads((cell.directory / RESULTS_FILE).read_text())
        primary = primary or stored["primary_metric"]
        results.setdefault(name, []).append(stored["best"])
    rows, metrics = stats.summarise(combos, results, diverged)
    return rows, metrics, primary, diverged


def run_grid(config, grid: str, seeds: int, workdir: str, log: Callable[[str], Any] = print,
             train_fn: Callable | None = None) -> dict[str, Any]:
    """Runs (or resumes) the whole grid and writes workdir/summary.{md,csv}.

    Returns {"best": combination name or None, "primary_metric", "ran", "skipped",
    "diverged", "rows": [stats.Row], "status"}. `train_fn(config, workdir, log)` defaults to
    bertjax.tasks.train_and_evaluate.
    """
    check = None  # a train_fn given by a test checks what it needs
    if train_fn is None:
        from bertjax.tasks import checks

        check = checks.check
    if seeds < 1:
        raise ConfigError(f"--seeds={seeds} must be at least 1")
    combos = combinations(parse_grid(grid, config))
    root = epath.Path(workdir)
    planned = plan(config, combos, seeds, root, check)
    todo = sum(not cell.finished for cell in planned)
    log(f"grid: {len(combos)} combinations × {seeds} seeds = {len(planned)} runs; "
        f"{len(planned) - todo} already finished, {todo} to run")
    status, ran, skipped = run_cells(planned, train_fn, log)
    if status == "preempted":
        return {"best": None, "primary_metric": None, "ran": ran, "skipped": skipped,
                "diverged": 0, "rows": [], "status": "preempted"}

    rows, metrics, primary, diverged = summarise(planned, combos)
    best = stats.best_row(rows, primary) if primary else None
    title = f"Fine-tuning grid: {config.task.family} {config.task.name}"

    def write_summary():
        (root / "summary.md").write_text(
            stats.summary_markdown(rows, metrics, primary or "?", seeds, title))
        (root / "summary.csv").write_text(stats.summary_csv(rows, metrics))

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

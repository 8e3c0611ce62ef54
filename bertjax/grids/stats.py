"""The numbers of a grid and their files: mean ± sample std over seeds, the fine-tuning grid's
summary rows (summary.md, summary.csv), the ablation tables in the paper's layout (table.md),
and their plots (matplotlib, files only).

Every table is Markdown with the first column left-aligned and the others right-aligned; a
spread is the sample standard deviation (ddof=1; 0 for one run)."""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from collections.abc import Iterable, Sequence
from typing import Any

NOT_METRICS = ("epoch",)  # keys of results.json "best" that are not dev metrics


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0.0 for one value; NaN for none)."""
    import numpy as np

    array = np.asarray(values, np.float64)
    if array.size == 0:
        return math.nan, math.nan
    return float(array.mean()), float(array.std(ddof=1)) if array.size > 1 else 0.0


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """The lines of a Markdown table: the first column left-aligned, the others right."""
    return ["| " + " | ".join(header) + " |",
            "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


# ---------------------------------------------------------------------------------------------
# The fine-tuning grid (sweep.py): a row per hyper-parameter combination


@dataclasses.dataclass
class Row:
    combination: Any  # a sweep.Combination: .name, .items ((key, value text), ...)
    stats: dict[str, tuple[float, float]]  # metric → (mean, std)
    n: int  # finished runs
    diverged: int


def summarise(combos: Sequence[Any], results: dict[str, list[dict[str, Any]]],
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
    cells = []
    for row in rows:
        name = f"**{row.combination.name}**" if row is best else row.combination.name
        cells.append([name] + [f"{m:.4f} ± {s:.4f}" if not math.isnan(m) else "–"
                               for m, s in (row.stats[k] for k in metrics)] + [str(row.n)])
        if "diverged" in header:
            cells[-1].append(str(row.diverged))
    return "\n".join(lines + markdown_table(header, cells)) + "\n"


# ---------------------------------------------------------------------------------------------
# The ablation tables (ablations.py): the paper's layout


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
    rows = []
    for row in results["rows"]:
        cells = []
        for column in results["columns"]:
            text = format_cell(row["cells"][column])
            if column in paper.get(row["name"], {}):
                text += f" ({paper[row['name']][column]:g})"
            cells.append(text)
        rows.append([row["name"], *cells])
    header = [grid.get("row_header", "Variant"), *results["columns"]]
    return "\n".join(lines + markdown_table(header, rows)) + "\n"


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


def plot_steps(results: dict[str, Any], path: str, reference: str) -> None:
    """Fine-tuned dev metric against pre-training steps, one line per pre-training and task;
    the rows of pre-training `reference` (random weights) as a level, not a curve."""
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
            if points and pretraining == reference:
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

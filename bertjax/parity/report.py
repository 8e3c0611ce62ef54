"""The parity report: parity.md (the table), parity.json (every row's numbers) and
loss_vs_step.png (bertjax's and the reference's loss curves overlaid, one panel per row)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from etils import epath

from bertjax.parity.harness import SEED_T, Row, seed_band

FIRST = 50  # steps of the first, tighter tolerance
MARKDOWN = "parity.md"
JSON = "parity.json"
PLOT = "loss_vs_step.png"


def _num(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.2e}"


def summary(row: Row) -> dict[str, Any]:
    """The table's figures for one row (NaN where they do not apply)."""
    record: dict[str, Any] = {"job": row.job, "reference": row.reference, "steps": row.steps,
                              "tolerances": list(row.tolerances),
                              "param_tolerance": row.param_tolerance, "passed": row.passed(),
                              "note": row.note, "max_param_diff": row.max_param_diff()}
    if row.seeded:
        record.update(seeds=len(row.ours_seeds), windows=row.seed_windows,
                      welch_t=row.seed_t(), max_rel_loss_diff_first=math.nan,
                      max_rel_loss_diff_all=math.nan)
    else:
        record.update(max_rel_loss_diff_first=row.max_rel_diff(first=FIRST),
                      max_rel_loss_diff_all=row.max_rel_diff())
    return record


def markdown_table(rows: Sequence[Row]) -> str:
    """One line per row: steps, max |Δloss|/loss over the first 50 and all steps, max
    parameter Δ, verdict (seed rows: the largest Welch t of the sides over the windows)."""
    lines = [
        f"| job | reference | steps | max Δloss/loss, first {FIRST} | max Δloss/loss, all "
        "| max param Δ | tolerances | verdict |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    notes = []
    for row in rows:
        s = summary(row)
        if row.seeded:
            first = (f"{s['seeds']} masks a side, {s['windows']} batches"
                     if row.x_label == "batch" else
                     f"{s['seeds']} seeds a side, {s['windows']} windows of steps")
            every = "max \\|t\\| " + f"{max(abs(t) for t in s['welch_t']):.2f}"
            tolerance = f"Welch \\|t\\| ≤ {SEED_T:g}"
        else:
            first, every = _num(s["max_rel_loss_diff_first"]), _num(s["max_rel_loss_diff_all"])
            tolerance = f"{row.tolerances[0]:.0e} / {row.tolerances[1]:.0e}"
            if math.isfinite(row.param_tolerance):
                tolerance += f", params {row.param_tolerance:.0e}"
        mark = ""
        if row.note:
            notes.append(row.note)
            mark = f" [{len(notes)}]"
        verdict = "PASS" if s["passed"] else "FAIL"
        lines.append(f"| {row.job}{mark} | {row.reference} | {s['steps']} | {first} | {every} "
                     f"| {_num(s['max_param_diff'])} | {tolerance} | {verdict} |")
    text = "\n".join(lines) + "\n"
    if notes:
        text += "\n" + "\n".join(f"[{i}] {note}" for i, note in enumerate(notes, 1)) + "\n"
    return text


def plot(rows: Sequence[Row], path: epath.Path) -> None:
    """Loss against step, bertjax and the reference overlaid; one panel per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, max(len(rows), 1))
    nrows = max(1, math.ceil(len(rows) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.4 * nrows), squeeze=False)
    for ax in axes.flat[len(rows):]:
        ax.set_visible(False)
    for ax, row in zip(axes.flat, rows, strict=False):
        if row.seeded and row.x_label == "batch":
            for curves, name, color, shift in ((row.theirs_seeds, "reference", "tab:orange",
                                                0.1), (row.ours_seeds, "bertjax", "tab:blue",
                                                       -0.1)):
                draws = np.asarray(curves)
                ax.errorbar(np.arange(draws.shape[1]) + shift, draws.mean(0),
                            yerr=3 * draws.std(0, ddof=1) / np.sqrt(len(draws)), fmt="o",
                            color=color, label=f"{name} (mean of {len(draws)} draws ± 3 se)")
        elif row.seeded:
            for curves, name, color in ((row.theirs_seeds, "reference", "tab:orange"),
                                        (row.ours_seeds, "bertjax", "tab:blue")):
                mean, low, high = seed_band(curves)
                ax.plot(mean, color=color, label=f"{name} (mean of {len(curves)} seeds)")
                ax.fill_between(range(len(mean)), low, high, color=color, alpha=0.2)
        else:
            ax.plot(row.theirs["loss"], color="tab:orange", lw=3, alpha=0.6, label="reference")
            ax.plot(row.ours["loss"], color="tab:blue", lw=1, ls="--", label="bertjax")
        ax.set_title(("" if row.passed() else "FAIL: ") + row.job, fontsize=9)
        ax.set_xlabel(row.x_label)
        ax.set_ylabel("loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    with path.open("wb") as f:
        fig.savefig(f, dpi=110)
    plt.close(fig)


def _jsonable(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def write(rows: Sequence[Row], workdir: str | epath.Path, header: str = "") -> str:
    """Writes parity.md, parity.json and loss_vs_step.png into `workdir`; returns the table."""
    workdir = epath.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    table = markdown_table(rows)
    (workdir / MARKDOWN).write_text((header + "\n\n" if header else "") + table)
    records = [dict(summary(r), ours=r.ours, theirs=r.theirs, param_rel_diff=r.param_rel_diff,
                    ours_seeds=r.ours_seeds, theirs_seeds=r.theirs_seeds) for r in rows]
    (workdir / JSON).write_text(json.dumps(_jsonable(records), indent=1) + "\n")
    plot(rows, workdir / PLOT)
    return table

r"""Training parity against the reference implementation, as a report.

  python -m bertjax.parity --workdir=runs/parity
  python -m bertjax.parity --workdir=/tmp/parity --steps=50 --jobs=pretraining_phases

Runs every job of bertjax.parity.{pretraining,modern,finetuning,optimizers,paths} (or those named by
--jobs) for --steps steps on both sides and writes parity.md, parity.json and
loss_vs_step.png to --workdir (data files go under --workdir/data). Exit status 1 when a row
is out of tolerance.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable

from absl import flags

from bertjax import cli

ROW_MODULES = ("pretraining", "modern", "finetuning", "optimizers", "paths")


def define_flags() -> None:
    flags.DEFINE_string("workdir", None, "Directory for parity.md, parity.json, "
                        "loss_vs_step.png and the jobs' data files.")
    flags.DEFINE_integer("steps", 300, "Training steps per job on each side.", lower_bound=1)
    flags.DEFINE_string("jobs", None, "Comma-separated job names (default: all; an unknown "
                        "name lists them).")


def collect_jobs() -> dict[str, Callable]:
    """{job name: run(steps, workdir)} of every row module."""
    jobs: dict[str, Callable] = {}
    for name in ROW_MODULES:
        jobs.update(importlib.import_module(f"bertjax.parity.{name}").JOBS)
    return jobs


def main(FLAGS) -> None:
    from etils import epath

    from bertjax.errors import ConfigError
    from bertjax.parity import report

    workdir = epath.Path(cli.require(FLAGS.workdir, "--workdir", "runs/parity"))
    jobs = collect_jobs()
    names = [n for n in (FLAGS.jobs or "").split(",") if n] or list(jobs)
    unknown = [n for n in names if n not in jobs]
    if unknown:
        raise ConfigError(f"--jobs: unknown job(s) {', '.join(unknown)}; the jobs are "
                          f"{', '.join(jobs)}")
    rows, start = [], time.perf_counter()
    for name in names:
        began = time.perf_counter()
        print(f"{name}: {FLAGS.steps} steps per side ...", flush=True)
        new = jobs[name](FLAGS.steps, workdir / "data" / name)
        rows.extend(new)
        verdicts = ", ".join("PASS" if r.passed() else "FAIL" for r in new)
        print(f"{name}: {verdicts} ({time.perf_counter() - began:.0f} s)", flush=True)
        # The report so far, rewritten after every job: an interrupted run keeps its rows.
        header = (f"# Training parity\n\n`python -m bertjax.parity --steps={FLAGS.steps}`: "
                  f"{len(rows)} rows in {time.perf_counter() - start:.0f} s.")
        table = report.write(rows, workdir, header)
    print(table)
    print(f"Wrote {workdir / report.MARKDOWN}, {workdir / report.JSON} and "
          f"{workdir / report.PLOT}")
    failed = [r.job for r in rows if not r.passed()]
    if failed:
        sys.exit(f"error: {len(failed)} parity row(s) out of tolerance: {'; '.join(failed)}")


if __name__ == "__main__":
    cli.run_flags_command(main, define_flags)

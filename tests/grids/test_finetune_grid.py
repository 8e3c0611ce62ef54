"""bertjax.finetune_grid: grid parsing, statistics against NumPy, divergence handling, and a
real tiny grid (2 combinations × 2 seeds) with the tiny checkpoint of tests/finetune_task.py,
then resumed through the command line."""

import csv
import io
import json
import random

import finetune_task
import numpy as np
import pytest
from conftest import filler_sentence, run_python

from bertjax.errors import ConfigError, TrainingError
from bertjax.grids.stats import mean_std
from bertjax.grids.sweep import (
    combinations,
    parse_grid,
    run_config,
    run_grid,
)
from experiments.finetune_files import get_config

checkpoint = finetune_task.checkpoint  # the module-scoped tiny-checkpoint fixture


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------------------------------------
# Pure parts


def test_grid_keys_map_to_the_fields_finetune_reads():
    config = get_config("classification")
    grid = parse_grid("learning_rate=2e-5,3e-5,5e-5 batch_size=16,32 num_epochs=2,3,4 "
                      "optimizer.warmup_proportion=0.2", config)
    combos = combinations(grid)
    assert len(combos) == 3 * 2 * 3 * 1
    assert len({c.name for c in combos}) == len(combos)
    assert combos[0].name == ("learning_rate=2e-5,batch_size=16,num_epochs=2,"
                              "optimizer.warmup_proportion=0.2")
    cfg = run_config(config, combos[-1], seed=7)
    assert cfg.optimizer.learning_rate == 5e-5 and isinstance(cfg.optimizer.learning_rate, float)
    assert cfg.train.batch_size == 32 and isinstance(cfg.train.batch_size, int)
    assert cfg.train.num_epochs == 4.0 and cfg.optimizer.warmup_proportion == 0.2
    assert cfg.seed == 7
    assert config.train.batch_size == 32 and config.seed == 0  # the base config is untouched
    assert config.optimizer.learning_rate == 2e-5


@pytest.mark.parametrize("grid, message", [
    ("lr=1e-5", "unknown key 'lr'"),
    ("learning_rate", "not key=value1,value2"),
    ("batch_size=16,x", "batch_size='x' is not a valid int"),
    ("batch_size=16 batch_size=32", "given twice"),
    ("batch_size=", "has no values"),
    ("num_epochs=2,2", "repeats a value"),
    ("optimizer=1", "names a group"),
    ("", "--grid is empty"),
])
def test_bad_grid_is_one_line_error(grid, message):
    with pytest.raises(ConfigError, match=message):
        parse_grid(grid, get_config("classification"))


def test_mean_std_is_numpy_sample_std():
    values = [0.5, 0.75, 0.8, 0.61]
    mean, std = mean_std(values)
    assert mean == pytest.approx(np.mean(values)) and std == pytest.approx(np.std(values, ddof=1))
    assert mean_std([0.3]) == (0.3, 0.0)


def test_stub_grid_counts_divergence_and_selects_by_mean(tmp_path):
    """A stub trainer: metrics are a known function of (lr, seed); lr=1 diverges."""
    calls = []

    def fake_train(config, workdir, log):
        from etils import epath

        lr, seed = config.optimizer.learning_rate, config.seed
        calls.append((lr, seed))
        path = epath.Path(workdir)
        path.mkdir(parents=True)
        (path / "run_config.json").write_text(config.to_json_best_effort())
        if lr == 1.0:
            raise TrainingError("loss is nan at step 3; lower config.optimizer.learning_rate")
        acc = {0.1: 0.6, 0.01: 0.7}[lr] + 0.05 * seed
        (path / "results.json").write_text(json.dumps({
            "primary_metric": "accuracy", "best": {"accuracy": acc, "f1": acc / 2, "epoch": 1}}))
        return {"status": "done", "primary_metric": "accuracy", "best": {"accuracy": acc}}

    config = get_config("classification")
    out = run_grid(config, "learning_rate=0.1,0.01,1.0", 3, str(tmp_path), log=lambda _: None,
                   train_fn=fake_train)
    assert out["best"] == "learning_rate=0.01" and out["diverged"] == 3 and out["ran"] == 9
    rows = {r["learning_rate"]: r for r in read_csv(tmp_path / "summary.csv")}
    accs = 0.7 + 0.05 * np.arange(3)
    assert float(rows["0.01"]["accuracy_mean"]) == pytest.approx(np.mean(accs))
    assert float(rows["0.01"]["f1_std"]) == pytest.approx(np.std(accs / 2, ddof=1))
    assert "epoch_mean" not in rows["0.01"]
    assert (rows["1.0"]["n"], rows["1.0"]["diverged"]) == ("0", "3")
    assert "**learning_rate=0.01**" in (tmp_path / "summary.md").read_text()
    # Diverged runs are finished too: a rerun trains nothing.
    calls.clear()
    out = run_grid(config, "learning_rate=0.1,0.01,1.0", 3, str(tmp_path), log=lambda _: None,
                   train_fn=fake_train)
    assert calls == [] and out["skipped"] == 9


def test_other_errors_stop_the_grid(tmp_path):
    def broken(config, workdir, log):
        raise ConfigError("config.init_checkpoint is empty")

    with pytest.raises(ConfigError, match="init_checkpoint is empty"):
        run_grid(get_config("classification"), "num_epochs=1,2", 1, str(tmp_path),
                 log=lambda _: None, train_fn=broken)


# ---------------------------------------------------------------------------------------------
# A real tiny grid


def _write_task(directory):
    rng = random.Random(3)
    for name, n in (("train", 64), ("dev", 32)):
        with open(directory / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                y = rng.random() < 0.5
                f.write(json.dumps({"text": filler_sentence(rng, "good" if y else "bad"),
                                    "label": int(y)}) + "\n")


@pytest.mark.slow
def test_tiny_grid_summary_and_resume(checkpoint, tmp_path):
    _write_task(tmp_path)
    overrides = {
        "init_checkpoint": checkpoint, "data.train": str(tmp_path / "train.jsonl"),
        "data.validation": str(tmp_path / "dev.jsonl"), "max_seq_length": 32,
        "min_bucket_length": 32, "train.batch_size": 16, "eval.batch_size": 32,
        "log_every_steps": 1000,
    }
    config = get_config("classification")
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node[p]
        node[leaf] = value
    grid, workdir = "learning_rate=1e-3 num_epochs=1,2", tmp_path / "grid"
    out = run_grid(config, grid, 2, str(workdir), log=lambda _: None)
    assert (out["ran"], out["skipped"]) == (4, 0)

    combos = ["learning_rate=1e-3,num_epochs=1", "learning_rate=1e-3,num_epochs=2"]
    runs = {c: [json.loads((workdir / c / f"seed_{s}" / "results.json").read_text())["best"]
                for s in (0, 1)] for c in combos}
    rows = read_csv(workdir / "summary.csv")
    assert [(r["learning_rate"], r["num_epochs"], r["n"]) for r in rows] == [
        ("1e-3", "1", "2"), ("1e-3", "2", "2")]
    markdown = (workdir / "summary.md").read_text()
    means = {}
    for combo, row in zip(combos, rows):
        for metric in ("accuracy", "f1", "matthews_corrcoef"):
            values = [r[metric] for r in runs[combo]]
            mean, std = float(row[f"{metric}_mean"]), float(row[f"{metric}_std"])
            assert mean == pytest.approx(np.mean(values), abs=1e-12)
            assert std == pytest.approx(np.std(values, ddof=1), abs=1e-12)
            assert f"{np.mean(values):.4f} ± {np.std(values, ddof=1):.4f}" in markdown
        means[combo] = np.mean([r["accuracy"] for r in runs[combo]])
    best = max(combos, key=lambda c: means[c])  # first one on ties, like the runner
    assert out["best"] == best and f"| **{best}** |" in markdown
    table = [line for line in markdown.splitlines() if "num_epochs=" in line and "|" in line]
    assert len(table) == 2 and "num_epochs=1" in table[0] and "num_epochs=2" in table[1]

    # Interrupt one run (results.json never written), then resume through the command line:
    # only that run trains again, the others are untouched.
    redo = workdir / combos[1] / "seed_1"
    before = runs[combos[1]][1]
    (redo / "results.json").unlink()
    untouched = {p: p.stat().st_mtime_ns for p in workdir.glob("*/seed_*/results.json")}
    result = run_python([
        "-m", "bertjax.finetune_grid", "--config=experiments/finetune_files.py:classification",
        f"--workdir={workdir}", f"--grid={grid}", "--seeds", "2",
        *(f"--config.{k}={v}" for k, v in overrides.items())], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ran 1, skipped 3" in result.stdout
    assert {p: p.stat().st_mtime_ns for p in untouched} == untouched
    after = json.loads((redo / "results.json").read_text())["best"]
    assert after["accuracy"] == pytest.approx(before["accuracy"])  # seeded: same run again

    # Reusing the directory with another config is refused before anything runs.
    config.optimizer.weight_decay = 0.0
    with pytest.raises(ConfigError, match="differs in optimizer.weight_decay"):
        run_grid(config, grid, 2, str(workdir), log=lambda _: None)
    assert list(csv.reader(io.StringIO((workdir / "summary.csv").read_text())))[0][:2] == [
        "learning_rate", "num_epochs"]

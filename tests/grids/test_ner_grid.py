"""bertjax.finetune_grid on the token-classification config as it is
(experiments/ner.py:conll2003): a tiny real grid of 2 learning rates on generated CoNLL-2003
files, its summary checked against each run's results.json."""

import csv
import json

import numpy as np
import pytest
import tagging_data as td

from bertjax import cli
from bertjax.grids.sweep import run_grid
from bertjax.tasks.tagging import schemes


@pytest.mark.slow
@pytest.mark.extended
def test_finetune_grid_runs_the_ner_config(tmp_path):
    checkpoint = td.write_checkpoint(tmp_path, max_positions=32)
    for name, seed, n in (("eng.train", 0, 64), ("eng.testa", 1, 32), ("eng.testb", 2, 16)):
        data = [(w, schemes.convert(t, "iob2", "iob1")) for w, t in td.dataset(seed, n)]
        td.write_conll(tmp_path / name, data, docs_every=10)
    config = cli.load_config("experiments/ner.py:conll2003")
    config.init_checkpoint, config.data.dir = checkpoint, str(tmp_path)
    config.max_seq_length = config.min_bucket_length = 32  # one shape: few compiles
    config.data.stride = 8
    config.train.batch_size, config.eval.batch_size, config.log_every_steps = 16, 16, 1000
    config.train.num_epochs = 1
    workdir = tmp_path / "grid"
    out = run_grid(config, "learning_rate=1e-4,3e-3", 1, str(workdir), log=lambda _: None)
    assert (out["ran"], out["skipped"], out["diverged"]) == (2, 0, 0)
    assert out["primary_metric"] == "f1"

    combos = ["learning_rate=1e-4", "learning_rate=3e-3"]
    best = {c: json.loads((workdir / c / "seed_0" / "results.json").read_text())["best"]
            for c in combos}
    with open(workdir / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["learning_rate"], r["n"]) for r in rows] == [("1e-4", "1"), ("3e-3", "1")]
    for combo, row in zip(combos, rows):
        for metric in ("f1", "precision", "recall", "accuracy", "PER_f1", "LOC_f1", "ORG_f1"):
            assert float(row[f"{metric}_mean"]) == pytest.approx(best[combo][metric], abs=1e-12)
    assert out["best"] == max(combos, key=lambda c: best[c]["f1"])  # first one on ties
    assert np.isfinite([best[c]["f1"] for c in combos]).all()
    markdown = (workdir / "summary.md").read_text()
    assert "token_classification conll2003" in markdown and f"| **{out['best']}** |" in markdown

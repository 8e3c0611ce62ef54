"""GLUE leaderboard submission files: one `<TASK>.tsv` per test set (CoLA.tsv, SST-2.tsv,
MRPC.tsv, STS-B.tsv, QQP.tsv, MNLI-m.tsv, MNLI-mm.tsv, QNLI.tsv, RTE.tsv, WNLI.tsv), each
with the header `index<TAB>prediction` and one row per test example in index order. Labels
are written as the server expects them: class names for MNLI / QNLI / RTE
("entailment", ...), 0/1 for the binary tasks, a score in [0, 5] for STS-B."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bertjax import paths

STSB_RANGE = (0.0, 5.0)


def format_predictions(predictions: np.ndarray, label_names: Sequence[str]) -> list[str]:
    """Class ids → label names; regression scores (label_names empty) → clipped "%.3f"."""
    predictions = np.asarray(predictions)
    if not label_names:
        return [f"{x:.3f}" for x in np.clip(predictions.astype(np.float64), *STSB_RANGE)]
    return [label_names[int(i)] for i in predictions]


def write_submission(directory: str, stem: str, indices: Sequence[str],
                     predictions: np.ndarray, label_names: Sequence[str]) -> str:
    """Writes `directory/<stem>.tsv`; returns its path."""
    if len(indices) != len(predictions):
        raise ValueError(f"{stem}: {len(indices)} indices but {len(predictions)} predictions")
    paths.makedirs(directory)
    path = paths.join(directory, f"{stem}.tsv")
    rows = zip(indices, format_predictions(predictions, label_names))
    with paths.open(path, "w", encoding="utf-8") as f:
        f.write("index\tprediction\n")
        f.writelines(f"{index}\t{value}\n" for index, value in rows)
    return path

"""The official GLUE / SWAG metrics, in NumPy (no scikit-learn or SciPy at run time).

Every function takes host arrays of equal length: `labels` [n], `predictions` [n] (class ids,
or floats for the regression metrics). tests/tasks/classification/test_tasks_metrics.py checks
each one against scikit-learn / SciPy.
"""

from __future__ import annotations

import numpy as np


def _pair(labels, predictions) -> tuple[np.ndarray, np.ndarray]:
    labels, predictions = np.asarray(labels), np.asarray(predictions)
    if labels.shape != predictions.shape or labels.ndim != 1:
        raise ValueError(
            f"labels {labels.shape} and predictions {predictions.shape} must be equal 1-D shapes"
        )
    return labels, predictions


def accuracy(labels, predictions) -> float:
    labels, predictions = _pair(labels, predictions)
    return float(np.mean(labels == predictions)) if labels.size else 0.0


def f1(labels, predictions, positive: int = 1) -> float:
    """Binary F1 of class `positive` (MRPC, QQP); 0.0 when precision + recall is 0."""
    labels, predictions = _pair(labels, predictions)
    tp = np.sum((predictions == positive) & (labels == positive))
    fp = np.sum((predictions == positive) & (labels != positive))
    fn = np.sum((predictions != positive) & (labels == positive))
    denominator = 2 * tp + fp + fn
    return float(2 * tp / denominator) if denominator else 0.0


def matthews_corrcoef(labels, predictions) -> float:
    """Matthews correlation (CoLA), the multi-class form of Gorodkin (2004); 0.0 if undefined."""
    labels, predictions = _pair(labels, predictions)
    classes, encoded = np.unique(np.concatenate([labels, predictions]), return_inverse=True)
    k, n = len(classes), labels.size
    confusion = np.zeros((k, k), np.float64)
    np.add.at(confusion, (encoded[:n], encoded[n:]), 1.0)
    true_counts, pred_counts = confusion.sum(axis=1), confusion.sum(axis=0)
    correct, total = np.trace(confusion), confusion.sum()
    numerator = correct * total - true_counts @ pred_counts
    denominator = np.sqrt(
        (total**2 - pred_counts @ pred_counts) * (total**2 - true_counts @ true_counts)
    )
    return float(numerator / denominator) if denominator else 0.0


def pearson(labels, predictions) -> float:
    labels, predictions = _pair(labels, predictions)
    x = labels.astype(np.float64) - labels.mean()
    y = predictions.astype(np.float64) - predictions.mean()
    denominator = np.sqrt(np.sum(x * x) * np.sum(y * y))
    return float(np.sum(x * y) / denominator) if denominator else 0.0


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their mean rank (as Spearman's rho requires)."""
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    # Each run of equal values shares the mean of the positions it spans.
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], x.size]
    mean_rank = (starts + ends + 1) / 2.0
    ranks = np.empty(x.size, np.float64)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


def spearman(labels, predictions) -> float:
    labels, predictions = _pair(labels, predictions)
    return pearson(_average_ranks(labels), _average_ranks(predictions))


METRICS = {
    "accuracy": accuracy,
    "f1": f1,
    "matthews_corrcoef": matthews_corrcoef,
    "pearson": pearson,
    "spearman": spearman,
}


def compute(names, labels, predictions, prefix: str = "") -> dict[str, float]:
    """{prefix + name: value} for each metric in `names`."""
    return {prefix + name: METRICS[name](labels, predictions) for name in names}

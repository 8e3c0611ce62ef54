"""Every official metric against scikit-learn / SciPy on random predictions."""

import numpy as np
import pytest
import scipy.stats
from sklearn import metrics as skm

from bertjax.tasks.classification import metrics


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("num_classes", [2, 3, 5])
def test_classification_metrics_match_sklearn(seed, num_classes):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 300))
    labels = rng.integers(0, num_classes, n)
    predictions = np.where(rng.random(n) < 0.6, labels, rng.integers(0, num_classes, n))
    assert metrics.accuracy(labels, predictions) == pytest.approx(
        skm.accuracy_score(labels, predictions))
    assert metrics.matthews_corrcoef(labels, predictions) == pytest.approx(
        skm.matthews_corrcoef(labels, predictions), abs=1e-12)
    if num_classes == 2:
        assert metrics.f1(labels, predictions) == pytest.approx(skm.f1_score(labels, predictions))


def test_degenerate_cases_match_sklearn():
    ones, zeros = np.ones(10, int), np.zeros(10, int)
    # All-one-class predictions: MCC undefined (0 by convention), F1 0 when nothing positive.
    assert metrics.matthews_corrcoef(ones, ones) == skm.matthews_corrcoef(ones, ones)
    assert metrics.matthews_corrcoef(np.r_[ones, zeros], np.r_[ones, ones]) == pytest.approx(
        skm.matthews_corrcoef(np.r_[ones, zeros], np.r_[ones, ones]))
    assert metrics.f1(zeros, zeros) == skm.f1_score(zeros, zeros, zero_division=0)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ties", [False, True])
def test_correlations_match_scipy(seed, ties):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 400))
    labels = rng.uniform(0, 5, n)
    predictions = labels + rng.normal(0, 1.5, n)
    if ties:  # STS-B gold scores are multiples of 0.2: many ties
        labels, predictions = np.round(labels * 5) / 5, np.round(predictions)
    assert metrics.pearson(labels, predictions) == pytest.approx(
        scipy.stats.pearsonr(labels, predictions)[0], abs=1e-10)
    assert metrics.spearman(labels, predictions) == pytest.approx(
        scipy.stats.spearmanr(labels, predictions)[0], abs=1e-10)


def test_mnli_matched_and_mismatched_prefixes():
    rng = np.random.default_rng(0)
    m_labels, mm_labels = rng.integers(0, 3, 50), rng.integers(0, 3, 70)
    m_pred, mm_pred = rng.integers(0, 3, 50), rng.integers(0, 3, 70)
    out = {**metrics.compute(["accuracy"], m_labels, m_pred, prefix="matched_"),
           **metrics.compute(["accuracy"], mm_labels, mm_pred, prefix="mismatched_")}
    assert out["matched_accuracy"] == pytest.approx(skm.accuracy_score(m_labels, m_pred))
    assert out["mismatched_accuracy"] == pytest.approx(skm.accuracy_score(mm_labels, mm_pred))


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="labels"):
        metrics.accuracy([1, 0], [1])


def test_one_class_for_every_example_is_warned(caplog):
    """A run that predicts one class (or no entity) for every dev example says so; mixed
    predictions say nothing."""
    import logging
    import types

    from bertjax.tasks import get_task
    from experiments.finetune_files import get_config as files_config
    from experiments.ner import get_config as ner_config

    task = get_task(files_config("classification"))
    task._declare("classification", ("neg", "pos"), ("accuracy",))
    features = types.SimpleNamespace(labels=np.array([0, 1, 1, 0]))
    with caplog.at_level(logging.WARNING):
        task.metrics({"prediction": np.array([1, 1, 1, 1])}, features, "dev")
    assert "dev: every example is predicted pos" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert task.metrics({"prediction": np.array([0, 1, 1, 1])}, features,
                            "dev")["accuracy"] == 0.75
    assert caplog.text == ""

    tagger = get_task(ner_config("files"))
    tagger._declare(("O", "B-PER", "I-PER"))
    gold = [["B-PER", "I-PER", "O"], ["O", "O"]]
    for predicted, warned in (([["O"] * 3, ["O"] * 2], True),
                              ([["B-PER", "O", "O"], ["O", "O"]], False)):
        tagger.sentence_tags = lambda p, f, out=predicted: (gold, out)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            tagger.metrics({}, None, "dev")
        assert ("dev: no entity is predicted (its tags hold 1)" in caplog.text) == warned

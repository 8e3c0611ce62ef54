"""The fidelity verdict: two sides' scores over seeds compared as distributions, their means
and their spreads.

A side is a list of one score per seed (a family's dev metric). Two tests, each at the 5%
level, two sided:
  means: Welch's t-test on the difference less a floor of 0.005 · scale (half a point), so
    that seeds with next to no spread do not demand identical numbers;
  spreads: the variance-ratio F-test, and the Brown–Forsythe test (Levene's, centred on the
    medians: robust where a seed or two fall apart); bertjax's spread counts as wider when
    either tells the variances apart, bertjax's sd is the larger by more than the floor.
A row also "leans" when neither test fires but bertjax's mean is below transformers' by more
than half transformers' sd (and the floor), or bertjax's sd is over twice transformers' (taken
as at least the floor): too few seeds to prove a difference, but a shape to explain.

Verdicts: "worse" / "better" (the means), "wider" (the spreads; with "worse": "worse, wider"),
"leans", "within"; "n/a (1 seed)". Worse or wider rows fail `make fidelity`.
"""

from __future__ import annotations

import dataclasses
import math

ALPHA = 0.05
FLOOR = 0.005  # half a point of a [0, 1] metric, times the row's scale


def summary(values: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation; 0 for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


@dataclasses.dataclass(frozen=True)
class Comparison:
    verdict: str
    means_p: float  # Welch, on the difference less the floor (1.0 inside the floor)
    sd_ratio: float  # bertjax's sd / transformers' (inf where theirs is 0)
    variance_p: float  # the variance-ratio F-test
    levene_p: float  # Brown–Forsythe
    leans: tuple[str, ...] = ()  # "mean" and / or "spread"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def welch_p(ours: list[float], theirs: list[float], floor: float) -> float:
    """Two-sided p of Welch's t-test of the means, on |difference| less `floor`."""
    from scipy import stats

    (m1, s1), (m2, s2) = summary(ours), summary(theirs)
    excess = abs(m1 - m2) - floor
    if excess <= 0:
        return 1.0
    v1, v2 = s1 ** 2 / len(ours), s2 ** 2 / len(theirs)
    if v1 + v2 == 0:
        return 0.0
    dof = (v1 + v2) ** 2 / (v1 ** 2 / (len(ours) - 1) + v2 ** 2 / (len(theirs) - 1))
    return float(2 * stats.t.sf(excess / math.sqrt(v1 + v2), dof))


def variance_ratio_p(ours: list[float], theirs: list[float]) -> float:
    """Two-sided p of the F-test of equal variances."""
    from scipy import stats

    (_, s1), (_, s2) = summary(ours), summary(theirs)
    if s1 == s2:
        return 1.0
    if s1 == 0 or s2 == 0:
        return 0.0
    f = s1 ** 2 / s2 ** 2
    d1, d2 = len(ours) - 1, len(theirs) - 1
    return float(min(1.0, 2 * min(stats.f.cdf(f, d1, d2), stats.f.sf(f, d1, d2))))


def levene_p(ours: list[float], theirs: list[float]) -> float:
    """p of the Brown–Forsythe test (Levene's, median-centred) of equal spreads."""
    from scipy import stats

    if len(set(ours)) < 2 and len(set(theirs)) < 2:
        return 1.0
    return float(stats.levene(ours, theirs, center="median").pvalue)


def compare(ours: list[float], theirs: list[float], scale: float = 1.0) -> Comparison:
    """bertjax's scores `ours` against transformers' `theirs` (one per seed); `scale`: 1 for
    metrics in [0, 1], 100 for percentages (SQuAD's F1)."""
    if min(len(ours), len(theirs)) < 2:
        return Comparison("n/a (1 seed)", math.nan, math.nan, math.nan, math.nan)
    floor = FLOOR * scale
    (m1, s1), (m2, s2) = summary(ours), summary(theirs)
    means_p = welch_p(ours, theirs, floor)
    variance_p, spread_p = variance_ratio_p(ours, theirs), levene_p(ours, theirs)
    verdicts = []
    if means_p < ALPHA:
        verdicts.append("better" if m1 > m2 else "worse")
    if s1 > s2 + floor and min(variance_p, spread_p) < ALPHA:
        verdicts.append("wider")
    leans = []
    if m2 - m1 > max(0.5 * s2, floor):
        leans.append("mean")
    if s1 > 2 * max(s2, floor):
        leans.append("spread")
    if verdicts == ["better", "wider"]:
        verdicts = ["wider"]
    verdict = ", ".join(verdicts) or ("leans" if leans else "within")
    ratio = s1 / s2 if s2 else (math.inf if s1 else 1.0)
    return Comparison(verdict, means_p, ratio, variance_p, spread_p, tuple(leans))


def fails(verdict: str) -> bool:
    """Whether a row's verdict fails the harness (worse or wider)."""
    return "worse" in verdict or "wider" in verdict

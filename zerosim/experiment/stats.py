"""The experiment's statistics: intervals of a mean score and paired comparisons between arms, at the levels
the data has.

An arm's scores are a seeds × questions matrix (one row per training seed, the same questions in every row).

- One seed: the interval resamples questions (scipy's percentile bootstrap); it holds the question sample's
  variance only.
- Two or more seeds: the interval resamples seeds, then questions — each replicate draws the rows and the
  columns with replacement, independently (a two-level bootstrap of the crossed seeds × questions design) —
  so it holds training's own variance too. scipy's bootstrap resamples one axis; the replicate indices here
  are drawn with numpy's ``Generator`` and the interval is the replicates' percentiles.
- A rate of 0 or 1 (every score 0, or every score 1) gets the exact binomial (Clopper-Pearson) bound of
  scipy's ``binomtest``, never a zero-width interval: 0 of 128 is "at most 2.8%", not "exactly 0".

A paired comparison resamples the questions once for both arms (the same questions), and each arm's seeds on
their own (different training runs). Its ratio is given only where no replicate of the reference's mean is 0;
otherwise the ratio is marked unreliable and the difference stands for it. An arm that scored 0 (or 1) on
every question is compared through its exact bound and the reference's interval (never "0.0% [0.0, 0.0]"). ``detectable`` is the smallest
difference the comparison would find at 80% power (two-sided, at the interval's level): ``(z_{1-a/2} + z_0.8)``
standard errors of the difference.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

POWER = 0.8


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    levels: str  # what the interval resamples: "questions", "seeds x questions", or "exact binomial"


def _rate_bound(scores: np.ndarray, confidence: float) -> Interval | None:
    """The exact binomial interval when every score is 0 or every score is 1; else None."""
    from scipy.stats import binomtest

    first = scores.flat[0]
    if first not in (0.0, 1.0) or not np.all(scores == first):
        return None
    n = scores.size
    ci = binomtest(int(first) * n, n).proportion_ci(confidence_level=confidence, method="exact")
    return Interval(float(first), float(ci.low), float(ci.high), "exact binomial")


def _two_level(matrix: np.ndarray, seeds: np.ndarray, questions: np.ndarray) -> np.ndarray:
    """Each replicate's mean over the drawn seeds (rows) and questions (columns)."""
    return matrix[seeds[:, :, None], questions[:, None, :]].mean(axis=(1, 2))


def bootstrap_mean(values, *, confidence: float, resamples: int, seed: int) -> tuple[float, float, float]:
    """Mean and its percentile bootstrap interval over the values (scipy)."""
    from scipy.stats import bootstrap

    x = np.asarray(values, dtype=float)
    mean = float(x.mean())
    if len(x) < 2 or np.all(x == x[0]):
        return mean, mean, mean
    res = bootstrap(
        (x,), np.mean, confidence_level=confidence, n_resamples=resamples, method="percentile",
        random_state=np.random.default_rng(seed),
    )  # fmt: skip
    return mean, float(res.confidence_interval.low), float(res.confidence_interval.high)


def mean_interval(scores, *, confidence: float, resamples: int, seed: int) -> Interval:
    """The mean of a seeds × questions matrix (or one seed's vector) and its interval (see the module)."""
    x = np.atleast_2d(np.asarray(scores, dtype=float))
    bound = _rate_bound(x, confidence)
    if bound is not None:
        return bound
    if x.shape[0] == 1:
        mean, low, high = bootstrap_mean(x[0], confidence=confidence, resamples=resamples, seed=seed)
        return Interval(mean, low, high, "questions")
    rng = np.random.default_rng(seed)
    s, q = x.shape
    reps = _two_level(x, rng.integers(0, s, (resamples, s)), rng.integers(0, q, (resamples, q)))
    alpha = 1 - confidence
    low, high = np.quantile(reps, [alpha / 2, 1 - alpha / 2])
    return Interval(float(x.mean()), float(low), float(high), "seeds x questions")


def compare(a, b, *, confidence: float, resamples: int, seed: int) -> dict[str, Any]:
    """Arm ``a`` against reference ``b`` (seeds × questions each, the same questions in the same order):
    ``diff`` (a − b) and ``ratio`` (a / b) with their intervals, the levels they resample, whether the ratio is
    reliable (no replicate of b's mean is 0), and the smallest difference detectable at 80% power."""
    from scipy.stats import norm

    a2, b2 = np.atleast_2d(np.asarray(a, dtype=float)), np.atleast_2d(np.asarray(b, dtype=float))
    if a2.shape[1] != b2.shape[1]:
        raise ValueError(f"paired arms need the same questions: {a2.shape[1]} against {b2.shape[1]}")
    out: dict[str, Any] = {"diff": float(a2.mean() - b2.mean())}
    alpha = 1 - confidence
    if _rate_bound(a2, confidence) is not None and b2.mean() > 0:
        return {**out, **_against_a_constant_arm(a2, b2, confidence, resamples, seed)}
    if a2.shape[0] == 1 and b2.shape[0] == 1:
        out["levels"] = "questions"
        if np.all(a2 == b2):  # identical answers: nothing varies
            diffs = np.zeros(1)
            ratios = np.ones(1) if b2.mean() > 0 else np.full(1, np.nan)
        else:
            rng = np.random.default_rng(seed)
            diffs, ratios = (
                _paired_replicates(stat, a2[0], b2[0], confidence, resamples, rng) for stat in (_diff, _ratio)
            )
    else:
        out["levels"] = "seeds x questions"
        rng = np.random.default_rng(seed)
        q = a2.shape[1]
        questions = rng.integers(0, q, (resamples, q))
        ra = _two_level(a2, rng.integers(0, a2.shape[0], (resamples, a2.shape[0])), questions)
        rb = _two_level(b2, rng.integers(0, b2.shape[0], (resamples, b2.shape[0])), questions)
        diffs = ra - rb
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios = np.where(rb > 0, ra / np.where(rb > 0, rb, 1), np.nan)
    out["diff_low"], out["diff_high"] = (float(v) for v in np.quantile(diffs, [alpha / 2, 1 - alpha / 2]))
    reliable = b2.mean() > 0 and not np.isnan(ratios).any()
    out["ratio_reliable"] = bool(reliable)
    if reliable:
        out["ratio"] = float(a2.mean() / b2.mean())
        out["ratio_low"], out["ratio_high"] = (
            float(v) for v in np.quantile(ratios, [alpha / 2, 1 - alpha / 2])
        )
    else:  # the reference resamples to 0: a ratio would be unbounded; the difference stands for it
        out["ratio"] = out["ratio_low"] = out["ratio_high"] = None
    z = norm.ppf(1 - alpha / 2) + norm.ppf(POWER)
    out["detectable"] = float(z * np.std(diffs, ddof=1)) if len(diffs) > 1 else 0.0
    return out


def _against_a_constant_arm(a, b, confidence: float, resamples: int, seed: int) -> dict[str, Any]:
    """An arm that scored 0 (or 1) on every question resamples to itself: a bootstrap would give its ratio a
    zero-width interval. Its exact binomial bound and the reference's own interval bound the difference and
    the ratio instead (each end from the far ends of both: conservative, not paired)."""
    from scipy.stats import norm

    arm = _rate_bound(a, confidence)
    ref = mean_interval(b, confidence=confidence, resamples=resamples, seed=seed)
    half = (ref.high - ref.low) / 2 / norm.ppf(1 - (1 - confidence) / 2)  # the reference's standard error
    se = float(np.hypot(half, (arm.high - arm.low) / 2 / norm.ppf(1 - (1 - confidence) / 2)))
    out = {
        "levels": f"exact binomial (arm) and {ref.levels} (reference), not paired",
        "diff_low": arm.low - ref.high,
        "diff_high": arm.high - ref.low,
        "detectable": float((norm.ppf(1 - (1 - confidence) / 2) + norm.ppf(POWER)) * se),
    }
    reliable = ref.low > 0
    out["ratio_reliable"] = reliable
    if reliable:
        out.update(ratio=arm.mean / ref.mean, ratio_low=arm.low / ref.high, ratio_high=arm.high / ref.low)
    else:
        out["ratio"] = out["ratio_low"] = out["ratio_high"] = None
    return out


def _paired_replicates(stat, a, b, confidence: float, resamples: int, rng) -> np.ndarray:
    """scipy's paired percentile bootstrap of ``stat(a, b)``: its replicates."""
    from scipy.stats import DegenerateDataWarning, bootstrap

    with warnings.catch_warnings():  # ratio replicates over a reference resampled to 0 are NaN: guarded above
        warnings.simplefilter("ignore", DegenerateDataWarning)
        res = bootstrap(
            (a, b), stat, paired=True, vectorized=True, confidence_level=confidence, n_resamples=resamples,
            method="percentile", random_state=rng,
        )  # fmt: skip
    return res.bootstrap_distribution


def _diff(x, y, axis=-1):
    return x.mean(axis=axis) - y.mean(axis=axis)


def _ratio(x, y, axis=-1):
    den = y.mean(axis=axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, x.mean(axis=axis) / np.where(den > 0, den, 1), np.nan)


def interval_fields(name: str, interval: Interval) -> dict[str, Any]:
    """A report row's fields for one metric: ``em``, ``em_low``, ``em_high``, ``em_levels``."""
    d = asdict(interval)
    return {
        name: d["mean"],
        f"{name}_low": d["low"],
        f"{name}_high": d["high"],
        f"{name}_levels": d["levels"],
    }

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

Seed-level tests (:func:`seed_test`) treat each training run's mean score as one observation, the question
sample being shared: the two-level bootstrap resamples seeds too, but a percentile bootstrap over a handful of
values under-covers (over n normal seed means its nominal 95% covers about 75% at n = 3, 85% at n = 5, 90% at
n = 10: it uses z and the plug-in spread where a t with n − 1 degrees of freedom is due; resampling the
questions too lifts it somewhat, to 85% / 87% / 93% simulated with a seed spread of 7 EM points on 532
questions). Beside it:

- paired by seed (both arms ran the same seeds): scipy's ``ttest_rel`` over the seeds' means, its t interval
  of the difference, and the exact sign-flip permutation test of the seeds' differences (all 2^n sign
  assignments; two-sided p is never below 2 / 2^n: 0.25 at n = 3);
- one run against several (a baseline evaluated once, the untrained warm start every arm starts from): the
  single run is a fixed value; ``ttest_1samp`` of the other arm's seed means against it, and the exact
  sign-flip test of those differences (Welch's t needs two runs in each arm);
- different seeds, two or more each: Welch's t (``ttest_ind(equal_var=False)``) over the seed means, and the
  exact permutation test over every relabeling of the runs (C(n_a + n_b, n_a) of them).

:func:`governs` says which inference a comparison should be read by: the seed-level test while an arm with
more than one run has fewer seeds than ``seed_test_below``, the bootstrap otherwise.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

POWER = 0.8
EXACT_LIMIT = 2**16  # permutation tests enumerate up to this many assignments (16 paired seeds), else sample


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


def _mean_stat(x, axis=-1):
    return np.mean(x, axis=axis)


def _mean_diff(x, y, axis=-1):
    return np.mean(x, axis=axis) - np.mean(y, axis=axis)


def _finite(x) -> float | None:
    x = float(x)
    return x if np.isfinite(x) else None


def _seed_order(seeds: Sequence[Any]) -> list[int]:
    """Indices of ``seeds`` in seed order (numbers by value, then anything else by its text)."""
    return sorted(
        range(len(seeds)),
        key=lambda i: (0, seeds[i], "") if isinstance(seeds[i], int) else (1, 0, str(seeds[i])),
    )


def seed_test(
    a, b, *, a_seeds: Sequence[Any], b_seeds: Sequence[Any], confidence: float, seed: int = 0
) -> dict[str, Any] | None:
    """The seed-level test of ``a`` − ``b`` (seeds × questions each, rows labelled by ``a_seeds`` and ``b_seeds``):
    each run's mean is one observation (see the module). None when each arm has one run (nothing to test at
    the seed level). ``t``, ``p``, ``t_low`` and ``t_high`` are None where the runs' means do not vary. The
    permutation test enumerates every assignment up to :data:`EXACT_LIMIT` of them; beyond, it draws that many
    (seeded by ``seed``) and says so (``permutation_exact``)."""
    from math import comb

    from scipy.stats import permutation_test, ttest_1samp, ttest_ind, ttest_rel

    ma = np.atleast_2d(np.asarray(a, dtype=float)).mean(axis=1)
    mb = np.atleast_2d(np.asarray(b, dtype=float)).mean(axis=1)
    if (len(a_seeds), len(b_seeds)) != (len(ma), len(mb)):
        raise ValueError(
            f"seed labels for {len(ma)} and {len(mb)} runs: got {len(a_seeds)} and {len(b_seeds)}"
        )
    if len(ma) == 1 and len(mb) == 1:
        return None
    ia, ib = _seed_order(a_seeds), _seed_order(b_seeds)
    ma, mb = ma[ia], mb[ib]
    out: dict[str, Any] = {
        "a_seeds": [a_seeds[i] for i in ia], "a_means": ma.tolist(),
        "b_seeds": [b_seeds[i] for i in ib], "b_means": mb.tolist(),
        "diff": float(ma.mean() - mb.mean()),
    }  # fmt: skip
    d = None
    if len(ma) > 1 and out["a_seeds"] == out["b_seeds"]:
        d = ma - mb
        out.update(design="paired by seed", t_test="paired t (scipy ttest_rel)")
        res = None if np.ptp(d) <= 1e-12 else ttest_rel(ma, mb)
    elif min(len(ma), len(mb)) == 1:
        d = ma - mb  # one side is a single run: a fixed value
        out.update(
            design="one run against seeds", t_test="one-sample t against the single run (scipy ttest_1samp)"
        )
        res = None if np.ptp(d) <= 1e-12 else ttest_1samp(d, 0.0)
    else:
        out.update(design="unpaired (different seeds)", t_test="Welch's t (scipy ttest_ind, equal_var=False)")
        res = None if max(np.ptp(ma), np.ptp(mb)) <= 1e-12 else ttest_ind(ma, mb, equal_var=False)
    if res is None:
        out.update(t=None, df=None, p=None, t_low=None, t_high=None)
    else:
        ci = res.confidence_interval(confidence_level=confidence)
        out.update(
            t=_finite(res.statistic), df=_finite(res.df), p=_finite(res.pvalue),
            t_low=_finite(ci.low), t_high=_finite(ci.high),
        )  # fmt: skip
    if d is not None:  # every one of the 2^n sign assignments of the differences
        total, data, stat, kind = 2 ** len(d), (d,), _mean_stat, "samples"
        what = f"sign-flip over the 2^{len(d)} assignments"
    else:  # every relabeling of the runs into two arms of their sizes
        total, data, stat, kind = comb(len(ma) + len(mb), len(ma)), (ma, mb), _mean_diff, "independent"
        what = f"over the C({len(ma) + len(mb)}, {len(ma)}) relabelings"
    exact = total <= EXACT_LIMIT
    perm = permutation_test(
        data, stat, permutation_type=kind, vectorized=True, n_resamples=np.inf if exact else EXACT_LIMIT,
        random_state=None if exact else np.random.default_rng(seed),
    )  # fmt: skip
    out.update(
        permutation=("exact " if exact else f"{EXACT_LIMIT} random draws ") + what,
        permutation_exact=exact,
        permutation_p=float(perm.pvalue),
        permutation_assignments=total,
        permutation_min_p=min(1.0, 2 / total),  # the smallest two-sided p it can give
    )
    return out


def governs(a_runs: int, b_runs: int, *, has_seed_test: bool, seed_test_below: int) -> str:
    """``"seed-level"`` while an arm with more than one run has fewer than ``seed_test_below`` seeds (and a seed-level
    test exists), else ``"bootstrap"`` (the bootstrap then reads as the comparison, the seed-level test beside it)."""
    multi = [n for n in (a_runs, b_runs) if n > 1]
    return "seed-level" if has_seed_test and multi and min(multi) < seed_test_below else "bootstrap"


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of ``pvalues`` (a family of tests; None: a comparison with no p, left out of
    the family and left None): the i-th smallest of m is multiplied by m − i + 1, kept non-decreasing, capped
    at 1. It controls the chance of any false positive in the family, as Bonferroni does, and is never less
    powerful."""
    family = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    out: list[float | None] = [None] * len(pvalues)
    running, m = 0.0, len(family)
    for rank, (p, i) in enumerate(family):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out

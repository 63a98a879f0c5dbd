"""The report's seed-level inference (issue 35, item 5): with few seeds, each comparison carries a t test over
the runs' mean scores (paired by seed, one run against several, or Welch's) with its interval and an exact
permutation test, says which inference governs, and report.json records the bootstrap's resamples and seed."""

import json

import numpy as np
import pytest
from scipy.stats import t as t_dist
from scipy.stats import ttest_1samp, ttest_ind, ttest_rel

# three seeds x four questions: seed means 0.5, 0.5, 0.75 against 0.25, 0.25, 0.25 (differences 0.25, 0.25, 0.5)
A = np.array([[1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 1, 0]], dtype=float)
B = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 1]], dtype=float)


def test_paired_seed_test_by_hand():
    """d = (0.25, 0.25, 0.5): mean 1/3, sd 0.25/√3 = 0.1443, se 0.0833, t = 4 on 2 df; for 2 df
    P(|T| < t) = t/√(2 + t²), so p = 1 − 4/√18; interval 1/3 ± t₀.₉₇₅,₂ · se. All three differences are
    positive: 1 of the 2³ sign assignments reaches the observed mean, two-sided p = 2/8 = 0.25, the floor."""
    from zerosim.experiment.stats import seed_test

    s = seed_test(A, B, a_seeds=[0, 1, 2], b_seeds=[0, 1, 2], confidence=0.95)
    assert s["design"] == "paired by seed" and s["df"] == 2
    assert s["diff"] == pytest.approx(1 / 3)
    assert s["t"] == pytest.approx(4.0)
    assert s["p"] == pytest.approx(1 - 4 / np.sqrt(18))
    half = t_dist.ppf(0.975, 2) * (0.25 / np.sqrt(3)) / np.sqrt(3)
    assert (s["t_low"], s["t_high"]) == pytest.approx((1 / 3 - half, 1 / 3 + half))
    assert (s["t_low"], s["t_high"]) == pytest.approx((-0.02523, 0.69189), abs=1e-4)
    assert s["permutation_exact"] and s["permutation_assignments"] == 8
    assert s["permutation_p"] == pytest.approx(0.25) and s["permutation_min_p"] == pytest.approx(0.25)


def test_exact_permutation_floor_for_three_paired_seeds():
    """n = 3 paired seeds: the exact sign-flip test cannot go below p = 0.25 (two-sided), however large the
    differences; one difference of the other sign doubles it."""
    from zerosim.experiment.stats import seed_test

    big = seed_test(A + 10, B, a_seeds=[0, 1, 2], b_seeds=[0, 1, 2], confidence=0.95)
    assert big["p"] is None or big["p"] < 0.01  # the t test can be small ...
    assert big["permutation_p"] == pytest.approx(0.25)  # ... the exact permutation test cannot
    mixed = seed_test(np.array([[0.6], [0.3], [0.9]]), np.array([[0.5], [0.5], [0.5]]), a_seeds=[0, 1, 2],
                      b_seeds=[0, 1, 2], confidence=0.95)  # fmt: skip
    # d = (0.1, −0.2, 0.4), sum 0.3: the sign assignments whose sum reaches 0.3 are (.1, −.2, .4), (.1, .2, .4)
    # and (−.1, .2, .4): 3 of 8, two-sided p = 2 · 3/8
    assert mixed["permutation_p"] == pytest.approx(0.75)
    assert mixed["permutation_p"] >= mixed["permutation_min_p"]


def test_seed_level_designs_match_scipy():
    """Pairing goes by seed label, not by row order; a single run is a fixed value (one-sample t, sign-flip);
    different seeds are Welch's t and the exact relabeling test; one run each has no seed-level test."""
    from zerosim.experiment.stats import seed_test

    rng = np.random.default_rng(0)
    a = (rng.random((4, 50)) < np.array([[0.2], [0.3], [0.35], [0.25]])).astype(float)
    b = (rng.random((4, 50)) < 0.3).astype(float)
    ma, mb = a.mean(1), b.mean(1)

    paired = seed_test(a, b[::-1], a_seeds=[0, 1, 2, 3], b_seeds=[3, 2, 1, 0], confidence=0.9)
    ref = ttest_rel(ma, mb)
    assert paired["design"] == "paired by seed" and paired["b_means"] == pytest.approx(mb.tolist())
    assert paired["p"] == pytest.approx(ref.pvalue) and paired["t"] == pytest.approx(ref.statistic)
    ci = ref.confidence_interval(0.9)
    assert (paired["t_low"], paired["t_high"]) == pytest.approx((ci.low, ci.high))
    assert paired["permutation_assignments"] == 16 and paired["permutation_min_p"] == pytest.approx(0.125)

    one = seed_test(b[:1], a, a_seeds=[None], b_seeds=[0, 1, 2, 3], confidence=0.95)
    ref = ttest_1samp(mb[0] - ma, 0.0)
    assert one["design"] == "one run against seeds" and one["diff"] == pytest.approx(mb[0] - ma.mean())
    assert one["p"] == pytest.approx(ref.pvalue)
    assert (one["t_low"], one["t_high"]) == pytest.approx(tuple(ref.confidence_interval(0.95)))

    welch = seed_test(a, b[:3], a_seeds=[0, 1, 2, 3], b_seeds=[4, 5, 6], confidence=0.95)
    ref = ttest_ind(ma, mb[:3], equal_var=False)
    assert welch["design"] == "unpaired (different seeds)" and welch["df"] == pytest.approx(ref.df)
    assert welch["p"] == pytest.approx(ref.pvalue)
    assert (welch["t_low"], welch["t_high"]) == pytest.approx(tuple(ref.confidence_interval(0.95)))
    assert welch["permutation_exact"] and welch["permutation_assignments"] == 35  # C(7, 4)

    assert seed_test(a[:1], b[:1], a_seeds=[0], b_seeds=[0], confidence=0.95) is None
    same = seed_test(a, a, a_seeds=[0, 1, 2, 3], b_seeds=[0, 1, 2, 3], confidence=0.95)
    assert same["p"] is None and same["t_low"] is None and same["permutation_p"] == pytest.approx(1.0)


def test_the_inference_that_governs_follows_the_seed_count():
    from zerosim.experiment.stats import governs

    assert governs(3, 3, has_seed_test=True, seed_test_below=10) == "seed-level"
    assert governs(1, 9, has_seed_test=True, seed_test_below=10) == "seed-level"
    assert governs(10, 12, has_seed_test=True, seed_test_below=10) == "bootstrap"
    assert governs(1, 10, has_seed_test=True, seed_test_below=10) == "bootstrap"  # the single run is fixed
    assert governs(1, 1, has_seed_test=False, seed_test_below=10) == "bootstrap"


def _write(tmp_path, arm, seed, ems):
    path = tmp_path / f"{arm}-{seed}.jsonl"
    path.write_text("".join(
        json.dumps({"dataset": "d", "id": i, "em": e, "f1": e, "cover_em": e}) + "\n" for i, e in enumerate(ems)
    ))  # fmt: skip
    return path


def _report(tmp_path, mlflow_db, arms, **report):
    import mlflow

    from zerosim.experiment import ExperimentConfig
    from zerosim.experiment.report import EvalScores, write_report
    from zerosim.job_config import EvalConfig

    evals = [
        EvalScores(arm, "bm25", seed, _write(tmp_path, arm, seed, row))
        for arm, runs in arms.items()
        for seed, row in runs.items()
    ]
    cfg = ExperimentConfig()
    for key, value in {"resamples": 300, "seed": 7, **report}.items():
        setattr(cfg.report, key, value)
    mlflow.set_tracking_uri(mlflow_db)
    experiment = mlflow.set_experiment("seed-tests")
    with mlflow.start_run(experiment_id=experiment.experiment_id):
        write_report(cfg, evals, {}, EvalConfig(), tmp_path)
    return json.loads((tmp_path / "report.json").read_text()), (tmp_path / "report.md").read_text()


def test_report_json_holds_the_seed_level_tests_and_the_bootstrap_settings(tmp_path, mlflow_db):
    """Three seeds per trained arm (the old ablation's shape): each comparison carries the seed-level test with
    scipy's values, the seed-level test governs, and report.json names the bootstrap's resamples and seed."""
    arms = {
        "real": {s: B[i].tolist() * 5 for i, s in enumerate((0, 1, 2))},
        "sim": {s: A[i].tolist() * 5 for i, s in enumerate((2, 0, 1))},  # written in another seed order
        "none": {None: [1, 0, 0, 0] * 5},
    }
    report, md = _report(tmp_path, mlflow_db, arms, pairs=["sim:none"])
    assert report["inference"]["bootstrap"] == {
        **report["inference"]["bootstrap"],
        "resamples": 300,
        "seed": 7,
        "confidence": 0.95,
    }
    assert report["inference"]["seed_test_below"] == 10
    by = {(c["arm"], c["reference"]): c for c in report["comparisons"]}
    sim = by["sim", "real"]
    s = sim["em"]["seed_level"]
    # by seed: sim 0 = A[1], 1 = A[2], 2 = A[0] against real B[0], B[1], B[2] (all 0.25)
    ref = ttest_rel(A.mean(1)[[1, 2, 0]], B.mean(1))
    assert s["design"] == "paired by seed" and s["a_seeds"] == [0, 1, 2]
    assert s["p"] == pytest.approx(ref.pvalue) and s["p"] == pytest.approx(1 - 4 / np.sqrt(18))
    assert (s["t_low"], s["t_high"]) == pytest.approx((-0.02523, 0.69189), abs=1e-4)
    assert s["permutation_p"] == pytest.approx(0.25)
    assert sim["governs"] == "seed-level"
    assert sim["f1"]["seed_level"]["p"] == pytest.approx(s["p"])  # every metric has its own
    none = by["none", "real"]["em"]["seed_level"]
    assert none["design"] == "one run against seeds" and none["p"] is None  # 0.25 against 0.25 three times
    assert by["sim", "none"]["em"]["seed_level"]["design"] == "one run against seeds"
    assert by["sim", "none"]["governs"] == "seed-level"
    assert md.count("Seed-level tests") == 2 and "2000" not in md and "300 resamples (seed 7)" in md
    assert "(descriptive)" in md and "| seed-level |" in md


def test_holm_by_hand():
    from zerosim.experiment.stats import holm

    # sorted 0.01, 0.03, 0.04, 0.2 times 4, 3, 2, 1 -> 0.04, 0.09, 0.08 (kept at 0.09: non-decreasing), 0.2
    assert holm([0.01, 0.04, 0.03, 0.2]) == pytest.approx([0.04, 0.09, 0.09, 0.2])
    assert holm([0.5, None, 0.4]) == [pytest.approx(0.8), None, pytest.approx(0.8)]  # None: out of the family
    assert holm([0.9, 0.8]) == pytest.approx([1.0, 1.0])  # capped at 1


def test_the_report_corrects_its_comparisons_by_holm_and_names_the_primary_one(tmp_path, mlflow_db):
    """Several comparisons, each with a seed-level p: beside each its Holm-adjusted p over the family, the
    family's size and method in report.json and report.md, and the primary comparison marked (report.primary)."""
    from zerosim.experiment.stats import holm

    arms = {
        "real": {s: B[i].tolist() * 5 for i, s in enumerate((0, 1, 2))},
        "sim": {s: A[i].tolist() * 5 for i, s in enumerate((0, 1, 2))},
        "other": {s: A[(i + 1) % 3].tolist() * 5 for i, s in enumerate((0, 1, 2))},
    }
    report, md = _report(tmp_path, mlflow_db, arms, pairs=["sim:other"], primary="sim:real")
    family = [c for c in report["comparisons"] if c["em"]["seed_level"]["p"] is not None]
    assert report["multiple_comparisons"] == {
        "method": "Holm", "metric": "em", "test": "seed-level t", "family": len(family), "primary": "sim:real",
    }  # fmt: skip
    assert len(family) >= 2
    expected = holm([c["em"]["seed_level"]["p"] for c in family])
    assert [c["em"]["seed_level"]["p_holm"] for c in family] == pytest.approx(expected)
    assert all(c["em"]["seed_level"]["p_holm"] >= c["em"]["seed_level"]["p"] for c in family)
    assert [c["primary"] for c in report["comparisons"]] == [
        (c["arm"], c["reference"]) == ("sim", "real") for c in report["comparisons"]
    ]
    assert "| p Holm |" in md and "(primary)" in md and "Primary comparison (set before the runs" in md
    assert "the primary comparison" in md and f"{len(family)} comparisons have a seed-level p" in md


def test_a_primary_comparison_the_report_does_not_make_is_refused(tmp_path):
    from pathlib import Path

    from zerosim.core.config import ConfigError
    from zerosim.experiment import load_experiment

    smoke = Path(__file__).resolve().parents[1] / "configs" / "experiments" / "sim-vs-real-smoke.yaml"
    with pytest.raises(
        ConfigError, match=r"report.primary='sim:nosuch' is not one of the report's comparisons"
    ):
        load_experiment(smoke, [f"output_dir={tmp_path}", "report.primary=sim:nosuch"])


def test_with_enough_seeds_or_one_run_each_the_bootstrap_governs(tmp_path, mlflow_db):
    rng = np.random.default_rng(1)
    arms = {
        arm: {s: (rng.random(40) < 0.3).astype(float).tolist() for s in (0, 1, 2)} for arm in ("real", "a")
    }
    report, md = _report(tmp_path, mlflow_db, arms, seed_test_below=3)
    (c,) = report["comparisons"]
    assert c["governs"] == "bootstrap" and c["em"]["seed_level"]["design"] == "paired by seed"
    assert "(descriptive)" not in md and "| bootstrap |" in md

    single = {arm: {0: runs[0]} for arm, runs in arms.items()}
    report, md = _report(tmp_path, mlflow_db, single)
    (c,) = report["comparisons"]
    assert c["em"]["seed_level"] is None and c["governs"] == "bootstrap"
    assert "Seed-level tests" not in md


def test_each_run_shows_its_em_and_its_most_common_answer(tmp_path):
    """Per-seed numbers beside the mean, and the share of a run's questions given its most common answer (a run
    that fell onto one answer shows), read from the eval stages' questions.jsonl."""
    import json

    from zerosim.experiment.report import EvalScores, _runs, _runs_markdown

    rows = [{"dataset": "d", "id": str(i), "em": float(i < 2), "prediction": "Paris" if i % 2 else "the Paris."}
            for i in range(8)]  # fmt: skip
    rows[0]["prediction"] = None
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    old = tmp_path / "old.jsonl"  # written before predictions were kept
    old.write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k != "prediction"}) + "\n" for r in rows)
    )
    runs = _runs([EvalScores("real", "bm25", 3, path), EvalScores("none", "bm25", None, old)])
    assert runs["real", "bm25", "d", 3] == {
        "seed": 3, "n": 8, "em": 0.25, "top_answer": "paris", "top_answer_share": 7 / 8,
    }  # fmt: skip
    assert runs["none", "bm25", "d", None] == {"seed": None, "n": 8, "em": 0.25}
    table = _runs_markdown(
        [{"arm": "real", "engine": "bm25", "dataset": "d", "runs": [runs["real", "bm25", "d", 3]]}]
    )
    assert table[-1] == "| real | bm25 | d | 3 | 25.0 | paris | 87.5% |"

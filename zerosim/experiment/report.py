"""The experiment's report: EM / F1 / cover-EM per arm × dataset × engine with bootstrap intervals over
questions, paired differences against the reference arm, and a manifest of what produced them
(``report.json``, ``report.md``, ``report.png``, also on the MLflow parent run).

It reads plain inputs — each eval stage's per-question file and the stage records — and knows nothing of
how the stages were built or run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zerosim.agent.rewards import METRICS as ANSWER_METRICS
from zerosim.core.data.jsonl import DataError, at_line, iter_jsonl
from zerosim.core.engine_names import EngineName
from zerosim.core.fsutil import atomic_write_text
from zerosim.core.tracking import code_version
from zerosim.experiment.config import ExperimentConfig, ReportConfig
from zerosim.experiment.stats import compare, governs, holm, interval_fields, mean_interval, seed_test

METRICS = tuple(m.value for m in ANSWER_METRICS)  # em, f1, cover_em (the judge is a training reward only)


@dataclass(frozen=True)
class EvalScores:
    """One eval stage's scores: which arm and engine, and its per-question file (``questions.jsonl``)."""

    arm: str
    engine: str
    seed: int | None  # the training seed (None: a baseline of the untrained policy)
    questions: str | Path

    @classmethod
    def of(cls, stage: Any, outputs: dict[str, Any]) -> EvalScores:
        """An eval stage's scores from what the stage returned (its record's ``outputs``)."""
        return cls(stage.meta["arm"], stage.meta["engine"], stage.meta["seed"], outputs["questions"])


def _scores(path: str | Path) -> dict[str, dict[str, dict[str, float]]]:
    """dataset -> question id -> metric -> score, from an eval stage's questions.jsonl. A (dataset, id) met
    twice is refused: keyed by id, the second question would silently replace the first (``n`` would count
    questions that share an id as one)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    lines: dict[tuple[str, str], int] = {}
    for line, row in iter_jsonl(path):
        dataset, qid = row["dataset"], str(row["id"])
        if (dataset, qid) in lines:
            raise DataError(
                f"{at_line(path, line)}: dataset {dataset!r} question id {qid!r} repeats line "
                f"{lines[dataset, qid]}; the report pairs questions by id, so each must be unique: give each "
                "question of that data set its own id, then run its eval stage again"
            )
        lines[dataset, qid] = line
        out.setdefault(dataset, {})[qid] = {m: float(row[m]) for m in METRICS}
    return out


def manifest(cfg: ExperimentConfig, records: dict[str, dict[str, Any]], evaluated: Any) -> dict[str, Any]:
    """What a reader needs to reproduce the numbers: ``records`` are the finished stages' records (by name,
    in run order), ``evaluated`` an eval stage's config (the search and rollout every policy was scored with)."""
    import importlib.metadata as md

    ws = evaluated
    corpus = {}
    for engine in cfg.eval.engines:
        if EngineName(engine).index_kind:  # a corpus of its own (search.<engine>.corpus)
            from eval.index import corpus_file_fingerprint
            from zerosim.engines import resolve_corpus

            source = getattr(ws.search, engine).corpus
            path = Path(resolve_corpus(source))
            # the fingerprint an index manifest records, so a reader can match the report to an index
            corpus[engine] = {"source": source, "path": str(path), **corpus_file_fingerprint(path)}
    versions = {}
    for pkg in (
        "zerosim",
        "torch",
        "transformers",
        "trl",
        "mlflow",
        "bm25s",
        "faiss-cpu",
        "sentence-transformers",
        "scipy",
    ):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            continue
    stage_records = {
        name: {
            "key": done["key"],
            "seconds": done["seconds"],
            "attempts": done.get("attempts", 1),
            "others_cpu": done.get("others_cpu"),
            "config": done["config"],
            "code": done.get("code"),
            # which weights: the model it wrote, the models it read (sha256), where it ran (provenance.py)
            "model": (done.get("model") or {}).get("sha256"),
            "reads": done.get("reads"),
            "machine": done.get("machine"),
        }
        for name, done in records.items()
    }
    return {
        "name": cfg.name,
        "base": cfg.base,
        "seeds": list(cfg.seeds),
        "corpus": corpus,
        "search": {
            "k": ws.search.k,
            "bm25": asdict(ws.search.bm25),
            "dense": asdict(ws.search.dense),
            "negatives": ws.search.negatives,
        },
        "rollout": {
            "max_turns": ws.rollout.max_turns,
            "max_new_tokens": ws.rollout.max_new_tokens,
            "max_obs_tokens": ws.rollout.max_obs_tokens,
            "max_completion_tokens": ws.rollout.max_completion_tokens,
        },
        "eval": asdict(cfg.eval),
        "versions": versions,
        "code": code_version(),
        "stages": stage_records,
    }


Matrices = dict[tuple[str, str], dict[str, dict[Any, dict[str, dict[str, float]]]]]


def _per_question(evals: Sequence[EvalScores]) -> Matrices:
    """(arm, engine) -> dataset -> seed -> question -> metric -> score."""
    per: Matrices = {}
    for ev in evals:
        data = per.setdefault((ev.arm, ev.engine), {})
        for dataset, questions in _scores(ev.questions).items():
            data.setdefault(dataset, {})[ev.seed] = questions
    return per


def _runs(evals: Sequence[EvalScores]) -> dict[tuple[str, str, str, Any], dict[str, Any]]:
    """(arm, engine, dataset, seed) -> that run's EM and its most common answer: the answer (normalised as EM
    reads it) and the share of all its questions given it — a run that fell onto one answer shows here. Files
    written before predictions were kept give the EM alone."""
    from collections import Counter

    from zerosim.core.metrics import normalize_answer

    out: dict[tuple[str, str, str, Any], dict[str, Any]] = {}
    for ev in evals:
        by_dataset: dict[str, list[dict[str, Any]]] = {}
        for _, row in iter_jsonl(ev.questions):
            by_dataset.setdefault(row["dataset"], []).append(row)
        for dataset, rows in by_dataset.items():
            run: dict[str, Any] = {
                "seed": ev.seed,
                "n": len(rows),
                "em": sum(float(r["em"]) for r in rows) / len(rows),
            }
            if all("prediction" in r for r in rows):
                answers = [normalize_answer(r["prediction"] or "") for r in rows]
                named = Counter(a for a in answers if a)
                top, count = named.most_common(1)[0] if named else (None, 0)
                run.update(top_answer=top, top_answer_share=count / len(rows))
            out[ev.arm, ev.engine, dataset, ev.seed] = run
    return out


def _runs_markdown(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per-seed numbers beside the means: each run's EM and the share of its questions given its most common
    answer; and, where the run trained, how often its actions were invalid over training (the trajectories
    with an invalid action at its first and last step, and under the tools protocol the invalid share of all
    its tool calls)."""
    trained = any(run.get("training") for row in rows for run in row.get("runs", []))
    extra = " training: trajectories with an invalid action, first → last step (mean) | training: invalid tool calls |"
    lines = [
        "",
        "### Each run (per seed)",
        "",
        "| arm | engine | dataset | seed | EM | most common answer | its share |"
        + (extra if trained else ""),
    ]
    lines.append("|---|---|---|---|---|---|---|" + ("---|---|" if trained else ""))
    for row in rows:
        for run in row.get("runs", []):
            share = run.get("top_answer_share")
            top = "" if share is None else f"{run['top_answer'] or '(none)'}"
            shown = "" if share is None else _share(share)
            seed = "-" if run["seed"] is None else run["seed"]
            line = f"| {row['arm']} | {row['engine']} | {row['dataset']} | {seed} | {100 * run['em']:.1f} | {top} | {shown} |"
            if trained:
                t = run.get("training")
                actions = (
                    f"{_share(t['invalid_actions_first'])} → {_share(t['invalid_actions_last'])} "
                    f"({_share(t['invalid_actions_mean'])})"
                    if t
                    else "-"
                )
                calls = "-" if not t or t["invalid_call_share"] is None else _share(t["invalid_call_share"])
                line += f" {actions} | {calls} |"
            lines.append(line)
    return lines


def _matrix(by_seed: dict[Any, dict[str, dict[str, float]]], questions: list[str], metric: str) -> np.ndarray:
    """seeds × questions scores of one metric."""
    return np.array([[scores[q][metric] for q in questions] for scores in by_seed.values()])


def _common(*by_seed: dict[Any, dict[str, dict[str, float]]]) -> list[str]:
    """The questions every seed of every arm answered (all of them when they evaluated the same sample)."""
    sets = [set(scores) for seeds in by_seed for scores in seeds.values()]
    return sorted(set.intersection(*sets)) if sets else []


def inference(r: ReportConfig) -> dict[str, Any]:
    """How the report's intervals and tests were made, and which one a comparison is read by (report.json's
    ``inference``; zerosim/experiment/stats.py)."""
    return {
        "bootstrap": {
            "confidence": r.confidence,
            "resamples": r.resamples,
            "seed": r.seed,
            "method": "percentile; seeds then questions resampled (questions only where an arm has one run)",
        },
        "seed_test_below": r.seed_test_below,
        "governs": (
            "seed-level (t over the runs' mean scores, with its interval; an exact permutation test beside it) "
            f"where an arm with more than one run has fewer than {r.seed_test_below} seeds, the bootstrap "
            "then descriptive; the bootstrap otherwise, and where each arm has one run (no seed-level test)"
        ),
        "why": (
            "a percentile bootstrap over a few seeds under-covers: its nominal 95% covers about 75% of n normal "
            "seed means at n = 3 and 90% at n = 10 (85% and 93% simulated with a seed spread of 7 EM points on "
            "532 questions, the question term lifting it)"
        ),
    }


def write_report(
    cfg: ExperimentConfig,
    evals: Sequence[EvalScores],
    records: dict[str, dict[str, Any]],
    evaluated: Any,
    root: Path,
    arms: dict[str, str] | None = None,
    interim: dict[str, Any] | None = None,
    costs: dict[str, Any] | None = None,
    training: dict[tuple[str, Any], dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """report.json / report.md / report.png in ``root`` and on the active (parent) MLflow run. ``arms``: what
    each arm changes against the base recipe, in words. ``training``: (arm, seed) -> that training run's
    invalid actions (:func:`zerosim.experiment.runlogs.training_signals`), shown beside its scores.
    ``interim`` (the evaluations finished and those still to come, by name): a report of an experiment
    part-way, written to ``root`` only — no MLflow run."""
    import mlflow

    r = cfg.report
    opts = dict(confidence=r.confidence, resamples=r.resamples, seed=r.seed)
    per = _per_question(evals)
    runs = _runs(evals)
    rows = []
    for (arm, engine), data in per.items():
        for dataset, by_seed in data.items():
            questions = _common(by_seed)
            row = {
                "arm": arm,
                "engine": engine,
                "dataset": dataset,
                "n": len(questions),
                "seeds": len(by_seed),
            }
            for k in METRICS:
                row.update(interval_fields(k, mean_interval(_matrix(by_seed, questions, k), **opts)))
            row["runs"] = [
                {**runs[arm, engine, dataset, seed], "training": (training or {}).get((arm, seed))}
                for seed in by_seed
                if (arm, engine, dataset, seed) in runs
            ]
            rows.append(row)
    pairs = [(arm, r.reference) for arm, _ in per if arm != r.reference]
    pairs += r.pair_names()
    comparisons = []
    for arm, against in dict.fromkeys(pairs):  # each pair once, in order: the reference's first
        for (name, engine), data in per.items():
            ref = per.get((against, engine))
            if name != arm or ref is None:
                continue
            for dataset, by_seed in data.items():
                ref_seeds = ref.get(dataset, {})
                common = _common(by_seed, ref_seeds)
                if not ref_seeds or not common:
                    continue
                entry = {
                    "arm": arm,
                    "reference": against,
                    "engine": engine,
                    "dataset": dataset,
                    "n": len(common),
                    "seeds": len(by_seed),
                    "reference_seeds": len(ref_seeds),
                }
                for k in METRICS:
                    a, b = _matrix(by_seed, common, k), _matrix(ref_seeds, common, k)
                    entry[k] = compare(a, b, **opts)
                    entry[k]["seed_level"] = seed_test(
                        a,
                        b,
                        a_seeds=list(by_seed),
                        b_seeds=list(ref_seeds),
                        confidence=r.confidence,
                        seed=r.seed,
                    )
                entry["governs"] = governs(
                    len(by_seed), len(ref_seeds), has_seed_test=entry["em"]["seed_level"] is not None,
                    seed_test_below=r.seed_test_below,
                )  # fmt: skip
                comparisons.append(entry)
    family = [c for c in comparisons if (c["em"].get("seed_level") or {}).get("p") is not None]
    for c, adjusted in zip(family, holm([c["em"]["seed_level"]["p"] for c in family]), strict=True):
        c["em"]["seed_level"]["p_holm"] = adjusted
    for c in comparisons:
        c["primary"] = r.primary == f"{c['arm']}:{c['reference']}"
    report = {
        "rows": rows,
        "comparisons": comparisons,
        "multiple_comparisons": {
            "method": "Holm",
            "metric": "em",
            "test": "seed-level t",
            "family": len(family),
            "primary": r.primary,
        },
        "confidence": r.confidence,
        "inference": inference(r),
        "arms": arms or {},
        "manifest": manifest(cfg, records, evaluated),
        "search_cost": costs or {},
    }
    if interim is not None:
        report["interim"] = interim
    from zerosim.experiment.provenance import add_row_provenance

    add_row_provenance(report, records)  # each row: which model instances each seed's eval read
    md = report_markdown(report)
    atomic_write_text(root / "report.json", json.dumps(report, indent=2, default=str))
    atomic_write_text(root / "report.md", md)
    png = root / "report.png"
    plot_report(rows, png, reference=r.reference)
    summary = {"report": str(root / "report.json"), "rows": len(rows), "comparisons": len(comparisons)}
    if interim is not None:
        return summary
    mlflow.log_text(json.dumps(report, indent=2, default=str), "report.json")
    mlflow.log_text(md, "report.md")
    mlflow.log_artifact(str(png))
    for row in rows:
        name = f"{row['arm']}/{row['engine']}/{row['dataset']}".replace(":", "_")
        mlflow.log_metrics({f"{name}/{k}": row[k] for k in METRICS})
    return summary


def _pct(x: float | None) -> str:
    return "–" if x is None or x != x else f"{100 * x:.1f}"


def _share(x: float) -> str:
    return f"{100 * x:.1f}%"


def _pts(x: float) -> str:
    return f"{100 * x:+.1f}"


LEVELS = {
    "questions": "questions resampled (one seed: training's own variance is not in it)",
    "seeds x questions": "seeds, then questions resampled (training's variance included)",
    "exact binomial": "every score 0 (or 1): the exact binomial bound",
}


def report_markdown(report: dict[str, Any]) -> str:
    level = round(100 * report["confidence"])
    lines = []
    if report.get("interim"):
        done, left = report["interim"]["finished"], report["interim"]["to_come"]
        lines += [
            f"**Interim: {len(done)} of {len(done) + len(left)} evaluations finished.** Every number below is "
            "of those only; an arm with fewer seeds than planned has wider seed-level intervals, or none.",
            "",
        ]
        if left:
            lines += [f"Still to come: {', '.join(left)}", ""]
    if report.get("arms"):
        lines += ["### Arms (what each changes against the base recipe)", ""]
        lines += [f"- `{arm}`: {change}" for arm, change in report["arms"].items()]
        lines.append("")
    lines += [
        f"### Held-out scores ({level}% intervals; the levels column says what each resamples)",
        "",
        "| arm | engine | dataset | n | seeds | EM | F1 | cover-EM | levels (EM) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(report["rows"], key=lambda r: (r["dataset"], r["engine"], r["arm"])):
        cells = [f"{_pct(row[k])} [{_pct(row[k + '_low'])}, {_pct(row[k + '_high'])}]" for k in METRICS]
        lines.append(
            f"| {row['arm']} | {row['engine']} | {row['dataset']} | {row['n']} | {row['seeds']} | "
            + " | ".join(cells)
            + f" | {row['em_levels']} |"
        )
    used = sorted({row["em_levels"] for row in report["rows"]})
    lines += ["", *[f"- {name}: {LEVELS[name]}" for name in used]]
    if inf := report.get("inference"):
        boot = inf["bootstrap"]
        lines += [
            "",
            f"Inference: the bootstrap draws {boot['resamples']} resamples (seed {boot['seed']}). Which one "
            f"governs a comparison: {inf['governs']} ({inf['why']}).",
        ]
    if multiple := report.get("multiple_comparisons"):
        primary = multiple["primary"]
        lines += [
            "",
            f"Multiple comparisons: {multiple['family']} comparisons have a seed-level p (EM); each is shown "
            "beside its Holm-adjusted p over all of them (p Holm), which bounds the chance of any false positive "
            "among them at the nominal level. "
            + (
                f"Primary comparison (set before the runs, report.primary): `{primary}`; the others are exploratory."
                if primary
                else "No primary comparison was set (report.primary): every comparison is exploratory."
            ),
        ]
    for against in dict.fromkeys(c["reference"] for c in report["comparisons"]):
        group = [c for c in report["comparisons"] if c["reference"] == against]
        lines += [
            "",
            f"### Paired against `{against}` (same questions; {level}% intervals)",
            "",
            "| arm | engine | dataset | n | seeds | EM difference | EM ratio | detectable at 80% power | F1 difference | levels |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in sorted(group, key=lambda c: (c["dataset"], c["engine"], c["arm"])):
            em, f1 = c["em"], c["f1"]
            ratio = (
                f"{_pct(em['ratio'])}% [{_pct(em['ratio_low'])}, {_pct(em['ratio_high'])}]"
                if em["ratio_reliable"]
                else "unreliable (the reference resamples to 0)"
            )
            lines.append(
                f"| {c['arm']} | {c['engine']} | {c['dataset']} | {c['n']} | {c['seeds']} vs {c['reference_seeds']} | "
                f"{_pts(em['diff'])} [{_pts(em['diff_low'])}, {_pts(em['diff_high'])}] | {ratio} | "
                f"±{100 * em['detectable']:.1f} | {_pts(f1['diff'])} [{_pts(f1['diff_low'])}, {_pts(f1['diff_high'])}] | "
                f"{em['levels']} |"
            )
        lines += _seed_level_table(group, level)
        lines += ["", "Sentences:", ""]
        for c in sorted(group, key=lambda c: (c["dataset"], c["engine"], c["arm"])):
            s, where = c["em"], f"on {c['dataset']} with {c['engine']}"
            diff = f"{_pts(s['diff'])} EM points [{_pts(s['diff_low'])}, {_pts(s['diff_high'])}]"
            if c.get("governs") == "seed-level":
                t = s["seed_level"]
                diff = (
                    f"{_pts(s['diff'])} EM points, seed-level t interval {_t_interval(t)}, p {_p(t['p'])} "
                    f"(Holm {_p(t.get('p_holm'))}), exact permutation p {_p(t['permutation_p'])}; bootstrap, descriptive: "
                    f"[{_pts(s['diff_low'])}, {_pts(s['diff_high'])}]"
                )
            if c.get("primary"):
                diff += "; the primary comparison"
            if s["ratio_reliable"]:
                lines.append(
                    f"- {c['arm']} reaches {_pct(s['ratio'])}% of {c['reference']}'s EM "
                    f"[{_pct(s['ratio_low'])}%, {_pct(s['ratio_high'])}%] {where} ({diff})"
                )
            else:
                lines.append(
                    f"- {c['reference']}'s EM {where} can resample to 0, so no ratio: {c['arm']} differs by {diff}"
                )
    from zerosim.experiment.provenance import provenance_markdown

    lines += _cost_markdown(report.get("search_cost") or {})
    lines += _runs_markdown(report["rows"])
    lines += provenance_markdown(report["rows"])
    stages = report["manifest"]["stages"]
    if stages:
        total = sum(s["seconds"] for s in stages.values())
        lines += [
            "",
            f"### Stages ({total / 60:.1f} min in all)",
            "",
            "| stage | minutes | other processes' CPU | code |",
            "|---|---|---|---|",
        ]
        current = report["manifest"].get("code", {})
        for name, s in stages.items():
            others = s.get("others_cpu")
            attempts = s.get("attempts", 1)
            minutes = f"{s['seconds'] / 60:.1f}" + (f" ({attempts} attempts)" if attempts > 1 else "")
            lines.append(
                f"| {name} | {minutes} | {'?' if others is None else f'{others:.0%}'} | {_code(s.get('code'), current)} |"
            )
    return "\n".join(lines) + "\n"


def search_costs(stages: Sequence[Any], outputs: dict[str, dict[str, Any]], web: Any) -> dict[str, Any]:
    """Per arm: the searches its training made (all seeds), what it asked the web (training and evaluation:
    requests, cache hits, estimated cost) and what its training's searches would have cost on the web at
    ``web``'s provider and price (``search.web`` of the base recipe) — for a simulator arm, what the simulator
    saved. Empty when no stage kept a ledger (records of an older version)."""
    from eval.web import PRICE_DATE, PROVIDERS

    provider = PROVIDERS[str(web.provider)]
    price = provider.price_per_1k if web.price_per_1k is None else web.price_per_1k
    arms: dict[str, dict[str, Any]] = {}
    for stage in stages:
        ledger = (outputs.get(stage.name) or {}).get("search_ledger")
        arm = stage.meta.get("arm")
        if not ledger or arm is None:
            continue
        row = arms.setdefault(
            arm,
            {"arm": arm, "seeds": 0, "searches": 0, "web_requests": 0, "cache_hits": 0, "web_cost_usd": 0.0},
        )
        if "searches" in ledger:  # a training stage
            row["seeds"] += 1
            row["searches"] += int(ledger["searches"])
        for entry in ledger.get("web", []):
            row["web_requests"] += int(entry["requests"])
            row["cache_hits"] += int(entry["cache_hits"])
            row["web_cost_usd"] += float(entry["cost_usd"])
    for row in arms.values():
        row["searches_at_web_price_usd"] = row["searches"] * price / 1000
    source = f"list price of {PRICE_DATE}" if web.price_per_1k is None else "search.web.price_per_1k"
    return {
        "provider": provider.label,
        "price_per_1k": price,
        "price_source": source,
        "arms": list(arms.values()),
    }


def _cost_markdown(costs: dict[str, Any]) -> list[str]:
    if not costs.get("arms"):
        return []
    lines = [
        "",
        f"### Search cost (priced at {costs['provider']}, ${costs['price_per_1k']:.2f} per 1,000 requests, "
        f"{costs['price_source']})",
        "",
        "| arm | training seeds | searches in training | web requests (train + eval) | cache hits | web cost | "
        "training's searches at the web's price |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in costs["arms"]:
        lines.append(
            f"| {r['arm']} | {r['seeds']} | {r['searches']} | {r['web_requests']} | {r['cache_hits']} | "
            f"${r['web_cost_usd']:.2f} | ${r['searches_at_web_price_usd']:.2f} |"
        )
    lines += [
        "",
        "The last column is what an arm's training searches would have cost as web requests (no cache): for an "
        "arm searching the simulator, what the simulator saved.",
    ]
    return lines


def _p(p: float | None) -> str:
    return "–" if p is None else f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def _t_interval(t: dict[str, Any]) -> str:
    if t["t_low"] is None:
        return "– (the runs' differences do not vary)"
    return f"[{_pts(t['t_low'])}, {_pts(t['t_high'])}]"


def _seed_level_table(group: list[dict[str, Any]], level: int) -> list[str]:
    """The seed-level tests of one reference's comparisons (EM), and which inference governs each."""
    rows = [c for c in group if c["em"].get("seed_level")]
    if not rows:
        return []
    lines = [
        "",
        f"Seed-level tests (EM; each run's mean is one observation; {level}% t intervals):",
        "",
        "| arm | engine | dataset | runs | design | EM difference | t interval | t p | p Holm | exact permutation p (the floor it can reach) | bootstrap interval | governs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in sorted(rows, key=lambda c: (c["dataset"], c["engine"], c["arm"])):
        em, t = c["em"], c["em"]["seed_level"]
        governing = c.get("governs", "bootstrap")
        boot = f"[{_pts(em['diff_low'])}, {_pts(em['diff_high'])}]"
        lines.append(
            f"| {c['arm']} | {c['engine']} | {c['dataset']} | {c['seeds']} vs {c['reference_seeds']} | "
            f"{t['design']}: {t['t_test']} | {_pts(em['diff'])} | {_t_interval(t)} | {_p(t['p'])} | "
            f"{_p(t.get('p_holm'))}{' (primary)' if c.get('primary') else ''} | "
            f"{_p(t['permutation_p'])} (floor {_p(t['permutation_min_p'])}; {t['permutation']}) | "
            f"{boot}{' (descriptive)' if governing == 'seed-level' else ''} | {governing} |"
        )
    return lines


def _code(code: dict[str, Any] | None, current: dict[str, Any]) -> str:
    """A stage's code version, flagged when it is not the one the report was written with."""
    if not code:
        return "not recorded"
    text = code.get("commit", "")[:10] or f"zerosim {code.get('version')}"
    if code.get("dirty"):
        text += " (uncommitted changes)"
    if code.get("commit") != current.get("commit") or code.get("version") != current.get("version"):
        text += " **other code than this report's**"
    return text


def plot_report(rows: Sequence[dict[str, Any]], path: Path, reference: str) -> None:
    """EM with its interval per arm, one panel per (dataset, engine)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["dataset"], r["engine"]) for r in rows})
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.5 * max(len(panels), 1), 3.6), squeeze=False)
    for ax, (dataset, engine) in zip(axes[0], panels, strict=False):
        sub = sorted(
            (r for r in rows if (r["dataset"], r["engine"]) == (dataset, engine)), key=lambda r: r["arm"]
        )
        xs = range(len(sub))
        em = [100 * r["em"] for r in sub]
        err = [[100 * (r["em"] - r["em_low"]) for r in sub], [100 * (r["em_high"] - r["em"]) for r in sub]]
        colors = ["tab:orange" if r["arm"] == reference else "tab:blue" for r in sub]
        ax.bar(xs, em, yerr=err, color=colors, capsize=3)
        ax.set_xticks(list(xs), [r["arm"] for r in sub], rotation=35, ha="right", fontsize=8)
        ax.set_title(f"{dataset} · {engine}", fontsize=9)
        ax.set_ylabel("EM (%)")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)

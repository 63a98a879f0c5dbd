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

from zerosim.agent.rewards import METRICS as ANSWER_METRICS
from zerosim.core.data.jsonl import read_jsonl
from zerosim.core.fsutil import atomic_write_text
from zerosim.experiment.config import ExperimentConfig

METRICS = tuple(m.value for m in ANSWER_METRICS)  # em, f1, cover_em (the judge is a training reward only)


@dataclass(frozen=True)
class EvalScores:
    """One eval stage's scores: which arm and engine, and its per-question file (``questions.jsonl``)."""

    arm: str
    engine: str
    questions: str | Path


def _scores(path: str | Path) -> dict[str, dict[str, dict[str, float]]]:
    """dataset -> question id -> metric -> score, from an eval stage's questions.jsonl."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for row in read_jsonl(path):
        out.setdefault(row["dataset"], {})[row["id"]] = {m: float(row[m]) for m in METRICS}
    return out


def bootstrap_mean(values, *, confidence: float, resamples: int, seed: int) -> tuple[float, float, float]:
    """Mean and its percentile bootstrap interval (scipy)."""
    import numpy as np
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


def paired_ratio(a, b, *, confidence: float, resamples: int, seed: int) -> dict[str, float]:
    """``mean(a) / mean(b)`` and ``mean(a) - mean(b)`` with paired bootstrap intervals (questions resampled
    together). The ratio is NaN (its interval too) when ``b``'s mean is 0."""
    import numpy as np
    from scipy.stats import bootstrap

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    rng = np.random.default_rng(seed)

    def diff(x, y, axis=-1):
        return x.mean(axis=axis) - y.mean(axis=axis)

    def ratio(x, y, axis=-1):
        den = y.mean(axis=axis)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(den > 0, x.mean(axis=axis) / np.where(den > 0, den, 1), np.nan)

    out = {
        "diff": float(a.mean() - b.mean()),
        "ratio": float(a.mean() / b.mean()) if b.mean() > 0 else float("nan"),
    }
    if len(a) < 2 or (np.all(a == a[0]) and np.all(b == b[0])):
        out.update(
            diff_low=out["diff"], diff_high=out["diff"], ratio_low=out["ratio"], ratio_high=out["ratio"]
        )
        return out
    for name, stat in (("diff", diff), ("ratio", ratio)):
        if name == "ratio" and not b.mean() > 0:
            out.update(ratio_low=float("nan"), ratio_high=float("nan"))
            continue
        res = bootstrap(
            (a, b), stat, paired=True, vectorized=True, confidence_level=confidence, n_resamples=resamples,
            method="percentile", random_state=rng,
        )  # fmt: skip
        out[f"{name}_low"] = float(res.confidence_interval.low)
        out[f"{name}_high"] = float(res.confidence_interval.high)
    return out


def manifest(cfg: ExperimentConfig, records: dict[str, dict[str, Any]], evaluated: Any) -> dict[str, Any]:
    """What a reader needs to reproduce the numbers: ``records`` are the finished stages' records (by name,
    in run order), ``evaluated`` an eval stage's config (the search and rollout every policy was scored with)."""
    import importlib.metadata as md

    ws = evaluated
    corpus = {}
    for engine in cfg.eval.engines:
        if engine in ("bm25", "dense"):
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
        "stages": stage_records,
    }


def _per_question(evals: Sequence[EvalScores]):
    """(arm, engine) -> dataset -> question -> metric -> mean over seeds, and how many seeds each holds."""
    per: dict[tuple[str, str], dict[str, dict[str, dict[str, float]]]] = {}
    counts: dict[tuple[str, str], int] = {}
    for ev in evals:
        key = (ev.arm, ev.engine)
        acc = per.setdefault(key, {})
        counts[key] = counts.get(key, 0) + 1
        for dataset, questions in _scores(ev.questions).items():
            for qid, m in questions.items():
                slot = acc.setdefault(dataset, {}).setdefault(qid, {k: 0.0 for k in METRICS})
                for k in METRICS:
                    slot[k] += m[k]
    for key, data in per.items():
        for questions in data.values():
            for m in questions.values():
                for k in METRICS:
                    m[k] /= counts[key]
    return per, counts


def write_report(
    cfg: ExperimentConfig,
    evals: Sequence[EvalScores],
    records: dict[str, dict[str, Any]],
    evaluated: Any,
    root: Path,
) -> dict[str, Any]:
    """report.json / report.md / report.png in ``root`` and on the active (parent) MLflow run."""
    import mlflow

    r = cfg.report
    opts = dict(confidence=r.confidence, resamples=r.resamples, seed=r.seed)
    per, counts = _per_question(evals)
    rows = []
    for (arm, engine), data in per.items():
        for dataset, questions in data.items():
            row = {
                "arm": arm,
                "engine": engine,
                "dataset": dataset,
                "n": len(questions),
                "seeds": counts[(arm, engine)],
            }
            for k in METRICS:
                mean, low, high = bootstrap_mean([m[k] for m in questions.values()], **opts)
                row[k], row[f"{k}_low"], row[f"{k}_high"] = mean, low, high
            rows.append(row)
    comparisons = []
    for (arm, engine), data in per.items():
        ref = per.get((r.reference, engine))
        if arm == r.reference or ref is None:
            continue
        for dataset, questions in data.items():
            ref_q = ref.get(dataset, {})
            common = sorted(set(questions) & set(ref_q))
            if not common:
                continue
            entry = {
                "arm": arm,
                "reference": r.reference,
                "engine": engine,
                "dataset": dataset,
                "n": len(common),
            }
            for k in METRICS:
                stats = paired_ratio([questions[q][k] for q in common], [ref_q[q][k] for q in common], **opts)
                entry[k] = stats
            comparisons.append(entry)
    report = {
        "rows": rows,
        "comparisons": comparisons,
        "confidence": r.confidence,
        "manifest": manifest(cfg, records, evaluated),
    }
    md = report_markdown(report)
    atomic_write_text(root / "report.json", json.dumps(report, indent=2, default=str))
    atomic_write_text(root / "report.md", md)
    png = root / "report.png"
    plot_report(rows, png, reference=r.reference)
    mlflow.log_text(json.dumps(report, indent=2, default=str), "report.json")
    mlflow.log_text(md, "report.md")
    mlflow.log_artifact(str(png))
    for row in rows:
        name = f"{row['arm']}/{row['engine']}/{row['dataset']}".replace(":", "_")
        mlflow.log_metrics({f"{name}/{k}": row[k] for k in METRICS})
    return {"report": str(root / "report.json"), "rows": len(rows), "comparisons": len(comparisons)}


def _pct(x: float) -> str:
    return "–" if x != x else f"{100 * x:.1f}"


def report_markdown(report: dict[str, Any]) -> str:
    level = round(100 * report["confidence"])
    lines = [
        f"### Held-out scores ({level}% bootstrap intervals over questions)",
        "",
        "| arm | engine | dataset | n | seeds | EM | F1 | cover-EM |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(report["rows"], key=lambda r: (r["dataset"], r["engine"], r["arm"])):
        cells = [f"{_pct(row[k])} [{_pct(row[k + '_low'])}, {_pct(row[k + '_high'])}]" for k in METRICS]
        lines.append(
            f"| {row['arm']} | {row['engine']} | {row['dataset']} | {row['n']} | {row['seeds']} | "
            + " | ".join(cells)
            + " |"
        )
    if report["comparisons"]:
        lines += [
            "",
            f"### Paired against `{report['comparisons'][0]['reference']}` (same questions; {level}% intervals)",
            "",
            "| arm | engine | dataset | n | EM ratio | EM difference | F1 ratio | F1 difference |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in sorted(report["comparisons"], key=lambda c: (c["dataset"], c["engine"], c["arm"])):
            cells = []
            for k in ("em", "f1"):
                s = c[k]
                cells.append(f"{_pct(s['ratio'])}% [{_pct(s['ratio_low'])}, {_pct(s['ratio_high'])}]")
                cells.append(
                    f"{100 * s['diff']:+.1f} [{100 * s['diff_low']:+.1f}, {100 * s['diff_high']:+.1f}]"
                )
            lines.append(
                f"| {c['arm']} | {c['engine']} | {c['dataset']} | {c['n']} | " + " | ".join(cells) + " |"
            )
        lines += ["", "Sentences:", ""]
        for c in sorted(report["comparisons"], key=lambda c: (c["dataset"], c["engine"], c["arm"])):
            s = c["em"]
            if s["ratio"] == s["ratio"]:
                lines.append(
                    f"- {c['arm']} reaches {_pct(s['ratio'])}% of {c['reference']}'s EM "
                    f"[{_pct(s['ratio_low'])}%, {_pct(s['ratio_high'])}%] on {c['dataset']} with {c['engine']}"
                )
            else:
                lines.append(
                    f"- {c['reference']} scores 0 EM on {c['dataset']} with {c['engine']}: "
                    f"{c['arm']} differs by {100 * s['diff']:+.1f} points [{100 * s['diff_low']:+.1f}, {100 * s['diff_high']:+.1f}]"
                )
    stages = report["manifest"]["stages"]
    if stages:
        total = sum(s["seconds"] for s in stages.values())
        lines += [
            "",
            f"### Stages ({total / 60:.1f} min in all)",
            "",
            "| stage | minutes | other processes' CPU |",
            "|---|---|---|",
        ]
        for name, s in stages.items():
            others = s.get("others_cpu")
            attempts = s.get("attempts", 1)
            minutes = f"{s['seconds'] / 60:.1f}" + (f" ({attempts} attempts)" if attempts > 1 else "")
            lines.append(f"| {name} | {minutes} | {'?' if others is None else f'{others:.0%}'} |")
    return "\n".join(lines) + "\n"


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

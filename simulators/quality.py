"""``zerosim simulator eval``: how good is a simulator at writing useful and noisy documents?

For each question (its text is the query), the simulator is asked for ``k`` useful documents and, in the
same batched call, for ``k`` noisy ones — the training-time setting, gold answers shown as configured.
The report:

- ``useful_answer_share`` — useful-mode results in which some document contains a gold answer;
- ``noisy_clean_share`` — noisy-mode results with at least one real document and no gold answer anywhere
  (a result of failure documents only is not counted as clean: saying nothing is not being noisy);
- ``useful_doc_answer_share`` / ``noisy_doc_leak_share`` — the same per document;
- ``useful_valid_answer_share`` / ``noisy_valid_clean_share`` — the strict forms: all ``k`` documents written
  AND the mode's goal met (a noisy result of one real document and two failure fillers is answer-free, but it
  is not a search result the policy should learn from);
- ``format_valid`` — results in which all ``k`` documents were parsed (no failure document filled in);
- ``duplicate_rate`` — documents repeating an earlier document of the same result (after normalisation);
- ``mean_words`` — words per parsed document; ``docs_per_second`` — parsed documents per second of search.

Containment is whole-word on normalised text (:func:`zerosim.core.metrics.answer_in_text`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from simulators.config import SimulatorEvalConfig
from simulators.llm import FAILURE_TEXTS, build_simulator
from zerosim.core.data.jsonl import write_jsonl
from zerosim.core.data.qa import QAExample
from zerosim.core.metrics import answer_in_text, normalize_answer
from zerosim.core.search import Document, SearchEngine, SearchRequest

COLUMNS = (
    ("useful_answer_share", "useful: has answer"),
    ("noisy_clean_share", "noisy: answer-free"),
    ("useful_doc_answer_share", "useful docs w/ answer"),
    ("noisy_doc_leak_share", "noisy docs leaking"),
    ("useful_valid_answer_share", "useful: all k + answer"),
    ("noisy_valid_clean_share", "noisy: all k + answer-free"),
    ("format_valid", "format valid"),
    ("duplicate_rate", "duplicates"),
    ("mean_words", "words/doc"),
    ("docs_per_second", "docs/s"),
)


@dataclass
class QualityResult:
    run_id: str
    report: dict[str, Any]
    markdown: str
    out_dir: Path


@dataclass
class ResultScore:
    """One simulator result (k documents for one request) checked against the gold answers."""

    real: int  # documents that are not failure fillers
    with_answer: int
    duplicates: int
    words: int

    @classmethod
    def of(cls, docs: Sequence[Document], answers: Sequence[str]) -> ResultScore:
        real = [d.text for d in docs if d.text not in FAILURE_TEXTS]
        seen: set[str] = set()
        duplicates = 0
        for text in real:
            key = normalize_answer(text)
            duplicates += key in seen
            seen.add(key)
        return cls(
            real=len(real),
            with_answer=sum(answer_in_text(t, answers) for t in real),
            duplicates=duplicates,
            words=sum(len(t.split()) for t in real),
        )


def score(
    useful: Sequence[ResultScore], noisy: Sequence[ResultScore], k: int, seconds: float
) -> dict[str, float]:
    """The report's numbers from per-result scores (see the module docstring)."""
    both = [*useful, *noisy]
    real = sum(r.real for r in both)
    useful_docs = sum(r.real for r in useful)
    noisy_docs = sum(r.real for r in noisy)
    share = lambda num, den: num / den if den else 0.0  # noqa: E731
    return {
        "results": len(both),
        "useful_answer_share": share(sum(r.with_answer > 0 for r in useful), len(useful)),
        "noisy_clean_share": share(sum(r.real > 0 and r.with_answer == 0 for r in noisy), len(noisy)),
        "useful_doc_answer_share": share(sum(r.with_answer for r in useful), useful_docs),
        "noisy_doc_leak_share": share(sum(r.with_answer for r in noisy), noisy_docs),
        "useful_valid_answer_share": share(
            sum(r.real == k and r.with_answer > 0 for r in useful), len(useful)
        ),
        "noisy_valid_clean_share": share(sum(r.real == k and r.with_answer == 0 for r in noisy), len(noisy)),
        "format_valid": share(sum(r.real == k for r in both), len(both)),
        "duplicate_rate": share(sum(r.duplicates for r in both), real),
        "mean_words": share(sum(r.words for r in both), real),
        "docs_per_second": share(real, seconds),
        "seconds": seconds,
    }


def evaluate(
    engine: SearchEngine, questions: Sequence[QAExample], *, k: int, batch_size: int, progress: bool = True
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Ask ``engine`` for useful and noisy results for every question; returns the report and the rows."""
    useful: list[ResultScore] = []
    noisy: list[ResultScore] = []
    rows: list[dict[str, Any]] = []
    seconds = 0.0
    batches = [questions[i : i + batch_size] for i in range(0, len(questions), batch_size)]
    for batch in tqdm(batches, desc="simulator quality", unit="batch", disable=not progress):
        requests = [
            SearchRequest(query=q.question, question=q.question, answers=q.golden_answers, noise=(noisy,) * k)
            for noisy in (False, True)
            for q in batch
        ]
        started = time.perf_counter()
        results = engine.search(requests, k)
        seconds += time.perf_counter() - started
        for req, docs in zip(requests, results, strict=True):
            mode_noisy = bool(req.noise and req.noise[0])
            s = ResultScore.of(docs, req.answers)
            (noisy if mode_noisy else useful).append(s)
            rows.append(
                {
                    "mode": "noisy" if mode_noisy else "useful",
                    "query": req.query,
                    "answers": list(req.answers),
                    "documents": [d.text for d in docs],
                    "with_answer": s.with_answer,
                    "parsed": s.real,
                }
            )
    return score(useful, noisy, k, seconds), rows


def markdown_table(report: dict[str, Any], model: str) -> str:
    head = "| simulator | n | " + " | ".join(title for _, title in COLUMNS) + " |"
    sep = "|---|---|" + "---|" * len(COLUMNS)

    def cell(key: str) -> str:
        value = report[key]
        return f"{value:.1f}" if key in ("mean_words", "docs_per_second") else f"{100 * value:.1f}"

    row = f"| {model} | {report['results'] // 2} | " + " | ".join(cell(k) for k, _ in COLUMNS) + " |"
    return "\n".join([head, sep, row]) + "\n"


def _plot(report: dict[str, Any], title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k, _ in COLUMNS if k not in ("mean_words", "docs_per_second")]
    fig, ax = plt.subplots(figsize=(8, 3.5), constrained_layout=True)
    ax.barh([dict(COLUMNS)[k] for k in keys][::-1], [100 * report[k] for k in keys][::-1], color="tab:blue")
    ax.set_xlim(0, 100)
    ax.set_xlabel("%")
    ax.set_title(title)
    for y, v in enumerate([100 * report[k] for k in keys][::-1]):
        ax.text(min(v + 1, 90), y, f"{v:.1f}", va="center")
    return fig


def run_quality(
    cfg: SimulatorEvalConfig,
    *,
    engine: SearchEngine | None = None,
    progress: bool = True,
) -> QualityResult:
    """Evaluate the configured simulator; writes table.json/table.md/samples.jsonl and an MLflow run.

    The simulator is ``engine``, or the one ``cfg.simulator`` describes (without its cache: the report
    measures the model), built once the questions are read.
    """
    import matplotlib.pyplot as plt
    import mlflow

    from zerosim.core.data.embedded import load_questions
    from zerosim.core.fsutil import atomic_write_text
    from zerosim.core.tracking import check_tracking_uri, log_config, mlflow_run

    check_tracking_uri(cfg.tracking.tracking_uri)  # the MLflow store, tried before the simulator loads
    questions = load_questions(cfg.data, cfg.split, limit=cfg.limit)
    if not questions:
        raise ValueError(f"{cfg.data} ({cfg.split}) holds no questions to evaluate the simulator on")
    sim_cfg = dataclasses.replace(cfg.simulator, cache=False)  # measure the model, not a cache
    if engine is None:
        engine = build_simulator(sim_cfg, seed=cfg.seed)
    model = cfg.simulator.served_model or cfg.simulator.model
    path = Path(model)
    run_name = cfg.run_name or f"quality-{path.parent.name if path.name == 'final' else path.name or model}"
    out_dir = Path(cfg.output_dir) / run_name
    tags = {"zerosim.job": "simulator-eval", "zerosim.simulator": model}
    with mlflow_run(cfg.tracking, run_name, tags=tags) as run:
        log_config(cfg)
        report, rows = evaluate(engine, questions, k=cfg.k, batch_size=cfg.batch_size, progress=progress)
        stats = getattr(engine, "stats", {})
        report.update({f"simulator_{k}": v for k, v in sorted(stats.items())})
        md = markdown_table(report, model)
        atomic_write_text(out_dir / "table.json", json.dumps(report, indent=2, sort_keys=True))
        atomic_write_text(out_dir / "table.md", md)
        write_jsonl(out_dir / "samples.jsonl", rows)
        mlflow.log_metrics({k: float(v) for k, v in report.items()})
        mlflow.log_artifact(str(out_dir / "table.json"))
        mlflow.log_artifact(str(out_dir / "table.md"))
        mlflow.log_artifact(str(out_dir / "samples.jsonl"))
        fig = _plot(report, f"simulator quality: {model}")
        mlflow.log_figure(fig, "plots/quality.png")
        plt.close(fig)
    close = getattr(engine, "close", None)
    if callable(close):
        close()
    return QualityResult(run.info.run_id, report, md, out_dir)

"""``zerosim eval``: load the policy, the engine and the datasets, evaluate, write the table, log to MLflow."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eval.harness import DatasetResult, Evaluator, markdown_table, table
from zerosim.config import EvalConfig
from zerosim.data.embedded import load_questions
from zerosim.fsutil import atomic_write_text
from zerosim.tracking import log_config, log_jsonl, mlflow_run


@dataclass
class EvalResult:
    run_id: str
    rows: list[dict[str, Any]]
    markdown: str
    out_dir: Path


def parse_dataset(spec: str, default_split: str) -> tuple[str, str, str]:
    """``"factbook:dev"`` → (display name, source, split). A bare name uses ``default_split``."""
    source, sep, split = spec.rpartition(":")
    if not sep or "/" in split or split.endswith((".jsonl", ".parquet")):
        source, split = spec, default_split
    name = Path(source).stem if source.endswith((".jsonl", ".parquet")) else source
    return (f"{name}:{split}" if split != default_split else name), source, split


def _training_run_of(policy_path: str) -> str | None:
    """The MLflow run whose final checkpoint is ``policy_path``, when it is in the same store."""
    import mlflow

    path = Path(policy_path)
    if not path.exists():
        return None
    runs = mlflow.search_runs(
        search_all_experiments=True,
        filter_string=f"tags.`zerosim.checkpoint` = '{path.resolve()}'",
        output_format="list",
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


def run_eval(cfg: EvalConfig, progress: bool = True) -> EvalResult:
    import mlflow
    import torch

    from zerosim.engines import build_search_engine
    from zerosim.models import load_causal_lm, load_tokenizer

    torch.manual_seed(cfg.seed)
    datasets = [parse_dataset(spec, cfg.split) for spec in cfg.datasets]
    loaded = [(name, load_questions(source, split, limit=cfg.limit)) for name, source, split in datasets]
    tokenizer = load_tokenizer(cfg.policy)
    model = load_causal_lm(cfg.policy, cfg.dtype)
    engine = (
        None if cfg.method == "direct" else build_search_engine(cfg.search, seed=cfg.seed, dtype=cfg.dtype)
    )
    evaluator = Evaluator(cfg, model, tokenizer, engine)
    engine_name = "none" if cfg.method == "direct" else cfg.search.engine
    run_name = cfg.run_name or f"{cfg.method}-{engine_name}"
    out_dir = Path(cfg.output_dir) / run_name
    out_dir.mkdir(parents=True, exist_ok=True)

    tags = {"zerosim.job": "eval", "zerosim.policy": cfg.policy, "zerosim.method": cfg.method}
    with mlflow_run(cfg.tracking, run_name, tags=tags) as run:
        train_run = _training_run_of(cfg.policy)
        if train_run:
            mlflow.set_tag("zerosim.train_run_id", train_run)
        log_config(cfg)
        results: list[DatasetResult] = [evaluator.evaluate(name, rows, progress) for name, rows in loaded]
        rows = table(results)
        title = f"{cfg.method} · search={engine_name} · policy={cfg.policy}"
        md = markdown_table(rows, title)
        for row in rows:
            prefix = row["dataset"].replace(":", "_")  # MLflow metric names allow no colon
            mlflow.log_metrics({f"{prefix}/{k}": v for k, v in row.items() if k != "dataset" and v == v})
        samples = [
            {"dataset": r.name, **asdict(row)}
            for r in results
            for row in r.rows[: cfg.num_sample_trajectories]
        ]
        atomic_write_text(out_dir / "table.json", json.dumps(rows, indent=2, sort_keys=True))
        atomic_write_text(out_dir / "table.md", md)
        mlflow.log_text(json.dumps(rows, indent=2, sort_keys=True), "table.json")
        mlflow.log_text(md, "table.md")
        log_jsonl(samples, "samples/trajectories.jsonl")
        return EvalResult(run.info.run_id, rows, md, out_dir)

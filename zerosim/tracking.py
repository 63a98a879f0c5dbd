"""MLflow tracking shared by every job: training, simulator SFT, evaluation.

One run per job. The resolved config goes in as params (flattened ``section.key``) and as a YAML
artifact; metrics use namespaces (``curriculum/…``, ``rollout/…``, ``search/…``, ``time/…``) listed in
docs/metrics.md.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from zerosim.config import TrackingConfig, flatten, to_yaml


def configure(tracking: TrackingConfig) -> None:
    """Point MLflow (and transformers' MLflowCallback, which reads the env) at the configured store."""
    import mlflow

    os.environ["MLFLOW_TRACKING_URI"] = tracking.tracking_uri
    mlflow.set_tracking_uri(tracking.tracking_uri)
    mlflow.set_experiment(tracking.experiment)


@contextlib.contextmanager
def mlflow_run(
    tracking: TrackingConfig,
    run_name: str,
    tags: Mapping[str, str] | None = None,
    run_id: str | None = None,
) -> Iterator[Any]:
    """Start (and always end) an MLflow run; a failure marks the run FAILED instead of leaving it RUNNING.

    With ``run_id`` the existing run is continued (a resumed training job logs into its first run).
    """
    import mlflow

    configure(tracking)
    if run_id is not None:
        run = mlflow.start_run(run_id=run_id)
        if tags:
            mlflow.set_tags(dict(tags))
    else:
        run = mlflow.start_run(run_name=run_name, tags=dict(tags or {}))
    try:
        yield run
    except BaseException:
        mlflow.end_run(status="FAILED")
        raise
    else:
        mlflow.end_run()


def log_config(cfg: Any, prefix: str = "") -> None:
    """Resolved config as params (names prefixed by ``prefix``) and as ``config.yaml``.

    Jobs that also run a transformers ``Trainer`` pass a prefix: its MLflow callback logs the
    ``TrainingArguments`` (``output_dir``, ``dtype``, ...) and MLflow refuses a param logged twice with
    different values.
    """
    import mlflow

    params = {f"{prefix}{k}": ("None" if v is None else v) for k, v in flatten(cfg).items()}
    mlflow.log_params(params)
    mlflow.log_text(to_yaml(cfg), "config.yaml")


def log_jsonl(rows: Iterable[Mapping[str, Any]], artifact_file: str) -> None:
    """Rows as a JSON-lines artifact."""
    import mlflow

    text = "".join(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows)
    mlflow.log_text(text, artifact_file)


PLOTTED = (
    ("reward", "reward"),
    ("rollout/em", "exact match"),
    ("rollout/f1", "answer F1"),
    ("rollout/answer_echo_rate", "answer restates the question"),
    ("curriculum/noise_prob", "scheduled noise p(i)"),
    ("search/noisy_doc_share", "noisy share served"),
    ("rollout/searches_per_traj", "searches / trajectory"),
    ("rollout/valid_format_rate", "valid format rate"),
    ("rollout/answer_rate", "answer rate"),
)


SFT_PLOTTED = (
    ("loss", "training loss"),
    ("mean_token_accuracy", "token accuracy"),
    ("learning_rate", "learning rate"),
)
DPO_PLOTTED = (
    ("loss", "training loss"),
    ("rewards/margins", "reward margin (preferred - other)"),
    ("rewards/accuracies", "preference accuracy"),
    ("learning_rate", "learning rate"),
)


def log_training_curves(
    log_history: list[dict[str, Any]],
    artifact_file: str = "plots/training.png",
    plotted: Sequence[tuple[str, str]] = PLOTTED,
) -> None:
    """Plot per-step curves (``plotted``: (log key, title) pairs) from a trainer's log history as a PNG.

    The default set is what people compare RL runs by: reward, curriculum, search behaviour.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import mlflow

    cols = min(3, len(plotted))
    rows = -(-len(plotted) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), constrained_layout=True, squeeze=False)
    for ax in axes.flat[len(plotted) :]:
        ax.set_visible(False)
    for ax, (key, title) in zip(axes.flat, plotted, strict=False):
        points = [(row["step"], row[key]) for row in log_history if key in row and row[key] is not None]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="o", markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    mlflow.log_figure(fig, artifact_file)
    plt.close(fig)

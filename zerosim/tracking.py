"""MLflow tracking shared by every job: training, simulator SFT, evaluation.

One run per job. The resolved config goes in as params (flattened ``section.key``) and as a YAML
artifact; metrics use namespaces (``curriculum/…``, ``rollout/…``, ``search/…``, ``time/…``) listed in
docs/metrics.md.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
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
    tracking: TrackingConfig, run_name: str, tags: Mapping[str, str] | None = None
) -> Iterator[Any]:
    """Start (and always end) an MLflow run; a failure marks the run FAILED instead of leaving it RUNNING."""
    import mlflow

    configure(tracking)
    run = mlflow.start_run(run_name=run_name, tags=dict(tags or {}))
    try:
        yield run
    except BaseException:
        mlflow.end_run(status="FAILED")
        raise
    else:
        mlflow.end_run()


def log_config(cfg: Any) -> None:
    """Resolved config as params and as ``config.yaml``."""
    import mlflow

    params = {k: ("None" if v is None else v) for k, v in flatten(cfg).items()}
    mlflow.log_params(params)
    mlflow.log_text(to_yaml(cfg), "config.yaml")


def log_jsonl(rows: Iterable[Mapping[str, Any]], artifact_file: str) -> None:
    """Rows as a JSON-lines artifact."""
    import mlflow

    text = "".join(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows)
    mlflow.log_text(text, artifact_file)

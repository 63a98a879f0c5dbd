"""What a stage logged to MLflow, so that it travels with the stage's results: the runs a stage started
(finished or not), and each run's metrics (``metrics.csv``: step, metric, value) and sample trajectories
(``samples/``) copied out of the store.

A surprising score — a run that collapsed onto one answer, a stage that failed half-way — is read in its
training curves and trajectories; an export that carried them only for finished stages left the run that
mattered most unreadable. So the experiment notes every MLflow run a stage's attempt started (nested under the
experiment's parent run) in ``attempt.json`` while it runs and in its record when it finishes, and the export
copies the logs of every stage that has a run.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zerosim.core.fsutil import read_json

ATTEMPT_FILE = "attempt.json"  # a running stage's time so far, and the MLflow runs its attempts started
SAMPLES = "samples"  # a run's artifacts that travel: its sample trajectories (small JSONL)
METRICS = "metrics.csv"
RUN_FILE = "mlflow_run.json"  # a training job's run id, in <stage>/<run name>/ (written at its start)


def runs_started(parent_run_id: str, since_ms: int, tracking_uri: str | None = None) -> list[str]:
    """The MLflow runs nested under ``parent_run_id`` that started at or after ``since_ms`` (epoch ms), in
    the order they started: the runs a stage's attempt started (stages run one at a time)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(
        experiments,
        filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.start_time >= {since_ms}",
        order_by=["attributes.start_time ASC"],
    )
    return [r.info.run_id for r in runs]


def stage_runs(folder: Path, record: Mapping[str, Any] | None) -> list[str]:
    """Every MLflow run id a stage's folder knows of: its record's (``outputs.run_id``, ``runs``), its
    attempts' (``attempt.json``), and a training job's ``mlflow_run.json``."""
    outputs = (record or {}).get("outputs") or {}
    found = [outputs.get("run_id"), *((record or {}).get("runs") or [])]
    found += (read_json(folder / ATTEMPT_FILE) or {}).get("runs") or []
    for path in sorted(folder.glob(f"*/{RUN_FILE}")):
        if path.is_file() and not path.is_symlink():
            found.append((read_json(path) or {}).get("run_id"))
    return [r for r in dict.fromkeys(found) if isinstance(r, str) and r]


def export_logs(run_ids: list[str], tracking_uri: str | None, dst: Path) -> int:
    """Write ``dst/metrics.csv`` (every metric of ``run_ids``: step, metric, value, timestamp, run_id) and
    ``dst/samples/`` (their sample trajectories); how many files. A run the store does not hold (results
    imported from another machine) gives nothing."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient(tracking_uri)
    rows, written = [], 0
    for run_id in run_ids:
        try:
            keys = sorted(client.get_run(run_id).data.metrics)
            for key in keys:
                history = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
                rows += [(m.step, key, m.value, m.timestamp, run_id) for m in history]
            samples = [a.path for a in client.list_artifacts(run_id, SAMPLES) if not a.is_dir]
        except (MlflowException, OSError):
            continue
        if samples:
            dst.mkdir(parents=True, exist_ok=True)
            client.download_artifacts(run_id, SAMPLES, str(dst))  # the folder: dst/samples/<file>
            written += len(samples)
    if rows:
        dst.mkdir(parents=True, exist_ok=True)
        with (dst / METRICS).open("w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["step", "metric", "value", "timestamp", "run_id"])
            out.writerows(rows)
        written += 1
    return written


# what the report reads of each training run, beside its held-out scores: how often its actions were invalid
INVALID_ACTIONS = "rollout/invalid_action_rate"  # trajectories with an invalid action (either protocol)
INVALID_CALLS = "tools/invalid_call_share"  # a step's invalid share of its tool calls (protocol tools)
CALLS = "tools/calls_per_traj"
TRAINING_SIGNALS = (INVALID_ACTIONS, INVALID_CALLS, CALLS)


def stage_metrics(
    folder: Path, record: Mapping[str, Any] | None, tracking_uri: str | None, names: tuple[str, ...]
) -> dict[str, dict[int, float]]:
    """metric -> {step: value} of a stage's runs, for ``names``: from the MLflow store where it holds them,
    else from the stage's exported ``mlflow/metrics.csv`` (a stage imported from another machine). A step
    logged twice (a resumed or rolled-back run) keeps its last value: the history the stage's result went
    through."""
    import mlflow
    from mlflow.exceptions import MlflowException

    logged: list[tuple[str, int, int, float]] = []  # metric, step, timestamp, value
    client = mlflow.MlflowClient(tracking_uri)
    for run_id in stage_runs(folder, record):
        for name in names:
            try:
                history = client.get_metric_history(run_id, name)
            except (MlflowException, OSError):
                break  # a run this store does not hold
            logged += [(name, m.step, m.timestamp, m.value) for m in history]
    if not logged and (folder / "mlflow" / METRICS).is_file():
        with (folder / "mlflow" / METRICS).open(newline="") as f:
            for row in csv.DictReader(f):
                if row["metric"] in names:
                    logged.append(
                        (row["metric"], int(row["step"]), int(row["timestamp"]), float(row["value"]))
                    )
    out: dict[str, dict[int, float]] = {}
    for name, step, _, value in sorted(logged, key=lambda m: (m[1], m[2])):
        out.setdefault(name, {})[step] = value
    return out


def training_signals(history: Mapping[str, Mapping[int, float]]) -> dict[str, Any] | None:
    """A training run's invalid actions, from its per-step metrics (:func:`stage_metrics`): the share of
    trajectories with an invalid action at its first and last step and over all steps, and, under the tools
    protocol, the share of all its tool calls that were invalid (each step's share weighted by its calls).
    None when the run logged neither."""
    actions = history.get(INVALID_ACTIONS) or {}
    if not actions:
        return None
    steps = sorted(actions)
    out: dict[str, Any] = {
        "steps": len(steps),
        "invalid_actions_first": actions[steps[0]],
        "invalid_actions_last": actions[steps[-1]],
        "invalid_actions_mean": sum(actions.values()) / len(steps),
        "invalid_call_share": None,
    }
    shares, calls = history.get(INVALID_CALLS) or {}, history.get(CALLS) or {}
    if shares and calls:
        total = sum(calls.get(step, 0.0) for step in shares)
        out["invalid_call_share"] = (
            sum(share * calls.get(step, 0.0) for step, share in shares.items()) / total if total else 0.0
        )
    return out

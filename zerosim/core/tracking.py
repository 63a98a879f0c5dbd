"""MLflow tracking shared by every job: training, simulator SFT, evaluation.

One run per job. The resolved config goes in as params (flattened ``section.key``) and as a YAML
artifact; metrics use namespaces (``curriculum/…``, ``rollout/…``, ``search/…``, ``time/…``) listed in
docs/metrics.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zerosim.core.config import ConfigError, flatten, ranged, to_yaml
from zerosim.core.data.jsonl import jsonl_text


@dataclass
class TrackingConfig:
    # MLflow tracking URI (sqlite file in the working dir by default)
    tracking_uri: str = "sqlite:///mlflow.db"
    # MLflow experiment name
    experiment: str = "zerosim"
    # trajectories per step written to the samples artifact
    num_sample_trajectories: int = ranged(4, ">=0")
    # keep sample trajectories every N steps
    sample_every: int = ranged(1, ">=1")
    # nest this job's run under that active MLflow run (set by zerosim experiment)
    parent_run_id: str | None = None
    # log the final checkpoint to the run as an MLflow model (transformers flavour; the folder is copied in)
    log_model: bool = False


def configure(tracking: TrackingConfig, experiment: bool = True) -> None:
    """Point MLflow (and transformers' MLflowCallback, which reads the env) at the configured store."""
    import mlflow

    os.environ["MLFLOW_TRACKING_URI"] = tracking.tracking_uri
    mlflow.set_tracking_uri(tracking.tracking_uri)
    if experiment:
        mlflow.set_experiment(tracking.experiment)


@contextlib.contextmanager
def mlflow_run(
    tracking: TrackingConfig,
    run_name: str,
    tags: Mapping[str, str] | None = None,
    run_id: str | None = None,
) -> Iterator[Any]:
    """Start (and always end) an MLflow run; a failure marks the run FAILED instead of leaving it RUNNING.

    With ``run_id`` the existing run is continued (a resumed training job logs into its first run, in that
    run's experiment): :func:`log_metrics` then leaves out every (metric, step) the run already holds.
    """
    import mlflow

    configure(tracking, experiment=run_id is None)
    # a stage of `zerosim experiment`: a nested run under the experiment's run (active in this process)
    nesting = {"nested": True, "parent_run_id": tracking.parent_run_id} if tracking.parent_run_id else {}
    if run_id is not None:
        from mlflow.exceptions import MlflowException

        try:
            found = mlflow.MlflowClient().get_run(run_id)
        except MlflowException as exc:
            raise ConfigError(
                f"MLflow run {run_id} (the run this job continues) is not in {tracking.tracking_uri}: "
                "resume with the tracking.tracking_uri the run was started with"
            ) from exc
        # the run's own experiment, whatever tracking.experiment says now
        mlflow.set_experiment(experiment_id=found.info.experiment_id)
        _LOGGED[run_id] = logged_steps(run_id)
        run = mlflow.start_run(run_id=run_id, **nesting)
        if tags:
            mlflow.set_tags(dict(tags))
    else:
        run = mlflow.start_run(run_name=run_name, tags=dict(tags or {}), **nesting)
    try:
        yield run
    except BaseException:
        mlflow.end_run(status="FAILED")
        raise
    else:
        mlflow.end_run()
    finally:
        _LOGGED.pop(run.info.run_id, None)


# run id -> metric key -> the last step the run holds (from a killed attempt too, when it was continued)
_LOGGED: dict[str, dict[str, int]] = {}


def logged_steps(run_id: str) -> dict[str, int]:
    """The last step logged for each metric of ``run_id``."""
    import mlflow

    client = mlflow.MlflowClient()
    keys = client.get_run(run_id).data.metrics
    return {key: max(m.step for m in client.get_metric_history(run_id, key)) for key in keys}


def log_metrics(metrics: Mapping[str, float], step: int) -> None:
    """``mlflow.log_metrics`` at ``step``, written before it returns, less what the run already holds.

    Each metric gets at most one value per step: a resumed job redoes the steps after its checkpoint, and
    those the killed attempt had already logged are not logged again (the run keeps the first values);
    transformers' closing summary does not log ``epoch`` a second time at the last step. Synchronous, so a
    metric logged before a checkpoint completes is in the store if the job dies after.
    """
    import mlflow

    run = mlflow.active_run()
    held = _LOGGED.setdefault(run.info.run_id, {}) if run is not None else {}
    fresh = {k: v for k, v in metrics.items() if step > held.get(k, -1)}
    if fresh:
        mlflow.log_metrics(fresh, step=step, synchronous=True)
        held.update(dict.fromkeys(fresh, step))


class _LoggedOnce:
    """The ``mlflow`` module as transformers' ``MLflowCallback`` uses it, with its metrics going through
    :func:`log_metrics` and its params logged only where the run has none of that name (a resumed run
    keeps its first values; MLflow refuses to change a param)."""

    def __getattr__(self, name: str) -> Any:
        import mlflow

        return getattr(mlflow, name)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None, **_: Any) -> None:
        log_metrics(metrics, step=int(step or 0))

    def log_params(self, params: Mapping[str, Any], **_: Any) -> None:
        import mlflow

        held = mlflow.MlflowClient().get_run(mlflow.active_run().info.run_id).data.params
        new = {k: v for k, v in params.items() if k not in held}
        if new:
            mlflow.log_params(new, synchronous=True)


def trainer_mlflow_callback():
    """transformers' ``MLflowCallback`` (what ``report_to=["mlflow"]`` adds) logging through
    :func:`log_metrics`: synchronously, and each (metric, step) of a continued run once."""
    from transformers.integrations import MLflowCallback

    callback = MLflowCallback()
    callback._ml_flow = _LoggedOnce()
    return callback


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


def log_model(
    checkpoint: str | os.PathLike, *, name: str = "model", validation_table: str | None = None
) -> str:
    """The saved checkpoint folder as the active run's MLflow model (``tracking.log_model``); its URI.

    Logged with ``mlflow.transformers.log_model`` from the folder itself (task ``text-generation``): nothing
    is loaded or saved again, the files are copied into the run's artifacts, and
    ``mlflow.transformers.load_model(uri)`` gives the model back (docs/tracking.md). The model (metadata and
    tags) and the run (tags) link the run's ``config.yaml`` (``zerosim.config``) and, where the run has one,
    its validation table (``validation_table``, an artifact path of the run: ``zerosim.validation_table``);
    the run is tagged ``zerosim.model_uri``. A later ``zerosim eval`` of the checkpoint links its table
    (:func:`link_eval_table`).
    """
    import mlflow
    import mlflow.transformers

    run = mlflow.active_run()
    if run is None:
        raise RuntimeError("log_model needs an active MLflow run (mlflow_run)")
    links = {"zerosim.config": f"runs:/{run.info.run_id}/config.yaml"}
    if validation_table is not None:
        links["zerosim.validation_table"] = f"runs:/{run.info.run_id}/{validation_table}"
    from importlib.metadata import version

    # what loading it back needs, pinned to this environment (MLflow's own default list asks for torchvision)
    requirements = [
        f"{p}=={version(p).split('+')[0]}" for p in ("torch", "transformers", "tokenizers", "safetensors")
    ]
    info = mlflow.transformers.log_model(
        str(checkpoint),
        name=name,
        task="text-generation",
        metadata=links,
        tags=links,
        pip_requirements=requirements,
    )
    mlflow.set_tags({**links, "zerosim.model_uri": info.model_uri})
    return info.model_uri


def link_eval_table(train_run_id: str, eval_run_id: str, artifact: str = "table.json") -> None:
    """Tag the run that trained an evaluated checkpoint, and the model it logged (``zerosim.model_uri``),
    with ``zerosim.eval_table`` = the eval run's ``artifact`` (the latest evaluation wins)."""
    import mlflow

    link = {"zerosim.eval_table": f"runs:/{eval_run_id}/{artifact}"}
    client = mlflow.MlflowClient()
    client.set_tag(train_run_id, "zerosim.eval_table", link["zerosim.eval_table"])
    model_uri = client.get_run(train_run_id).data.tags.get("zerosim.model_uri", "")
    if model_uri.startswith("models:/"):
        mlflow.set_logged_model_tags(model_uri.removeprefix("models:/"), link)


def log_jsonl(rows: Iterable[Mapping[str, Any]], artifact_file: str) -> None:
    """Rows as a JSON-lines artifact (:func:`zerosim.core.data.jsonl.jsonl_text`, keys sorted)."""
    import mlflow

    mlflow.log_text(jsonl_text(rows, sort_keys=True), artifact_file)


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


def code_version() -> dict[str, Any]:
    """Which code is running: ``{"version": zerosim's, "commit": the checkout's HEAD, "dirty": whether tracked
    files differ from it}``; outside a git checkout (an installed package), the version alone."""
    import subprocess
    from pathlib import Path

    from zerosim import __version__

    out: dict[str, Any] = {"version": __version__}
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0 or not (root / ".git").exists():
            return out
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):  # no git here
        return out
    out["commit"] = head.stdout.strip()
    out["dirty"] = bool(status.stdout.strip())
    return out


def check_tracking_uri(uri: str | None, key: str = "tracking.tracking_uri") -> None:
    """Refuse, before anything runs, a local MLflow store this process could not write: a sqlite file (or a
    file store's folder) whose folder is missing or read-only, or a read-only file. Creates nothing; a
    server URI (http, https, databricks) is the server's to answer."""
    from pathlib import Path
    from urllib.parse import urlsplit

    if not uri:
        return
    scheme = urlsplit(uri).scheme
    if scheme == "sqlite":
        path = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
        what = "sqlite file"
    elif scheme in ("", "file"):
        path, what = Path(uri.removeprefix("file://")), "store folder"
    else:
        return
    if path is None or str(path) in ("", ":memory:"):
        return
    path = path.expanduser()
    target = path if path.exists() else path.parent
    while not target.exists() and target != target.parent and what == "store folder":
        target = target.parent  # mlflow makes a file store's missing folders
    problem = None
    if not target.exists():
        problem = f"its folder {target} does not exist"
    elif path.exists() and path.is_dir() and what == "sqlite file":
        problem = f"{path} is a folder"
    elif not os.access(target, os.W_OK):
        problem = f"{target} is not writable"
    if problem:
        raise ConfigError(
            f"{key}={uri}: MLflow could not write this {what}: {problem}. Fix: point {key} at a writable place, "
            "e.g. sqlite:///mlflow.db (in the working directory)"
        )

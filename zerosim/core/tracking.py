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
from pathlib import Path
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


def refuse_log_model(tracking: TrackingConfig, prefix: str, *, job: str, trainer: str) -> None:
    """Refuse ``tracking.log_model=true`` on ``job``, which trains no model and so has none to log; the fix
    names ``trainer``, the job that writes the model."""
    if tracking.log_model:
        raise ConfigError(
            f"{prefix}tracking.log_model=true: {job} trains no model, so it has none to log; set "
            f"tracking.log_model=true on {trainer}, and {prefix}tracking.log_model=false here"
        )


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
        # a store gone mid-run fails this too: the job's own error is the one to report
        with contextlib.suppress(Exception):
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


def code_version(root: str | Path | None = None) -> dict[str, Any]:
    """Which code is running: ``{"version": zerosim's, "commit": the checkout's HEAD, "dirty": whether tracked
    files differ from it}``, with ``"diff_sha256"`` (of :func:`code_diff`) when they do, so "which code produced
    this" stays answerable; outside a git checkout (an installed package), the version alone. ``root``: the
    checkout (default: the one this module is in)."""
    import hashlib
    import subprocess

    from zerosim import __version__

    out: dict[str, Any] = {"version": __version__}
    root = Path(__file__).resolve().parents[2] if root is None else Path(root)
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
    diff = code_diff(root) if out["dirty"] else None
    if diff is not None:
        out["diff_sha256"] = hashlib.sha256(diff.encode()).hexdigest()
    return out


def code_diff(root: str | Path | None = None) -> str | None:
    """``git diff HEAD`` of the checkout (tracked files: what ``dirty`` means; files git does not track are
    not in it), or None outside a checkout, with no changes, or where git fails."""
    import subprocess

    root = Path(__file__).resolve().parents[2] if root is None else Path(root)
    try:
        diff = subprocess.run(
            ["git", "-C", str(root), "diff", "HEAD", "--binary", "--no-color", "--no-ext-diff"],
            capture_output=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if diff.returncode != 0 or not diff.stdout:
        return None
    return diff.stdout.decode("utf-8", errors="replace")  # --binary writes binary files as ASCII


def check_tracking_uri(uri: str | None, key: str = "tracking.tracking_uri", timeout: float = 5.0) -> None:
    """Refuse, before anything runs, an MLflow store this job could not use, trying it for real (``os.access``
    says yes to root everywhere, /proc included): for a sqlite file, a file made and removed in its folder and
    the file itself opened when it exists; for a file store, a file made and removed in its folder (or the
    nearest folder that exists: MLflow makes the rest); for a server (http, https), a GET of its experiments
    search within ``timeout`` seconds. Leaves nothing behind; other schemes (databricks …) are not tried."""
    from pathlib import Path
    from urllib.parse import urlsplit

    if not uri:
        return
    scheme = urlsplit(uri).scheme
    if scheme in ("http", "https"):
        _check_server(uri, key, timeout)
        return
    if scheme == "sqlite":
        text = uri.removeprefix("sqlite:///").split("?", 1)[0] if uri.startswith("sqlite:///") else ""
        path, what = Path(text), "sqlite file"
    elif scheme in ("", "file"):
        text = uri.removeprefix("file://") if uri.startswith("file://") else uri.removeprefix("file:")
        path, what = Path(text), "store folder"
    else:
        return
    if str(path) in ("", ".", ":memory:") and what == "sqlite file":
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
    else:
        folder = target if target.is_dir() else target.parent
        problem = _write_probe(folder)
        if problem is None and what == "sqlite file" and path.is_file():
            problem = _sqlite_probe(path)
    if problem:
        raise ConfigError(
            f"{key}={uri}: MLflow could not write this {what}: {problem}. Fix: point {key} at a writable place, "
            "e.g. sqlite:///mlflow.db (in the working directory)"
        )


def _write_probe(folder: Any) -> str | None:
    """Why a file cannot be made (and removed) in ``folder``; None when it can."""
    import tempfile

    try:
        fd, name = tempfile.mkstemp(prefix=".zerosim-store-check-", dir=folder)
    except OSError as exc:
        return f"{folder} is not writable ({exc.strerror or exc})"
    os.close(fd)
    try:
        os.unlink(name)
    except OSError as exc:
        return f"a file made in {folder} could not be removed ({exc.strerror or exc})"
    return None


def _sqlite_probe(path: Any) -> str | None:
    """Why the sqlite file ``path`` cannot be opened for writing (not a database, read-only); None when it can."""
    import sqlite3

    try:
        db = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=5)
    except sqlite3.Error as exc:
        return f"{path} cannot be opened ({exc})"
    try:
        db.execute("PRAGMA schema_version").fetchone()  # reads the header: a file that is no database fails
        db.execute("BEGIN IMMEDIATE")  # takes the write lock: a read-only file or folder fails
        db.rollback()
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc):
            return None  # another process writes it now: it is a database, and a writable one
        return f"{path} cannot be written ({exc})"
    except sqlite3.DatabaseError as exc:
        return f"{path} is not an sqlite database ({exc})"
    finally:
        db.close()
    return None


def _check_server(uri: str, key: str, timeout: float) -> None:
    """A GET of the tracking server's experiments search; refuses no answer within ``timeout`` seconds, a
    refused login and an answer that is no MLflow API."""
    import base64
    import ssl
    import urllib.error
    import urllib.request

    url = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1"
    request = urllib.request.Request(url, method="GET")
    if token := os.environ.get("MLFLOW_TRACKING_TOKEN"):
        request.add_header("Authorization", f"Bearer {token}")
    elif (user := os.environ.get("MLFLOW_TRACKING_USERNAME")) is not None:
        basic = f"{user}:{os.environ.get('MLFLOW_TRACKING_PASSWORD', '')}".encode()
        request.add_header("Authorization", "Basic " + base64.b64encode(basic).decode())
    context = None
    if uri.startswith("https"):
        if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() in ("1", "true"):
            context = ssl._create_unverified_context()
        else:
            context = ssl.create_default_context(cafile=os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH"))
    problem = None
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as answer:
            answer.read(1)
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            problem = (
                f"the server refused the login (HTTP {exc.code}); set MLFLOW_TRACKING_USERNAME and "
                "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)"
            )
        elif exc.code == 404:
            problem = f"no MLflow tracking API there (HTTP 404 for {url})"
        elif exc.code >= 500:
            problem = f"the server failed (HTTP {exc.code} {exc.reason})"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        problem = f"no answer within {timeout:g}s ({reason})"
    if problem:
        raise ConfigError(
            f"{key}={uri}: the MLflow tracking server cannot be used: {problem}. Fix: start the server "
            f"(mlflow server --host … --port …), or point {key} at a local store, e.g. sqlite:///mlflow.db"
        )


def mlflow_failure(exc: BaseException) -> str | None:
    """The one line for an exception MLflow raised (a store gone or refusing, mid-run): it names
    ``tracking.tracking_uri`` and the store in use; None for any other exception. Found by where it was
    raised (a frame in the mlflow package) or its type (an ``MlflowException``)."""
    import sys
    from pathlib import Path

    mlflow = sys.modules.get("mlflow")
    if mlflow is None or isinstance(exc, ConfigError) or not isinstance(exc, Exception):
        return None
    from mlflow.exceptions import MlflowException

    package = Path(mlflow.__file__).resolve().parent
    frames = traceback_paths(exc)
    if not isinstance(exc, MlflowException) and not any(p.is_relative_to(package) for p in frames):
        return None
    try:
        uri = mlflow.get_tracking_uri()
    except Exception:  # noqa: BLE001 - the store itself is what failed
        uri = os.environ.get("MLFLOW_TRACKING_URI", "?")
    detail = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    if len(detail) > 300:
        detail = detail[:300] + " …"
    return (
        f"tracking.tracking_uri={uri}: the MLflow store failed ({type(exc).__name__}: {detail}). Fix: check "
        "that the store is reachable and writable (a running server, a writable sqlite file), or point "
        "tracking.tracking_uri at another store, e.g. sqlite:///mlflow.db"
    )


def traceback_paths(exc: BaseException) -> list[Any]:
    """The source files of the frames ``exc`` passed through, resolved."""
    import traceback
    from pathlib import Path

    return [Path(frame.filename).resolve() for frame in traceback.extract_tb(exc.__traceback__)]

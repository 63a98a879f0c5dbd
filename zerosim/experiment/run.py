"""Running an experiment: the dry run's table, and the run — every stage not already finished with the same
inputs, each timed over all its attempts and recorded (``stages/<name>/stage.json``), under one MLflow parent
run."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

from zerosim.core.fsutil import atomic_write_text
from zerosim.core.runtime import cpu_times, others_cpu_share
from zerosim.experiment.config import ExperimentConfig
from zerosim.experiment.estimates import CONTENDED_SHARE, estimate_notes, estimates
from zerosim.experiment.keys import status
from zerosim.experiment.kinds import (
    KINDS,
    STAGE_FILE,
    Kind,
    Stage,
    read_json,
    read_stage,
    relative_to_root,
    run_stage,
)
from zerosim.experiment.stages import build_stages

EXPERIMENT_FILE = "experiment.json"  # the experiment's MLflow parent run, and the folder it was started in
ATTEMPT_FILE = "attempt.json"  # a running stage's time so far
LOCK_FILE = ".lock"  # held by the one process running (or importing into) the experiment
OWNER_FILE = ".lock.owner"  # who holds it: pid and host, for the error a second process gets

_LOCKS: dict[str, Any] = {}  # one FileLock per folder in this process (re-entrant: import, then run)


@contextmanager
def folder_lock(root: Path) -> Iterator[None]:
    """Hold ``root``'s lock while this process writes into the experiment: a second ``zerosim experiment``
    on the same folder is refused at once (it would run the same stages and clear the other's folders),
    naming the process that holds it."""
    import os
    import socket

    from filelock import FileLock, Timeout

    from zerosim.core.config import ConfigError

    root.mkdir(parents=True, exist_ok=True)
    lock = _LOCKS.setdefault(str(root.resolve()), FileLock(root / LOCK_FILE))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        owner = read_json(root / OWNER_FILE) or {}
        who = f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}"
        raise ConfigError(
            f"{root} is in use by another zerosim experiment ({who}); wait for it to end, or give this one "
            "its own folder (output_dir= or name=)"
        ) from None
    try:
        if lock.lock_counter == 1:
            atomic_write_text(
                root / OWNER_FILE, json.dumps({"pid": os.getpid(), "host": socket.gethostname()})
            )
        yield
    finally:
        lock.release()


def describe(stage: Stage) -> str:
    return KINDS[stage.kind].describe(stage)


def _model_absent(record: dict[str, Any] | None) -> bool:
    """Whether a finished stage's model (``outputs.path``) is not on this machine (its results were imported)."""
    path = ((record or {}).get("outputs") or {}).get("path")
    return isinstance(path, str) and not Path(path).exists()


def statuses(stages: Sequence[Stage], root: Path) -> dict[str, str]:
    """Each stage's :func:`~zerosim.experiment.keys.status`, and one more rule: a reused stage whose model is
    absent (it ran on another machine) runs again when a stage that reads it has to run; while every stage
    that reads it is reused, it is not."""
    state = {s.name: status(s, root, stages) for s in stages}
    by_name = {s.name: s for s in stages}
    for stage in reversed(stages):  # readers before what they read: a re-run reaches up the chain
        if state[stage.name] == "reuse":
            continue
        for dep in stage.deps:
            if state.get(dep) == "reuse" and _model_absent(read_stage(by_name[dep], root)):
                state[dep] = "re-run"
    return state


def check_inputs(cfg: ExperimentConfig, stages: Sequence[Stage] = ()) -> None:
    """What a later stage would read, checked before the first one runs (and by ``--dry-run``): the held-out
    datasets that are local files, a ready simulator given as a path, the MLflow store, the training launcher,
    and for each of ``stages`` the inputs no other stage produces — its training and warm-start questions,
    the corpora, indexes, servers and reranker of its real retrievers — so a typo does not cost every
    training arm before the first evaluation stops on it."""
    from eval.run import dataset_names
    from zerosim.core.config import ConfigError
    from zerosim.core.data.embedded import SPLITS
    from zerosim.core.data.spec import parse_qa_spec
    from zerosim.core.models import ModelError, resolve_model
    from zerosim.core.tracking import check_tracking_uri

    check_tracking_uri(cfg.tracking.tracking_uri)
    for _, source, split in dataset_names(list(cfg.eval.datasets), cfg.eval.split):
        spec = parse_qa_spec(source, split)
        if spec.path is not None and not spec.path.exists():
            raise ConfigError(
                f"eval.datasets: {source} does not exist; point it at a FlashRAG jsonl/parquet file or folder, "
                "an HF dataset id, or factbook[:split]"
            )
        if spec.repo == "factbook" and spec.split not in SPLITS:
            raise ConfigError(
                f"eval.datasets: the embedded factbook has splits {', '.join(SPLITS)}, not {spec.split!r} "
                "(eval.split or a :split suffix)"
            )
    if cfg.simulator.model is not None:
        try:
            resolve_model(cfg.simulator.model)
        except ModelError as exc:
            raise ConfigError(f"simulator.model: {exc}") from None
    if cfg.train_launcher:
        import shlex
        import shutil as sh

        program = (shlex.split(cfg.train_launcher) or [""])[0]
        if sh.which(program) is None:
            raise ConfigError(
                f"train_launcher: {program!r} is not a program on PATH here; give the launcher's full path "
                "(e.g. `accelerate launch --num_processes 8`, with accelerate installed) or leave it unset"
            )
    _stage_inputs(stages)


def _stage_inputs(stages: Sequence[Stage]) -> None:
    """Each stage's own inputs (what no stage before it writes), read as its job would read them first."""
    from zerosim.engines import EngineName, preflight
    from zerosim.training.dry_run import _data

    read: set[tuple[str, ...]] = set()

    def once(key: tuple[str, ...], check: Callable[[], Any]) -> None:
        if key not in read:
            read.add(key)
            check()

    def search(c: Any, prefix: str) -> None:  # the simulator's model is another stage's (or simulator.model)
        if EngineName(c.engine) not in (EngineName.simulator, EngineName.mixed):
            once(("search", prefix, repr(c)), lambda: preflight(c, prefix=prefix))

    for stage in stages:
        c = stage.config
        if stage.kind in (Kind.train, Kind.warmstart):
            if stage.kind == Kind.train:
                d = c.data
                once(("data", d.train, d.split), lambda d=d: _data(d.train, d.split, "data.train"))
                search(c.search, f"{stage.name}: search.")
            if c.warmstart.enabled:
                w = c.warmstart
                once(("data", w.data, w.split), lambda w=w: _data(w.data, w.split, "warmstart.data"))
                search(w.search, f"{stage.name}: warmstart.search.")
        elif stage.kind == Kind.eval and stage.config.method != "direct":
            search(c.search, f"{stage.name}: search.")


def plan_rows(cfg: ExperimentConfig, stages: Sequence[Stage], root: Path) -> list[tuple[str, str, str, str]]:
    """(stage, status, estimate, what) for ``--dry-run``."""
    check_inputs(cfg, stages)
    est, notes = estimates(stages, root), estimate_notes(stages, root)
    state_of = statuses(stages, root)
    rows = []
    for stage in stages:
        state = state_of[stage.name]
        seconds = 0.0 if state == "reuse" else est[stage.name]
        note = f" ({notes[stage.name]})" if notes[stage.name] and state != "reuse" else ""
        rows.append(
            (stage.name, state, f"{seconds / 60:.1f} min{note}", describe(stage).replace(str(root), "<root>"))
        )
    return rows


class StageClock:
    """A stage's wall time over all its attempts. While an attempt runs, the time so far is kept in
    ``attempt.json`` every ``every`` seconds, so when a killed stage continues, the killed attempt's time
    (to within ``every``) counts too; ``attempts`` counts them."""

    def __init__(self, folder: Path, *, continuing: bool, every: float = 30.0):
        self.folder, self.every = folder, every
        earlier = read_json(folder / ATTEMPT_FILE) if continuing else None
        self.prior = float(earlier.get("seconds", 0.0)) if earlier else 0.0
        self.attempts = int(earlier.get("attempts", 1)) + 1 if earlier else 1
        self._stop = threading.Event()
        self.ended: float | None = None

    def seconds(self) -> float:
        end = self.ended if self.ended is not None else time.perf_counter()
        return self.prior + end - self.started

    def _save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(
            self.folder / ATTEMPT_FILE, json.dumps({"seconds": self.seconds(), "attempts": self.attempts})
        )

    def _tick(self) -> None:
        while not self._stop.wait(self.every):
            self._save()

    def __enter__(self) -> StageClock:
        self.started = time.perf_counter()
        self._save()
        self._thread = threading.Thread(target=self._tick, name="stage-clock", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.ended = time.perf_counter()
        self._save()


def plain(obj: Any) -> Any:
    """A stage's config as its record holds it."""
    return asdict(obj) if is_dataclass(obj) else obj


@dataclass
class ExperimentResult:
    root: Path
    report: dict[str, Any]
    ran: list[str]
    reused: list[str]
    parent_run_id: str


def _parent_run(state: dict[str, Any], root: Path, echo: Callable[[str], None]) -> str | None:
    """The experiment's MLflow parent run from an earlier attempt in this folder, if the store still holds
    it. A folder copied (or moved) from elsewhere gets a parent run of its own: its runs are not logged
    into, nor a failure here marks, the original's."""
    import mlflow

    parent_id = state.get("parent_run_id")
    started_in = state.get("root")
    if parent_id is not None and started_in is not None and started_in != str(root.resolve()):
        echo(f"this folder was started as {started_in} (copied or moved here): a new MLflow parent run")
        return None
    if parent_id is not None:
        try:
            mlflow.MlflowClient().get_run(parent_id)
        except Exception:  # noqa: BLE001 - another tracking store: a new parent run
            parent_id = None
    return parent_id


def _end_stale_runs(parent_id: str, echo: Callable[[str], None]) -> None:
    """Mark FAILED the stage runs an earlier attempt left RUNNING (a SIGKILL leaves no time to end them):
    with the folder locked, no other process is running them."""
    import mlflow

    client = mlflow.MlflowClient()
    experiment = client.get_run(parent_id).info.experiment_id
    stale = client.search_runs(
        [experiment],
        filter_string=f"tags.mlflow.parentRunId = '{parent_id}' and attributes.status = 'RUNNING'",
    )
    for run in stale:
        client.set_terminated(run.info.run_id, status="FAILED")
        echo(
            f"  MLflow run {run.info.run_id} ({run.info.run_name}) was left RUNNING by a killed attempt: FAILED"
        )


def run_experiment(
    cfg: ExperimentConfig,
    *,
    echo: Callable[[str], None] = print,
    stop_after: str | None = None,
) -> ExperimentResult:
    """Run every stage not already finished with the same inputs, then the report.

    ``stop_after`` (a stage name) ends the run after that stage, as a kill would (tests use it).
    """
    root = Path(cfg.output_dir) / cfg.name
    stages = build_stages(cfg, root)
    check_inputs(cfg, stages)
    with folder_lock(root):
        return _run_locked(cfg, root, stages, echo, stop_after)


def _run_locked(
    cfg: ExperimentConfig,
    root: Path,
    stages: list[Stage],
    echo: Callable[[str], None],
    stop_after: str | None,
) -> ExperimentResult:
    import mlflow

    from zerosim.core.tracking import code_version, configure, mlflow_run

    state_path = root / EXPERIMENT_FILE
    state = read_json(state_path) or {}
    configure(cfg.tracking)
    parent_id = _parent_run(state, root, echo)
    tags = {"zerosim.job": "experiment", "zerosim.experiment": cfg.name}
    ran, reused = [], []
    with mlflow_run(cfg.tracking, cfg.name, tags=tags, run_id=parent_id) as parent:
        if parent_id is not None:
            _end_stale_runs(parent_id, echo)
        parent_id = parent.info.run_id
        where = {"parent_run_id": parent_id, "name": cfg.name, "root": str(root.resolve())}
        atomic_write_text(state_path, json.dumps(where, indent=2))
        if not state:
            from zerosim.core.config import to_yaml

            mlflow.log_text(to_yaml(cfg), "experiment.yaml")
        outputs: dict[str, dict[str, Any]] = {}
        code = code_version()
        state_of = statuses(stages, root)
        for i, stage in enumerate(stages, 1):
            current = state_of[stage.name]
            if current == "reuse":
                outputs[stage.name] = read_stage(stage, root)["outputs"]
                reused.append(stage.name)
                echo(f"[{i}/{len(stages)}] {stage.name}: reused")
                continue
            if current in ("re-run", "run") and stage.dir(root).exists():
                shutil.rmtree(stage.dir(root))
            echo(f"[{i}/{len(stages)}] {stage.name}: {current} ({describe(stage)})")
            cpu_before = cpu_times()
            with StageClock(stage.dir(root), continuing=current == "continue") as clock:
                result = run_stage(stage, root, cfg, parent_id, stages=stages, outputs=outputs)
            seconds = clock.seconds()
            others = others_cpu_share(cpu_before, cpu_times())  # this attempt's
            if others is not None and others > CONTENDED_SHARE:
                echo(
                    f"  {stage.name} ran beside other processes (they took {others:.0%} of the CPU): "
                    "its time is not this job's speed and no estimate learns from it"
                )
            record = {
                "name": stage.name,
                "kind": stage.kind,
                "key": stage.key,
                "deps": stage.deps,
                "meta": stage.meta,
                "seconds": seconds,  # every attempt's
                "attempts": clock.attempts,
                "others_cpu": None if others is None else round(others, 3),
                "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "config": plain(stage.config),
                "outputs": result,
                "code": code,  # which code ran it (not part of its key: the report flags other code)
            }
            stage.dir(root).mkdir(parents=True, exist_ok=True)
            # paths under the folder written as <root>: a copied or moved folder reads its own files
            text = relative_to_root(json.dumps(record, indent=2, default=str), root)
            atomic_write_text(stage.dir(root) / STAGE_FILE, text)
            mlflow.log_metric(f"stage_seconds/{stage.name}", seconds)
            outputs[stage.name] = result
            ran.append(stage.name)
            if stop_after == stage.name:
                break
    report_path = root / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    return ExperimentResult(root, report, ran, reused, parent_id)

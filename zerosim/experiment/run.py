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

from zerosim.core.config import ConfigError
from zerosim.core.fsutil import atomic_write_text, read_json
from zerosim.core.runtime import cpu_times, others_cpu_share
from zerosim.experiment.config import ExperimentConfig
from zerosim.experiment.estimates import CONTENDED_SHARE, estimate_notes, estimates
from zerosim.experiment.keys import status
from zerosim.experiment.kinds import (
    CODE_DIFF,
    KINDS,
    STAGE_FILE,
    Kind,
    Stage,
    read_stage,
    relative_to_root,
    run_stage,
)
from zerosim.experiment.provenance import (
    MODEL_KINDS,
    machine_kind,
    model_digest,
    model_problem,
    provenance,
    read_by,
    short,
)
from zerosim.experiment.runlogs import ATTEMPT_FILE
from zerosim.experiment.stagefiles import files_problem, written_files
from zerosim.experiment.stages import build_stages

EXPERIMENT_FILE = "experiment.json"  # the experiment's MLflow parent run, and the folder it was started in
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
    """Each stage's status (:func:`plan_statuses`)."""
    return {name: state for name, (state, _) in plan_statuses(stages, root).items()}


def plan_statuses(stages: Sequence[Stage], root: Path, ran: Sequence[str] = ()) -> dict[str, tuple[str, str]]:
    """Each stage's :func:`~zerosim.experiment.keys.status` and why, in words, with more rules:

    - a finished stage that read a model re-run since with other weights (its record's ``reads`` against that
      model's digest now: :mod:`zerosim.experiment.provenance`) runs again: "reads warmstart a1b2…, now c3d4…";
      with the same weights it is reused;
    - a finished stage that reads results (not a model) of a stage that runs again, or ran again since
      (``ran``: in this process), runs again: the report after an evaluation re-run;
    - a reused stage whose model is absent (it ran on another machine) runs again when a stage that reads it
      has to run; while every stage that reads it is reused, it is not.

    A record from before digests is reused as before, its model instance noted as unrecorded; a reused stage
    that reads a model about to run again is noted: it is checked again once that model is there.

    A stage is reused only with the results files its record says it wrote (:func:`reused_files`)."""
    by_name = {s.name: s for s in stages}
    state, why = {}, {}
    for stage in stages:
        state[stage.name], why[stage.name] = status(stage, root, stages), ""
        done = read_stage(stage, root) if state[stage.name] == "reuse" else None
        if done is None or stage.name in ran:
            continue
        problem = reused_files(stage, done, root)
        if problem is not None:  # the report: written again from the results
            state[stage.name], why[stage.name] = "re-run", problem
            continue
        changed, notes = provenance(stage, done, by_name, lambda s: read_stage(s, root))
        for dep in (d for d in stage.deps if by_name[d].kind not in MODEL_KINDS):
            dep_done = read_stage(by_name[dep], root)
            since = dep in ran or str((dep_done or {}).get("finished", "")) > str(done.get("finished", "~"))
            if state[dep] != "reuse" or since:
                changed.append(f"reads {dep}, which {'runs' if state[dep] != 'reuse' else 'ran'} again")
        if changed:
            state[stage.name] = "re-run"
        why[stage.name] = "; ".join(changed or notes)
    for stage in reversed(stages):  # readers before what they read: a re-run reaches up the chain
        if state[stage.name] == "reuse":
            continue
        for dep in stage.deps:
            if state.get(dep) == "reuse" and _model_absent(read_stage(by_name[dep], root)):
                state[dep], why[dep] = "re-run", f"its model is not here, and {stage.name} reads it"
    for stage in stages:
        pending = [d for d in stage.deps if state.get(d) != "reuse" and by_name[d].kind in MODEL_KINDS]
        if state[stage.name] == "reuse" and pending:
            reads = (read_stage(stage, root) or {}).get("reads") or {}
            again = ", ".join(f"{d} (read {short(reads.get(d))})" for d in pending)
            why[stage.name] = f"checked again once {again} has run: runs again if its weights differ"
    return {name: (state[name], why[name]) for name in state}


def reused_files(stage: Stage, done: dict[str, Any], root: Path) -> str | None:
    """A reused stage's results files against its record (:func:`~zerosim.experiment.stagefiles.files_problem`):
    the report without its files (they do not travel) runs again (the reason returned); any other stage's
    truncated or edited results file is refused, naming it: the results would be read as measured."""
    from zerosim.core.config import ConfigError

    problem = files_problem(stage, done, stage.dir(root), root)
    if problem is None or stage.kind == Kind.report:
        return problem
    raise ConfigError(
        f"{stage.name}: {problem}. Its results are not what it measured: put back the file from the export "
        f"or the folder it came from, or delete {stage.dir(root)} to run the stage again"
    )


def check_inputs(
    cfg: ExperimentConfig, stages: Sequence[Stage] = (), missing: list[str] | None = None
) -> None:
    """What a later stage would read, checked before the first one runs (and by ``--dry-run``): the held-out
    datasets that are local files, a ready simulator given as a path, the MLflow store, the training launcher,
    and for each of ``stages`` the inputs no other stage produces — its training and warm-start questions,
    the corpora, indexes, servers and reranker of its real retrievers — so a typo does not cost every
    training arm before the first evaluation stops on it.

    With a ``missing`` list (the dry run), a refused input is appended to it and the checks go on, so the plan
    is printed with every missing file listed under it; without one, the first is raised."""
    from eval.run import dataset_names
    from zerosim.core.config import ConfigError
    from zerosim.core.data.embedded import SPLITS
    from zerosim.core.data.qa import DataError
    from zerosim.core.data.spec import parse_qa_spec
    from zerosim.core.models import ModelError, resolve_model
    from zerosim.core.tracking import check_tracking_uri

    def checked(check: Callable[[], Any]) -> None:
        try:
            check()
        except (ConfigError, DataError) as exc:
            if missing is None:
                raise
            missing.append(str(exc))

    def held_out(name: str, source: str, split: str, where: str) -> None:
        """``where``: what set the split — eval.datasets (eval.split, a :split suffix) or an eval override."""
        try:
            spec = parse_qa_spec(source, split)
        except DataError as exc:  # a FlashRAG folder without the split: what it holds is named
            raise DataError(f"{where}: {exc}" if where != "eval.datasets" else str(exc)) from None
        if spec.path is not None and not spec.path.exists():
            raise ConfigError(
                f"eval.datasets: {source} does not exist; point it at a FlashRAG jsonl/parquet file or folder, "
                "an HF dataset id, or factbook[:split]"
            )
        if spec.path is not None:  # read as `zerosim eval` reads it: the same row checks, before any stage
            _held_out_rows(cfg, name, source, split)
        if spec.repo == "factbook" and spec.split not in SPLITS:
            if where == "eval.datasets":
                raise ConfigError(
                    f"eval.datasets: the embedded factbook has splits {', '.join(SPLITS)}, not {spec.split!r} "
                    "(eval.split or a :split suffix)"
                )
            raise ConfigError(
                f"{where}: every eval stage would read split {spec.split!r} of the embedded factbook, whose "
                f"splits are {', '.join(SPLITS)}; give one of them (or set eval.split and drop the override)"
            )

    def simulator_model() -> None:
        try:
            resolve_model(cfg.simulator.model)
        except ModelError as exc:
            raise ConfigError(f"simulator.model: {exc}") from None

    check_tracking_uri(cfg.tracking.tracking_uri)
    # each eval stage's split as the stage applies it: eval.split, unless an eval override sets another
    splits = [s.config.split for s in stages if s.kind == Kind.eval] or [cfg.eval.split]
    read: set[tuple[str, str]] = set()
    for default_split in dict.fromkeys(splits):
        where = (
            "eval.datasets" if default_split == cfg.eval.split else f"eval.overrides: split={default_split}"
        )
        for name, source, split in dataset_names(list(cfg.eval.datasets), default_split):
            if (source, split) not in read:
                read.add((source, split))
                checked(lambda n=name, so=source, sp=split, w=where: held_out(n, so, sp, w))
    if cfg.simulator.model is not None:
        checked(simulator_model)
    if cfg.train_launcher:
        import shlex
        import shutil as sh

        program = (shlex.split(cfg.train_launcher) or [""])[0]
        if sh.which(program) is None:
            raise ConfigError(
                f"train_launcher: {program!r} is not a program on PATH here; give the launcher's full path "
                "(e.g. `accelerate launch --num_processes 8`, with accelerate installed) or leave it unset"
            )
    _stage_inputs(stages, checked)


def _held_out_rows(cfg: ExperimentConfig, name: str, source: str, split: str) -> None:
    """A held-out file's rows as the eval stages read them (eval's ``load_datasets``): a malformed row, a
    repeated question id or no rows at all refused now, naming eval.datasets, file and line."""
    from eval.config import Sample
    from eval.harness import empty_dataset_error
    from zerosim.core.data.embedded import load_questions
    from zerosim.core.data.qa import DataError

    first = cfg.eval.limit is not None and cfg.eval.sample == Sample.first  # else every row is read
    try:
        rows = load_questions(source, split, limit=cfg.eval.limit if first else None)
    except DataError as exc:
        raise DataError(f"eval.datasets: {exc}") from None
    if not rows:
        raise empty_dataset_error(name, source)


def _stage_inputs(stages: Sequence[Stage], checked: Callable[[Callable[[], Any]], None]) -> None:
    """Each stage's own inputs (what no stage before it writes), read as its job would read them first."""
    from zerosim.engines import EngineName, preflight
    from zerosim.training.dry_run import _data

    read: set[tuple[str, ...]] = set()

    def once(key: tuple[str, ...], check: Callable[[], Any]) -> None:
        if key not in read:
            read.add(key)
            checked(check)

    def search(c: Any, prefix: str) -> None:  # the simulator's model is another stage's (or simulator.model)
        # the same settings are checked once, named by the first stage that reads them
        if EngineName(c.engine) not in (EngineName.simulator, EngineName.mixed):
            once(("search", prefix.split(": ")[-1], repr(c)), lambda: preflight(c, prefix=prefix))

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
        elif stage.kind == Kind.eval:
            # what generates (eval.overrides: generation=vllm without vLLM here, server without policy_url)
            once(("generation", c.generation, c.policy_url or ""), lambda c=c: _generation(c))
            if c.method != "direct":
                search(c.search, f"{stage.name}: search.")


def _generation(config: Any) -> None:
    """An eval stage's ``generation`` checked as its run checks it before the policy loads (vLLM found with
    ``importlib.util.find_spec``, not imported), naming ``eval.overrides``, which is what sets it."""
    from eval.harness import generation_backend

    try:
        generation_backend(config)
    except ConfigError as exc:
        raise ConfigError(f"eval.overrides: {exc}") from None


def changed_models(stages: Sequence[Stage], root: Path) -> list[str]:
    """For each finished stage of ``stages`` that wrote a model still on disk, why that model is not the one
    its record names (:func:`~zerosim.experiment.provenance.model_problem`): every file that changes what it
    does is hashed, once per file version and process (about a second per GB)."""
    problems = []
    for stage in stages:
        if stage.kind in MODEL_KINDS:
            problem = model_problem(stage.name, read_stage(stage, root))
            if problem is not None:
                problems.append(problem)
    return problems


def plan_rows(
    cfg: ExperimentConfig, stages: Sequence[Stage], root: Path, missing: list[str] | None = None
) -> list[tuple[str, str, str, str]]:
    """(stage, status, estimate, what) for ``--dry-run``; missing inputs go to ``missing`` when given
    (:func:`check_inputs`), else the first is raised."""
    check_inputs(cfg, stages, missing)
    for problem in changed_models(stages, root):  # a model replaced on disk after its record
        if missing is None:
            raise ConfigError(problem)
        missing.append(problem)
    est, notes = estimates(stages, root), estimate_notes(stages, root)
    plan = plan_statuses(stages, root)
    rows = []
    for stage in stages:
        state, why = plan[stage.name]
        seconds = 0.0 if state == "reuse" else est[stage.name]
        note = f" ({notes[stage.name]})" if notes[stage.name] and state != "reuse" else ""
        what = (describe(stage) + (f" [{why}]" if why else "")).replace(str(root), "<root>")
        rows.append((stage.name, state, f"{seconds / 60:.1f} min{note}", what))
    return rows


class StageClock:
    """A stage's wall time over all its attempts. While an attempt runs, the time so far is kept in
    ``attempt.json`` every ``every`` seconds, so when a killed stage continues, the killed attempt's time
    (to within ``every``) counts too; ``attempts`` counts them. ``runs``: the MLflow runs its attempts
    started (:func:`~zerosim.experiment.runlogs.runs_started`), kept there too, so the logs of a stage that
    failed or was stopped are found by the export."""

    def __init__(self, folder: Path, *, continuing: bool, every: float = 30.0):
        self.folder, self.every = folder, every
        earlier = read_json(folder / ATTEMPT_FILE) if continuing else None
        self.prior = float(earlier.get("seconds", 0.0)) if earlier else 0.0
        self.attempts = int(earlier.get("attempts", 1)) + 1 if earlier else 1
        self.runs: list[str] = list((earlier or {}).get("runs") or [])
        self.started_ms = int(time.time() * 1000)  # for MLflow's start times (epoch ms)
        self._stop = threading.Event()
        self.ended: float | None = None

    def seconds(self) -> float:
        end = self.ended if self.ended is not None else time.perf_counter()
        return self.prior + end - self.started

    def _save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        state = {"seconds": self.seconds(), "attempts": self.attempts, "runs": self.runs}
        atomic_write_text(self.folder / ATTEMPT_FILE, json.dumps(state))

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


def _with_runs_started(clock: StageClock, parent_id: str) -> list[str]:
    """``clock.runs`` and the MLflow runs nested under the experiment's run since this attempt started."""
    from zerosim.experiment.runlogs import runs_started

    try:
        started = runs_started(parent_id, clock.started_ms)
    except Exception:  # noqa: BLE001 - a store gone mid-stage: the stage's own error is the one to report
        started = []
    return list(dict.fromkeys([*clock.runs, *started]))


def drop_checkpoints(stage: Stage, root: Path) -> None:
    """A finished training stage's trainer checkpoints: they only served its continuation, and each holds the
    optimizer's state too (~3x the model: 1.6 GB a checkpoint for SmolLM2-135M). Its final and best policies
    stay. Called when its record is written, and again whenever it is reused (a kill between the two, or a
    stage finished by older code, left them)."""
    if stage.kind != Kind.train or not stage.dir(root).is_dir():
        return
    from zerosim.training.checkpoint import remove_all

    for run in stage.dir(root).iterdir():
        if run.is_dir() and not run.is_symlink():
            remove_all(run)


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

    from zerosim.core.tracking import code_diff, code_version, configure, mlflow_run

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
        code, machine = code_version(), machine_kind()
        diff = code_diff() if code.get("diff_sha256") else None  # beside each record: which code ran it
        by_name = {s.name: s for s in stages}
        number = {s.name: i for i, s in enumerate(stages, 1)}
        while True:
            # again after each stage: a model re-run with other weights sends the stages that read it
            # (reused until now) to run again, and they may need a model that is not here
            plan = plan_statuses(stages, root, ran)
            stage = next((s for s in stages if plan[s.name][0] != "reuse"), None)
            for done in stages[: number[stage.name] - 1] if stage is not None else stages:
                if done.name not in outputs:
                    outputs[done.name] = read_stage(done, root)["outputs"]
                    drop_checkpoints(done, root)  # what a kill after its record, or older code, left there
                    reused.append(done.name)
                    echo(f"[{number[done.name]}/{len(stages)}] {done.name}: reused")
            if stage is None:
                break
            if stage.name in ran:  # cannot happen while stages come in run order; never loop on one
                raise RuntimeError(f"stage {stage.name} would run twice: {plan[stage.name][1]}")
            current, why = plan[stage.name]
            if stage.name in reused:
                reused.remove(stage.name)
            if current in ("re-run", "run") and stage.dir(root).exists():
                shutil.rmtree(stage.dir(root))
            because = f" [{why}]" if why and current != "reuse" else ""
            echo(f"[{number[stage.name]}/{len(stages)}] {stage.name}: {current} ({describe(stage)}){because}")
            for problem in changed_models([by_name[d] for d in stage.deps if d in by_name], root):
                raise ConfigError(problem)  # a model it reads is not the one recorded: refused before it runs
            reads = read_by(
                stage, by_name, lambda s: read_stage(s, root)
            )  # the models there as it starts: what it reads
            cpu_before = cpu_times()
            with StageClock(stage.dir(root), continuing=current == "continue") as clock:
                try:
                    result = run_stage(stage, root, cfg, parent_id, stages=stages, outputs=outputs)
                finally:  # failed or stopped too: its logs are exported (runlogs)
                    clock.runs = _with_runs_started(clock, parent_id)
            seconds = clock.seconds()
            others = others_cpu_share(cpu_before, cpu_times())  # this attempt's
            if others is not None and others > CONTENDED_SHARE:
                echo(
                    f"  {stage.name} ran beside other processes (they took {others:.0%} of the CPU): "
                    "its time is not this job's speed and no estimate learns from it"
                )
            if diff is not None:  # uncommitted changes ran this stage: the diff travels with its record
                atomic_write_text(stage.dir(root) / CODE_DIFF, diff)
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
                "machine": machine,  # the CPU kind or GPU: AMX updates in bf16, others in fp32
                "reads": reads,  # the digests of the models it read (not part of its key either)
                "runs": clock.runs,  # every MLflow run it started: its curves and samples travel
                "files": written_files(stage, root),  # checked when it is reused (stagefiles)
            }
            if stage.kind in MODEL_KINDS:  # the weights it wrote, so its readers can tell a re-run apart
                record["model"] = model_digest(result["path"])
            stage.dir(root).mkdir(parents=True, exist_ok=True)
            # paths under the folder written as <root>: a copied or moved folder reads its own files
            text = relative_to_root(json.dumps(record, indent=2, default=str), root)
            atomic_write_text(stage.dir(root) / STAGE_FILE, text)
            drop_checkpoints(stage, root)
            mlflow.log_metric(f"stage_seconds/{stage.name}", seconds)
            outputs[stage.name] = result
            ran.append(stage.name)
            if stop_after == stage.name:
                break
    report_path = root / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    return ExperimentResult(root, report, ran, reused, parent_id)


INTERIM_DIR = "interim"  # <root>/interim: the report of the evaluations finished so far (--interim)


def interim_report(cfg: ExperimentConfig) -> tuple[Path, dict[str, Any]]:
    """A report of the evaluations finished so far with this config's settings (those the next run would
    reuse), written to ``<root>/interim/`` (report.md, report.json, report.png) and nowhere else: no stage runs,
    no MLflow run is written, the experiment's own report is left alone — so it can be read while another
    process runs the experiment, or after an ``--import`` of another machine's results. Returns the folder and
    the report."""
    from zerosim.core.config import ConfigError
    from zerosim.experiment.kinds import describe_arms, training_signals_of
    from zerosim.experiment.report import EvalScores, write_report

    root = Path(cfg.output_dir) / cfg.name
    stages = build_stages(cfg, root)
    state = statuses(stages, root)
    evals = [s for s in stages if s.kind == Kind.eval]
    done = [s for s in evals if state[s.name] == "reuse"]
    if not done:
        raise ConfigError(
            f"{root}: no evaluation has finished with this config's settings yet, so there is nothing to report; "
            "`--dry-run` shows each stage's status"
        )
    # the records of current stages only: one of other work (to run again) is not in this report's provenance
    current = [s for s in stages if state[s.name] == "reuse"]
    records = {s.name: record for s in current if (record := read_stage(s, root)) is not None}
    scores = [EvalScores.of(s, records[s.name]["outputs"]) for s in done]
    out = root / INTERIM_DIR
    out.mkdir(parents=True, exist_ok=True)
    interim = {"finished": [s.name for s in done], "to_come": [s.name for s in evals if s not in done]}
    write_report(
        cfg,
        scores,
        records,
        done[0].config,
        out,
        arms=describe_arms(cfg, stages),
        interim=interim,
        training=training_signals_of(cfg, stages, records, root),
    )
    return out, json.loads((out / "report.json").read_text())

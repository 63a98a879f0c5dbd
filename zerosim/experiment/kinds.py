"""What a stage is, and the one table of stage kinds: for each kind, the job it runs, the schema of that
job's config (its inputs: a stage's key holds the settings that differ from that schema's defaults), what
it returns (its outputs: the ``outputs`` of its record, read by the stages downstream and the report), and
how long it takes (seconds per unit on a quiet 2-core machine, and how many units a config asks for).

A new kind of stage is one :class:`Kind` member and one :data:`KINDS` entry.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from curricula import describe_noise
from simulators.config import SimulatorEvalConfig, SimulatorTrainConfig
from zerosim.core.fsutil import atomic_write_text
from zerosim.engines import EngineName, SearchConfig
from zerosim.experiment.config import ExperimentConfig
from zerosim.job_config import EvalConfig, SimulatorCollectConfig
from zerosim.training.config import TrainConfig

log = logging.getLogger(__name__)

STAGE_FILE = "stage.json"  # a finished stage's record: key, time, config, outputs
CODE_DIFF = (
    "code.diff"  # beside a record written by a checkout with uncommitted changes: `git diff HEAD` then
)


class Kind(StrEnum):
    collect = "collect"
    sft = "sft"
    dpo = "dpo"
    quality = "quality"
    warmstart = "warmstart"
    train = "train"
    eval = "eval"
    report = "report"


@dataclass
class Stage:
    name: str  # also the folder under <root>/stages
    kind: Kind
    config: Any  # the job's resolved config (a dataclass); None for the report
    deps: list[str]  # the names of the stages whose outputs it reads
    estimate_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)  # arm, seed, engine, method for eval stages
    key: str = ""
    changes: list[str] = field(
        default_factory=list
    )  # a training stage's overrides of the base recipe (not keyed)

    def dir(self, root: Path) -> Path:
        return root / "stages" / self.name


ROOT = "<root>"  # the experiment's folder, as its records write it: a copied or moved folder reads its own


def relative_to_root(text: str, root: Path) -> str:
    """``text`` (a record's JSON) with the experiment's folder written as ``<root>``."""
    return text.replace(str(root.resolve()), ROOT).replace(str(root), ROOT)


def read_stage(stage: Stage, root: Path) -> dict[str, Any] | None:
    """The record of a finished stage (``stage.json``), its ``<root>`` read as ``root``; None when the stage
    has not finished. A record that is not one (damaged, cut short, edited) is refused, naming the file and
    the fix, rather than read as half a result."""
    from zerosim.core.config import ConfigError

    path = stage.dir(root) / STAGE_FILE
    if not path.is_file():
        return None
    fix = f"delete {stage.dir(root)} to run the stage again (or put back its record from an --export)"
    try:
        text = path.read_text(encoding="utf-8")
        record = json.loads(text.replace(ROOT, json.dumps(str(root))[1:-1]))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: damaged stage record ({exc}); {fix}") from None
    missing = [k for k in ("key", "outputs") if not isinstance(record, dict) or k not in record]
    if missing or not isinstance(record["outputs"], dict):
        what = f"no {', '.join(missing)}" if missing else "its outputs are not a mapping"
        raise ConfigError(f"{path}: not a stage record ({what}); {fix}")
    outside = outputs_outside(stage, record, str(root))
    if outside is not None:
        raise ConfigError(f"{path}: {outside}; {fix}")
    return record


def _path_like(value: str) -> bool:
    return value.startswith(("/", ROOT, "~", "./", "../"))


def outputs_outside(stage: Stage, record: dict[str, Any], root: str = ROOT) -> str | None:
    """Why a record's outputs name a file outside the stage's own folder (``<root>/stages/<name>/…``; the
    report's, ``<root>/…``), or None: a record names only what its stage wrote, so an edited or foreign record
    cannot point the report at other answers or a reuse at other weights. ``root``: how the record writes the
    experiment's folder (``<root>`` in an export, the folder itself once read)."""
    import os

    base = root if stage.kind == Kind.report else f"{root}/stages/{stage.name}"
    for key, value in (record.get("outputs") or {}).items():
        if not isinstance(value, str) or not _path_like(value):
            continue
        if root == ROOT:  # as exported: compared as written
            inside, within = os.path.normpath(value), base
        else:  # as read here: compared as the files they name
            inside, within = str(Path(value).expanduser().resolve()), str(Path(base).resolve())
        if not (inside == within or inside.startswith(within.rstrip("/") + "/")):
            return (
                f"outputs.{key} is {value!r}, not inside the stage's folder ({base}/…): a record names only "
                "files its stage wrote there"
            )
    return None


@dataclass
class RunContext:
    """What a stage's job is run with: the experiment, its folder, its MLflow parent run, and (for the
    report) every stage and the outputs of those run or reused so far."""

    cfg: ExperimentConfig
    root: Path
    parent_run_id: str | None
    stages: Sequence[Stage] = ()
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)


# -- the jobs: each runs one stage and returns its outputs -----------------------------------------------
def _collect(stage: Stage, ctx: RunContext) -> dict[str, Any]:
    from simulators.collect import run_collect
    from zerosim.engines import build_search_engine

    result = run_collect(stage.config, build_engine=build_search_engine)
    return {"path": str(result.path), "rows": len(result.rows), "report": result.report}


def _simulator_train(stage: Stage, ctx: RunContext) -> dict[str, Any]:
    from simulators.sft import run_sft

    return {"path": str(run_sft(stage.config))}


def _quality(stage: Stage, ctx: RunContext) -> dict[str, Any]:
    from simulators.quality import run_quality

    result = run_quality(stage.config, progress=True)
    return {"run_id": result.run_id, "report": result.report}


# what _warmstart hands run_warmstart (where runs are logged aside): the rest of the train config is the RL job's
# rollout.protocol/tools: the protocol its demonstrations are written in (defaults: tags, a key as before)
WARMSTART_READS = (
    "warmstart.",
    "policy.model",
    "run.seed",
    "rollout.protocol",
    "rollout.tools",
    "rollout.max_turns",
    "rollout.max_page_tokens",
)
# of those, what only demonstrations that open pages read (read_page offered under tools): inert otherwise
READ_PAGE_SETTINGS = ("rollout.max_turns", "rollout.max_page_tokens")


def warmstart_inert(leaves: dict[str, Any]) -> tuple[str, ...]:
    """The warm start reads the turn budget and the page budget only to write demonstrations that open pages."""
    reading = leaves.get("rollout.protocol") == "tools" and "read_page" in (leaves.get("rollout.tools") or ())
    return () if reading else READ_PAGE_SETTINGS


def _warmstart(stage: Stage, ctx: RunContext) -> dict[str, Any]:
    from zerosim.training.warmstart import run_warmstart

    c = stage.config
    path = run_warmstart(
        c.warmstart,
        policy=c.policy.model,
        seed=c.run.seed,
        tracking=c.tracking,
        output_dir=stage.dir(ctx.root) / "warmstart",
        rollout=c.rollout,
    )
    return {"path": str(path)}


def _train(stage: Stage, ctx: RunContext) -> dict[str, Any]:
    out = stage.dir(ctx.root)
    c = stage.config
    checkpoints = list((out / c.run.name).glob("checkpoint-*/"))
    c = replace(c, run=replace(c.run, resume=bool(checkpoints)))
    if ctx.cfg.train_launcher:
        return _launch_training(c, out, ctx.cfg.train_launcher)
    from zerosim.training.recipe import train

    train(c)
    return finished_training(c, out / c.run.name, f"zerosim train (stage {stage.name})")


def _launch_training(c: TrainConfig, out: Path, launcher: str) -> dict[str, Any]:
    """``<launcher> -m zerosim.cli train --config <out>/train.yaml``: several processes (GPUs) per arm.

    The stage is finished only when the job says so: its ``result.json`` (written last by a job that trained
    to its end), its final model and its MLflow run — a launcher that exits 0 without training is an error,
    not a stage to reuse. When this process is stopped (SIGTERM, Ctrl-C), the job is stopped too."""
    import os
    import shlex
    import signal
    import subprocess

    from zerosim.core.config import to_yaml
    from zerosim.training.stopping import GRACE_ENV

    out.mkdir(parents=True, exist_ok=True)
    recipe = atomic_write_text(out / "train.yaml", to_yaml(c))
    command = [*shlex.split(launcher), "-m", "zerosim.cli", "train", "--config", str(recipe)]
    grace = launch_grace(c, command)
    env = {**os.environ, GRACE_ENV: os.environ.get(GRACE_ENV, str(grace))}  # the user's own setting wins
    log.info("launching %s (%s=%s)", " ".join(command), GRACE_ENV, env[GRACE_ENV])
    from zerosim.core.signals import Terminated
    from zerosim.training.recipe import STOPPED_FILE

    stopped = out / c.run.name / STOPPED_FILE
    stopped.unlink(missing_ok=True)
    job = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env)
    try:
        code = job.wait()
    except BaseException:  # stopped here: the job gets the same SIGTERM, and the time to checkpoint
        job.send_signal(signal.SIGTERM)
        try:
            job.wait(timeout=max(600, int(env[GRACE_ENV]) + 60) if env[GRACE_ENV].isdigit() else 600)
        except subprocess.TimeoutExpired:
            job.kill()
        raise
    if code != 0 and stopped.is_file():  # the job stopped cleanly (its launcher says 1 for ranks' 143)
        raise Terminated(
            f"training stage stopped cleanly ({stopped.read_text().strip()}; {' '.join(command)} exited {code}): "
            "run the experiment again to resume it from its checkpoint"
        )
    if code != 0:
        raise RuntimeError(f"training stage failed (exit code {code}): {' '.join(command)}")
    return finished_training(c, out / c.run.name, " ".join(command))


def launch_grace(c: TrainConfig, command: list[str]) -> int:
    """The seconds torchrun should wait after its SIGTERM before killing a launched training job: a step and
    a checkpoint of the plan (:func:`zerosim.training.stopping.stop_plan`) under the launcher's
    ``--config_file`` (else DDP over its ``--num_processes``); torchrun's default where sizes are unknown."""
    from zerosim.training.memory import Launch, Strategy, launch_from_config, memory_plan
    from zerosim.training.stopping import TORCHRUN_DEFAULT_GRACE, stop_plan

    def option(name: str) -> str | None:
        for i, word in enumerate(command):
            if word == name and i + 1 < len(command):
                return command[i + 1]
            if word.startswith(name + "="):
                return word.partition("=")[2]
        return None

    processes = option("--num_processes")
    n = int(processes) if processes and processes.isdigit() else None
    config_file = option("--config_file")
    if config_file and Path(config_file).is_file():
        launch = launch_from_config(Path(config_file), n)
    else:
        launch = Launch(Strategy.ddp if (n or 2) > 1 else Strategy.plain, n or 2, source="train_launcher")
    plan = stop_plan(c, memory_plan(c, launch))
    return TORCHRUN_DEFAULT_GRACE if plan is None else plan.grace


def finished_training(c: TrainConfig, run_dir: Path, command: str) -> dict[str, Any]:
    """A training job's outputs, from what it wrote in ``run_dir``, once it is shown to have finished: its
    result file, its final model, its MLflow run. Raises naming what is missing."""
    from zerosim.training.recipe import RESULT_FILE, read_result

    result = read_result(run_dir)
    final = run_dir / "final"
    from zerosim.core.models import is_model_folder

    if result is None or not is_model_folder(final):  # a full model, or a LoRA policy's adapter
        absent = (
            RESULT_FILE if result is None else f"final model ({final}/config.json or adapter_config.json)"
        )
        raise RuntimeError(
            f"training stage: `{command}` exited 0 but left no {absent} in {run_dir}, so it did not train to "
            "its end; train_launcher must run the command it is given (e.g. `accelerate launch "
            "--num_processes 8`), and the recipe must keep trainer.save_final=true"
        )
    _require_run(result["run_id"], c.tracking.tracking_uri, command)
    from zerosim.training.recipe import read_search_ledger

    done = {"path": str(final), "run_id": result["run_id"], "steps": int(result["steps"])}
    ledger = read_search_ledger(run_dir)
    return done if ledger is None else {**done, "search_ledger": ledger}


def _require_run(run_id: Any, tracking_uri: str, command: str) -> None:
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        mlflow.MlflowClient(tracking_uri).get_run(str(run_id))
    except MlflowException:
        raise RuntimeError(
            f"training stage: `{command}` reported MLflow run {run_id}, which {tracking_uri} does not hold; "
            "the launched job must log to the experiment's tracking.tracking_uri"
        ) from None


def _eval(stage: Stage, ctx: RunContext) -> dict[str, Any]:
    from eval.run import run_eval
    from zerosim.engines import build_search_engine

    result = run_eval(stage.config, build_engine=build_search_engine)
    done = {
        "run_id": result.run_id,
        "rows": result.rows,
        "questions": str(result.out_dir / "questions.jsonl"),
    }
    return {**done, "search_ledger": {"web": result.ledger}} if result.ledger else done


def _report(stage: Stage, ctx: RunContext) -> dict[str, Any]:
    from zerosim.experiment.report import EvalScores, write_report

    evals = [s for s in ctx.stages if s.kind == Kind.eval]
    scores = [EvalScores.of(s, ctx.outputs[s.name]) for s in evals]
    records = {s.name: done for s in ctx.stages if (done := read_stage(s, ctx.root)) is not None}
    # the search and rollout settings every policy was evaluated with: the base recipe's
    from zerosim.experiment.report import search_costs

    trains = [s for s in ctx.stages if s.kind == Kind.train]
    web = (trains[0].config if trains else evals[0].config).search.web  # the base recipe's provider and price
    costs = search_costs(ctx.stages, ctx.outputs, web)
    return write_report(
        ctx.cfg,
        scores,
        records,
        evals[0].config,
        ctx.root,
        arms=describe_arms(ctx.cfg, ctx.stages),
        costs=costs,
        training=training_signals_of(ctx.cfg, ctx.stages, records, ctx.root),
    )


def training_signals_of(
    cfg: ExperimentConfig, stages: Sequence[Stage], records: Mapping[str, Any], root: Path
) -> dict[tuple[str, Any], dict[str, Any] | None]:
    """(arm, seed) -> what each finished training stage's run logged of its invalid actions, for the report."""
    from zerosim.experiment.runlogs import TRAINING_SIGNALS, stage_metrics, training_signals

    return {
        (s.meta["arm"], s.meta["seed"]): training_signals(
            stage_metrics(s.dir(root), records[s.name], cfg.tracking.tracking_uri, TRAINING_SIGNALS)
        )
        for s in stages
        if s.kind == Kind.train and s.name in records
    }


def describe_arms(cfg: ExperimentConfig, stages: Sequence[Stage]) -> dict[str, str]:
    """What each enabled arm changes against the base recipe, in words (its overrides, placeholders resolved)."""
    out = {}
    for name, arm in cfg.enabled_arms().items():
        if not arm.rl:
            rollout = ", ".join(f"`{o}`" for o in arm.overrides)
            out[name] = (
                f"no RL: the warm start for {rollout} as it is, rolled out so"
                if rollout
                else "no RL: the shared warm start (or the base policy) as it is"
            )
            continue
        train = next((s for s in stages if s.kind == Kind.train and s.meta.get("arm") == name), None)
        out[name] = ", ".join(f"`{o}`" for o in train.changes) if train and train.changes else "nothing"
    return out


# -- how much work a stage's config asks for, and what it is in one line --------------------------------
# A trajectory against the simulator (or mixed) costs this many real-retriever ones: the simulator writes the
# documents (measured: 962, 1,277 and 1,114 s for the sim, sim-nocurriculum and mixed arms against 835 s).
SIMULATOR_FACTOR = 1.35
OVERHEAD_S = 15.0  # model load and MLflow per stage


def _train_units(c: TrainConfig) -> float:
    t = c.trainer
    trajectories = t.max_steps * t.per_device_train_batch_size * t.gradient_accumulation_steps
    return trajectories * (SIMULATOR_FACTOR if EngineName(c.search.engine).simulated else 1.0)


def _eval_units(c: EvalConfig) -> float:
    n = (c.limit or 200) * len(c.datasets)
    return n * (1 / 3 if c.method == "direct" else 1.0)


def _eval_inert(leaves: dict[str, Any]) -> tuple[str, ...]:
    """An evaluation reads its seed to sample questions (``limit``), to sample the policy's tokens
    (``rollout.temperature`` > 0) and to draw a simulator's words or a retriever's noisy slots (none while
    evaluating: no curriculum). A greedy evaluation of every question over a real retriever (or none) reads it
    nowhere: every experiment's evaluation unless eval.limit is set
    (tests/test_eval_harness.py::test_a_greedy_evaluation_of_every_question_reads_no_seed)."""
    engine = leaves.get("search.engine")
    searched = leaves.get("method") == "direct" or (engine is not None and EngineName(engine).real)
    greedy = leaves.get("rollout.temperature") == 0
    return ("seed",) if greedy and leaves.get("limit") is None and searched else ()


def _describe_train(stage: Stage) -> str:
    c = stage.config
    t, cur = c.trainer, c.curriculum
    return f"{t.algorithm} {t.max_steps} steps x {t.per_device_train_batch_size * t.gradient_accumulation_steps} traj, search={describe_search(c.search)}, {describe_noise(cur)}"


def describe_search(s: SearchConfig) -> str:
    """``search.engine`` and what answers it: the simulator (its model, served at a URL or in every process)
    and the real retriever (a server's URL, or the index each process loads)."""
    engine = EngineName(s.engine)
    parts = []
    if engine.simulated:
        sim = s.simulator
        served = sim.backend == "openai"
        parts.append(f"simulator at {sim.url}" if served else f"simulator {sim.model} in process")
        if served:
            parts[-1] += f" ({sim.served_model or sim.model})"
    real = EngineName(s.mixed.real) if engine == EngineName.mixed else engine
    if real == EngineName.http:
        parts.append(f"retriever at {s.http.url}")
    elif real in (EngineName.bm25, EngineName.dense):
        index = getattr(s, real.value)
        parts.append(f"{real.value} {index.index_dir or index.corpus} in process")
    elif real == EngineName.hybrid:
        parts.append("bm25 + dense in process")
    return f"{engine} ({'; '.join(parts)})" if parts else str(engine)


@dataclass(frozen=True)
class StageKind:
    """What the experiment knows about one kind of stage."""

    job: str  # the command a user would type for it
    schema: type | None  # its config's schema (the stage key reads the settings changed from its defaults)
    run: Callable[[Stage, RunContext], dict[str, Any]]  # runs the job; returns the record's outputs
    outputs: tuple[str, ...]  # what those outputs hold
    rate: float  # seconds per unit on a quiet 2-core machine with the embedded SmolLM2 (docs/experiments.md)
    units: Callable[[Any], float]  # how many units a config asks for
    describe: Callable[[Stage], str]  # one line for the dry run and the progress
    # the settings its result depends on, where its schema holds more (a path, or a section ending in "."):
    # the stage key reads only these, so a change elsewhere re-runs nothing. () = every setting
    keyed_on: tuple[str, ...] = ()
    # the settings its result cannot depend on given the others (its config's dotted leaves, defaults filled
    # in): left out of the stage key, so a stage whose record differs only there is reused
    inert: Callable[[dict[str, Any]], tuple[str, ...]] | None = None

    def estimate(self, stage: Stage, rate: float | None = None) -> float:
        """Seconds the stage should take, at ``rate`` (default: the shipped one) per unit."""
        if stage.config is None:
            return self.rate
        return OVERHEAD_S + (self.rate if rate is None else rate) * self.units(stage.config)


def _simulator_training(job: str, *, rate: float) -> StageKind:
    """SFT or DPO of the simulator: ``rate`` seconds per optimizer step."""
    return StageKind(
        job=job,
        schema=SimulatorTrainConfig,
        run=_simulator_train,
        outputs=("path",),
        rate=rate,
        units=lambda c: c.max_steps,
        describe=lambda s: f"{s.config.objective} of {s.config.model}, {s.config.max_steps} steps",
    )


KINDS: dict[Kind, StageKind] = {
    Kind.collect: StageKind(
        job="zerosim simulator collect",
        schema=SimulatorCollectConfig,
        run=_collect,
        outputs=("path", "rows", "report"),
        rate=0.01,  # per question (BM25 + labelling; measured: 400 in 1.6 s)
        units=lambda c: c.max_questions or 2000,
        describe=lambda s: (
            f"{s.config.max_questions or 'all'} {s.config.split} questions, "
            f"{s.config.search.engine} depth {s.config.depth}"
        ),
    ),
    # per optimizer step (batch 4, max_length 384; measured: 60 steps in 506 s)
    Kind.sft: _simulator_training("zerosim simulator train", rate=8.2),
    # per optimizer step (batch 4: policy and reference; measured: 20 steps in 514 s)
    Kind.dpo: _simulator_training("zerosim simulator train objective=dpo", rate=25.0),
    Kind.quality: StageKind(
        job="zerosim simulator eval",
        schema=SimulatorEvalConfig,
        run=_quality,
        outputs=("run_id", "report"),
        rate=3.1,  # per question, a useful and a noisy request (measured: 32 in 113 s)
        units=lambda c: c.limit or 200,
        describe=lambda s: (
            f"{s.config.simulator.model} on {s.config.limit or 'all'} {s.config.split} questions"
        ),
    ),
    Kind.warmstart: StageKind(
        job="zerosim policy warmstart",
        schema=TrainConfig,
        run=_warmstart,
        outputs=("path",),
        rate=9.8,  # per optimizer step (batch 4), trajectories built in seconds (measured: 5 in 64 s)
        units=lambda c: c.warmstart.max_steps,
        describe=lambda s: f"{s.config.policy.model}, {s.config.warmstart.max_steps} steps",
        keyed_on=WARMSTART_READS,
        inert=warmstart_inert,
    ),
    Kind.train: StageKind(
        job="zerosim train",
        schema=TrainConfig,
        run=_train,
        outputs=("path", "run_id", "steps"),
        rate=3.2,  # per trajectory with a real retriever (measured: 16 steps x 16 with BM25 in 835 s)
        units=_train_units,
        describe=_describe_train,
    ),
    Kind.eval: StageKind(
        job="zerosim eval",
        schema=EvalConfig,
        run=_eval,
        outputs=("run_id", "rows", "questions"),
        # per question and method=agent (direct: a third); measured: 128 questions with BM25 in 97-214 s by
        # policy (mean 160 s). A dense index of the corpus not built yet adds its build once (factbook: ~7 min)
        rate=1.1,
        units=_eval_units,
        describe=lambda s: (
            f"{s.config.method} on {','.join(s.config.datasets)} ({s.config.limit or 'all'}), "
            f"search={s.meta['engine']}"
        ),
        inert=_eval_inert,
    ),
    Kind.report: StageKind(
        job="(the experiment's report)",
        schema=None,
        run=_report,
        outputs=("report", "rows", "comparisons"),
        rate=5.0,  # the whole report
        units=lambda c: 0.0,
        describe=lambda s: "tables, intervals, paired differences, plot",
    ),
}
# the shipped rate of each kind that has units (tests and docs read them here)
RATES = {kind.value: spec.rate for kind, spec in KINDS.items() if spec.schema is not None}


def run_stage(
    stage: Stage,
    root: Path,
    cfg: ExperimentConfig,
    parent: str | None,
    *,
    stages: Sequence[Stage] = (),
    outputs: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Run one stage's job, its MLflow run nested under ``parent``; returns what downstream stages and the
    report read."""
    c = stage.config
    if c is not None and hasattr(c, "tracking"):
        stage = replace(stage, config=replace(c, tracking=replace(c.tracking, parent_run_id=parent)))
    ctx = RunContext(cfg, root, parent, stages, outputs if outputs is not None else {})
    return KINDS[stage.kind].run(stage, ctx)

"""``zerosim experiment``: the ZeroSearch question — does a policy trained against the simulator do as well on
real search as one trained on real search? — answered by one command.

An orchestrator over the existing jobs (no second implementation of any): it builds each job's config from
one experiment config, runs the jobs as *stages* in order, and writes a report.

- *simulator*: ``simulator collect`` (a real retriever over the training split) → ``simulator train`` (SFT)
  → ``simulator train objective=dpo`` → ``simulator eval`` (quality); skipped when ``simulator.model``
  names a ready simulator;
- *warmstart*: once, shared by every arm;
- *train*: each enabled arm (a set of train overrides on one base recipe) for each seed, same steps and
  trajectories;
- *eval*: every arm's final policy (``method=agent``) on the held-out datasets with each eval engine, plus the
  untrained policy's ``direct`` and ``rag`` baselines;
- *report*: EM / F1 / cover-EM per arm × dataset × engine with 95% bootstrap intervals over questions, and
  paired differences against the reference arm (``report.json``, ``report.md``, ``report.png``).

Every stage is keyed by a fingerprint of its inputs (its job's settings that differ from their defaults, the
version of those defaults, the experiment root written as ``<root>``, and the keys of the stages it reads
from), so a release that adds a setting at a neutral default re-runs nothing. A stage whose ``stage.json``
holds the same key is reused; a killed stage (no ``stage.json``) runs again — a training stage continues
from its last checkpoint — and a changed input re-runs that stage and everything downstream of it. Each
stage records its wall time and how much of the CPU other processes took meanwhile; only stages timed on a
quiet machine teach the dry run's estimates. The MLflow parent run of the experiment holds every stage's
run as a nested run.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path
from typing import Any

from simulators.config import SimulatorEvalConfig, SimulatorTrainConfig
from zerosim.agent.rewards import METRICS as ANSWER_METRICS
from zerosim.core.config import EMBEDDED_MODEL, ConfigError, flatten, load_config
from zerosim.core.data.jsonl import read_jsonl
from zerosim.core.fsutil import atomic_write_text
from zerosim.core.runtime import RuntimeConfig, cpu_times, others_cpu_share
from zerosim.core.tracking import TrackingConfig
from zerosim.job_config import EvalConfig, SimulatorCollectConfig
from zerosim.training.config import TrainConfig

log = logging.getLogger(__name__)

SIMULATOR_PLACEHOLDER = "{simulator}"  # in an arm's overrides: the experiment's simulator checkpoint
STAGE_FILE = "stage.json"
EXPERIMENT_FILE = "experiment.json"


# -- config ------------------------------------------------------------------------------------------------
@dataclass
class SimulatorStageConfig:
    # a ready simulator (path, HF id, smollm2): the simulator stages are skipped
    model: str | None = None
    # overrides of `zerosim simulator collect` (e.g. max_questions=400)
    collect: list[str] = field(default_factory=list)
    # overrides of `zerosim simulator train` (the SFT stage)
    sft: list[str] = field(default_factory=list)
    # DPO from the SFT checkpoint (mode-contrast pairs of the collected data)
    dpo: bool = True
    # overrides of the DPO `zerosim simulator train`
    dpo_overrides: list[str] = field(default_factory=list)
    # overrides of `zerosim simulator eval` (e.g. limit=32)
    quality: list[str] = field(default_factory=list)
    # search.simulator.* overrides of every arm that trains against the simulator (e.g. hint_min_coverage=0.5)
    serve: list[str] = field(default_factory=list)


@dataclass
class ArmConfig:
    # train overrides on the base recipe; {simulator} = the simulator
    overrides: list[str] = field(default_factory=list)
    # false: no RL, the shared warm start is evaluated as it is
    rl: bool = True
    # false: leave the arm out of this experiment
    enabled: bool = True


def default_arms() -> dict[str, ArmConfig]:
    simulator = ["search.engine=simulator", f"search.simulator.model={SIMULATOR_PLACEHOLDER}"]
    return {
        # the tuned simulator with the base recipe's curriculum (ZeroSearch)
        "sim": ArmConfig(simulator),
        # the tuned simulator, noise fixed at the curriculum's mean level instead of rising
        "sim-nocurriculum": ArmConfig([*simulator, "curriculum.schedule=constant", "curriculum.p_end=0.25"]),
        # the real retriever, no noise: the Search-R1 baseline
        "real": ArmConfig(["search.engine=bm25", "curriculum.p_start=0.0", "curriculum.p_end=0.0"]),
        # each search answered by the simulator or BM25 (half and half)
        "mixed": ArmConfig(
            [
                "search.engine=mixed",
                f"search.simulator.model={SIMULATOR_PLACEHOLDER}",
                "search.mixed.real=bm25",
                "search.mixed.real_share=0.5",
            ]
        ),
        # the warm start only
        "none": ArmConfig(rl=False),
    }


@dataclass
class ExperimentEvalConfig:
    # held-out sets (files, HF ids, factbook[:split])
    datasets: list[str] = field(default_factory=lambda: ["factbook"])
    # default split of those datasets
    split: str = "test"
    # questions per dataset (first N); None = all
    limit: int | None = None
    # real engines every policy is evaluated with
    engines: list[str] = field(default_factory=lambda: ["bm25", "dense"])
    # methods run on the untrained policy
    baselines: list[str] = field(default_factory=lambda: ["direct", "rag"])
    # questions per batched rollout
    batch_size: int = 16
    # overrides of every `zerosim eval` stage
    overrides: list[str] = field(default_factory=list)


@dataclass
class ReportConfig:
    # the arm every other arm is compared with (paired, same questions)
    reference: str = "real"
    # bootstrap interval level
    confidence: float = 0.95
    # bootstrap resamples
    resamples: int = 2000
    # seeds the bootstrap
    seed: int = 0


@dataclass
class ExperimentConfig:
    """``zerosim experiment``: stages over one base recipe; see the module docstring."""

    # folder under output_dir and MLflow parent run name
    name: str = "sim-vs-real"
    # the experiment writes to <output_dir>/<name>
    output_dir: str = "outputs/experiments"
    # the training recipe every arm starts from
    base: str = "configs/demo-learning.yaml"
    # train overrides for every arm (and the warm start)
    overrides: list[str] = field(default_factory=list)
    # one training run per arm and seed
    seeds: list[int] = field(default_factory=lambda: [0])
    # e.g. "accelerate launch --config_file configs/accelerate/zero2.yaml": each training stage runs as `<launcher> -m zerosim.cli train` (None: in this process)
    train_launcher: str | None = None
    simulator: SimulatorStageConfig = field(default_factory=SimulatorStageConfig)
    # overrides of the shared warm start (warmstart.* keys)
    warmstart: list[str] = field(default_factory=list)
    # name -> train overrides (docs/experiments.md)
    arms: dict[str, ArmConfig] = field(default_factory=default_arms)
    eval: ExperimentEvalConfig = field(default_factory=ExperimentEvalConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    tracking: TrackingConfig = field(default_factory=lambda: TrackingConfig(experiment="zerosim-experiments"))
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


def load_experiment(path: str | Path | None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    cfg = load_config(path, overrides, schema=ExperimentConfig)
    arms = {name: arm for name, arm in cfg.arms.items() if arm.enabled}
    if not arms:
        raise ConfigError("every arm is disabled (arms.<name>.enabled=false): enable at least one")
    if cfg.report.reference not in arms:
        raise ConfigError(
            f"report.reference={cfg.report.reference!r} is not an enabled arm ({', '.join(arms)}): "
            "name one of them, e.g. report.reference=real"
        )
    if not cfg.seeds:
        raise ConfigError("seeds is empty: give at least one, e.g. seeds=[0]")
    if not cfg.eval.engines:
        raise ConfigError("eval.engines is empty: give at least one real engine, e.g. eval.engines=[bm25]")
    bad = [e for e in cfg.eval.engines if e not in ("bm25", "dense", "hybrid", "http")]
    if bad:
        raise ConfigError(f"eval.engines has {bad}; valid: bm25, dense, hybrid, http (a real engine)")
    bad = [m for m in cfg.eval.baselines if m not in ("direct", "rag")]
    if bad:
        raise ConfigError(f"eval.baselines has {bad}; valid: direct, rag")
    if not 0 < cfg.report.confidence < 1:
        raise ConfigError(f"report.confidence must be in (0, 1), got {cfg.report.confidence}: e.g. 0.95")
    return cfg


# -- stages ------------------------------------------------------------------------------------------------
@dataclass
class Stage:
    name: str  # also the folder under <root>/stages
    kind: str  # collect | sft | dpo | quality | warmstart | train | eval | report
    config: Any  # the job's resolved config (a dataclass); None for the report
    deps: list[str]
    estimate_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)  # arm, seed, engine, method for eval stages
    key: str = ""

    def dir(self, root: Path) -> Path:
        return root / "stages" / self.name


def _plain(obj: Any) -> Any:
    return asdict(obj) if is_dataclass(obj) else obj


# The schema each stage kind's job reads.
STAGE_SCHEMAS: dict[str, type] = {
    "collect": SimulatorCollectConfig,
    "sft": SimulatorTrainConfig,
    "dpo": SimulatorTrainConfig,
    "quality": SimulatorEvalConfig,
    "warmstart": TrainConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
}
# A stage's key holds only the settings that differ from their schema's defaults, so a release that adds a
# setting at a default that changes nothing does not re-run finished stages. A release that changes a default
# changes what a stage computes without changing those settings: it bumps this version, which every key holds.
# tests/test_experiment.py pins the defaults (tests/snapshots/stage_key_defaults.json) and fails on any change
# until the snapshot is rewritten, with the version bumped where a changed default changes results.
KEY_DEFAULTS_VERSION = 1
UNSET = "<unset>"  # a default's setting that a config lacks (a removed dict entry)


def _leaves(config: Any) -> dict[str, Any]:
    """``{"trainer.learning_rate": 1e-06, ...}``: a config's leaves (:func:`zerosim.core.config.flatten`) as plain
    JSON values, so enums, tuples and paths compare as they are written."""
    return {k: json.loads(json.dumps(v, default=str)) for k, v in flatten(config).items()}


@functools.cache
def schema_defaults(schema: type) -> dict[str, Any]:
    """Every setting of a job's schema at its default, as dotted leaves."""
    return _leaves(schema())


def changed_settings(config: Any, schema: type, *, missing: Any = UNSET) -> dict[str, Any]:
    """The leaves of ``config`` that differ from ``schema``'s defaults (where runs are logged left out); a
    default's setting that ``config`` lacks counts as ``missing`` (``None``: as at its default)."""
    current, defaults = _leaves(config), schema_defaults(schema)
    changed = {k: v for k, v in current.items() if k not in defaults or defaults[k] != v}
    if missing is not None:
        changed.update({k: missing for k in defaults if k not in current})
    return {k: v for k, v in changed.items() if not k.startswith("tracking.")}


def _fingerprint(stage: Stage, root: Path, keys: dict[str, str]) -> str:
    """The stage's key: what its result depends on — its settings that differ from their defaults, the version
    of those defaults, and the keys of the stages it reads. Where it is logged (``tracking``) is left out, so
    moving the MLflow store or naming another experiment does not re-run finished work."""
    config = None if stage.config is None else changed_settings(stage.config, STAGE_SCHEMAS[stage.kind])
    return _key(stage.kind, config, stage.meta, {d: keys[d] for d in stage.deps}, root)


def _key(
    kind: str, config: dict[str, Any] | None, meta: dict[str, Any], deps: dict[str, str], root: Path
) -> str:
    payload = {"kind": kind, "defaults": KEY_DEFAULTS_VERSION, "config": config, "meta": meta, "deps": deps}
    text = json.dumps(payload, sort_keys=True, default=str).replace(str(root), "<root>")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# Settings whose default changed without changing what any stage computes (so KEY_DEFAULTS_VERSION stayed):
# a record holding a former default reads as today's default. Keyed by a setting's path or the end of it (a
# section nested in another matches too).
FORMER_DEFAULTS: dict[str, tuple[Any, ...]] = {
    # unset takes a given index's own encoder and minilm for an index built here: what "minilm" (the former
    # default) ran, since a given index with another encoder refused it
    "search.dense.encoder": ("minilm",),
}


def _former_default(path: str, value: Any) -> bool:
    return any(
        (path == name or path.endswith("." + name)) and value in former
        for name, former in FORMER_DEFAULTS.items()
    )


def _recorded_changes(recorded: dict[str, Any], schema: type) -> dict[str, Any]:
    """:func:`changed_settings` of a stage record's config (``stage.json``), read by today's schema: a setting
    the record lacks was added since, and the stage ran as at its default; a former default that computes
    what today's does (:data:`FORMER_DEFAULTS`) reads as today's."""
    return {
        k: v for k, v in changed_settings(recorded, schema, missing=None).items() if not _former_default(k, v)
    }


def recorded_key(stage: Stage, done: dict[str, Any], root: Path, stages: dict[str, Stage]) -> str | None:
    """The key today's rules give what a finished stage ran — its recorded config and meta, and the records of
    the stages it read, each finished before it — or None where the records cannot tell.

    A record keeps the key of the rules it was written under; when the rules change (a new way to key
    stages), :func:`status` still reuses a stage whose record shows the work that would run now."""
    config = done.get("config")
    if stage.config is not None and not isinstance(config, dict):
        return None
    deps: dict[str, str] = {}
    for name in stage.deps:
        dep = stages.get(name)
        dep_done = None if dep is None else read_stage(dep, root)
        # the record this stage read: a dependency finished after it was re-run since
        if dep_done is None or str(dep_done.get("finished", "~")) > str(done.get("finished", "")):
            return None
        key = dep_done.get("key")
        if key != dep.key:
            key = recorded_key(dep, dep_done, root, stages)
        if key is None:
            return None
        deps[name] = key
    changes = None if stage.config is None else _recorded_changes(config, STAGE_SCHEMAS[stage.kind])
    return _key(stage.kind, changes, done.get("meta", {}), deps, root)


def _job_config(schema: type, path: str | Path | None, overrides: Sequence[str], where: str):
    try:
        return load_config(path, list(overrides), schema=schema)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _tracked(tracking: TrackingConfig, experiment: ExperimentConfig) -> TrackingConfig:
    return replace(
        tracking, tracking_uri=experiment.tracking.tracking_uri, experiment=experiment.tracking.experiment
    )


# Seconds per unit on a quiet 2-core machine with the embedded SmolLM2, measured by the CPU preset's run
# (docs/experiments.md, Results); a stage of the same kind finished quiet in this experiment replaces them.
RATES = {
    "collect": 0.01,  # per question (BM25 + labelling; measured: 400 in 1.6 s)
    "sft": 8.2,  # per optimizer step (batch 4, max_length 384; measured: 60 steps in 506 s)
    "dpo": 25.0,  # per optimizer step (batch 4: policy and reference; measured: 20 steps in 514 s)
    "quality": 3.1,  # per question, a useful and a noisy request (measured: 32 in 113 s)
    "warmstart": 9.8,  # per optimizer step (batch 4), trajectories built in seconds (measured: 5 in 64 s)
    "train": 3.2,  # per trajectory with a real retriever (measured: 16 steps x 16 with BM25 in 835 s)
    # per question and method=agent (direct: a third); measured: 128 questions with BM25 in 97-214 s by policy
    # (mean 160 s). A dense index of the corpus not built yet adds its build once (factbook: ~7 min)
    "eval": 1.1,
}
# a trajectory against the simulator (or mixed) costs this many real-retriever ones: the simulator writes the
# documents (measured: 962, 1,277 and 1,114 s for the sim, sim-nocurriculum and mixed arms against 835 s)
SIMULATOR_FACTOR = 1.35
OVERHEAD_S = 15.0  # model load and MLflow per stage


def _units(stage: Stage) -> float:
    c = stage.config
    if stage.kind == "collect":
        return c.max_questions or 2000
    if stage.kind in ("sft", "dpo"):
        return c.max_steps
    if stage.kind == "quality":
        return c.limit or 200
    if stage.kind == "warmstart":
        return c.warmstart.max_steps
    if stage.kind == "train":
        trajectories = (
            c.trainer.max_steps
            * c.trainer.per_device_train_batch_size
            * c.trainer.gradient_accumulation_steps
        )
        return trajectories * (SIMULATOR_FACTOR if c.search.engine in ("simulator", "mixed") else 1.0)
    if stage.kind == "eval":
        n = (c.limit or 200) * len(c.datasets)
        return n * (1 / 3 if c.method == "direct" else 1.0)
    return 0.0


def build_stages(cfg: ExperimentConfig, root: Path) -> list[Stage]:
    """Every stage with its job's resolved config, in run order (reads config files only)."""
    stages: list[Stage] = []
    sim_model = cfg.simulator.model
    sim_deps: list[str] = []
    if sim_model is None:
        d = root / "stages"
        collect = _job_config(
            SimulatorCollectConfig,
            None,
            [
                "search.engine=bm25",
                "split=train",
                *cfg.simulator.collect,
                f"out={d / 'sim-collect' / 'sft.jsonl'}",
            ],
            "simulator.collect",
        )
        collect = replace(collect, runtime=cfg.runtime)
        stages.append(Stage("sim-collect", "collect", collect, []))
        sft = _job_config(
            SimulatorTrainConfig,
            None,
            [
                *cfg.simulator.sft,
                f"data={collect.out}",
                f"output_dir={d / 'sim-sft'}",
                "name=sft",
            ],
            "simulator.sft",
        )
        sft = replace(sft, tracking=_tracked(sft.tracking, cfg), runtime=cfg.runtime)
        stages.append(Stage("sim-sft", "sft", sft, ["sim-collect"]))
        sim_model, sim_deps = str(d / "sim-sft" / "sft" / "final"), ["sim-sft"]
        if cfg.simulator.dpo:
            dpo = _job_config(
                SimulatorTrainConfig,
                None,
                [
                    "objective=dpo",
                    *cfg.simulator.dpo_overrides,
                    f"data={collect.out}",
                    f"model={sim_model}",
                    f"output_dir={d / 'sim-dpo'}",
                    "name=dpo",
                ],
                "simulator.dpo_overrides",
            )
            dpo = replace(dpo, tracking=_tracked(dpo.tracking, cfg), runtime=cfg.runtime)
            stages.append(Stage("sim-dpo", "dpo", dpo, ["sim-collect", "sim-sft"]))
            sim_model, sim_deps = str(d / "sim-dpo" / "dpo" / "final"), ["sim-dpo"]
        quality = _job_config(
            SimulatorEvalConfig,
            None,
            [
                *cfg.simulator.quality,
                f"simulator.model={sim_model}",
                f"output_dir={d / 'sim-quality'}",
                "run_name=quality",
            ],
            "simulator.quality",
        )
        quality = replace(quality, tracking=_tracked(quality.tracking, cfg), runtime=cfg.runtime)
        stages.append(Stage("sim-quality", "quality", quality, list(sim_deps)))

    base_path = Path(cfg.base)
    if not base_path.is_file():
        raise ConfigError(
            f"base recipe {cfg.base} does not exist: point base= at a training recipe, e.g. configs/demo-learning.yaml"
        )

    def train_config(extra: Sequence[str], where: str) -> TrainConfig:
        t = _job_config(TrainConfig, base_path, [*cfg.overrides, *extra], where)
        return replace(t, tracking=_tracked(t.tracking, cfg), runtime=cfg.runtime)

    ws = train_config(
        [*cfg.warmstart, f"run.output_dir={root / 'stages'}", "run.name=warmstart"], "warmstart"
    )
    base_policy = ws.policy.model
    if ws.warmstart.enabled:  # one warm start shared by every arm
        stages.append(Stage("warmstart", "warmstart", ws, []))
        warm, warm_deps = str(root / "stages" / "warmstart" / "warmstart" / "final"), ["warmstart"]
    else:  # the base recipe (or `warmstart`) turns it off: every arm starts from the base policy
        warm, warm_deps = base_policy, []

    arms = {name: arm for name, arm in cfg.arms.items() if arm.enabled}
    policies: dict[tuple[str, int], tuple[str, list[str]]] = {}
    for name, arm in arms.items():
        for seed in cfg.seeds:
            if not arm.rl:
                policies[(name, seed)] = (warm, warm_deps)
                continue
            uses_sim = any(SIMULATOR_PLACEHOLDER in o for o in arm.overrides)
            overrides = [o.replace(SIMULATOR_PLACEHOLDER, sim_model or EMBEDDED_MODEL) for o in arm.overrides]
            if uses_sim:
                overrides += [
                    f"search.simulator.{o.removeprefix('search.simulator.')}" for o in cfg.simulator.serve
                ]
            stage_name = f"train-{name}-s{seed}"
            t = train_config(
                [
                    *overrides,
                    f"policy.model={warm}",
                    "warmstart.enabled=false",
                    f"run.seed={seed}",
                    f"run.output_dir={root / 'stages' / stage_name}",
                    f"run.name={name}",
                ],
                f"arms.{name}",
            )
            deps = [*warm_deps, *(sim_deps if uses_sim else [])]
            stages.append(Stage(stage_name, "train", t, deps, meta={"arm": name, "seed": seed}))
            policies[(name, seed)] = (str(root / "stages" / stage_name / name / "final"), [stage_name])

    e = cfg.eval
    train_like = ws  # the rollout settings every policy is evaluated with: the base recipe's

    def eval_config(policy: str, method: str, engine: str, stage_name: str) -> EvalConfig:
        overrides = [
            f"policy={policy}",
            f"method={method}",
            f"split={e.split}",
            f"batch_size={e.batch_size}",
            f"output_dir={root / 'stages' / stage_name}",
            "run_name=eval",
            f"seed={cfg.seeds[0]}",
            *e.overrides,
        ]
        if e.limit is not None:
            overrides.append(f"limit={e.limit}")
        ev = _job_config(EvalConfig, None, overrides, "eval.overrides")
        search = replace(copy.deepcopy(train_like.search), engine=engine)
        rollout = replace(train_like.rollout, temperature=0.0)
        return replace(
            ev,
            datasets=list(e.datasets),
            search=search,
            rollout=rollout,
            tracking=_tracked(ev.tracking, cfg),
            runtime=cfg.runtime,
        )

    for (name, seed), (policy, deps) in policies.items():
        for engine in e.engines:
            stage_name = f"eval-{name}-s{seed}-{engine}"
            stages.append(
                Stage(
                    stage_name,
                    "eval",
                    eval_config(policy, "agent", engine, stage_name),
                    deps,
                    meta={"arm": name, "seed": seed, "engine": engine, "method": "agent"},
                )
            )
    for method in e.baselines:
        for engine in ["none"] if method == "direct" else e.engines:
            stage_name = f"baseline-{method}-{engine}"
            ev = eval_config(base_policy, method, engine if engine != "none" else e.engines[0], stage_name)
            stages.append(
                Stage(
                    stage_name,
                    "eval",
                    ev,
                    [],
                    meta={"arm": f"base-{method}", "seed": None, "engine": engine, "method": method},
                )
            )
    evals = [s.name for s in stages if s.kind == "eval"]
    stages.append(Stage("report", "report", None, evals, meta={"report": asdict(cfg.report)}))

    keys: dict[str, str] = {}
    for stage in stages:
        stage.key = keys[stage.name] = _fingerprint(stage, root, keys)
        stage.estimate_s = (
            OVERHEAD_S + RATES.get(stage.kind, 0.0) * _units(stage) if stage.kind != "report" else 5.0
        )
    return stages


# -- state -------------------------------------------------------------------------------------------------
def read_stage(stage: Stage, root: Path) -> dict[str, Any] | None:
    return _read_json(stage.dir(root) / STAGE_FILE)


def status(stage: Stage, root: Path, stages: Sequence[Stage] = ()) -> str:
    """``reuse`` (finished with this key, or its record shows the same work: :func:`recorded_key`, which reads
    the records of ``stages``), ``run`` (never finished), ``re-run`` (finished with other work), ``continue``
    (a training stage killed after a checkpoint)."""
    done = read_stage(stage, root)
    if done is not None:
        if done.get("key") == stage.key:
            return "reuse"
        same = recorded_key(stage, done, root, {s.name: s for s in stages}) == stage.key
        return "reuse" if same else "re-run"
    if stage.kind == "train" and any(stage.dir(root).glob("*/checkpoint-*/")):
        return "continue"
    return "run"


# A stage during which other processes took more than this share of the machine's CPU ran contended: its
# time says little about this job's speed (on 2 cores, several-fold slower), so no estimate learns from it.
CONTENDED_SHARE = 0.25


def ran_quiet(record: dict[str, Any]) -> bool:
    """Whether a finished stage's time was taken with the machine to itself (None: not measurable here,
    e.g. not Linux, taken as quiet; no entry: an older record whose conditions are unknown)."""
    if "others_cpu" not in record:
        return False
    return record["others_cpu"] is None or record["others_cpu"] <= CONTENDED_SHARE


def _learned_rates(stages: Sequence[Stage], root: Path) -> dict[str, float]:
    """Seconds per unit of each kind, from the stages of this experiment that finished on a quiet machine."""
    total: dict[str, list[float]] = {}
    for stage in stages:
        done = read_stage(stage, root)
        units = _units(stage)
        # a continued stage's time holds the steps its killed attempt did again: no rate learns from it
        if done and units and stage.kind != "report" and ran_quiet(done) and done.get("attempts", 1) == 1:
            total.setdefault(stage.kind, []).append(max(done["seconds"] - OVERHEAD_S, 0.0) / units)
    return {kind: sum(v) / len(v) for kind, v in total.items()}


def estimates(stages: Sequence[Stage], root: Path) -> dict[str, float]:
    learned = _learned_rates(stages, root)
    out = {}
    for stage in stages:
        rate = learned.get(stage.kind)
        out[stage.name] = stage.estimate_s if rate is None else OVERHEAD_S + rate * _units(stage)
    return out


def plan_rows(cfg: ExperimentConfig, stages: Sequence[Stage], root: Path) -> list[tuple[str, str, str, str]]:
    """(stage, status, estimate, what) for ``--dry-run``."""
    est = estimates(stages, root)
    rows = []
    for stage in stages:
        state = status(stage, root, stages)
        seconds = 0.0 if state == "reuse" else est[stage.name]
        rows.append((stage.name, state, _minutes(seconds), _describe(stage).replace(str(root), "<root>")))
    return rows


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def _describe(stage: Stage) -> str:
    c = stage.config
    if stage.kind == "collect":
        return f"{c.max_questions or 'all'} {c.split} questions, {c.search.engine} depth {c.depth}"
    if stage.kind in ("sft", "dpo"):
        return f"{c.objective} of {c.model}, {c.max_steps} steps"
    if stage.kind == "quality":
        return f"{c.simulator.model} on {c.limit or 'all'} {c.split} questions"
    if stage.kind == "warmstart":
        return f"{c.policy.model}, {c.warmstart.max_steps} steps"
    if stage.kind == "train":
        t = c.trainer
        cur = c.curriculum
        noise = (
            f"noise {cur.p_start:g}->{cur.p_end:g} {cur.schedule}"
            if cur.schedule != "constant"
            else f"noise {cur.p_end:g}"
        )
        return f"{t.algorithm} {t.max_steps} steps x {t.per_device_train_batch_size * t.gradient_accumulation_steps} traj, search={c.search.engine}, {noise}"
    if stage.kind == "eval":
        return f"{c.method} on {','.join(c.datasets)} ({c.limit or 'all'}), search={stage.meta['engine']}"
    return "tables, intervals, paired differences, plot"


# -- running -----------------------------------------------------------------------------------------------
ATTEMPT_FILE = "attempt.json"


class StageClock:
    """A stage's wall time over all its attempts. While an attempt runs, the time so far is kept in
    ``attempt.json`` every ``every`` seconds, so when a killed stage continues, the killed attempt's time
    (to within ``every``) counts too; ``attempts`` counts them."""

    def __init__(self, folder: Path, *, continuing: bool, every: float = 30.0):
        self.folder, self.every = folder, every
        earlier = _read_json(folder / ATTEMPT_FILE) if continuing else None
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


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        return None


def _clear(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)


def _run_stage(stage: Stage, root: Path, cfg: ExperimentConfig, parent: str | None) -> dict[str, Any]:
    """Run one stage's job; returns what downstream stages and the report read."""
    from zerosim.engines import build_search_engine

    c = stage.config
    if c is not None and hasattr(c, "tracking"):
        c = replace(c, tracking=replace(c.tracking, parent_run_id=parent))
    out = stage.dir(root)
    if stage.kind == "collect":
        from simulators.collect import run_collect

        result = run_collect(c, build_engine=build_search_engine)
        return {"path": str(result.path), "rows": len(result.rows), "report": result.report}
    if stage.kind in ("sft", "dpo"):
        from simulators.sft import run_sft

        return {"path": str(run_sft(c))}
    if stage.kind == "quality":
        from simulators.quality import run_quality

        result = run_quality(c, progress=True)
        return {"run_id": result.run_id, "report": result.report}
    if stage.kind == "warmstart":
        from zerosim.training.warmstart import run_warmstart

        path = run_warmstart(
            c.warmstart,
            policy=c.policy.model,
            seed=c.run.seed,
            tracking=c.tracking,
            output_dir=out / "warmstart",
        )
        return {"path": str(path)}
    if stage.kind == "train":
        checkpoints = list((out / c.run.name).glob("checkpoint-*/"))
        c = replace(c, run=replace(c.run, resume=bool(checkpoints)))
        if cfg.train_launcher:
            return _launch_training(c, out, cfg.train_launcher)
        from zerosim.training.recipe import train

        result = train(c)
        return {"path": str(result.checkpoint), "run_id": result.run_id, "steps": result.steps}
    if stage.kind == "eval":
        from eval.run import run_eval

        result = run_eval(c, build_engine=build_search_engine)
        return {
            "run_id": result.run_id,
            "rows": result.rows,
            "questions": str(result.out_dir / "questions.jsonl"),
        }
    raise AssertionError(f"unknown stage kind {stage.kind}")


def _launch_training(c: TrainConfig, out: Path, launcher: str) -> dict[str, Any]:
    """``<launcher> -m zerosim.cli train --config <out>/train.yaml``: several processes (GPUs) per arm."""
    import shlex
    import subprocess

    from zerosim.core.config import to_yaml
    from zerosim.training.checkpoint import recorded_run

    out.mkdir(parents=True, exist_ok=True)
    recipe = atomic_write_text(out / "train.yaml", to_yaml(c))
    command = [*shlex.split(launcher), "-m", "zerosim.cli", "train", "--config", str(recipe)]
    log.info("launching %s", " ".join(command))
    code = subprocess.call(command, stdin=subprocess.DEVNULL)
    if code != 0:
        raise RuntimeError(f"training stage failed (exit code {code}): {' '.join(command)}")
    final = out / c.run.name / "final"
    return {"path": str(final), "run_id": recorded_run(out / c.run.name), "steps": c.trainer.max_steps}


@dataclass
class ExperimentResult:
    root: Path
    report: dict[str, Any]
    ran: list[str]
    reused: list[str]
    parent_run_id: str


def run_experiment(
    cfg: ExperimentConfig,
    *,
    echo: Callable[[str], None] = print,
    stop_after: str | None = None,
) -> ExperimentResult:
    """Run every stage not already finished with the same inputs, then the report.

    ``stop_after`` (a stage name) ends the run after that stage, as a kill would (tests use it).
    """
    import mlflow

    from zerosim.core.tracking import configure, mlflow_run

    root = Path(cfg.output_dir) / cfg.name
    stages = build_stages(cfg, root)
    root.mkdir(parents=True, exist_ok=True)
    state_path = root / EXPERIMENT_FILE
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    configure(cfg.tracking)
    parent_id = state.get("parent_run_id")
    if parent_id is not None:
        try:
            mlflow.MlflowClient().get_run(parent_id)
        except Exception:  # noqa: BLE001 - another tracking store: a new parent run
            parent_id = None
    tags = {"zerosim.job": "experiment", "zerosim.experiment": cfg.name}
    ran, reused = [], []
    with mlflow_run(cfg.tracking, cfg.name, tags=tags, run_id=parent_id) as parent:
        parent_id = parent.info.run_id
        atomic_write_text(state_path, json.dumps({"parent_run_id": parent_id, "name": cfg.name}, indent=2))
        if not state:
            from zerosim.core.config import to_yaml

            mlflow.log_text(to_yaml(cfg), "experiment.yaml")
        outputs: dict[str, dict[str, Any]] = {}
        for i, stage in enumerate(stages, 1):
            current = status(stage, root, stages)
            if current == "reuse":
                outputs[stage.name] = read_stage(stage, root)["outputs"]
                reused.append(stage.name)
                echo(f"[{i}/{len(stages)}] {stage.name}: reused")
                continue
            if current in ("re-run", "run"):
                _clear(stage.dir(root))
            echo(f"[{i}/{len(stages)}] {stage.name}: {current} ({_describe(stage)})")
            cpu_before = cpu_times()
            with StageClock(stage.dir(root), continuing=current == "continue") as clock:
                if stage.kind == "report":
                    result = write_report(cfg, stages, root, outputs, parent_id)
                else:
                    result = _run_stage(stage, root, cfg, parent_id)
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
                "config": _plain(stage.config),
                "outputs": result,
            }
            stage.dir(root).mkdir(parents=True, exist_ok=True)
            atomic_write_text(stage.dir(root) / STAGE_FILE, json.dumps(record, indent=2, default=str))
            mlflow.log_metric(f"stage_seconds/{stage.name}", seconds)
            outputs[stage.name] = result
            ran.append(stage.name)
            if stop_after == stage.name:
                break
    report_path = root / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    return ExperimentResult(root, report, ran, reused, parent_id)


# -- report ------------------------------------------------------------------------------------------------
METRICS = tuple(m.value for m in ANSWER_METRICS)  # em, f1, cover_em (the judge is a training reward only)


def _scores(path: str | Path) -> dict[str, dict[str, dict[str, float]]]:
    """dataset -> question id -> metric -> score, from an eval stage's questions.jsonl."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for row in read_jsonl(path):
        out.setdefault(row["dataset"], {})[row["id"]] = {m: float(row[m]) for m in METRICS}
    return out


def bootstrap_mean(values, *, confidence: float, resamples: int, seed: int) -> tuple[float, float, float]:
    """Mean and its percentile bootstrap interval (scipy)."""
    import numpy as np
    from scipy.stats import bootstrap

    x = np.asarray(values, dtype=float)
    mean = float(x.mean())
    if len(x) < 2 or np.all(x == x[0]):
        return mean, mean, mean
    res = bootstrap(
        (x,), np.mean, confidence_level=confidence, n_resamples=resamples, method="percentile",
        random_state=np.random.default_rng(seed),
    )  # fmt: skip
    return mean, float(res.confidence_interval.low), float(res.confidence_interval.high)


def paired_ratio(a, b, *, confidence: float, resamples: int, seed: int) -> dict[str, float]:
    """``mean(a) / mean(b)`` and ``mean(a) - mean(b)`` with paired bootstrap intervals (questions resampled
    together). The ratio is NaN (its interval too) when ``b``'s mean is 0."""
    import numpy as np
    from scipy.stats import bootstrap

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    rng = np.random.default_rng(seed)

    def diff(x, y, axis=-1):
        return x.mean(axis=axis) - y.mean(axis=axis)

    def ratio(x, y, axis=-1):
        den = y.mean(axis=axis)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(den > 0, x.mean(axis=axis) / np.where(den > 0, den, 1), np.nan)

    out = {
        "diff": float(a.mean() - b.mean()),
        "ratio": float(a.mean() / b.mean()) if b.mean() > 0 else float("nan"),
    }
    if len(a) < 2 or (np.all(a == a[0]) and np.all(b == b[0])):
        out.update(
            diff_low=out["diff"], diff_high=out["diff"], ratio_low=out["ratio"], ratio_high=out["ratio"]
        )
        return out
    for name, stat in (("diff", diff), ("ratio", ratio)):
        if name == "ratio" and not b.mean() > 0:
            out.update(ratio_low=float("nan"), ratio_high=float("nan"))
            continue
        res = bootstrap(
            (a, b), stat, paired=True, vectorized=True, confidence_level=confidence, n_resamples=resamples,
            method="percentile", random_state=rng,
        )  # fmt: skip
        out[f"{name}_low"] = float(res.confidence_interval.low)
        out[f"{name}_high"] = float(res.confidence_interval.high)
    return out


def manifest(cfg: ExperimentConfig, stages: Sequence[Stage], root: Path) -> dict[str, Any]:
    """What a reader needs to reproduce the numbers."""
    import importlib.metadata as md

    ws = next(s.config for s in stages if s.kind == "eval")  # search and rollout: the base recipe's
    corpus = {}
    for engine in cfg.eval.engines:
        if engine in ("bm25", "dense"):
            from eval.index import corpus_file_fingerprint
            from zerosim.engines import resolve_corpus

            source = getattr(ws.search, engine).corpus
            path = Path(resolve_corpus(source))
            # the fingerprint an index manifest records, so a reader can match the report to an index
            corpus[engine] = {"source": source, "path": str(path), **corpus_file_fingerprint(path)}
    versions = {}
    for pkg in (
        "zerosim",
        "torch",
        "transformers",
        "trl",
        "mlflow",
        "bm25s",
        "faiss-cpu",
        "sentence-transformers",
        "scipy",
    ):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            continue
    stage_records = {}
    for stage in stages:
        done = read_stage(stage, root)
        if done:
            stage_records[stage.name] = {
                "key": done["key"],
                "seconds": done["seconds"],
                "attempts": done.get("attempts", 1),
                "others_cpu": done.get("others_cpu"),
                "config": done["config"],
            }
    return {
        "name": cfg.name,
        "base": cfg.base,
        "seeds": list(cfg.seeds),
        "corpus": corpus,
        "search": {
            "k": ws.search.k,
            "bm25": asdict(ws.search.bm25),
            "dense": asdict(ws.search.dense),
            "negatives": ws.search.negatives,
        },
        "rollout": {
            "max_turns": ws.rollout.max_turns,
            "max_new_tokens": ws.rollout.max_new_tokens,
            "max_obs_tokens": ws.rollout.max_obs_tokens,
            "max_completion_tokens": ws.rollout.max_completion_tokens,
        },
        "eval": asdict(cfg.eval),
        "versions": versions,
        "stages": stage_records,
    }


def write_report(
    cfg: ExperimentConfig, stages: Sequence[Stage], root: Path, outputs: dict[str, dict], parent_id: str
) -> dict[str, Any]:
    """report.json / report.md / report.png in ``root`` and on the parent MLflow run."""
    import mlflow

    r = cfg.report
    opts = dict(confidence=r.confidence, resamples=r.resamples, seed=r.seed)
    # (arm, engine) -> dataset -> question -> metric -> mean over seeds
    per: dict[tuple[str, str], dict[str, dict[str, dict[str, float]]]] = {}
    counts: dict[tuple[str, str], int] = {}
    for stage in stages:
        if stage.kind != "eval":
            continue
        key = (stage.meta["arm"], stage.meta["engine"])
        scores = _scores(outputs[stage.name]["questions"])
        acc = per.setdefault(key, {})
        counts[key] = counts.get(key, 0) + 1
        for dataset, questions in scores.items():
            for qid, m in questions.items():
                slot = acc.setdefault(dataset, {}).setdefault(qid, {k: 0.0 for k in METRICS})
                for k in METRICS:
                    slot[k] += m[k]
    for key, data in per.items():
        for questions in data.values():
            for m in questions.values():
                for k in METRICS:
                    m[k] /= counts[key]
    rows = []
    for (arm, engine), data in per.items():
        for dataset, questions in data.items():
            row = {
                "arm": arm,
                "engine": engine,
                "dataset": dataset,
                "n": len(questions),
                "seeds": counts[(arm, engine)],
            }
            for k in METRICS:
                mean, low, high = bootstrap_mean([m[k] for m in questions.values()], **opts)
                row[k], row[f"{k}_low"], row[f"{k}_high"] = mean, low, high
            rows.append(row)
    comparisons = []
    for (arm, engine), data in per.items():
        ref = per.get((r.reference, engine))
        if arm == r.reference or ref is None:
            continue
        for dataset, questions in data.items():
            ref_q = ref.get(dataset, {})
            common = sorted(set(questions) & set(ref_q))
            if not common:
                continue
            entry = {
                "arm": arm,
                "reference": r.reference,
                "engine": engine,
                "dataset": dataset,
                "n": len(common),
            }
            for k in METRICS:
                stats = paired_ratio([questions[q][k] for q in common], [ref_q[q][k] for q in common], **opts)
                entry[k] = stats
            comparisons.append(entry)
    report = {
        "rows": rows,
        "comparisons": comparisons,
        "confidence": r.confidence,
        "manifest": manifest(cfg, stages, root),
    }
    md = report_markdown(report)
    atomic_write_text(root / "report.json", json.dumps(report, indent=2, default=str))
    atomic_write_text(root / "report.md", md)
    png = root / "report.png"
    plot_report(rows, png, reference=r.reference)
    mlflow.log_text(json.dumps(report, indent=2, default=str), "report.json")
    mlflow.log_text(md, "report.md")
    mlflow.log_artifact(str(png))
    for row in rows:
        name = f"{row['arm']}/{row['engine']}/{row['dataset']}".replace(":", "_")
        mlflow.log_metrics({f"{name}/{k}": row[k] for k in METRICS})
    return {"report": str(root / "report.json"), "rows": len(rows), "comparisons": len(comparisons)}


def _pct(x: float) -> str:
    return "–" if x != x else f"{100 * x:.1f}"


def report_markdown(report: dict[str, Any]) -> str:
    level = round(100 * report["confidence"])
    lines = [
        f"### Held-out scores ({level}% bootstrap intervals over questions)",
        "",
        "| arm | engine | dataset | n | seeds | EM | F1 | cover-EM |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(report["rows"], key=lambda r: (r["dataset"], r["engine"], r["arm"])):
        cells = [f"{_pct(row[k])} [{_pct(row[k + '_low'])}, {_pct(row[k + '_high'])}]" for k in METRICS]
        lines.append(
            f"| {row['arm']} | {row['engine']} | {row['dataset']} | {row['n']} | {row['seeds']} | "
            + " | ".join(cells)
            + " |"
        )
    if report["comparisons"]:
        lines += [
            "",
            f"### Paired against `{report['comparisons'][0]['reference']}` (same questions; {level}% intervals)",
            "",
            "| arm | engine | dataset | n | EM ratio | EM difference | F1 ratio | F1 difference |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in sorted(report["comparisons"], key=lambda c: (c["dataset"], c["engine"], c["arm"])):
            cells = []
            for k in ("em", "f1"):
                s = c[k]
                cells.append(f"{_pct(s['ratio'])}% [{_pct(s['ratio_low'])}, {_pct(s['ratio_high'])}]")
                cells.append(
                    f"{100 * s['diff']:+.1f} [{100 * s['diff_low']:+.1f}, {100 * s['diff_high']:+.1f}]"
                )
            lines.append(
                f"| {c['arm']} | {c['engine']} | {c['dataset']} | {c['n']} | " + " | ".join(cells) + " |"
            )
        lines += ["", "Sentences:", ""]
        for c in sorted(report["comparisons"], key=lambda c: (c["dataset"], c["engine"], c["arm"])):
            s = c["em"]
            if s["ratio"] == s["ratio"]:
                lines.append(
                    f"- {c['arm']} reaches {_pct(s['ratio'])}% of {c['reference']}'s EM "
                    f"[{_pct(s['ratio_low'])}%, {_pct(s['ratio_high'])}%] on {c['dataset']} with {c['engine']}"
                )
            else:
                lines.append(
                    f"- {c['reference']} scores 0 EM on {c['dataset']} with {c['engine']}: "
                    f"{c['arm']} differs by {100 * s['diff']:+.1f} points [{100 * s['diff_low']:+.1f}, {100 * s['diff_high']:+.1f}]"
                )
    stages = report["manifest"]["stages"]
    if stages:
        total = sum(s["seconds"] for s in stages.values())
        lines += [
            "",
            f"### Stages ({total / 60:.1f} min in all)",
            "",
            "| stage | minutes | other processes' CPU |",
            "|---|---|---|",
        ]
        for name, s in stages.items():
            others = s.get("others_cpu")
            attempts = s.get("attempts", 1)
            minutes = f"{s['seconds'] / 60:.1f}" + (f" ({attempts} attempts)" if attempts > 1 else "")
            lines.append(f"| {name} | {minutes} | {'?' if others is None else f'{others:.0%}'} |")
    return "\n".join(lines) + "\n"


def plot_report(rows: Sequence[dict[str, Any]], path: Path, reference: str) -> None:
    """EM with its interval per arm, one panel per (dataset, engine)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["dataset"], r["engine"]) for r in rows})
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.5 * max(len(panels), 1), 3.6), squeeze=False)
    for ax, (dataset, engine) in zip(axes[0], panels, strict=False):
        sub = sorted(
            (r for r in rows if (r["dataset"], r["engine"]) == (dataset, engine)), key=lambda r: r["arm"]
        )
        xs = range(len(sub))
        em = [100 * r["em"] for r in sub]
        err = [[100 * (r["em"] - r["em_low"]) for r in sub], [100 * (r["em_high"] - r["em"]) for r in sub]]
        colors = ["tab:orange" if r["arm"] == reference else "tab:blue" for r in sub]
        ax.bar(xs, em, yerr=err, color=colors, capsize=3)
        ax.set_xticks(list(xs), [r["arm"] for r in sub], rotation=35, ha="right", fontsize=8)
        ax.set_title(f"{dataset} · {engine}", fontsize=9)
        ax.set_ylabel("EM (%)")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)

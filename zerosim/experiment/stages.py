"""The stage graph: every stage of an experiment with its job's resolved config, in run order.

``build_stages`` reads config files only (no weights, no data) and is what both ``--dry-run`` and the run
walk. It is written as the experiment's steps, each adding its stages and saying which model the next step
starts from (a :class:`Source`: a model, and the stages that produce it):

1. the simulator — collect → SFT → DPO → quality (none when ``simulator.model`` names one);
2. the shared warm start (none when the base recipe turns it off), and one more per agent shape an arm asks
   for (``rollout.protocol`` / ``rollout.tools``: the warm start's demonstrations are written in its protocol);
3. one training stage per arm × seed, from its shape's warm start (``rl: false`` arms take the warm start as it
   is, evaluated once);
4. every arm's policy evaluated with each real engine, rolling out as the arm trained (its protocol and
   tools), and the untrained policy's baselines;
5. the report, over every eval stage.

Each policy's evaluation runs right after the stage that produces it (:func:`_run_order`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from simulators.config import SimulatorEvalConfig, SimulatorTrainConfig
from zerosim.agent.rollout import RolloutConfig
from zerosim.core.config import EMBEDDED_MODEL, ConfigError, load_config
from zerosim.core.tracking import TrackingConfig
from zerosim.engines import EngineName
from zerosim.experiment.config import CURRICULUM_MEAN, SIMULATOR_PLACEHOLDER, ExperimentConfig, baseline_arm
from zerosim.experiment.keys import fingerprint
from zerosim.experiment.kinds import KINDS, Kind, Stage
from zerosim.job_config import EvalConfig, SimulatorCollectConfig
from zerosim.training.config import TrainConfig


@dataclass(frozen=True)
class Source:
    """A model and the stages that produce it (none: it exists already)."""

    model: str
    deps: tuple[str, ...] = ()


def build_stages(cfg: ExperimentConfig, root: Path) -> list[Stage]:
    """Every stage with its job's resolved config, key and estimate, in run order (reads config files only)."""
    stages: list[Stage] = []
    simulator = _simulator(cfg, root, stages)
    base = _base_recipe(cfg)
    named = [f"run.output_dir={root / 'stages'}", "run.name=warmstart"]
    warm = _train_config(cfg, base, [*cfg.warmstart, *named], "warmstart")
    protocol = _protocol(warm)
    if cfg.warmstarts.get(protocol):  # the base recipe's protocol has a warm-start budget of its own
        extra = [*cfg.warmstart, *cfg.warmstarts[protocol], *named]
        warm = _train_config(cfg, base, extra, f"warmstarts.{protocol}")
    # the experiment's tracking.log_model: the shared warm start's policy (what rl: false arms evaluate) too
    logged = (
        replace(warm, tracking=replace(warm.tracking, log_model=True)) if cfg.tracking.log_model else warm
    )
    starts = WarmStarts(cfg, base, logged, root, stages)
    policies, rollouts = _arms(cfg, root, base, warm, starts, simulator, stages)
    _evals(cfg, root, warm, policies, rollouts, stages)
    _baselines(cfg, root, warm, stages)
    stages = _run_order(stages)
    evals = [s.name for s in stages if s.kind == Kind.eval]
    stages.append(Stage("report", Kind.report, None, evals, meta={"report": asdict(cfg.report)}))
    keys: dict[str, str] = {}
    for stage in stages:
        stage.key = keys[stage.name] = fingerprint(stage, root, keys)
        stage.estimate_s = KINDS[stage.kind].estimate(stage)
    return stages


# -- the jobs' configs -------------------------------------------------------------------------------------
def _job_config(schema: type, path: str | Path | None, overrides: Sequence[str], where: str):
    try:
        return load_config(path, list(overrides), schema=schema)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _tracked(tracking: TrackingConfig, experiment: ExperimentConfig) -> TrackingConfig:
    """A stage's tracking: its job's, in the experiment's store and MLflow experiment."""
    return replace(
        tracking, tracking_uri=experiment.tracking.tracking_uri, experiment=experiment.tracking.experiment
    )


def _job(schema: type, overrides: Sequence[str], where: str, cfg: ExperimentConfig):
    """A simulator or eval job's config from its defaults and ``overrides``, tracked and run as the
    experiment says."""
    job = _job_config(schema, None, overrides, where)
    return replace(job, tracking=_tracked(job.tracking, cfg), runtime=cfg.runtime)


def _base_recipe(cfg: ExperimentConfig) -> Path:
    base = Path(cfg.base)
    if not base.is_file():
        raise ConfigError(
            f"base recipe {cfg.base} does not exist: point base= at a training recipe, e.g. configs/demo-learning.yaml"
        )
    return base


def _train_config(cfg: ExperimentConfig, base: Path, extra: Sequence[str], where: str) -> TrainConfig:
    """The base recipe on ``train_split``, with the experiment's overrides, then ``extra``."""
    split = (
        []
        if cfg.train_split is None
        else [f"data.split={cfg.train_split}", f"warmstart.split={cfg.train_split}"]
    )
    t = _job_config(TrainConfig, base, [*split, *cfg.overrides, *extra], where)
    return replace(t, tracking=_tracked(t.tracking, cfg), runtime=cfg.runtime)


# -- 1. the simulator ----------------------------------------------------------------------------------------
def _simulator(cfg: ExperimentConfig, root: Path, stages: list[Stage]) -> Source:
    """collect → SFT → (DPO) → quality, unless ``simulator.model`` names a ready simulator or no enabled arm trains
    against one (a sweep over real retrievers)."""
    if cfg.simulator.model is not None:
        return Source(cfg.simulator.model)
    if not any(arm.uses_simulator for arm in cfg.enabled_arms().values()):
        return Source("")  # nothing reads it: no arm names {simulator}
    s, d = cfg.simulator, root / "stages"
    split = f"split={cfg.train_split or 'train'}"
    overrides = ["search.engine=bm25", split, *s.collect, f"out={d / 'sim-collect' / 'sft.jsonl'}"]
    collect = _job_config(SimulatorCollectConfig, None, overrides, "simulator.collect")
    collect = Stage("sim-collect", Kind.collect, replace(collect, runtime=cfg.runtime), [])
    data = collect.config.out
    sft = _job(
        SimulatorTrainConfig,
        [*s.sft, f"data={data}", f"output_dir={d / 'sim-sft'}", "name=sft"],
        "simulator.sft",
        cfg,
    )
    sft = Stage("sim-sft", Kind.sft, sft, [collect.name])
    stages += [collect, sft]
    simulator = Source(str(d / "sim-sft" / "sft" / "final"), (sft.name,))
    if s.dpo:
        overrides = ["objective=dpo", *s.dpo_overrides, f"data={data}", f"model={simulator.model}"]
        dpo = _job(
            SimulatorTrainConfig,
            [*overrides, f"output_dir={d / 'sim-dpo'}", "name=dpo"],
            "simulator.dpo_overrides",
            cfg,
        )
        dpo = Stage("sim-dpo", Kind.dpo, dpo, [collect.name, sft.name])
        stages.append(dpo)
        simulator = Source(str(d / dpo.name / "dpo" / "final"), (dpo.name,))
    quality = _job(
        SimulatorEvalConfig,
        [
            *s.quality,
            f"simulator.model={simulator.model}",
            f"output_dir={d / 'sim-quality'}",
            "run_name=quality",
        ],
        "simulator.quality",
        cfg,
    )
    stages.append(Stage("sim-quality", Kind.quality, quality, list(simulator.deps)))
    return simulator


# -- 2. the warm starts --------------------------------------------------------------------------------------
def _protocol(train: TrainConfig) -> str:
    """The rollout protocol a training config's policy speaks, as ``warmstarts`` keys it."""
    from zerosim.agent.rollout import Protocol

    return Protocol(train.rollout.protocol).value


def agent_shape(train: TrainConfig) -> tuple[tuple[str, str], ...]:
    """What a warm start's demonstrations read of the rollout besides its own settings, as ``(setting, value)``
    overrides: the protocol they are written in and, under ``tools``, the tools offered and what of the rollout
    those tools' demonstrations read (:data:`~zerosim.experiment.kinds.WARMSTART_READS` less what
    :func:`~zerosim.experiment.kinds.warmstart_inert` leaves out: the turn and page budgets without read_page)."""
    from zerosim.agent.rollout import Protocol
    from zerosim.core.config import flatten
    from zerosim.experiment.kinds import WARMSTART_READS, warmstart_inert

    leaves = flatten(train)
    if Protocol(train.rollout.protocol) == Protocol.tags:
        return (("rollout.protocol", Protocol.tags.value),)
    inert = warmstart_inert(leaves)
    reads = [k for k in WARMSTART_READS if k.startswith("rollout.") and k not in inert]
    written = {k: f"[{','.join(v)}]" if isinstance(v, list | tuple) else str(v) for k, v in leaves.items()}
    return tuple((k, written[k]) for k in reads)


class WarmStarts:
    """The warm start shared by every arm of the base recipe's agent shape (:func:`agent_shape`), and one per
    other shape an arm asks for, made on first request: ``warmstart`` and, e.g., ``warmstart-tools``. When the
    base recipe (or ``warmstart``) turns the warm start off, every arm starts from the base policy."""

    def __init__(self, cfg: ExperimentConfig, base: Path, warm: TrainConfig, root: Path, stages: list[Stage]):
        self.cfg, self.base, self.warm, self.root, self.stages = cfg, base, warm, root, stages
        self.enabled = warm.warmstart.enabled
        shared = self._stage("warmstart", warm) if self.enabled else Source(warm.policy.model)
        self.made: dict[tuple[tuple[str, str], ...], Source] = {agent_shape(warm): shared}

    def _stage(self, name: str, warm: TrainConfig) -> Source:
        stage = Stage(name, Kind.warmstart, warm, [])
        self.stages.append(stage)
        return Source(str(stage.dir(self.root) / "warmstart" / "final"), (stage.name,))

    def of(self, train: TrainConfig, where: str) -> Source:
        """The warm start an arm training as ``train`` starts from."""
        from zerosim.training.warmstart import warmstart_folder

        shape = agent_shape(train)
        if not self.enabled:  # no warm start for any arm: the base policy
            return next(iter(self.made.values()))
        if shape not in self.made:
            name = warmstart_folder(train)
            taken = {s.name for s in self.stages}
            name = "warmstart-tags" if name == "warmstart" else name  # the shared one's name is taken
            if name in taken:  # the same tools with other budgets
                name = f"{name}-{sum(n.startswith(name) for n in taken) + 1}"
            warm = _train_config(
                self.cfg,
                self.base,
                [
                    *self.cfg.warmstart,
                    *(f"{k}={v}" for k, v in shape),
                    *self.cfg.warmstarts.get(_protocol(train), []),
                    f"run.output_dir={self.root / 'stages'}",
                    f"run.name={name}",
                ],
                where,
            )
            self.made[shape] = self._stage(name, replace(warm, tracking=self.warm.tracking))
        return self.made[shape]


# -- 3. the arms ---------------------------------------------------------------------------------------------
def _curriculum_mean(recipe: TrainConfig) -> str:
    """:data:`CURRICULUM_MEAN`: the base recipe's curriculum, averaged over the steps training draws at."""
    from curricula import curriculum_schedule, mean_probability

    steps = recipe.trainer.max_steps
    try:
        return f"{mean_probability(curriculum_schedule(recipe.curriculum, steps), steps):.6g}"
    except ValueError as exc:
        raise ConfigError(
            f"{CURRICULUM_MEAN} in an arm's overrides: {exc}; give the noise level instead"
        ) from None


def _with_mean(overrides: Sequence[str], recipe: TrainConfig) -> list[str]:
    """An arm's overrides with :data:`CURRICULUM_MEAN` filled in (what the report shows)."""
    if not any(CURRICULUM_MEAN in o for o in overrides):
        return list(overrides)
    mean = _curriculum_mean(recipe)
    return [o.replace(CURRICULUM_MEAN, mean) for o in overrides]


def _simulator_settings(cfg: ExperimentConfig, overrides: Sequence[str], simulator: Source) -> list[str]:
    """What an arm that trains against the simulator is given: the experiment's simulator (unless the arm
    names one), ZeroSearch's prompt layout for one of their released simulators (unless the arm picks a
    preset), and ``simulator.serve``."""
    from simulators.prompts import is_zerosearch_release

    named = {o.split("=", 1)[0] for o in overrides}
    out = []
    if "search.simulator.model" not in named:
        out.append(f"search.simulator.model={SIMULATOR_PLACEHOLDER}")
    if is_zerosearch_release(simulator.model) and "search.simulator.prompts" not in named:
        out.append("search.simulator.prompts=zerosearch")
    return out + [f"search.simulator.{o.removeprefix('search.simulator.')}" for o in cfg.simulator.serve]


def _arms(
    cfg: ExperimentConfig,
    root: Path,
    base: Path,
    recipe: TrainConfig,
    starts: WarmStarts,
    simulator: Source,
    stages: list[Stage],
) -> tuple[dict[tuple[str, int], Source], dict[str, RolloutConfig]]:
    """A training stage per enabled arm and seed; returns each (arm, seed)'s policy and each arm's rollout
    settings (what its evaluation rolls out with). ``recipe``: the base recipe with the experiment's overrides
    (its curriculum is what :data:`CURRICULUM_MEAN` averages)."""
    policies: dict[tuple[str, int], Source] = {}
    rollouts: dict[str, RolloutConfig] = {}
    # what each arm changes and the warm start it starts from, resolved once (the same for every seed)
    resolved: dict[str, tuple[list[str], bool, Source]] = {}
    for name, arm in cfg.enabled_arms().items():
        changes = _with_mean(arm.overrides, recipe)
        named = [o.replace(SIMULATOR_PLACEHOLDER, simulator.model or EMBEDDED_MODEL) for o in changes]
        shaped = _train_config(cfg, base, named, f"arms.{name}")
        rollouts[name] = shaped.rollout
        start = starts.of(shaped, f"arms.{name}")
        if arm.rl:
            uses_simulator = arm.uses_simulator or EngineName(shaped.search.engine).simulated
            if uses_simulator:
                changes += _simulator_settings(cfg, changes, simulator)
        else:
            uses_simulator = False
        resolved[name] = changes, uses_simulator, start
    # seed by seed: an experiment stopped part-way has the same seeds of every arm
    for seed, (name, arm) in ((s, a) for s in cfg.seeds for a in cfg.enabled_arms().items()):
        changes, uses_simulator, start = resolved[name]
        if not arm.rl:  # one policy, evaluated greedily: once, not once per seed
            policies.setdefault((name, cfg.seeds[0]), start)
            continue
        overrides = [o.replace(SIMULATOR_PLACEHOLDER, simulator.model or EMBEDDED_MODEL) for o in changes]
        stage_name = f"train-{name}-s{seed}"
        out = root / "stages" / stage_name
        train = _train_config(
            cfg,
            base,
            [
                *overrides,
                f"policy.model={start.model}",
                "warmstart.enabled=false",
                f"run.seed={seed}",
                f"run.output_dir={out}",
                f"run.name={name}",
            ],
            f"arms.{name}",
        )
        train = _logging_model(train, cfg, name)
        deps = [*start.deps, *(simulator.deps if uses_simulator else ())]
        stage = Stage(stage_name, Kind.train, train, deps, meta={"arm": name, "seed": seed}, changes=changes)
        stages.append(stage)
        policies[(name, seed)] = Source(str(out / name / "final"), (stage_name,))
    return policies, rollouts


def _logging_model(train: TrainConfig, cfg: ExperimentConfig, name: str) -> TrainConfig:
    """An arm's training job with the experiment's ``tracking.log_model=true``: its final policy logged to its
    run as an MLflow model. Where runs are logged is no part of a stage's key, so this re-runs nothing."""
    if not cfg.tracking.log_model:
        return train
    if not train.trainer.save_final:
        raise ConfigError(
            f"arms.{name}: tracking.log_model=true logs each arm's final policy, but this arm trains with "
            "trainer.save_final=false and saves none: drop trainer.save_final=false from its overrides (or the "
            "experiment's), or set tracking.log_model=false"
        )
    return replace(train, tracking=replace(train.tracking, log_model=True))


def _run_order(stages: list[Stage]) -> list[Stage]:
    """Each policy's evaluation right after the stage that produces it, so an experiment stopped part-way (a
    kill, a session's end) leaves whole arms — trained and scored — to report and export. Baselines (they read
    no stage) stay last."""
    after: dict[str, list[Stage]] = {}
    rest = []
    for stage in stages:
        if stage.kind == Kind.eval and stage.deps:
            after.setdefault(stage.deps[-1], []).append(stage)
        else:
            rest.append(stage)
    return [s for stage in rest for s in (stage, *after.get(stage.name, []))]


# -- 4. evaluation -------------------------------------------------------------------------------------------
# an eval stage's sections taken from the base recipe or the experiment, whatever eval.overrides say
REPLACED_IN_EVAL = ("search", "rollout", "datasets", "tracking", "runtime")


def _eval_config(
    cfg: ExperimentConfig,
    root: Path,
    recipe: TrainConfig,
    policy: str,
    method: str,
    engine: str,
    stage_name: str,
    rollout: RolloutConfig | None = None,
) -> EvalConfig:
    """``zerosim eval`` of ``policy``, searching as the base recipe (``recipe``) does and rolling out as
    ``rollout`` (an arm's; the recipe's where None), greedily."""
    e = cfg.eval
    for o in e.overrides:  # the settings set below from the recipe and the experiment: not silently dropped
        key = o.split("=", 1)[0].strip()
        if key.split(".", 1)[0] in REPLACED_IN_EVAL:
            raise ConfigError(
                f"eval.overrides: {o} would be replaced — every policy is evaluated with the base recipe's "
                f"{', '.join(REPLACED_IN_EVAL)} settings; set it in the experiment's overrides= (all stages) "
                "or in eval.datasets / tracking / runtime"
            )
    overrides = [
        f"policy={policy}",
        f"method={method}",
        f"split={e.split}",
        f"batch_size={e.batch_size}",
        f"output_dir={root / 'stages' / stage_name}",
        "run_name=eval",
        f"seed={e.seed}",  # not the first of seeds: a part run (seeds=[3]) evaluates as the whole one does
        *e.overrides,
    ]
    if e.limit is not None:
        overrides += [f"limit={e.limit}", f"sample={e.sample}"]
    ev = _job_config(EvalConfig, None, overrides, "eval.overrides")
    return replace(
        ev,
        datasets=list(e.datasets),
        search=replace(copy.deepcopy(recipe.search), engine=engine),
        rollout=replace(rollout or recipe.rollout, temperature=0.0),
        tracking=_tracked(ev.tracking, cfg),
        runtime=cfg.runtime,
    )


def _evals(
    cfg: ExperimentConfig,
    root: Path,
    recipe: TrainConfig,
    policies: dict[tuple[str, int], Source],
    rollouts: dict[str, RolloutConfig],
    stages: list[Stage],
) -> None:
    """Every arm's policy (``method=agent``) with each real engine, rolling out as the arm trained."""
    for (name, seed), policy in policies.items():
        for engine in cfg.eval.engines:
            stage_name = f"eval-{name}-s{seed}-{engine}"
            config = _eval_config(
                cfg, root, recipe, policy.model, "agent", engine, stage_name, rollouts[name]
            )
            meta = {"arm": name, "seed": seed, "engine": engine, "method": "agent"}
            stages.append(Stage(stage_name, Kind.eval, config, list(policy.deps), meta=meta))


def _baselines(cfg: ExperimentConfig, root: Path, recipe: TrainConfig, stages: list[Stage]) -> None:
    """The untrained policy's baselines: ``direct`` (no search, once) and ``rag`` with each real engine."""
    first: EngineName = cfg.eval.engines[0]
    for method in cfg.eval.baselines:
        for engine in ["none"] if method == "direct" else cfg.eval.engines:
            stage_name = f"baseline-{method}-{engine}"
            searched = engine if engine != "none" else first
            config = _eval_config(cfg, root, recipe, recipe.policy.model, method, searched, stage_name)
            meta = {"arm": baseline_arm(method), "seed": None, "engine": engine, "method": method}
            stages.append(Stage(stage_name, Kind.eval, config, [], meta=meta))

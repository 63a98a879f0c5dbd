"""The experiment's own settings (``zerosim experiment --config``): the arms, the simulator and eval stages,
the report. Each stage's job reads its own schema; these only say how to build those jobs' configs."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from eval.config import Method, Sample
from zerosim.core.config import ConfigError, load_config, ranged
from zerosim.core.runtime import RuntimeConfig
from zerosim.core.tracking import TrackingConfig
from zerosim.engines import EngineName

SIMULATOR_PLACEHOLDER = "{simulator}"  # in an arm's overrides: the experiment's simulator checkpoint
# in an arm's overrides: the mean noise probability of the base recipe's curriculum over its trainer.max_steps
# (the experiment's overrides applied), e.g. curriculum.p_end={curriculum_mean} with curriculum.schedule=constant
CURRICULUM_MEAN = "{curriculum_mean}"
# an arm's name: its report row, MLflow metric prefix, run.name and stage folders (train-<arm>-s<seed>)
ARM_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*\Z")


def baseline_arm(method: str) -> str:
    """The report row of the untrained policy's baseline ``method`` (``base-direct``, ``base-rag``), which no
    arm may take: rows of one name are one row, their scores averaged as seeds of one arm."""
    return f"base-{method}"


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
    # false: no RL, the warm start is evaluated as it is (overrides: rollout.* only; rollout.protocol / rollout.tools pick which warm start)
    rl: bool = True
    # false: leave the arm out of this experiment
    enabled: bool = True

    @property
    def uses_simulator(self) -> bool:
        """Whether the arm trains against the experiment's simulator (its overrides name it)."""
        return any(SIMULATOR_PLACEHOLDER in o for o in self.overrides)


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
    # default split of those datasets (the embedded factbook's fact-test: no fact shared with fact-train)
    split: str = "fact-test"
    # questions per dataset (which ones: sample); None = all
    limit: int | None = ranged(None, ">=1", "null = every question")
    # with limit: a random sample seeded by eval.seed and stratified by hops (stratified), or the first N rows (first)
    sample: Sample = Sample.stratified
    # seeds every evaluation (the question sample; a greedy one over every question reads it nowhere): one value for every arm and seed, not the first of seeds, so a part run (seeds=[3]) evaluates as the whole experiment does
    seed: int = ranged(0, ">=0")
    # real engines every policy is evaluated with (bm25, dense, hybrid, http)
    engines: list[EngineName] = field(default_factory=lambda: [EngineName.bm25, EngineName.dense])
    # methods run on the untrained policy (direct, rag)
    baselines: list[Method] = field(default_factory=lambda: [Method.direct, Method.rag])
    # questions per batched rollout
    batch_size: int = ranged(16, ">=1")
    # overrides of every `zerosim eval` stage
    overrides: list[str] = field(default_factory=list)

    def validate(self, prefix: str) -> None:
        """Held-out sets to evaluate on: with none, every eval stage would stop (after the warm start ran)."""
        if not self.datasets:
            raise ConfigError(
                f"{prefix}datasets is empty: the held-out evaluation needs at least one dataset (a file, an HF "
                f"id, or factbook[:split]), e.g. {prefix}datasets=[factbook]"
            )


@dataclass
class ReportConfig:
    # the arm every other arm is compared with (paired, same questions)
    reference: str = "real"
    # further paired comparisons, each "ARM:AGAINST" (ARM - AGAINST), e.g. ["sim-curriculum:sim-fixed-matched"]
    pairs: list[str] = field(default_factory=list)
    # bootstrap interval level
    confidence: float = ranged(0.95, "(0,1)")
    # bootstrap resamples (fewer than 100 give intervals that can exclude their own mean)
    resamples: int = ranged(2000, ">=100")
    # seeds the bootstrap
    seed: int = ranged(0, ">=0")
    # with fewer seeds than this in an arm of several runs, a comparison is read by its seed-level test (t over the runs' means, exact permutation beside it), the bootstrap shown as descriptive: a percentile bootstrap over few seeds under-covers (docs/experiments.md)
    seed_test_below: int = ranged(10, ">=2")
    # the one comparison the experiment was built to test, "ARM:AGAINST" (AGAINST: the reference or a report.pairs
    # entry's): marked primary in the report; every other one reads as exploratory. The report applies Holm's
    # correction over all of its comparisons' seed-level p values either way (docs/experiments.md)
    primary: str | None = None

    def pair_names(self) -> list[tuple[str, ...]]:
        """``pairs`` as ``(ARM, AGAINST)`` tuples (:func:`load_experiment` checks each has two enabled arms)."""
        return [tuple(pair.split(":")) for pair in self.pairs]


@dataclass
class ExperimentConfig:
    """``zerosim experiment``: stages over one base recipe; see :mod:`zerosim.experiment`."""

    # folder under output_dir and MLflow parent run name
    name: str = "sim-vs-real"
    # the experiment writes to <output_dir>/<name>
    output_dir: str = "outputs/experiments"
    # the training recipe every arm starts from
    base: str = "configs/demo-learning.yaml"
    # train overrides for every arm (and the warm start)
    overrides: list[str] = field(default_factory=list)
    # one training run per arm and seed
    seeds: list[int] = ranged(default_factory=lambda: [0], spec=">=0")
    # the split every training job reads — the arms' and warm start's data.split, warmstart.split, the simulator's collect split (fact-train: no fact shared with the eval default fact-test); None = as the base recipe and the jobs say
    train_split: str | None = "fact-train"
    # e.g. "accelerate launch --config_file configs/accelerate/zero2.yaml": each training stage runs as `<launcher> -m zerosim.cli train` (None: in this process)
    train_launcher: str | None = None
    simulator: SimulatorStageConfig = field(default_factory=SimulatorStageConfig)
    # overrides of the shared warm start (warmstart.* keys)
    warmstart: list[str] = field(default_factory=list)
    # rollout.protocol -> overrides of that protocol's warm starts after `warmstart` (warmstart.* keys), e.g.
    # {tools: [warmstart.max_steps=20]}: an agent shape whose demonstrations take longer to learn gets its own budget
    warmstarts: dict[str, list[str]] = field(default_factory=dict)
    # name -> train overrides (docs/experiments.md)
    arms: dict[str, ArmConfig] = field(default_factory=default_arms)
    eval: ExperimentEvalConfig = field(default_factory=ExperimentEvalConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    tracking: TrackingConfig = field(default_factory=lambda: TrackingConfig(experiment="zerosim-experiments"))
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    @property
    def root(self) -> Path:
        """Where the experiment writes: ``<output_dir>/<name>``."""
        return Path(self.output_dir) / self.name

    def enabled_arms(self) -> dict[str, ArmConfig]:
        return {name: arm for name, arm in self.arms.items() if arm.enabled}


def _check_arm_names(arms: dict[str, ArmConfig]) -> None:
    """Every arm's name fits :data:`ARM_NAME` and is no baseline's row (:func:`baseline_arm`). Distinct names
    stay distinct once named: a report row is the name itself, and its stages (``train-<arm>-s<seed>``,
    ``eval-<arm>-s<seed>-<engine>``) end in a seed and an engine that hold no name's characters apart."""
    from zerosim.experiment.provenance import CHECKPOINT_PREFIX, MODEL_DIRS

    baselines = {baseline_arm(m.value): m.value for m in Method}
    for name in arms:
        if not ARM_NAME.match(name):
            fixed = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-._") or "arm"
            raise ConfigError(
                f"arms.{name!r}: an arm's name becomes its report row, its run's name and its stage folders "
                "(train-<arm>-s<seed>), so it must be lowercase letters, digits, '.', '_' or '-', starting "
                f"with a letter or digit (^[a-z0-9][a-z0-9._-]*$); rename the arm, e.g. arms.{fixed}"
            )
        if name in MODEL_DIRS or name.startswith(CHECKPOINT_PREFIX):
            raise ConfigError(
                f"arms.{name}: an arm's run folder is named after it, and a folder named {name!r} is a model "
                f"folder (final/, best/, critic/, checkpoint-*/), left out of its stage's results and exports, so "
                f"its curves and records would not travel; rename the arm, e.g. arms.arm-{name}"
            )
        if name in baselines:
            raise ConfigError(
                f"arms.{name}: {name} is the report row of the untrained policy's {baselines[name]} baseline, so "
                f"the arm and the baseline would be averaged as seeds of one row; rename the arm, e.g. "
                f"arms.{name.replace('base-', 'warm-', 1)}"
            )


def _check_warmstarts(warmstarts: dict[str, list[str]]) -> None:
    """``warmstarts`` is keyed by a protocol and holds ``warmstart.*`` overrides only: what else an agent shape's
    warm start differs by comes from the arms (their rollout settings), not from here."""
    from zerosim.agent.rollout import Protocol

    protocols = [p.value for p in Protocol]
    for protocol, overrides in warmstarts.items():
        if protocol not in protocols:
            raise ConfigError(
                f"warmstarts.{protocol}: keys are rollout protocols ({', '.join(protocols)}), e.g. "
                "warmstarts.tools=[warmstart.max_steps=20]"
            )
        other = [o for o in overrides if not o.split("=", 1)[0].strip().startswith("warmstart.")]
        if other:
            raise ConfigError(
                f"warmstarts.{protocol} has {other}: it overrides that protocol's warm starts only (warmstart.* "
                "keys); put what every job reads in overrides and what an arm rolls out with in its arm"
            )


def load_experiment(path: str | Path | None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    from zerosim.core.fsutil import check_output_folder

    cfg = load_config(path, overrides, schema=ExperimentConfig)
    check_output_folder(cfg.root, "output_dir")  # <output_dir>/<name>: every stage writes under it
    _check_arm_names(cfg.arms)
    arms = cfg.enabled_arms()
    if not arms:
        raise ConfigError("every arm is disabled (arms.<name>.enabled=false): enable at least one")
    if cfg.report.reference not in arms:
        raise ConfigError(
            f"report.reference={cfg.report.reference!r} is not an enabled arm ({', '.join(arms)}): "
            "name one of them, e.g. report.reference=real"
        )
    for pair, named in zip(cfg.report.pairs, cfg.report.pair_names(), strict=True):
        if len(named) != 2 or named[0] == named[1] or any(n not in arms for n in named):
            raise ConfigError(
                f"report.pairs entry {pair!r} must be ARM:AGAINST, two different enabled arms "
                f"({', '.join(arms)}), e.g. report.pairs=[sim-curriculum:sim-fixed-matched]"
            )
    if cfg.report.primary is not None:
        compared = {f"{a}:{cfg.report.reference}" for a in arms if a != cfg.report.reference} | set(
            cfg.report.pairs
        )
        if cfg.report.primary not in compared:
            raise ConfigError(
                f"report.primary={cfg.report.primary!r} is not one of the report's comparisons: name ARM:AGAINST "
                f"against report.reference ({cfg.report.reference}) or a report.pairs entry, e.g. "
                f"report.primary={sorted(compared)[0] if compared else 'ARM:' + cfg.report.reference}"
            )
    for name, arm in arms.items():
        fixed = [o for o in arm.overrides if not o.split("=", 1)[0].strip().startswith("rollout.")]
        if not arm.rl and fixed:
            raise ConfigError(
                f"arms.{name}: an rl: false arm evaluates a warm start as it is, so its overrides may only say how "
                f"it rolls out (rollout.*: rollout.protocol and rollout.tools pick the warm start), not {fixed}; "
                "drop them, or make it a trained arm"
            )
    _check_warmstarts(cfg.warmstarts)
    if not cfg.seeds:
        raise ConfigError("seeds is empty: give at least one, e.g. seeds=[0]")
    twice = sorted({s for s in cfg.seeds if cfg.seeds.count(s) > 1})
    if twice:
        raise ConfigError(
            f"seeds lists {', '.join(map(str, twice))} more than once: one run would count as several seeds and "
            f"narrow every interval; give distinct seeds, e.g. seeds={sorted(set(cfg.seeds))}"
        )
    if not cfg.eval.engines:
        raise ConfigError("eval.engines is empty: give at least one real engine, e.g. eval.engines=[bm25]")
    real = [e.value for e in EngineName if e.real]
    bad = [e.value for e in cfg.eval.engines if not e.real]
    if bad:
        raise ConfigError(f"eval.engines has {bad}; valid: {', '.join(real)} (a real engine)")
    bad = [m.value for m in cfg.eval.baselines if m == Method.agent]
    if bad:
        raise ConfigError(f"eval.baselines has {bad}; valid: direct, rag")
    return cfg

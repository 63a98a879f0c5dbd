"""How long each stage should take: the shipped rates of :data:`zerosim.experiment.kinds.KINDS`, replaced by
what this experiment's own stages measured — but only stages timed on a quiet machine teach it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zerosim.experiment.kinds import KINDS, OVERHEAD_S, Kind, Stage, read_stage

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
        if stage.kind == Kind.report:
            continue
        done = read_stage(stage, root)
        units = KINDS[stage.kind].units(stage.config)
        # a continued stage's time holds the steps its killed attempt did again: no rate learns from it
        if done and units and ran_quiet(done) and done.get("attempts", 1) == 1:
            total.setdefault(stage.kind, []).append(max(done["seconds"] - OVERHEAD_S, 0.0) / units)
    return {kind: sum(v) / len(v) for kind, v in total.items()}


def estimates(stages: Sequence[Stage], root: Path) -> dict[str, float]:
    """Seconds each stage should take (by name): at the rate learned here where there is one."""
    learned = _learned_rates(stages, root)
    out = {}
    for stage in stages:
        rate = learned.get(stage.kind)
        out[stage.name] = stage.estimate_s if rate is None else KINDS[stage.kind].estimate(stage, rate)
    return out

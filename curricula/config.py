"""The curriculum's settings (``curriculum.*``) and the mixed engine's (``search.mixed.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from zerosim.core.config import ConfigError, ranged
from zerosim.core.engine_names import EngineName


class ScheduleName(StrEnum):
    """``curriculum.schedule``: how the noise probability moves over training (:mod:`curricula.schedules`)."""

    exponential = "exponential"
    linear = "linear"
    cosine = "cosine"
    step = "step"
    constant = "constant"
    adaptive = "adaptive"


class Granularity(StrEnum):
    """``curriculum.granularity``: one noise draw per search, or per document."""

    call = "call"
    document = "document"


# ``search.mixed.real``: the real retriever beside the simulator — any of ``EngineName``'s real ones, so that a new
# retriever is a choice here too
RealEngine = StrEnum("RealEngine", {e.name: e.value for e in EngineName if e.real})


class ShareSchedule(StrEnum):
    """``search.mixed.schedule``: the rising / falling curriculum shapes the real share may follow."""

    linear = "linear"
    cosine = "cosine"
    exponential = "exponential"
    step = "step"


@dataclass
class CurriculumConfig:
    # exponential (ZeroSearch) | linear | cosine | step | constant | adaptive
    schedule: ScheduleName = ScheduleName.exponential
    # noise probability at step 0
    p_start: float = ranged(0.0, "[0,1]", "a probability")
    # noise probability at the last step (constant: the probability used throughout)
    p_end: float = ranged(0.5, "[0,1]", "a probability")
    # exponential base b; larger = noise stays low longer
    base: float = ranged(4.0, ">0")
    # steps over which noise rises; None = trainer.max_steps
    total_steps: int | None = ranged(None, ">=1", "null = trainer.max_steps")
    # call (one draw per search: all k noisy or all useful) | document
    granularity: Granularity = Granularity.call
    # step: number of equal plateaus from p_start to p_end
    stages: int = ranged(4, ">=1")
    # adaptive: steps in the rolling mean reward
    adaptive_window: int = ranged(5, ">=1")
    # adaptive: rolling mean reward at or above this raises p by adaptive_delta
    adaptive_raise_above: float = ranged(0.5, "finite")
    # adaptive: rolling mean reward at or below this lowers p by adaptive_delta
    adaptive_lower_below: float = ranged(0.1, "finite")
    # adaptive: change of p per decision (bounded by p_start and p_end)
    adaptive_delta: float = ranged(0.05, "(0,1]")

    def steps(self, max_steps: int) -> int:
        """The steps over which noise rises: ``total_steps``, else the run's ``max_steps``."""
        return self.total_steps or max_steps

    def validate(self, prefix: str) -> None:
        """The adaptive schedule's thresholds in order."""
        if self.schedule == "adaptive" and self.adaptive_lower_below >= self.adaptive_raise_above:
            raise ConfigError(
                f"{prefix}adaptive_lower_below ({self.adaptive_lower_below}) must be below "
                f"{prefix}adaptive_raise_above ({self.adaptive_raise_above}); e.g. 0.1 and 0.5"
            )


@dataclass
class MixedConfig:
    # engine=mixed: the real retriever beside the simulator: bm25 | dense | hybrid | http (its own search.<engine> settings)
    real: RealEngine = RealEngine.bm25
    # engine=mixed: probability that a search goes to the real retriever (at step 0 when real_share_end is set)
    real_share: float = ranged(0.5, "[0,1]", "a probability")
    # engine=mixed: the real share at the last step (schedule from real_share); None = real_share throughout
    real_share_end: float | None = ranged(None, "[0,1]", "a probability; null = real_share throughout")
    # engine=mixed, real_share_end set: linear | cosine | exponential | step (curriculum shapes)
    schedule: ShareSchedule = ShareSchedule.linear
    # engine=mixed, real_share_end set: steps over which the share moves; None = trainer.max_steps
    total_steps: int | None = ranged(None, ">=1", "null = trainer.max_steps")

    def steps(self, max_steps: int | None) -> int:
        """The steps over which the share moves: ``total_steps``, else the run's ``max_steps`` (at least 1)."""
        return self.total_steps or max_steps or 1

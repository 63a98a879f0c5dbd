"""Noise schedules: the probability that a search returns noisy documents at training step ``i``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from curricula.config import CurriculumConfig, ScheduleName


@runtime_checkable
class NoiseSchedule(Protocol):
    """Maps a training step to the probability that a search result slot is noisy."""

    def probability(self, step: int) -> float: ...


def _check(p_start: float, p_end: float, total_steps: int) -> None:
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    for name, value in (("p_start", p_start), ("p_end", p_end)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")


@dataclass(frozen=True, kw_only=True)
class RisingSchedule:
    """``p(i) = p_s + rise(i/m) (p_e - p_s)`` with ``rise`` going from 0 to 1; ``m`` is ``total_steps``,
    steps are clamped to ``[0, m]`` (past ``m`` stays at ``p_e``). Subclasses define :meth:`rise`."""

    p_start: float = 0.0
    p_end: float = 0.5
    total_steps: int = 200

    def __post_init__(self) -> None:
        _check(self.p_start, self.p_end, self.total_steps)

    def rise(self, frac: float) -> float:
        raise NotImplementedError

    def probability(self, step: int) -> float:
        frac = min(max(step, 0), self.total_steps) / self.total_steps
        return self.p_start + self.rise(frac) * (self.p_end - self.p_start)


@dataclass(frozen=True, kw_only=True)
class ExponentialSchedule(RisingSchedule):
    """ZeroSearch's curriculum: ``rise = (b^(i/m) - 1) / (b - 1)``. With ``b = 1`` the limit is linear."""

    base: float = 4.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.base <= 0:
            raise ValueError(f"base must be > 0, got {self.base}")

    def rise(self, frac: float) -> float:
        return frac if self.base == 1 else (self.base**frac - 1) / (self.base - 1)


@dataclass(frozen=True, kw_only=True)
class LinearSchedule(RisingSchedule):
    """``rise = i/m``."""

    def rise(self, frac: float) -> float:
        return frac


@dataclass(frozen=True, kw_only=True)
class CosineSchedule(RisingSchedule):
    """``rise = (1 - cos(pi i/m)) / 2``: slow start, fastest mid-way, slow finish."""

    def rise(self, frac: float) -> float:
        return (1 - math.cos(math.pi * frac)) / 2


@dataclass(frozen=True, kw_only=True)
class StepSchedule(RisingSchedule):
    """``stages`` = n equal-length plateaus: ``rise = min(floor(n i/m), n-1) / (n-1)`` (one stage: ``p_e``
    throughout)."""

    stages: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stages < 1:
            raise ValueError(f"stages must be >= 1, got {self.stages}")

    def rise(self, frac: float) -> float:
        n = self.stages
        return 1.0 if n == 1 else min(math.floor(n * frac), n - 1) / (n - 1)


@dataclass
class AdaptiveSchedule:
    """Noise follows the policy: up when it copes, down when it collapses.

    After each step :meth:`observe` gets the step's mean reward. Over the last ``window`` observed steps,
    a rolling mean ``>= raise_above`` raises ``p`` by ``delta`` (up to ``p_end``); a rolling mean
    ``<= lower_below`` lowers it by ``delta`` (down to ``p_start``); the window then starts afresh, so one
    change is judged on ``window`` new steps. ``p`` starts at ``p_start``. The state (``p`` and the
    window) is small and plain: :meth:`state_dict` / :meth:`load_state_dict` carry it across a resume.
    """

    p_start: float = 0.0
    p_end: float = 0.5
    window: int = 5
    raise_above: float = 0.5
    lower_below: float = 0.1
    delta: float = 0.05
    p: float = field(init=False)
    recent: list[float] = field(init=False, default_factory=list)
    observed: dict[int, float] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        _check(self.p_start, self.p_end, 1)
        if self.window < 1 or self.delta <= 0:
            raise ValueError(f"need window >= 1 and delta > 0, got window={self.window}, delta={self.delta}")
        if self.lower_below >= self.raise_above:
            raise ValueError(
                f"lower_below ({self.lower_below}) must be below raise_above ({self.raise_above})"
            )
        self.p = self.p_start

    def probability(self, step: int) -> float:
        return self.p

    def observe(self, step: int, mean_reward: float) -> None:
        """Record step ``step``'s mean reward (a step seen twice, e.g. per micro-batch, counts once)."""
        if step in self.observed:
            return
        self.observed[step] = mean_reward
        self.recent.append(mean_reward)
        if len(self.recent) < self.window:
            return
        rolling = sum(self.recent[-self.window :]) / self.window
        lo, hi = sorted((self.p_start, self.p_end))
        if rolling >= self.raise_above:
            self.p = min(hi, self.p + self.delta)
            self.recent.clear()
        elif rolling <= self.lower_below:
            self.p = max(lo, self.p - self.delta)
            self.recent.clear()

    def state_dict(self) -> dict:
        return {"p": self.p, "recent": list(self.recent), "observed": dict(self.observed)}

    def load_state_dict(self, state: dict) -> None:
        self.p = float(state["p"])
        self.recent = [float(x) for x in state["recent"]]
        self.observed = {int(k): float(v) for k, v in state["observed"].items()}


@dataclass(frozen=True)
class ConstantSchedule:
    """The same noise probability at every step (``p = 0`` turns the curriculum off)."""

    p: float = 0.0

    def probability(self, step: int) -> float:
        return self.p


def noise_bounds(schedule: str, p_start: float, p_end: float) -> tuple[float, float]:
    """Where ``schedule``'s noise probability starts and where it heads: ``constant`` holds ``p_end``
    throughout (its ``p_start`` is unused); every other schedule moves from ``p_start`` to ``p_end`` (adaptive:
    within the two)."""
    return (p_end, p_end) if schedule == ScheduleName.constant else (p_start, p_end)


def curriculum_adds_noise(c: CurriculumConfig) -> bool:
    """Whether ``curriculum.*`` can ask for noisy documents at some step (p > 0)."""
    return max(noise_bounds(c.schedule, c.p_start, c.p_end)) > 0


def describe_noise(c: CurriculumConfig) -> str:
    """``curriculum.*``'s noise in a few words: ``noise 0->0.5 exponential``, or ``noise 0.5`` (constant)."""
    start, end = noise_bounds(c.schedule, c.p_start, c.p_end)
    if c.schedule == ScheduleName.constant:
        return f"noise {end:g}"
    return f"noise {start:g}->{end:g} {c.schedule}"


def build_schedule(
    name: str,
    *,
    p_start: float,
    p_end: float,
    base: float = 4.0,
    total_steps: int = 200,
    stages: int = 4,
    window: int = 5,
    raise_above: float = 0.5,
    lower_below: float = 0.1,
    delta: float = 0.05,
) -> NoiseSchedule:
    """A schedule from its config name; ``constant`` uses ``p_end`` throughout."""
    if name == "exponential":
        return ExponentialSchedule(p_start=p_start, p_end=p_end, base=base, total_steps=total_steps)
    if name == "linear":
        return LinearSchedule(p_start=p_start, p_end=p_end, total_steps=total_steps)
    if name == "cosine":
        return CosineSchedule(p_start=p_start, p_end=p_end, total_steps=total_steps)
    if name == "step":
        return StepSchedule(p_start=p_start, p_end=p_end, total_steps=total_steps, stages=stages)
    if name == "constant":
        p, _ = noise_bounds(name, p_start, p_end)
        return ConstantSchedule(p=p)
    if name == "adaptive":
        return AdaptiveSchedule(
            p_start=p_start,
            p_end=p_end,
            window=window,
            raise_above=raise_above,
            lower_below=lower_below,
            delta=delta,
        )
    raise ValueError(f"unknown noise schedule {name!r}; valid: {', '.join(ScheduleName)}")


def curriculum_schedule(c: CurriculumConfig, max_steps: int) -> NoiseSchedule:
    """The noise schedule ``curriculum.*`` describes, over :meth:`CurriculumConfig.steps` (``max_steps``: the
    run's ``trainer.max_steps``) — what training draws from and ``--dry-run`` prints."""
    return build_schedule(
        c.schedule,
        p_start=c.p_start,
        p_end=c.p_end,
        base=c.base,
        total_steps=c.steps(max_steps),
        stages=c.stages,
        window=c.adaptive_window,
        raise_above=c.adaptive_raise_above,
        lower_below=c.adaptive_lower_below,
        delta=c.adaptive_delta,
    )


def mean_probability(schedule: NoiseSchedule, steps: int) -> float:
    """The mean noise probability over a run of ``steps`` optimizer steps (``p(0) .. p(steps - 1)``: the steps
    training draws at): what a constant schedule must be to ask for as much noise in all. An adaptive schedule
    follows the reward, so it has no mean before the run: ValueError."""
    if isinstance(schedule, AdaptiveSchedule):
        raise ValueError("an adaptive schedule follows the reward: its mean is known only after the run")
    return sum(schedule.probability(i) for i in range(steps)) / steps


def describe_curve(schedule: NoiseSchedule, total_steps: int) -> str:
    """``schedule``'s probability at steps 0, 1/4, 1/2, 3/4 and all of ``total_steps``: ``"0.00@0, ..."``."""
    marks = sorted({0, total_steps // 4, total_steps // 2, 3 * total_steps // 4, total_steps})
    return ", ".join(f"{schedule.probability(i):.2f}@{i}" for i in marks)

"""Noise schedules: the probability that a search returns noisy documents at training step ``i``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@runtime_checkable
class NoiseSchedule(Protocol):
    """Maps a training step to the probability that a search result slot is noisy."""

    def probability(self, step: int) -> float: ...


@dataclass(frozen=True)
class ExponentialSchedule:
    """ZeroSearch's curriculum: ``p(i) = p_s + (b^(i/m) - 1) / (b - 1) * (p_e - p_s)``.

    ``m`` is ``total_steps``; steps past ``m`` stay at ``p_e``. With ``b = 1`` the limit is linear.
    """

    p_start: float = 0.0
    p_end: float = 0.5
    base: float = 4.0
    total_steps: int = 200

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if self.base <= 0:
            raise ValueError(f"base must be > 0, got {self.base}")

    def probability(self, step: int) -> float:
        frac = min(max(step, 0), self.total_steps) / self.total_steps
        rise = frac if self.base == 1 else (self.base**frac - 1) / (self.base - 1)
        return self.p_start + rise * (self.p_end - self.p_start)


def _fraction(step: int, total_steps: int) -> float:
    return min(max(step, 0), total_steps) / total_steps


def _check(p_start: float, p_end: float, total_steps: int) -> None:
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    for name, value in (("p_start", p_start), ("p_end", p_end)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")


@dataclass(frozen=True)
class LinearSchedule:
    """``p(i) = p_s + (i/m) (p_e - p_s)``; steps past ``m`` stay at ``p_e``."""

    p_start: float = 0.0
    p_end: float = 0.5
    total_steps: int = 200

    def __post_init__(self) -> None:
        _check(self.p_start, self.p_end, self.total_steps)

    def probability(self, step: int) -> float:
        return self.p_start + _fraction(step, self.total_steps) * (self.p_end - self.p_start)


@dataclass(frozen=True)
class CosineSchedule:
    """``p(i) = p_s + (1 - cos(pi i/m)) / 2 (p_e - p_s)``: slow start, fastest mid-way, slow finish."""

    p_start: float = 0.0
    p_end: float = 0.5
    total_steps: int = 200

    def __post_init__(self) -> None:
        _check(self.p_start, self.p_end, self.total_steps)

    def probability(self, step: int) -> float:
        rise = (1 - math.cos(math.pi * _fraction(step, self.total_steps))) / 2
        return self.p_start + rise * (self.p_end - self.p_start)


@dataclass(frozen=True)
class StepSchedule:
    """``stages`` equal-length plateaus from ``p_s`` to ``p_e``: stage ``s = min(floor(n i/m), n-1)`` has
    ``p = p_s + s/(n-1) (p_e - p_s)`` (one stage: ``p_e`` throughout)."""

    p_start: float = 0.0
    p_end: float = 0.5
    total_steps: int = 200
    stages: int = 4

    def __post_init__(self) -> None:
        _check(self.p_start, self.p_end, self.total_steps)
        if self.stages < 1:
            raise ValueError(f"stages must be >= 1, got {self.stages}")

    def probability(self, step: int) -> float:
        n = self.stages
        if n == 1:
            return self.p_end
        stage = min(math.floor(n * _fraction(step, self.total_steps)), n - 1)
        return self.p_start + stage / (n - 1) * (self.p_end - self.p_start)


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


SCHEDULES = ("exponential", "linear", "cosine", "step", "constant", "adaptive")


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
        return ConstantSchedule(p=p_end)
    if name == "adaptive":
        return AdaptiveSchedule(
            p_start=p_start,
            p_end=p_end,
            window=window,
            raise_above=raise_above,
            lower_below=lower_below,
            delta=delta,
        )
    raise ValueError(f"unknown noise schedule {name!r}; valid: {', '.join(SCHEDULES)}")

"""Noise schedules: the probability that a search returns noisy documents at training step ``i``."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class ConstantSchedule:
    """The same noise probability at every step (``p = 0`` turns the curriculum off)."""

    p: float = 0.0

    def probability(self, step: int) -> float:
        return self.p


def build_schedule(
    name: str, *, p_start: float, p_end: float, base: float, total_steps: int
) -> NoiseSchedule:
    """A schedule from its config name; ``constant`` uses ``p_end`` throughout."""
    if name == "exponential":
        return ExponentialSchedule(p_start=p_start, p_end=p_end, base=base, total_steps=total_steps)
    if name == "constant":
        return ConstantSchedule(p=p_end)
    raise ValueError(f"unknown noise schedule {name!r}; valid: exponential, constant")

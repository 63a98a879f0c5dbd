"""Curricula: how often searches return noisy documents as training goes on."""

from curricula.noise import draw_noise, search_source, trajectory_noise
from curricula.schedules import (
    SCHEDULES,
    AdaptiveSchedule,
    ConstantSchedule,
    CosineSchedule,
    ExponentialSchedule,
    LinearSchedule,
    NoiseSchedule,
    StepSchedule,
    build_schedule,
)

__all__ = [
    "SCHEDULES",
    "AdaptiveSchedule",
    "ConstantSchedule",
    "CosineSchedule",
    "ExponentialSchedule",
    "LinearSchedule",
    "NoiseSchedule",
    "StepSchedule",
    "build_schedule",
    "draw_noise",
    "search_source",
    "trajectory_noise",
]

"""Curricula: what the searches of a training run return as it goes on — how often noisy documents (the
schedules and their draws, corpus negatives over real retrievers), and, under ``search.engine=mixed``, which
engine answers.

Components layer: independent of the other components (simulators, eval, curricula). May import ``zerosim.agent``,
``zerosim.core`` and third-party libraries; imported by the apps (``zerosim.engines`` and above).
"""

from curricula.mixed import MixedSearchEngine, find_mixed, mixed_share, share_schedule
from curricula.noise import CurriculumNoise, draw_noise, search_source, trajectory_noise
from curricula.schedules import (
    AdaptiveSchedule,
    ConstantSchedule,
    CosineSchedule,
    ExponentialSchedule,
    LinearSchedule,
    NoiseSchedule,
    StepSchedule,
    build_schedule,
    curriculum_adds_noise,
    curriculum_schedule,
    describe_curve,
    describe_noise,
    mean_probability,
    noise_bounds,
)

__all__ = [
    "CurriculumNoise",
    "MixedSearchEngine",
    "find_mixed",
    "mixed_share",
    "share_schedule",
    "AdaptiveSchedule",
    "ConstantSchedule",
    "CosineSchedule",
    "ExponentialSchedule",
    "LinearSchedule",
    "NoiseSchedule",
    "StepSchedule",
    "build_schedule",
    "curriculum_adds_noise",
    "curriculum_schedule",
    "describe_curve",
    "describe_noise",
    "mean_probability",
    "noise_bounds",
    "draw_noise",
    "search_source",
    "trajectory_noise",
]

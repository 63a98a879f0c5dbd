"""Curricula: how often searches return noisy documents as training goes on."""

from curricula.noise import draw_noise
from curricula.schedules import ConstantSchedule, ExponentialSchedule, NoiseSchedule, build_schedule

__all__ = ["ConstantSchedule", "ExponentialSchedule", "NoiseSchedule", "build_schedule", "draw_noise"]

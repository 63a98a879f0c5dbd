"""Outcome rewards from the policy's final ``<answer>``, as TRL reward functions.

A trajectory without an answer scores 0 (never an exception). The answer is the one the rollout parsed
from the policy's own tokens, so text inside ``<information>`` blocks can never be mistaken for it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from zerosim.metrics import cover_exact_match, exact_match, f1_score

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "em": exact_match,
    "f1": f1_score,
    "cover_em": cover_exact_match,
}


def extract_answer(text: str) -> str | None:
    """The content of the last complete ``<answer>...</answer>`` in ``text``, stripped; ``None`` if none."""
    found = ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


def answer_reward(prediction: str | None, golds: Sequence[str], metric: str = "em") -> float:
    """``metric(prediction, golds)``, or 0 when there is no prediction."""
    if prediction is None:
        return 0.0
    return float(METRICS[metric](prediction, list(golds)))


def make_reward_func(metric: str) -> Callable[..., list[float]]:
    """A TRL reward function scoring the rollout's ``final_answer`` against ``golden_answers``."""
    if metric not in METRICS:
        raise ValueError(f"unknown reward metric {metric!r}; valid: {', '.join(METRICS)}")

    def reward(prompts, completions, final_answer, golden_answers, **kwargs) -> list[float]:
        return [answer_reward(a, g, metric) for a, g in zip(final_answer, golden_answers, strict=True)]

    reward.__name__ = metric  # TRL logs it as rewards/<name>/mean
    return reward

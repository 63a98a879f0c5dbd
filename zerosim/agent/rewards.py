"""Outcome rewards from the policy's final ``<answer>``, as TRL reward functions.

A trajectory without an answer scores 0 (never an exception). The answer is the one the rollout parsed
from the policy's own tokens, so text inside ``<information>`` blocks can never be mistaken for it.
``judge`` asks an LLM judge (:mod:`zerosim.core.judge`) instead of comparing strings; its server's failure is an
error, never a score.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from urllib.parse import urlsplit

from zerosim.core.config import ConfigError, ranged
from zerosim.core.judge import JudgeConfig, LLMJudge
from zerosim.core.metrics import cover_exact_match, exact_match, f1_score


class Metric(StrEnum):
    """An answer metric: ``reward.metric``, the keys of ``reward.weights``; all but ``judge`` (a reward only,
    asked of a server) are the evaluation's columns (:data:`METRICS`)."""

    em = "em"
    f1 = "f1"
    cover_em = "cover_em"
    judge = "judge"


# the string metrics (the evaluation's columns); Metric.judge needs a server (an LLMJudge)
METRICS: dict[Metric, Callable[[str, Sequence[str]], float]] = {
    Metric.em: exact_match,
    Metric.f1: f1_score,
    Metric.cover_em: cover_exact_match,
}


class StepCredit(StrEnum):
    """Which tokens a search's step reward credits under the sequence-level algorithms (``reward.step_credit``).

    ``sequence`` adds it to the trajectory's reward: every token, the answer's included, shares it — so an
    answer is credited for documents the environment happened to return (under a simulator, the draw of its
    noise), whatever the answer made of them. ``prefix`` keeps it to the tokens up to the search's
    ``</search>`` (:func:`zerosim.training.algorithms.prefix_credited_advantages`)."""

    sequence = "sequence"
    prefix = "prefix"


@dataclass
class RewardConfig:
    # em | f1 | cover_em | judge (an LLM asked at reward.judge.url) — outcome reward from the final <answer>
    metric: Metric = Metric.em
    # compose the outcome instead: {judge: 0.5, f1: 0.5} = Σ weight · metric; None = metric alone
    weights: dict[str, float] | None = ranged(None, ">=0")
    # λ of Search-R1's format-shaped reward (0 = outcome only; 0.2 in their runs)
    format_weight: float = ranged(0.0, "[0,1)")
    # StepSearch-style: weight of each search's TF-IDF information gain toward the gold answer (0 = off)
    step_gain_weight: float = ranged(0.0, ">=0")
    # StepSearch-style: weight of the penalty for documents already seen (0 = off)
    step_redundancy_weight: float = ranged(0.0, ">=0")
    # sequence-level algorithms: sequence (a search's step reward joins the trajectory's reward, every token
    # shares it) | prefix (it credits only the tokens up to its </search>; the answer's tokens are judged by
    # the outcome alone). PPO and REINFORCE++ always place it on its </search> token
    step_credit: StepCredit = StepCredit.sequence
    # the LLM judge of metric=judge / a judge weight (an OpenAI-compatible server)
    judge: JudgeConfig = field(default_factory=JudgeConfig)

    def uses_judge(self) -> bool:
        """Whether the outcome asks the judge: ``metric=judge`` alone, or a ``judge`` weight."""
        if self.weights is not None:
            return bool(self.weights.get(Metric.judge))
        return self.metric == Metric.judge

    def validate(self, prefix: str) -> None:
        """``weights`` name known metrics, and not all with weight 0; the judge has a server to ask."""
        self._check_weights(prefix)
        if self.uses_judge():
            url = self.judge.url or ""
            if not url:
                raise ConfigError(
                    f"{prefix}judge.url is not set: the judge reward asks an OpenAI-compatible server; start "
                    f"one (vllm serve MODEL, or zerosim simulator serve --model MODEL) and pass "
                    f"{prefix}judge.url=http://HOST:PORT {prefix}judge.model=NAME"
                )
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(f"{prefix}judge.url {url!r} must look like http://HOST:PORT")

    def _check_weights(self, prefix: str) -> None:
        if self.weights is None:
            return
        unknown = sorted(set(self.weights) - set(Metric))
        if unknown or not self.weights:
            raise ConfigError(
                f"{prefix}weights takes {', '.join(Metric)}; got {sorted(self.weights)}: "
                f"e.g. {prefix}weights='{{em: 0.5, f1: 0.5}}'"
            )
        if not any(self.weights.values()):
            raise ConfigError(
                f"{prefix}weights are all 0: every trajectory would score 0; give one metric a positive weight"
            )


def answer_reward(prediction: str | None, golds: Sequence[str], metric: str = "em") -> float:
    """``metric(prediction, golds)``, or 0 when there is no prediction."""
    if prediction is None:
        return 0.0
    return float(METRICS[metric](prediction, list(golds)))


def format_shaped(outcome: float, answered: bool, valid_format: bool, weight: float) -> float:
    """Search-R1's format-shaped reward with format weight ``λ`` and outcome ``r`` in [0, 1]:

    valid format:            λ + (1 - λ)·r            (1 correct, λ wrong)
    invalid, but answered:   (1 - λ)·r + (λ/2)(1 - r)  (1 - λ correct, λ/2 wrong)
    no answer:               0

    ``λ = 0`` gives the plain outcome reward.
    """
    if not answered:
        return 0.0
    if valid_format:
        return weight + (1 - weight) * outcome
    return (1 - weight) * outcome + (weight / 2) * (1 - outcome)


def composed_reward(prediction: str | None, golds: Sequence[str], weights: dict[str, float]) -> float:
    """``Σ_m w_m · m(prediction, golds)`` over the string metrics in ``weights``; 0 without a prediction."""
    return sum(w * answer_reward(prediction, golds, m) for m, w in weights.items() if m != Metric.judge)


def make_reward_func(
    metric: str,
    format_weight: float = 0.0,
    step_rewards: bool = False,
    weights: dict[str, float] | None = None,
    judge: LLMJudge | None = None,
) -> Callable[..., list[float]]:
    """A TRL reward function scoring the rollout's ``final_answer`` against ``golden_answers``.

    With ``format_weight`` > 0 the outcome is shaped by the trajectory's format (:func:`format_shaped`).
    With ``weights`` (``{"em": 0.5, "f1": 0.5}``) the outcome is :func:`composed_reward` instead of ``metric``.
    ``metric="judge"`` (or a ``judge`` weight) asks ``judge`` once per unique uncached (question, answer) of
    the batch, reading the dataset's ``question`` column; its counts go to TRL's ``log_metric`` as
    ``judge/requests``, ``judge/judged``, ``judge/cache_hits``, ``judge/seconds`` (per reward call).
    With ``step_rewards`` the rollout's per-search rewards (``step_reward_total``) are added: sequence-level
    algorithms see their sum; PPO and REINFORCE++ put each on its ``</search>`` token instead (``zerosim.training.trainer``).
    """
    if metric not in set(Metric):
        raise ValueError(f"unknown reward metric {metric!r}; valid: {', '.join(Metric)}")
    if weights is not None and (not weights or set(weights) - set(Metric)):
        raise ValueError(f"reward weights take {', '.join(Metric)}; got {sorted(weights)}")
    if not 0.0 <= format_weight < 1.0:
        raise ValueError(f"format_weight must be in [0, 1), got {format_weight}")
    judge_weight = (weights or {}).get(Metric.judge, 0.0) if weights else float(metric == Metric.judge)
    if judge_weight and judge is None:
        raise ValueError("the judge reward needs judge=LLMJudge(url, model) (reward.judge.url)")

    def reward(
        prompts, completions, final_answer, golden_answers, valid_format=None, **kwargs
    ) -> list[float]:
        if weights:
            outcomes = [
                composed_reward(a, g, weights) for a, g in zip(final_answer, golden_answers, strict=True)
            ]
        elif not judge_weight:
            outcomes = [
                answer_reward(a, g, metric) for a, g in zip(final_answer, golden_answers, strict=True)
            ]
        else:
            outcomes = [0.0] * len(final_answer)
        if judge_weight:
            questions = kwargs.get("question")
            if questions is None:
                raise ValueError(
                    "the judge reward reads each row's question from the dataset's 'question' column "
                    "(zerosim.training.recipe.build_dataset writes it); this batch has none"
                )
            verdicts = judge.score(questions, final_answer, golden_answers)
            outcomes = [r + judge_weight * v for r, v in zip(outcomes, verdicts, strict=True)]
            log_metric = kwargs.get("log_metric")
            stats = judge.take_stats()
            if log_metric is not None:
                for name, value in stats.items():
                    log_metric(name, value)
        if format_weight:
            outcomes = [
                format_shaped(r, a is not None, bool(v), format_weight)
                for r, a, v in zip(outcomes, final_answer, valid_format, strict=True)
            ]
        if step_rewards:
            totals = kwargs.get("step_reward_total") or [0.0] * len(outcomes)
            outcomes = [r + s for r, s in zip(outcomes, totals, strict=True)]
        return outcomes

    reward.__name__ = "outcome" if weights else metric  # TRL logs it as rewards/<name>/mean
    return reward


def build_judge(cfg: RewardConfig) -> LLMJudge | None:
    """The config's LLM judge, its server checked (up, serving the model, answering on the endpoint
    ``reward.judge.api`` asks: :meth:`LLMJudge.check`), or None when no reward asks one."""
    if not cfg.uses_judge():
        return None
    judge = LLMJudge.from_config(cfg.judge)
    try:
        judge.check()
    except BaseException:
        judge.close()
        raise
    return judge

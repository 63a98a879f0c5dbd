"""The RL algorithms: what each ``trainer.algorithm`` name means (:data:`ALGORITHMS`, one entry each), and the
advantage estimators and losses that are not TRL's, one short function each, formula in the docstring.

Nothing here imports TRL, so the dry run reads the table without loading it.

Shapes: ``rewards`` is ``(B,)`` with the ``G`` trajectories of a prompt contiguous (``B = P·G``, TRL's
layout). Token-level tensors are ``(B, T)`` over completion tokens; ``mask`` is 1 on tokens the policy
wrote and 0 on environment tokens (``<information>`` blocks) and padding. NaN rewards (unscorable
trajectories) get advantage 0.

GRPO, Dr. GRPO and DAPO advantages are TRL's (group mean; / group std for grpo and dapo, not for Dr. GRPO);
the others, and DAPO's dynamic-sampling test (:func:`uniform_groups`), are here.

A new algorithm is an :class:`Algorithm` member and its :data:`ALGORITHMS` entry (and, if TRL lacks its estimator,
the function here that the entry names).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

EPS = 1e-4


class Algorithm(StrEnum):
    """``trainer.algorithm``: the RL algorithm — one :data:`ALGORITHMS` entry each (:mod:`zerosim.training.trainer`
    applies it; the schema, :mod:`zerosim.training.config`, takes it from here)."""

    grpo = "grpo"
    dr_grpo = "dr_grpo"
    dapo = "dapo"
    rloo = "rloo"
    reinforce = "reinforce"
    reinforce_pp = "reinforce_pp"
    ppo = "ppo"


class Estimator(StrEnum):
    """Who computes an algorithm's advantages, and how."""

    trl = "trl"  # TRL's group-relative advantages (group mean; / group std when scale_rewards="group")
    sequence = "sequence"  # one advantage per trajectory from its group's rewards (AlgorithmSpec.advantages)
    returns = (
        "returns"  # per-token returns-to-go with the KL to the reference as a token reward (REINFORCE++)
    )
    gae = "gae"  # per-token GAE over a critic's values (PPO)


@dataclass(frozen=True)
class AlgorithmSpec:
    """Everything an algorithm name means: the TRL settings that make it what its paper says, who computes its
    advantages, what else it needs, and what it allows. :class:`~zerosim.training.trainer.SearchTrainer`, the
    recipe, the config check and the dry run read it; no other code branches on an algorithm's name."""

    loss_type: str  # TRL's aggregation of the per-token surrogate
    estimator: Estimator = Estimator.trl
    scale_rewards: str | None = None  # TRL's advantages: "group" (/ group std), "none"; None: ours instead
    epsilon_high: float | None = None  # default upper clip range (None: trainer.epsilon, symmetric clipping)
    dynamic_sampling: bool = False  # default: drop groups whose rewards are all equal from the loss
    # may drop equal-reward groups at all: needs a group baseline (such a group then has advantage 0 everywhere)
    # and a token-level mean (zeroed rows then leave the denominator too)
    allows_dynamic_sampling: bool = False
    kl_in_reward: bool = False  # the KL to the reference is a token reward, not a loss term
    # reward.step_credit=prefix: the (baseline, scaled) of its step-credited advantages
    # (:func:`prefix_credited_advantages`); None: each step reward sits on its </search> token already
    prefix_credit: tuple[str, bool] | None = None
    # Estimator.sequence: (rewards (B,), group size) -> (B,) advantages
    advantages: Callable[[torch.Tensor, int], torch.Tensor] | None = None

    @property
    def needs_critic(self) -> bool:
        """A value model is trained beside the policy (``trainer.critic_*``)."""
        return self.estimator == Estimator.gae

    @property
    def own_advantages(self) -> bool:
        """Its advantages are ours, not TRL's (logged as ``algorithm/advantage_abs_mean``)."""
        return self.estimator != Estimator.trl


def _rloo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    return rloo_advantages(rewards, group_size)


def _reinforce(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    return reinforce_advantages(rewards)


# The one table: an entry per ``trainer.algorithm`` (tests/test_algorithms.py checks it covers the enum).
# rloo, reinforce, reinforce_pp and ppo take the token-level mean over the batch ("dapo"): each token of a long
# answer counts once.
ALGORITHMS: dict[Algorithm, AlgorithmSpec] = {
    Algorithm.grpo: AlgorithmSpec("grpo", scale_rewards="group", prefix_credit=("mean", True)),
    # Dr. GRPO: no std division, constant normaliser
    Algorithm.dr_grpo: AlgorithmSpec("dr_grpo", scale_rewards="none", prefix_credit=("mean", False)),
    Algorithm.dapo: AlgorithmSpec(
        "dapo",
        scale_rewards="group",
        epsilon_high=0.28,
        dynamic_sampling=True,
        allows_dynamic_sampling=True,
        prefix_credit=("mean", True),
    ),
    Algorithm.rloo: AlgorithmSpec(
        "dapo",
        Estimator.sequence,
        allows_dynamic_sampling=True,
        prefix_credit=("others", False),
        advantages=_rloo,
    ),
    Algorithm.reinforce: AlgorithmSpec(
        "dapo", Estimator.sequence, prefix_credit=("none", False), advantages=_reinforce
    ),
    Algorithm.reinforce_pp: AlgorithmSpec("dapo", Estimator.returns, kl_in_reward=True),
    Algorithm.ppo: AlgorithmSpec("dapo", Estimator.gae),
}
# Dynamic sampling needs a group baseline and a token-level mean: the algorithms that allow it.
DYNAMIC_SAMPLING = tuple(name.value for name, spec in ALGORITHMS.items() if spec.allows_dynamic_sampling)


def spec_of(algorithm: str) -> AlgorithmSpec:
    """The :class:`AlgorithmSpec` of ``algorithm`` (a name or an :class:`Algorithm`); an unknown one is refused."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[Algorithm(algorithm)]


def algorithm_args(algorithm: str, epsilon_high: float | None = None) -> dict[str, Any]:
    """The ``GRPOConfig`` fields that define ``algorithm`` (``epsilon_high``: an explicit upper clip range)."""
    spec = spec_of(algorithm)
    fields: dict[str, Any] = {"loss_type": spec.loss_type}
    if spec.scale_rewards is not None:
        fields["scale_rewards"] = spec.scale_rewards
    if epsilon_high is not None or spec.epsilon_high is not None:
        fields["epsilon_high"] = epsilon_high if epsilon_high is not None else spec.epsilon_high
    return fields


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.view(-1, group_size)


def uniform_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(P,)`` booleans: True for a group whose scorable (non-NaN) rewards are all equal, or that has none.

    Such a group has no learning signal under a group baseline (every advantage is 0); DAPO's dynamic
    sampling drops it from the batch.
    """
    g = _grouped(rewards, group_size)
    scorable = ~torch.isnan(g)
    top = torch.where(scorable, g, torch.full_like(g, -torch.inf)).max(dim=1).values
    bottom = torch.where(scorable, g, torch.full_like(g, torch.inf)).min(dim=1).values
    return ~scorable.any(dim=1) | (top == bottom)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: each trajectory's baseline is the mean of the *other* ``G-1`` in its group.

    ``A_i = r_i - (Σ_{j≠i} r_j) / (G-1) = G/(G-1) · (r_i - mean_g(r))``. Needs ``G ≥ 2``.
    """
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 trajectories per prompt (trainer.num_generations >= 2)")
    g = torch.nan_to_num(_grouped(rewards, group_size), nan=0.0)
    others = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    adv = g - others
    return adv.reshape(-1).masked_fill(torch.isnan(rewards), 0.0)


def reinforce_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE without a baseline (ZeroSearch's variant): ``A_i = r_i``."""
    return torch.nan_to_num(rewards.clone(), nan=0.0)


def prefix_credited_advantages(
    rewards: torch.Tensor,
    step_totals: torch.Tensor,
    steps: torch.Tensor,
    positions: torch.Tensor,
    group_size: int,
    width: int,
    algorithm: str,
) -> torch.Tensor:
    """``(B, width)`` token advantages of a sequence-level algorithm whose step rewards credit only the tokens
    that led to them (``reward.step_credit=prefix``).

    ``rewards`` ``(B,)``: each trajectory's whole reward (NaN: unscorable), ``step_totals`` ``(B,)`` the sum
    of its step rewards in it, so its outcome is ``o_i = rewards_i - step_totals_i``; ``steps`` ``(B, S)``:
    its searches' step rewards (NaN: no such search, or one whose ``</search>`` was cut off); ``positions``
    ``(B, S)``: the completion index of each search's closing ``</search>`` token. With ``b`` the algorithm's baseline and ``σ`` its
    scale (its :attr:`AlgorithmSpec.prefix_credit`), token ``t`` of trajectory ``i`` gets

        ``A_i(t) = (o_i - b(o))/σ + Σ_{s: pos_{i,s} ≥ t} (r_{i,s} - b(r))/σ``

    — the outcome's advantage on every token, each search's on the tokens up to its ``</search>`` only, so
    an answer is never credited for the documents it was shown. ``b``: the group's mean (grpo, dapo,
    dr_grpo; for step rewards, the mean over the group's searches, as DeepSeekMath's process-supervised
    GRPO), the mean of the *other* trajectories (rloo), 0 (reinforce); unscorable trajectories count in
    neither. A search is judged against the group's average search, so — unlike ``sequence``, where a
    trajectory's step rewards add up — a search whose reward is below that average lowers the advantage of
    the tokens that led to it. ``σ`` (grpo, dapo): ``√(var(o) + var(r)) + EPS`` over the group's scorable
    outcomes and their searches' step rewards — TRL's group std when there are no step rewards, one scale
    for both parts so that their weights keep their ratio, and never smaller than either part's spread;
    else 1. Without step rewards this is the algorithm's own advantage on every token.
    """
    credit = spec_of(algorithm).prefix_credit
    if credit is None:
        takes = ", ".join(name for name, spec in ALGORITHMS.items() if spec.prefix_credit is not None)
        raise ValueError(
            f"step rewards credited to their searches' tokens are built for {takes}, not "
            f"{algorithm!r} (ppo and reinforce_pp place each on its </search> token already)"
        )
    baseline, scaled = credit
    if baseline == "others" and group_size < 2:
        raise ValueError("RLOO needs at least 2 trajectories per prompt (trainer.num_generations >= 2)")
    B = rewards.numel()
    whole = _grouped(rewards.float(), group_size)  # (P, G)
    o = whole - step_totals.float().to(whole.device).view_as(whole)
    r = steps.float().to(whole.device).reshape(B, -1).view(o.shape[0], group_size, -1)  # (P, G, S)
    scorable = ~torch.isnan(o)
    has = ~torch.isnan(r) & scorable.unsqueeze(2)  # an unscorable trajectory's searches count nowhere
    o0 = torch.nan_to_num(o, nan=0.0)
    r0 = torch.where(has, r, torch.zeros_like(r))
    if baseline == "mean":
        n = scorable.sum(1, keepdim=True).clamp(min=1)
        b_o = (o0 * scorable).sum(1, keepdim=True) / n
        b_r = (r0.sum((1, 2)) / has.sum((1, 2)).clamp(min=1)).view(-1, 1, 1)
    elif baseline == "others":
        b_o = (o0.sum(1, keepdim=True) - o0) / (group_size - 1)
        total, count = r0.sum(2), has.sum(2)  # per trajectory
        others = (total.sum(1, keepdim=True) - total) / (count.sum(1, keepdim=True) - count).clamp(min=1)
        b_r = others.unsqueeze(2)
    else:
        b_o, b_r = torch.zeros_like(o0), torch.zeros_like(r0)
    if scaled:
        # one scale for both parts, so reward.step_gain_weight keeps its weight against the outcome; each
        # part's spread is in it, so neither part's advantage can outgrow it (a group whose whole rewards tie
        # while their parts differ would divide by ~0 under the whole rewards' std)
        spread = _nanvar(torch.where(scorable, o, torch.nan)) + _nanvar(
            torch.where(has, r, torch.nan).flatten(1)
        )
        sigma = spread.sqrt().unsqueeze(1) + EPS  # (P, 1)
    else:
        sigma = torch.ones_like(o0[:, :1])
    outcome_adv = ((o0 - b_o) / sigma).masked_fill(~scorable, 0.0).reshape(B)
    step_adv = ((r0 - b_r) / sigma.unsqueeze(2)).masked_fill(~has, 0.0).reshape(B, -1)
    out = outcome_adv.unsqueeze(1).expand(B, width).clone()
    t = torch.arange(width, device=out.device)
    pos = positions.reshape(B, -1).to(out.device)
    for s in range(step_adv.shape[1]):  # a handful of searches: one masked add each
        upto = (t.unsqueeze(0) <= pos[:, s : s + 1]).float()
        out += upto * step_adv[:, s : s + 1]
    return out


def _nanvar(x: torch.Tensor) -> torch.Tensor:
    """Per row, the unbiased variance of the non-NaN entries (0 with fewer than 2), as TRL's ``nanstd``."""
    n = (~torch.isnan(x)).sum(1)
    mean = torch.nanmean(x, dim=1, keepdim=True)
    var = torch.nansum((x - mean) ** 2, dim=1) / (n - 1).clamp(min=1)
    return torch.where(n > 1, var, torch.zeros_like(var))


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``(B, T)`` discounted sums of the token rewards from each policy token to the end of its row.

    Walking the masked-in positions ``t_1 < … < t_n`` of a row as consecutive steps (environment tokens are
    skipped, as in :func:`gae`): ``G_{t_n} = r_{t_n}``, ``G_{t_k} = r_{t_k} + γ G_{t_{k+1}}``. Masked-out
    positions get 0 and a reward placed on one is ignored. (REINFORCE++'s return: ``gae`` with ``V = 0``, ``λ = 1``.)
    """
    advantages, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
    return advantages


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the policy's own tokens; environment tokens are skipped.

    Walking the masked-in positions ``t_1 < t_2 < … < t_n`` of a row (``mask = 1``) as consecutive steps:
    ``δ_t = r_t + γ V(t') - V(t)`` with ``t'`` the next masked-in position (``V = 0`` after the last one),
    ``A_t = δ_t + γλ A_{t'}``, returns ``R_t = A_t + V(t)``. Masked-out positions get ``A = R = 0``,
    and a reward placed on one is ignored (place rewards on policy tokens).
    Returns ``(advantages, returns)``, both ``(B, T)``.
    """
    if not (rewards.shape == values.shape == mask.shape):
        raise ValueError(f"shapes differ: rewards {rewards.shape}, values {values.shape}, mask {mask.shape}")
    m = mask.bool()
    adv = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m[:, t], a, torch.zeros_like(a))
        next_adv = torch.where(m[:, t], a, next_adv)
        next_value = torch.where(m[:, t], values[:, t], next_value)
    returns = torch.where(m, adv + values, torch.zeros_like(values))
    return adv, returns


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` token rewards: each trajectory's reward on its last policy token (``mask = 1``), 0 elsewhere."""
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = torch.nan_to_num(rewards.float(), nan=0.0)[rows]
    return out


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask = 1`` (0 when there are none)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over masked-in positions; masked-out positions stay 0."""
    m = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) / (var.sqrt() + EPS) * m


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float
) -> torch.Tensor:
    """PPO's clipped value loss over masked-in tokens.

    ``V_clip = V_old + clamp(V - V_old, -c, c)``;
    ``L = ½ · mean_mask( max((V - R)², (V_clip - R)²) )``.
    """
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    loss = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * masked_mean(loss, mask)

"""Advantage estimators and losses against hand-computed values (masked positions included), and the TRL
settings each algorithm name stands for. Through the trainer itself: tests/test_trainer_math.py."""

import pytest
import torch

from zerosim.training.algorithms import (
    gae,
    masked_mean,
    outcome_token_rewards,
    reinforce_advantages,
    returns_to_go,
    rloo_advantages,
    uniform_groups,
    value_loss,
    whiten,
)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


NAN = float("nan")


def test_uniform_groups():
    r = t(1.0, 0.0, 0.5, 0.5, NAN, 0.3, NAN, NAN, 0.0, 0.0)  # five groups of 2
    # varied | equal | one scorable (nothing to compare) | none scorable | equal zeros
    assert uniform_groups(r, 2).tolist() == [False, True, True, True, True]
    with pytest.raises(ValueError, match="groups of 3"):
        uniform_groups(t(1.0, 2.0), 3)


def test_grpo_args_spell_out_each_algorithm(tmp_path):
    """What `zerosim train` hands TRL: Dr. GRPO unscaled, DAPO clip-higher, an explicit epsilon_high kept."""
    from zerosim.training.config import TrainConfig
    from zerosim.training.recipe import grpo_args

    def args(algorithm, **trainer):
        cfg = TrainConfig()
        cfg.trainer.algorithm = algorithm
        for key, value in trainer.items():
            setattr(cfg.trainer, key, value)
        a = grpo_args(cfg, tmp_path)
        return a.loss_type, a.scale_rewards, a.epsilon, a.epsilon_high

    assert args("grpo") == ("grpo", "group", 0.2, None)  # None: TRL clips symmetrically at epsilon
    assert args("dr_grpo") == ("dr_grpo", "none", 0.2, None)
    assert args("dapo") == ("dapo", "group", 0.2, 0.28)
    assert args("dapo", epsilon_high=0.3) == ("dapo", "group", 0.2, 0.3)
    assert args("grpo", epsilon_high=0.25)[3] == 0.25
    for name in ("rloo", "reinforce", "reinforce_pp", "ppo"):
        assert args(name)[0] == "dapo"


def test_dynamic_sampling_is_checked_before_anything_loads():
    from zerosim.core.config import ConfigError
    from zerosim.training.config import load_train_config

    assert load_train_config(None, ["trainer.algorithm=dapo"]).trainer.dynamic_sampling is None  # on for dapo
    load_train_config(None, ["trainer.algorithm=rloo", "trainer.dynamic_sampling=true"])
    with pytest.raises(ConfigError, match="trainer.dynamic_sampling=false or trainer.algorithm=dapo"):
        load_train_config(None, ["trainer.algorithm=grpo", "trainer.dynamic_sampling=true"])
    with pytest.raises(ConfigError, match="epsilon_high"):
        load_train_config(None, ["trainer.epsilon_high=0"])


def test_rloo_leave_one_out():
    r = t(1.0, 0.0, 0.5, 0.0)  # two groups of 2: baseline is the other member
    assert rloo_advantages(r, 2).tolist() == pytest.approx([1.0, -1.0, 0.5, -0.5])
    r3 = t(3.0, 0.0, 0.0)
    # A_0 = 3 - (0+0)/2 = 3; A_1 = 0 - (3+0)/2 = -1.5
    assert rloo_advantages(r3, 3).tolist() == pytest.approx([3.0, -1.5, -1.5])
    # = G/(G-1) (r - mean)
    assert rloo_advantages(r3, 3).tolist() == pytest.approx((1.5 * (r3 - r3.mean())).tolist())
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages(t(1.0), 1)
    with pytest.raises(ValueError, match="groups of 2"):
        rloo_advantages(t(1.0, 2.0, 3.0), 2)
    # an unscorable trajectory gets 0 and counts as reward 0 for its group mates
    assert rloo_advantages(t(float("nan"), 1.0), 2).tolist() == pytest.approx([0.0, 1.0])


def test_reinforce():
    assert reinforce_advantages(t(1.0, 0.0, 0.0, 1.0)).tolist() == [1.0, 0.0, 0.0, 1.0]
    assert reinforce_advantages(t(NAN)).tolist() == [0.0]


def test_returns_to_go_skip_environment_tokens():
    # policy, policy, env, env, policy, pad ; rewards on every position (env ones must be ignored)
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]])
    rewards = t(0.1, 0.2, 5.0, 5.0, 1.0, 7.0).unsqueeze(0)
    assert returns_to_go(rewards, mask).tolist()[0] == pytest.approx([1.3, 1.2, 0, 0, 1.0, 0])
    # discounted per policy step, not per position: t1 -> t4 is one step
    g = 0.5
    expected = [0.1 + g * (0.2 + g * 1.0), 0.2 + g * 1.0, 0, 0, 1.0, 0]
    assert returns_to_go(rewards, mask, g).tolist()[0] == pytest.approx(expected)


def test_gae_skips_environment_tokens():
    # one row: policy, policy, env, env, policy, pad ; reward 1 on the last policy token
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]])
    values = t(0.5, 0.6, 9.0, 9.0, 0.8, 9.0).unsqueeze(0)  # values on masked positions must not matter
    rewards = outcome_token_rewards(t(1.0), mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 1.0, 0]]
    gamma, lam = 0.9, 0.5
    # steps: t0 (V .5) -> t1 (V .6) -> t4 (V .8) -> end
    d4 = 1.0 + 0 - 0.8
    d1 = 0 + gamma * 0.8 - 0.6
    d0 = 0 + gamma * 0.6 - 0.5
    a4 = d4
    a1 = d1 + gamma * lam * a4
    a0 = d0 + gamma * lam * a1
    adv, ret = gae(rewards, values, mask, gamma, lam)
    assert adv.tolist()[0] == pytest.approx([a0, a1, 0, 0, a4, 0])
    assert ret.tolist()[0] == pytest.approx([a0 + 0.5, a1 + 0.6, 0, 0, a4 + 0.8, 0])
    # gamma = lambda = 1 (the papers' setting): every policy token's advantage is R - V(t)
    adv1, ret1 = gae(rewards, values, mask, 1.0, 1.0)
    assert adv1.tolist()[0] == pytest.approx([0.5, 0.4, 0, 0, 0.2, 0])
    assert ret1.tolist()[0] == pytest.approx([1.0, 1.0, 0, 0, 1.0, 0])


def test_gae_batch_rows_are_independent():
    mask = torch.tensor([[1, 1, 1], [0, 1, 0]])
    values = torch.zeros(2, 3)
    rewards = outcome_token_rewards(t(2.0, 3.0), mask)
    assert rewards.tolist() == [[0, 0, 2.0], [0, 3.0, 0]]
    adv, _ = gae(rewards, values, mask, 1.0, 1.0)
    assert adv.tolist() == [[2.0, 2.0, 2.0], [0.0, 3.0, 0.0]]
    with pytest.raises(ValueError, match="shapes differ"):
        gae(rewards, values[:, :2], mask, 1.0, 1.0)
    # a row with no policy token gets no reward at all
    assert outcome_token_rewards(t(5.0), torch.tensor([[0, 0]])).tolist() == [[0.0, 0.0]]


def test_value_loss_clipping_and_mask():
    mask = torch.tensor([[1, 1, 0]])
    old = t(0.0, 0.0, 0.0).unsqueeze(0)
    new = t(1.0, -0.1, 5.0).unsqueeze(0)
    ret = t(1.0, 0.0, 100.0).unsqueeze(0)
    # token 0: unclipped (1-1)^2=0, clipped (0.2-1)^2=0.64 -> max 0.64 ; token 1: (-0.1)^2=0.01 both ; token 2 masked
    assert value_loss(new, old, ret, mask, clip=0.2).item() == pytest.approx(0.5 * (0.64 + 0.01) / 2)
    assert masked_mean(t(1.0, 3.0), torch.tensor([0, 1])).item() == 3.0
    w = whiten(t(1.0, 3.0, 100.0).unsqueeze(0), torch.tensor([[1, 1, 0]]))
    assert w.tolist()[0] == pytest.approx([-1.0, 1.0, 0.0], abs=1e-3)


# -- the algorithm table -----------------------------------------------------------------------------------------


def test_every_algorithm_has_one_table_entry():
    """A new ``trainer.algorithm`` member without its ALGORITHMS entry (or an entry without a member) fails here."""
    from zerosim.training.algorithms import ALGORITHMS
    from zerosim.training.config import Algorithm

    assert set(ALGORITHMS) == set(Algorithm)


def test_each_entry_is_complete():
    """An entry names how its advantages are made: a sequence estimator names its function; TRL's estimator needs
    TRL's reward scaling; dynamic sampling on by default only where it is allowed."""
    from zerosim.training.algorithms import ALGORITHMS, Estimator

    for name, spec in ALGORITHMS.items():
        assert (spec.advantages is not None) == (spec.estimator == Estimator.sequence), name
        assert (spec.scale_rewards is not None) == (spec.estimator == Estimator.trl), name
        assert spec.allows_dynamic_sampling or not spec.dynamic_sampling, name
        assert spec.loss_type in ("grpo", "dr_grpo", "dapo", "bnpo"), name


def test_the_table_says_what_the_names_meant():
    """The table holds what the eight scattered places held before it (critic: ppo; dynamic sampling: dapo, rloo;
    prefix credit: the sequence-level ones; TRL's advantages: grpo, dr_grpo, dapo)."""
    from zerosim.training.algorithms import ALGORITHMS, DYNAMIC_SAMPLING

    assert [n for n, s in ALGORITHMS.items() if s.needs_critic] == ["ppo"]
    assert DYNAMIC_SAMPLING == ("dapo", "rloo")
    assert {n: s.prefix_credit for n, s in ALGORITHMS.items() if s.prefix_credit} == {
        "grpo": ("mean", True),
        "dapo": ("mean", True),
        "dr_grpo": ("mean", False),
        "rloo": ("others", False),
        "reinforce": ("none", False),
    }
    assert [n for n, s in ALGORITHMS.items() if not s.own_advantages] == ["grpo", "dr_grpo", "dapo"]
    assert [n for n, s in ALGORITHMS.items() if s.kl_in_reward] == ["reinforce_pp"]


def test_no_algorithm_name_is_branched_on_outside_the_table():
    """``if algorithm == "ppo"`` and its kin live nowhere but algorithms.py: the trainer, recipe, config check and dry
    run read the spec."""
    import re
    from pathlib import Path

    import zerosim
    from zerosim.training.config import Algorithm

    names = "|".join(a.value for a in Algorithm)
    quoted = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["'](?:{names})["']|Algorithm\.(?:{names})\b""")
    package = Path(zerosim.__file__).parent
    found = [
        f"{path.relative_to(package)}:{i}: {line.strip()}"
        for path in package.rglob("*.py")
        if path.name != "algorithms.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if quoted.search(line) and "Algorithm.grpo" not in line  # the config's default value
    ]
    assert not found, "\n".join(found)

"""The losses through the trainer itself: each algorithm's advantages and loss as ``SearchTrainer`` computes
them (TRL's scoring included), KL sign, zero gradient on environment tokens, the PPO critic's micro-batches."""

import math
import time

import pytest
import torch

from zerosim.training.trainer import SearchTrainer


def make_trainer(tmp_path, tiny_model_dir, tokenizer, beta=0.0, rewards=None, **trainer_kwargs):
    """A ``SearchTrainer`` on the tiny model: groups of 2, 8 completion tokens; ``rewards``: what the reward
    function returns for a batch (default: 0 for every completion)."""
    from datasets import Dataset
    from trl import GRPOConfig

    from zerosim.core.models import load_causal_lm

    # no loss_type / scale_rewards / epsilon_high: the algorithm sets them
    args = GRPOConfig(
        output_dir=str(tmp_path), beta=beta, num_generations=2, per_device_train_batch_size=2,
        max_completion_length=8, use_cpu=True, report_to=[], logging_steps=1,
    )  # fmt: skip
    return SearchTrainer(
        model=load_causal_lm(str(tiny_model_dir), "float32"),
        reward_funcs=[lambda completions, **kw: list(rewards) if rewards else [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "q"}] * 4),
        processing_class=tokenizer,
        **trainer_kwargs,
    )


# Two groups of 2 trajectories, 6 completion tokens each; env mask 0 = an <information> token.
ENV = [[1, 1, 0, 0, 1, 1], [1, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1]]


def scripted_rollout(prompts, trainer):
    """A TRL ``rollout_func``: fixed prompt and completion tokens, ``ENV`` as the env mask."""
    g = torch.Generator().manual_seed(5)
    return {
        "prompt_ids": [[101, 102, 103, 104]] * len(prompts),
        "completion_ids": torch.randint(10, 1000, (len(prompts), 6), generator=g).tolist(),
        "logprobs": [[0.0] * 6] * len(prompts),
        "env_mask": ENV[: len(prompts)],
    }


def scored(tmp_path, tiny_model_dir, tokenizer, algorithm, rewards, beta=0.0, **kwargs):
    """The trainer and the batch it scored: TRL's ``_generate_and_score_completions`` with our overrides,
    over ``scripted_rollout``'s 4 trajectories rewarded ``rewards``."""
    torch.manual_seed(0)
    if algorithm == "ppo" and "critic" not in kwargs:
        from zerosim.training.trainer import Critic

        kwargs["critic"] = Critic.from_pretrained(str(tiny_model_dir), "float32")
    trainer = make_trainer(
        tmp_path, tiny_model_dir, tokenizer, beta=beta, rewards=rewards, algorithm=algorithm,
        rollout_func=scripted_rollout, **kwargs,
    )  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what transformers' loop sets with no accumulation
    return trainer, trainer._generate_and_score_completions([{"prompt": "q"}] * 4)


def logps(trainer, model, out):
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attention = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(model, ids, attention, ids.shape[1] - 4)[0]


REWARDS = [1.0, 0.0, 0.25, 0.75]
S0, S1 = math.sqrt(0.5), math.sqrt(0.125)  # unbiased std of (1, 0) and of (0.25, 0.75)
EXPECTED = {
    "grpo": [0.5 / (S0 + 1e-4), -0.5 / (S0 + 1e-4), -0.25 / (S1 + 1e-4), 0.25 / (S1 + 1e-4)],
    "dr_grpo": [0.5, -0.5, -0.25, 0.25],  # Dr. GRPO: r - group mean, no division by the std
    "dapo": [0.5 / (S0 + 1e-4), -0.5 / (S0 + 1e-4), -0.25 / (S1 + 1e-4), 0.25 / (S1 + 1e-4)],
    "rloo": [1.0, -1.0, -0.5, 0.5],  # r_i - (the other member)
    "reinforce": REWARDS,
}
LOSS = {"grpo": "grpo", "dr_grpo": "dr_grpo", "dapo": "dapo", "rloo": "dapo", "reinforce": "dapo"}


@pytest.mark.parametrize("algorithm", sorted(EXPECTED))
def test_sequence_advantages_through_the_trainer(tmp_path, tiny_model_dir, tokenizer, algorithm):
    trainer, out = scored(tmp_path, tiny_model_dir, tokenizer, algorithm, REWARDS)
    assert trainer.loss_type == LOSS[algorithm]
    assert out["advantages"].tolist() == pytest.approx(EXPECTED[algorithm], rel=1e-5)
    assert out["tool_mask"].tolist() == ENV  # no group has equal rewards: nothing dropped


# Step rewards: trajectory 0 searched once (its </search> closes at token 1, a policy token of ENV[0]) and
# was shown documents holding the gold answer (step reward 0.4), trajectory 1 searched (closing at token 0)
# and was shown none (0.0) — under a simulator, the draw of its noise. Both then answered wrong (outcome 0.2:
# the format reward alone). Group 2: no searches, outcomes 1 and 0.
STEPS = [[(1, 0.4)], [(0, 0.0)], [], []]
OUTCOMES = [0.2, 0.2, 1.0, 0.0]
WHOLE = [o + sum(v for _, v in st) for o, st in zip(OUTCOMES, STEPS, strict=True)]  # what the reward returns


def stepped_rollout(prompts, trainer):
    """``scripted_rollout`` with the rollout's step-reward fields (``zerosim.training.trl_rollout``)."""
    out = scripted_rollout(prompts, trainer)
    out["step_rewards"] = STEPS[: len(prompts)]
    out["step_reward_total"] = [sum(v for _, v in st) for st in STEPS[: len(prompts)]]
    return out


def stepped(tmp_path, tiny_model_dir, tokenizer, algorithm, step_credit):
    torch.manual_seed(0)
    trainer = make_trainer(
        tmp_path, tiny_model_dir, tokenizer, rewards=WHOLE, algorithm=algorithm, rollout_func=stepped_rollout,
        step_credit=step_credit, dynamic_sampling=False if algorithm == "dapo" else None,
    )  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    # one dict per row: TRL writes the rollout's fields into each row, where the trainer reads them back
    return trainer._generate_and_score_completions([{"prompt": "q"} for _ in range(4)])


def test_sequence_credit_pays_the_answer_for_the_documents_it_was_shown(tmp_path, tiny_model_dir, tokenizer):
    """What ``reward.step_credit=sequence`` does (the default, as before): the step reward joins the
    trajectory's reward, so the wrong answer written after the gold-bearing documents is pushed up and the
    same wrong answer after the others pushed down — a gradient on the answer from the environment's draw."""
    out = stepped(tmp_path, tiny_model_dir, tokenizer, "grpo", "sequence")
    a = 0.2 / (math.sqrt(0.08) + 1e-4)  # (0.6 - 0.4) / std(0.6, 0.2)
    assert out["advantages"].tolist() == pytest.approx(
        [a, -a, 0.5 / (S0 + 1e-4), -0.5 / (S0 + 1e-4)], rel=1e-5
    )


PREFIX_EXPECTED = {
    # (the searches' tokens 0..1, the answer's tokens 2..5) of trajectories 0 and 1; group 2's every token
    "grpo": ((0.2 / (math.sqrt(0.08) + 1e-4), 0.0), 0.5 / (S0 + 1e-4)),
    "dapo": ((0.2 / (math.sqrt(0.08) + 1e-4), 0.0), 0.5 / (S0 + 1e-4)),
    "dr_grpo": ((0.2, 0.0), 0.5),
    "rloo": ((0.4, 0.0), 1.0),  # leave-one-out: the other trajectory's search (0.0 or 0.4), outcome 1 - 0
}


@pytest.mark.parametrize("algorithm", sorted(PREFIX_EXPECTED))
def test_prefix_credit_keeps_a_step_reward_to_the_tokens_of_its_search(
    tmp_path, tiny_model_dir, tokenizer, algorithm
):
    """``reward.step_credit=prefix``: the search's tokens carry its step reward's advantage, the answer's
    tokens the outcome's alone (0 here: both answers scored the same), whatever the documents were."""
    out = stepped(tmp_path, tiny_model_dir, tokenizer, algorithm, "prefix")
    (search, answer), outcome = PREFIX_EXPECTED[algorithm]
    expected = [
        [search] * 2 + [answer] * 4,
        [-search] + [-answer] * 5,
        [outcome] * 6,
        [-outcome] * 6,
    ]
    assert out["advantages"].shape == (4, 6)
    assert out["advantages"].tolist() == [pytest.approx(row, rel=1e-5, abs=1e-6) for row in expected]


def test_prefix_credit_without_step_rewards_is_the_algorithms_own_advantage(
    tmp_path, tiny_model_dir, tokenizer
):
    from zerosim.training.algorithms import prefix_credited_advantages

    for algorithm in ("grpo", "dr_grpo", "rloo", "reinforce"):
        _, out = scored(tmp_path / algorithm, tiny_model_dir, tokenizer, algorithm, REWARDS)
        none = torch.full((4, 0), torch.nan)
        got = prefix_credited_advantages(
            torch.tensor(REWARDS), torch.zeros(4), none, none.long(), 2, 6, algorithm
        )
        torch.testing.assert_close(
            got, out["advantages"].float().view(4, 1).expand(4, 6), rtol=1e-5, atol=1e-6
        )


def test_prefix_credit_reinforce_two_searches_and_an_unscorable_row():
    """No baseline: a token's advantage is the outcome plus the step rewards of the searches still ahead of
    it; a second search credits only the tokens up to its own </search>; an unscorable row gets 0."""
    from zerosim.training.algorithms import prefix_credited_advantages

    rewards = torch.tensor([1.0 + 0.3 + 0.1, torch.nan])
    steps = torch.tensor([[0.3, 0.1], [0.2, torch.nan]])
    where = torch.tensor([[1, 3], [1, -1]])
    got = prefix_credited_advantages(rewards, torch.tensor([0.4, 0.2]), steps, where, 2, 5, "reinforce")
    assert got.tolist() == [pytest.approx([1.4, 1.4, 1.1, 1.1, 1.0]), [0.0] * 5]
    with pytest.raises(ValueError, match="ppo and reinforce_pp place"):
        prefix_credited_advantages(rewards, torch.zeros(2), steps, where, 2, 5, "ppo")


def test_prefix_credit_judges_each_search_against_the_groups_average_search():
    """dr_grpo, two searches in one trajectory: the baseline of a step reward is the mean over the group's
    searches (0.2 here), each search's advantage sits on the tokens up to its own </search>."""
    from zerosim.training.algorithms import prefix_credited_advantages

    nan = float("nan")
    got = prefix_credited_advantages(
        torch.tensor([1.0 + 0.3 + 0.1, 0.0 + 0.2]), torch.tensor([0.4, 0.2]),
        torch.tensor([[0.3, 0.1], [0.2, nan]]), torch.tensor([[1, 3], [1, -1]]), 2, 5, "dr_grpo",
    )  # fmt: skip
    assert got.tolist() == [pytest.approx([0.5, 0.5, 0.4, 0.4, 0.5]), pytest.approx([-0.5] * 5)]


def test_prefix_credit_stays_bounded_when_the_whole_rewards_tie():
    """A group whose whole rewards tie (0.2 + a step of 0.4 against 0.6 without a search) while their parts
    differ: dividing by the whole rewards' std (0) would give ±2000 on every token; the parts' own spread
    keeps the outcome's advantage at ∓0.2/√0.08."""
    from zerosim.training.algorithms import prefix_credited_advantages

    nan = float("nan")
    got = prefix_credited_advantages(
        torch.tensor([0.6, 0.6]), torch.tensor([0.4, 0.0]), torch.tensor([[0.4], [nan]]),
        torch.tensor([[1], [-1]]), 2, 4, "grpo",
    )  # fmt: skip
    a = 0.2 / (math.sqrt(0.08) + 1e-4)
    assert got.tolist() == [pytest.approx([-a] * 4, rel=1e-5), pytest.approx([a] * 4, rel=1e-5)]


@pytest.mark.parametrize("algorithm", ["dr_grpo", "rloo", "grpo"])
def test_an_unscorable_trajectorys_searches_are_in_no_baseline(algorithm):
    from zerosim.training.algorithms import prefix_credited_advantages

    got = prefix_credited_advantages(
        torch.tensor([1.1, float("nan")]), torch.tensor([0.1, 0.9]), torch.tensor([[0.1], [0.9]]),
        torch.tensor([[1], [1]]), 2, 3, algorithm,
    )  # fmt: skip
    # the one scorable trajectory is its own baseline (rloo: no other scorable one, baseline 0)
    expected = [1.1, 1.1, 1.0] if algorithm == "rloo" else [0.0] * 3
    assert got.tolist() == [pytest.approx(expected, abs=1e-6), [0.0] * 3]


def test_step_credit_is_sequence_or_prefix(tmp_path, tiny_model_dir, tokenizer):
    with pytest.raises(ValueError, match="'sequence' or 'prefix'"):
        make_trainer(tmp_path, tiny_model_dir, tokenizer, step_credit="answer")


def test_dapo_clips_higher_and_drops_equal_reward_groups(tmp_path, tiny_model_dir, tokenizer):
    rewards = [1.0, 0.0, 0.5, 0.5]  # the second group has no signal
    trainer, out = scored(tmp_path, tiny_model_dir, tokenizer, "dapo", rewards)
    assert (trainer.epsilon_low, trainer.epsilon_high) == (0.2, 0.28)
    # dropped from the loss: the rows' loss mask is zeroed and the token count no longer includes them
    assert out["tool_mask"].tolist() == ENV[:2] + [[0] * 6] * 2
    n0, n1 = sum(ENV[0]), sum(ENV[1])
    assert int(out["num_items_in_batch"]) == n0 + n1
    assert trainer._metrics["train"]["algorithm/groups_dropped"] == [1.0]
    # the loss at ratio 1.25 (inside DAPO's [0.8, 1.28], outside symmetric clipping's 1.2): every kept token
    # contributes -1.25 A, divided by the kept tokens only
    out["old_per_token_logps"] = logps(trainer, trainer.model, out) - math.log(1.25)
    a = 0.5 / (S0 + 1e-4)
    expected = -1.25 * (a * n0 - a * n1) / (n0 + n1)
    assert trainer._compute_loss(trainer.model, out).item() == pytest.approx(expected, rel=1e-4)

    _, kept = scored(tmp_path / "all", tiny_model_dir, tokenizer, "dapo", rewards, dynamic_sampling=False)
    assert kept["tool_mask"].tolist() == ENV and int(kept["num_items_in_batch"]) == sum(map(sum, ENV))


def test_dynamic_sampling_needs_a_group_baseline(tmp_path, tiny_model_dir, tokenizer):
    with pytest.raises(ValueError, match="dynamic_sampling=false"):
        make_trainer(tmp_path, tiny_model_dir, tokenizer, algorithm="reinforce", dynamic_sampling=True)


def test_reinforce_pp_puts_the_kl_in_the_reward_not_the_loss(tmp_path, tiny_model_dir, tokenizer):
    beta = 0.5
    trainer, _ = scored(tmp_path, tiny_model_dir, tokenizer, "reinforce_pp", REWARDS, beta=beta)
    with torch.no_grad():  # move the policy away from the reference, then score a batch
        g = torch.Generator().manual_seed(2)
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    out = trainer._generate_and_score_completions([{"prompt": "q"}] * 4)
    old, ref = logps(trainer, trainer.model, out), logps(trainer, trainer.ref_model, out)
    torch.testing.assert_close(out["ref_per_token_logps"], ref)

    # by hand: r_t = -beta (log pi_old - log pi_ref) on policy tokens, + the outcome on the last one;
    # returns-to-go over policy tokens; normalised over all policy tokens of the batch
    raw = torch.zeros(4, 6, dtype=torch.float64)
    for b in range(4):
        ret, last = 0.0, max(t for t in range(6) if ENV[b][t])
        for t in reversed(range(6)):
            if ENV[b][t]:
                ret += -beta * (old[b, t] - ref[b, t]).item() + (REWARDS[b] if t == last else 0.0)
                raw[b, t] = ret
    mask = torch.tensor(ENV, dtype=torch.bool)
    values = raw[mask]
    mean, std = values.mean(), values.var(unbiased=False).sqrt()
    expected = torch.where(mask, (raw - mean) / (std + 1e-4), torch.zeros_like(raw))
    assert out["advantages"].shape == (4, 6)
    torch.testing.assert_close(out["advantages"].double(), expected, rtol=1e-4, atol=1e-5)
    kl_reward = trainer._metrics["train"]["algorithm/kl_reward"][-1]
    assert kl_reward == pytest.approx((old - ref)[mask].mean().item(), rel=1e-4)

    # the loss holds no KL term: at ratio 1 it is -mean(A) over policy tokens, 0 for normalised advantages,
    # where TRL's k3 KL in the loss would add beta * mean(k3) (clearly non-zero here)
    d = ref - logps(trainer, trainer.model, out)
    k3 = (torch.exp(d) - d - 1)[mask].mean().item()
    assert beta * k3 > 1e-3
    assert trainer._compute_loss(trainer.model, out).item() == pytest.approx(0.0, abs=1e-5)


@pytest.fixture
def trainer(tmp_path, tiny_model_dir, tokenizer):
    torch.manual_seed(0)
    return make_trainer(tmp_path, tiny_model_dir, tokenizer, beta=0.5, algorithm="reinforce")


def make_inputs(trainer, advantages, tool_mask):
    g = torch.Generator().manual_seed(1)
    B, P, T = tool_mask.shape[0], 5, tool_mask.shape[1]
    prompt_ids = torch.randint(10, 1000, (B, P), generator=g)
    completion_ids = torch.randint(10, 1000, (B, T), generator=g)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": torch.ones(B, T, dtype=torch.long),
        "tool_mask": tool_mask,
        "advantages": advantages,
        "num_items_in_batch": tool_mask.sum(),
    }
    with torch.no_grad():
        ref = trainer._get_per_token_logps_and_entropies(
            trainer.ref_model,
            torch.cat([prompt_ids, completion_ids], 1),
            torch.ones(B, P + T, dtype=torch.long),
            T,
        )[0]
    inputs["ref_per_token_logps"] = ref
    return inputs


def policy_logps(trainer, inputs):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, torch.ones_like(ids), inputs["completion_ids"].shape[1]
        )[0]
    return logps


LR = 0.05


def test_kl_term_pulls_the_policy_toward_the_reference(trainer):
    with torch.no_grad():  # move the policy away from the reference (a copy of the initial weights)
        g = torch.Generator().manual_seed(2)
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    mask = torch.ones(2, 6, dtype=torch.long)
    inputs = make_inputs(trainer, torch.zeros(2), mask)  # zero advantages: only the KL term acts

    def kl(logps):  # the k3 estimator TRL minimises, and the plain log-ratio gap
        d = inputs["ref_per_token_logps"] - logps
        return (torch.exp(d) - d - 1).mean().item(), d.abs().mean().item()

    before = kl(policy_logps(trainer, inputs))
    assert before[0] > 1e-4
    for _ in range(3):
        trainer.model.zero_grad()
        trainer._compute_loss(trainer.model, inputs).backward()
        with torch.no_grad():
            for p in trainer.model.parameters():
                if p.grad is not None:
                    p.add_(-LR * p.grad)  # plain gradient descent on the loss
    after = kl(policy_logps(trainer, inputs))
    assert after[0] < 0.8 * before[0] and after[1] < before[1], (before, after)


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "dapo", "rloo", "reinforce", "reinforce_pp", "ppo"])
def test_environment_tokens_get_exactly_zero_gradient(tmp_path, tiny_model_dir, tokenizer, algorithm):
    """Each algorithm's loss on the batch the trainer scored (its own advantages, KL on): the gradient reaching
    an <information> token's prediction is exactly 0, every policy token's is not."""
    # every trajectory's advantage is non-zero under every algorithm (reinforce: no reward of 0)
    trainer, out = scored(tmp_path, tiny_model_dir, tokenizer, algorithm, [1.0, -0.5, 0.25, 0.75], beta=0.1)
    captured = {}

    def keep(module, args, output):
        output.retain_grad()
        captured["hidden"] = output

    # The loss computes log-probs with a fused head (no logits tensor): watch the final hidden states instead.
    # Position p of the final norm's output feeds only the prediction of token p+1.
    handle = trainer.model.model.norm.register_forward_hook(keep)
    try:
        trainer.model.zero_grad()
        trainer._compute_loss(trainer.model, out).backward()
    finally:
        handle.remove()
    grad = captured["hidden"].grad  # (B, P+T, H)
    per_position = grad[:, -6 - 1 : -1].abs().sum(-1)  # the positions predicting completion tokens 0..5
    env = torch.tensor(ENV)
    assert torch.all(per_position[env == 0] == 0)  # exactly zero, not just small
    assert torch.all(per_position[env == 1] > 0)


def test_collapse_guard_stops_only_after_patience_silent_steps():
    from transformers import TrainerControl, TrainerState

    from zerosim.training.recipe import CollapseGuard

    guard, state, control = CollapseGuard(3), TrainerState(), TrainerControl()
    logs = [
        {"reward": 0.0, "frac_reward_zero_std": 1.0},
        {"reward": 0.0, "frac_reward_zero_std": 1.0},
        {
            "reward": 0.3,
            "frac_reward_zero_std": 1.0,
        },  # all equal but not zero: a signal-free step, not a collapse
        {"reward": 0.0, "frac_reward_zero_std": 0.5},  # some group still varies: gradient
        {"reward": 0.0, "frac_reward_zero_std": 1.0},
        {"reward": 0.0, "frac_reward_zero_std": 1.0},
        {"loss": 0.1},  # other log lines do not break or extend the streak
    ]
    for step, entry in enumerate(logs, 1):
        state.global_step = step
        guard.on_log(None, state, control, logs=entry)
    assert not control.should_training_stop and guard.collapsed_at is None
    state.global_step = 8
    guard.on_log(None, state, control, logs={"reward": 0.0, "frac_reward_zero_std": 1.0})
    assert control.should_training_stop and guard.collapsed_at == 8
    off = CollapseGuard(0)
    for _ in range(10):
        off.on_log(None, state, TrainerControl(), logs={"reward": 0.0, "frac_reward_zero_std": 1.0})
    assert off.collapsed_at is None


def ppo_trainer(tmp_path, tiny_model_dir, tokenizer, critic, micro_batch):
    return make_trainer(
        tmp_path, tiny_model_dir, tokenizer, algorithm="ppo", critic=critic,
        critic_micro_batch=micro_batch, critic_learning_rate=1e-3,
    )  # fmt: skip


def test_critic_micro_batches_accumulate_the_whole_batch_gradient(tmp_path, tiny_model_dir, tokenizer):
    """5 rows in micro-batches of 2 (2 + 2 + 1, one row fully masked) give the gradient and loss of one
    whole-batch step, while no forward pass sees more than 2 rows."""
    import copy

    from zerosim.training.trainer import Critic

    torch.manual_seed(0)
    critic = Critic.from_pretrained(str(tiny_model_dir), "float32")
    torch.nn.init.normal_(critic.model.score.weight, std=0.5)  # a non-zero head: the body gets gradient too
    twin = copy.deepcopy(critic)
    whole = ppo_trainer(tmp_path / "a", tiny_model_dir, tokenizer, critic, None)
    micro = ppo_trainer(tmp_path / "b", tiny_model_dir, tokenizer, twin, 2)

    g = torch.Generator().manual_seed(3)
    B, P, T = 5, 4, 6
    input_ids = torch.randint(10, 1000, (B, P + T), generator=g)
    attention = torch.ones(B, P + T, dtype=torch.long)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 0], [0] * 6, [1, 0, 0, 0, 0, 1], [1] * 6])
    old_values, returns = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)

    seen = []
    original = twin.forward

    def counting(ids, att, length):
        seen.append(ids.shape[0])
        return original(ids, att, length)

    twin.forward = counting
    a = whole._update_critic(input_ids, attention, mask, old_values, returns, T)
    b = micro._update_critic(input_ids, attention, mask, old_values, returns, T)

    assert seen == [2, 2, 1]
    assert b["critic/value_loss"] == pytest.approx(a["critic/value_loss"], rel=1e-5)
    grads = [(p.grad, q.grad) for p, q in zip(critic.parameters(), twin.parameters(), strict=True)]
    assert all(gp is not None and gq is not None for gp, gq in grads)
    assert any(gp.abs().sum() > 0 for gp, _ in grads[:-1])  # the body, not only the head
    for gp, gq in grads:
        torch.testing.assert_close(gq, gp, rtol=1e-4, atol=1e-7)


def test_critic_micro_batch_must_be_positive(tmp_path, tiny_model_dir, tokenizer):
    from zerosim.training.trainer import Critic

    critic = Critic.from_pretrained(str(tiny_model_dir), "float32")
    with pytest.raises(ValueError, match="critic_micro_batch must be >= 1"):
        ppo_trainer(tmp_path, tiny_model_dir, tokenizer, critic, 0)


def test_critic_values_are_deterministic_in_train_mode(tiny_model_dir):
    from zerosim.training.trainer import Critic

    critic = Critic.from_pretrained(str(tiny_model_dir), "float32")
    torch.nn.init.normal_(critic.model.score.weight, std=0.5)
    critic.train()
    ids = torch.randint(10, 1000, (2, 9), generator=torch.Generator().manual_seed(4))
    first = critic(ids, torch.ones_like(ids), 5)
    assert first.shape == (2, 5) and first.abs().sum() > 0
    torch.testing.assert_close(critic(ids, torch.ones_like(ids), 5), first, rtol=0, atol=0)


def test_phase_times_are_per_optimizer_step_sums(tmp_path, tiny_model_dir, tokenizer):
    """time/update_s is the update time of the whole optimizer step (summed over its micro-batches, not their
    mean), and time/step_s the step's wall time, which holds every phase measured inside it."""
    from transformers import TrainerCallback

    from zerosim.training.trainer import SearchTrainer

    micro: list[float] = []

    class Timed(SearchTrainer):
        def training_step(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return super().training_step(*args, **kwargs)
            finally:
                micro.append(time.perf_counter() - started)

    logged: list[dict] = []

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append(dict(logs or {}))

    from datasets import Dataset
    from trl import GRPOConfig

    from zerosim.core.models import load_causal_lm

    args = GRPOConfig(
        output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=1, max_completion_length=8, use_cpu=True, report_to=[], logging_steps=1, save_strategy="no",
    )  # fmt: skip
    torch.manual_seed(0)
    trainer = Timed(
        model=load_causal_lm(str(tiny_model_dir), "float32"),
        reward_funcs=[lambda completions, **kw: [float(i % 2) for i in range(len(completions))]],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "q"}] * 4),
        processing_class=tokenizer,
        rollout_func=scripted_rollout,
        callbacks=[Keep()],
    )
    trainer.train()
    (step,) = [entry for entry in logged if "time/update_s" in entry]
    assert len(micro) == 2  # two micro-batches in the one optimizer step
    assert 0.6 * sum(micro) < step["time/update_s"] <= sum(micro)  # the mean of the two would be <= 0.5x
    assert step["time/step_s"] >= sum(micro) - 1e-6

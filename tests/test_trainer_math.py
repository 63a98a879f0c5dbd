"""The losses through the trainer itself: KL sign, zero gradient on environment tokens, the PPO critic's micro-batches."""

import pytest
import torch

from zerosim.trainer import SearchTrainer


def make_trainer(tmp_path, tiny_model_dir, tokenizer, beta=0.0, **trainer_kwargs):
    """A ``SearchTrainer`` on the tiny model: groups of 2, 8 completion tokens, no reward signal."""
    from datasets import Dataset
    from trl import GRPOConfig

    from zerosim.models import load_causal_lm

    args = GRPOConfig(
        output_dir=str(tmp_path), beta=beta, num_generations=2, per_device_train_batch_size=2,
        max_completion_length=8, loss_type="dapo", use_cpu=True, report_to=[], logging_steps=1,
    )  # fmt: skip
    return SearchTrainer(
        model=load_causal_lm(str(tiny_model_dir), "float32"),
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "q"}] * 4),
        processing_class=tokenizer,
        **trainer_kwargs,
    )


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


def test_environment_tokens_get_exactly_zero_gradient(trainer):
    tool_mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 0, 0, 0, 1]])
    inputs = make_inputs(trainer, torch.tensor([1.0, -2.0]), tool_mask)
    captured = {}

    def keep(module, args, output):
        output.retain_grad()
        captured["logits"] = output

    # The loss computes log-probs with a fused head (no logits tensor): watch the final hidden states instead.
    # Position p of the final norm's output feeds only the prediction of token p+1.
    handle = trainer.model.model.norm.register_forward_hook(keep)
    try:
        trainer.model.zero_grad()
        trainer._compute_loss(trainer.model, inputs).backward()
    finally:
        handle.remove()
    grad = captured["logits"].grad  # (B, P+T, H)
    T = tool_mask.shape[1]
    per_position = grad[:, -T - 1 : -1].abs().sum(-1)  # the positions predicting completion tokens 0..T-1
    assert torch.all(per_position[tool_mask == 0] == 0)  # exactly zero, not just small
    assert torch.all(per_position[tool_mask == 1] > 0)


def test_collapse_guard_stops_only_after_patience_silent_steps():
    from transformers import TrainerControl, TrainerState

    from zerosim.train import CollapseGuard

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

    from zerosim.trainer import Critic

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
    from zerosim.trainer import Critic

    critic = Critic.from_pretrained(str(tiny_model_dir), "float32")
    with pytest.raises(ValueError, match="critic_micro_batch must be >= 1"):
        ppo_trainer(tmp_path, tiny_model_dir, tokenizer, critic, 0)


def test_critic_values_are_deterministic_in_train_mode(tiny_model_dir):
    from zerosim.trainer import Critic

    critic = Critic.from_pretrained(str(tiny_model_dir), "float32")
    torch.nn.init.normal_(critic.model.score.weight, std=0.5)
    critic.train()
    ids = torch.randint(10, 1000, (2, 9), generator=torch.Generator().manual_seed(4))
    first = critic(ids, torch.ones_like(ids), 5)
    assert first.shape == (2, 5) and first.abs().sum() > 0
    torch.testing.assert_close(critic(ids, torch.ones_like(ids), 5), first, rtol=0, atol=0)

"""The update's speed-ups keep its maths: micro-batches grouped by length (same summed gradient, every value
attached to its row), the log-prob head scoring only the loss mask's positions (same loss and gradient), no
log-prob pass TRL does not need, and ``trainer.bf16``'s autocast applied where asked."""

import pytest
import torch

from zerosim.training.trainer import SearchTrainer

PROMPT_LENGTHS = [4, 2, 3, 4]
COMPLETION_LENGTHS = [3, 12, 5, 10]  # rows of very different lengths: grouping changes the micro-batches
REWARDS = [1.0, 0.0, 0.25, 0.75]  # two groups of 2, neither uniform (dapo drops none)


def varied_rollout(prompts, trainer):
    """A TRL ``rollout_func``: row i has its own prompt and completion lengths; token 3 of each completion of
    6 tokens or more is an environment token (out of the loss)."""
    g = torch.Generator().manual_seed(7)
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
    for i in range(len(prompts)):
        p, c = PROMPT_LENGTHS[i % 4], COMPLETION_LENGTHS[i % 4]
        out["prompt_ids"].append(torch.randint(10, 1000, (p,), generator=g).tolist())
        out["completion_ids"].append(torch.randint(10, 1000, (c,), generator=g).tolist())
        out["logprobs"].append([0.0] * c)
        out["env_mask"].append([0 if (j == 3 and c >= 6) else 1 for j in range(c)])
    return out


def make_trainer(
    tmp_path, tiny_model_dir, tokenizer, algorithm="grpo", beta=0.0, dtype=torch.float32, **kwargs
):
    """4 trajectories per optimizer step in 2 micro-batches of 2 (``gradient_accumulation_steps`` 2)."""
    from datasets import Dataset
    from trl import GRPOConfig

    from zerosim.core.models import load_causal_lm

    args = GRPOConfig(
        output_dir=str(tmp_path), beta=beta, num_generations=2, per_device_train_batch_size=2,
        gradient_accumulation_steps=kwargs.pop("gradient_accumulation_steps", 2),
        steps_per_generation=kwargs.pop("steps_per_generation", None), max_completion_length=16,
        use_cpu=True, bf16=False, report_to=[], logging_steps=1,  # TRL defaults to bf16=True
    )  # fmt: skip
    torch.manual_seed(0)
    trainer = SearchTrainer(
        model=load_causal_lm(str(tiny_model_dir), "float32").to(dtype),
        reward_funcs=[lambda completions, **kw: REWARDS[: len(completions)]],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "q"}] * 4),
        processing_class=tokenizer,
        rollout_func=varied_rollout,
        algorithm=algorithm,
        **kwargs,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    return trainer


def accumulate(trainer, micro_steps=None):
    """One optimizer step's micro-batches through ``training_step`` (TRL's scoring, micro-batching and loss);
    returns the summed gradient and the micro-batches the loss saw."""
    trainer.model.zero_grad(set_to_none=True)
    trainer._step, trainer._buffered_inputs = 0, None
    torch.manual_seed(3)  # TRL shuffles the rows before slicing them into micro-batches
    for _ in range(micro_steps or trainer.args.gradient_accumulation_steps):
        trainer.training_step(trainer.model, [{"prompt": "q"}] * 4, None)
    grad = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    return grad, list(trainer._buffered_inputs)


# -- grouped micro-batches ---------------------------------------------------------------------------------
def test_group_by_length_moves_every_value_with_its_row_and_trims_padding():
    from zerosim.training.speedups import group_by_length

    B, P, T = 6, 5, 9
    prompt_len, completion_len = [5, 2, 3, 5, 1, 4], [9, 2, 7, 1, 8, 3]
    batch = {
        "prompt_ids": torch.zeros(B, P, dtype=torch.long),
        "prompt_mask": torch.zeros(B, P, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": torch.zeros(B, T, dtype=torch.long),
        "tool_mask": torch.ones(B, T, dtype=torch.long),
        "ref_per_token_logps": torch.zeros(B, T),
        "advantages": torch.arange(B, dtype=torch.float32) * 10,  # row i: 10 i
        "num_items_in_batch": torch.tensor(33),
    }
    for i in range(B):
        batch["prompt_ids"][i, P - prompt_len[i] :] = 100 + i
        batch["prompt_mask"][i, P - prompt_len[i] :] = 1
        batch["completion_ids"][i, : completion_len[i]] = 200 + i
        batch["completion_mask"][i, : completion_len[i]] = 1
        batch["tool_mask"][i, 1] = 0
        batch["ref_per_token_logps"][i, : completion_len[i]] = -(i + 1)
    chunks = [{k: (v[j : j + 2] if v.ndim else v) for k, v in batch.items()} for j in (0, 2, 4)]

    grouped = group_by_length(chunks)

    assert len(grouped) == 3 and all(len(mb["advantages"]) == 2 for mb in grouped)
    seen = []
    for mb in grouped:
        rows = [int(ids[0]) - 200 for ids in mb["completion_ids"]]  # the row each line came from
        seen += rows
        width_p = max(prompt_len[r] for r in rows)
        width_c = max(completion_len[r] for r in rows)
        assert mb["prompt_ids"].shape[1] == width_p and mb["completion_ids"].shape[1] == width_c  # trimmed
        for line, r in enumerate(rows):
            assert mb["advantages"][line] == 10 * r
            assert (
                mb["prompt_ids"][line].tolist() == [0] * (width_p - prompt_len[r]) + [100 + r] * prompt_len[r]
            )
            assert mb["completion_mask"][line].sum() == completion_len[r]
            assert (mb["completion_ids"][line][: completion_len[r]] == 200 + r).all()
            assert mb["ref_per_token_logps"][line][: completion_len[r]].eq(-(r + 1)).all()
            assert mb["tool_mask"][line][1] == 0
        assert mb["num_items_in_batch"] == 33  # the generation batch's count, unchanged
    assert sorted(seen) == list(range(B))
    totals = [prompt_len[r] + completion_len[r] for r in seen]
    assert totals == sorted(totals)  # shortest rows together, longest together


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "dapo"])
def test_grouped_micro_batches_give_the_same_summed_gradient(tmp_path, tiny_model_dir, tokenizer, algorithm):
    """Rows regrouped across the step's micro-batches: each micro-batch narrower, every row's advantage still
    its own, and the step's summed gradient the same as with TRL's micro-batches. In float64: in float32 the
    two differ by rounding (~3e-3 of the norm here, as much as float32 differs from float64 on either)."""
    trainer = make_trainer(tmp_path, tiny_model_dir, tokenizer, algorithm, dtype=torch.float64)
    trainer.group_by_length = False
    plain, trl_batches = accumulate(trainer)
    trainer.group_by_length = True
    grouped, ours = accumulate(trainer)

    full = trl_batches[0]["completion_ids"].shape[1]
    assert full == max(COMPLETION_LENGTHS) and all(
        mb["completion_ids"].shape[1] == full for mb in trl_batches
    )
    assert sorted(mb["completion_ids"].shape[1] for mb in ours) == [5, 12]  # {3, 5} and {10, 12} tokens

    def advantage_of(batches):  # completion tokens -> advantage, over every row of the step
        return {
            tuple(ids[mask.bool()].tolist()): float(adv)
            for mb in batches
            for ids, mask, adv in zip(
                mb["completion_ids"], mb["completion_mask"], mb["advantages"], strict=True
            )
        }

    assert advantage_of(ours) == advantage_of(trl_batches)
    assert plain.abs().sum() > 0
    assert ((grouped - plain).norm() / plain.norm()).item() < 1e-6


@pytest.mark.parametrize("accumulation,grouped", [(2, True), (1, False)])
def test_grouping_keeps_rows_in_their_optimizer_step(
    tmp_path, tiny_model_dir, tokenizer, accumulation, grouped
):
    """A generation batch of 2 micro-batches: regrouped when one optimizer step takes both (accumulation 2);
    kept as TRL sliced it when it spans two optimizer steps (accumulation 1), so no row changes step."""
    trainer = make_trainer(
        tmp_path, tiny_model_dir, tokenizer, gradient_accumulation_steps=accumulation, steps_per_generation=2
    )
    _, batches = accumulate(trainer, micro_steps=2)
    widths = sorted(mb["completion_ids"].shape[1] for mb in batches)
    assert widths == ([5, 12] if grouped else [12, 12])


# -- the loss's log-prob pass ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "algorithm,beta",
    [("grpo", 0.0), ("dapo", 0.1), ("reinforce_pp", 0.1), ("ppo", 0.0), ("grpo-lora", 0.1)],
)
def test_loss_pass_scores_only_the_loss_mask(
    tmp_path, tiny_model_dir, tokenizer, monkeypatch, algorithm, beta
):
    """The loss's log-prob head projects exactly the positions in the loss mask (not the prompt, padding or
    environment tokens TRL's head projects off CUDA), with the same loss and gradient as TRL's head — a LoRA
    policy's too (TRL patched the model under peft's wrapper; the adapters' gradient compared)."""
    from trl.kernels import ChunkedLogProbFunction

    kwargs = {}
    if algorithm == "grpo-lora":
        from zerosim.training.config import PolicyLoraConfig

        algorithm, kwargs["peft_config"] = "grpo", PolicyLoraConfig(enabled=True, r=4).peft_config()
    if algorithm == "ppo":
        from zerosim.training.trainer import Critic

        kwargs["critic"] = Critic.from_pretrained(str(tiny_model_dir), "float32")
    trainer = make_trainer(tmp_path, tiny_model_dir, tokenizer, algorithm, beta=beta, **kwargs)
    if "peft_config" in kwargs:  # B starts at 0: moved, so that the adapters' gradient is not A's zero one
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    trainer._step, trainer._buffered_inputs = 0, None
    out = trainer._generate_and_score_completions([{"prompt": "q"}] * 4)
    projected = []
    apply = ChunkedLogProbFunction.apply

    def counting(hidden, *args):
        projected.append(hidden.shape[0])
        return apply(hidden, *args)

    monkeypatch.setattr(ChunkedLogProbFunction, "apply", counting)
    results = {}
    for compact in (False, True):
        trainer.compact_head = compact
        trainer.model.zero_grad(set_to_none=True)
        projected.clear()
        loss = trainer._compute_loss(trainer.model, out)
        loss.backward()
        grad = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
        results[compact] = (loss.detach(), grad, list(projected))
    loss_mask = out["completion_mask"] * out.get("tool_mask", 1)
    assert results[True][2] == [int(loss_mask.sum())]
    assert results[False][2][0] > int(loss_mask.sum())
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-7)
    assert ((results[True][1] - results[False][1]).norm() / results[False][1].norm()).item() < 1e-5


@pytest.mark.parametrize(
    "beta,accumulation,steps_per_generation,passes",
    [
        (0.0, 2, 2, 0),  # aligned steps, no KL: the loss's own forward is the only one
        (0.1, 2, 2, 1),  # the reference model, once per generation batch
        (0.0, 1, 2, 1),  # generation batch used over 2 optimizer steps: old log-probs needed
    ],
)
def test_no_log_prob_pass_that_is_not_needed(
    tmp_path, tiny_model_dir, tokenizer, beta, accumulation, steps_per_generation, passes
):
    """No-grad log-prob passes of one generation batch: the reference only when beta != 0, the old policy
    only when the batch outlives an optimizer step (TRL's rule; a regression guard)."""
    trainer = make_trainer(
        tmp_path, tiny_model_dir, tokenizer, beta=beta, gradient_accumulation_steps=accumulation,
        steps_per_generation=steps_per_generation,
    )  # fmt: skip
    assert (trainer.ref_model is None) == (beta == 0.0)
    calls = {"grad": 0, "no_grad": 0}
    inner = SearchTrainer._get_per_token_logps_and_entropies

    def counting(self, *args, **kwargs):
        calls["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return inner(self, *args, **kwargs)

    trainer._get_per_token_logps_and_entropies = counting.__get__(trainer)
    accumulate(trainer, micro_steps=2)  # the 2 micro-batches of one generation batch
    assert calls == {"grad": 2, "no_grad": passes}


# -- trainer.bf16 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bf16", [False, True])
def test_update_bf16_autocasts_the_loss_and_keeps_fp32_weights(
    tmp_path, tiny_model_dir, tokenizer, monkeypatch, bf16
):
    """``update_bf16``: the body's matmuls in bf16, the log-prob head in fp32 (autocast off inside it), the
    weights and their gradients fp32."""
    from trl.kernels import ChunkedLogProbFunction

    trainer = make_trainer(tmp_path, tiny_model_dir, tokenizer, update_bf16=bf16)
    seen, head = [], []
    apply = ChunkedLogProbFunction.apply

    def recording(hidden, *args):
        head.append((hidden.dtype, torch.is_autocast_enabled("cpu")))
        return apply(hidden, *args)

    monkeypatch.setattr(ChunkedLogProbFunction, "apply", recording)
    layer = trainer.model.model.layers[0].mlp.up_proj
    handle = layer.register_forward_hook(
        lambda m, a, out: seen.append((torch.is_autocast_enabled("cpu"), out.dtype))
    )
    try:
        grad, _ = accumulate(trainer)
    finally:
        handle.remove()
    assert seen and all(s == (bf16, torch.bfloat16 if bf16 else torch.float32) for s in seen)
    assert head and all(h == (torch.float32, False) for h in head)
    assert layer.weight.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_bf16_setting_resolves_per_machine(monkeypatch):
    from zerosim.training.config import load_train_config
    from zerosim.training.speedups import cpu_autocast_bf16

    assert load_train_config("configs/demo-learning.yaml", []).trainer.bf16 is None
    assert load_train_config("configs/demo-learning.yaml", ["trainer.bf16=false"]).trainer.bf16 is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cpu_autocast_bf16(True) is True and cpu_autocast_bf16(False) is False
    assert cpu_autocast_bf16(None, cpu=False) is False  # auto: as the process computes on CPU (runtime.bf16)
    assert cpu_autocast_bf16(None, cpu=True) is True
    monkeypatch.setattr("zerosim.core.runtime._CPU_BF16", True)
    assert cpu_autocast_bf16(None) is True  # the process's decision (apply_precision)
    # auto stays fp32 where the loss compares two passes' log-probs (a KL term, a reused batch)
    assert cpu_autocast_bf16(None, compares_passes=True) is False
    assert cpu_autocast_bf16(True, compares_passes=True) is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_autocast_bf16(True) is False  # with a GPU TRL's own bf16 applies


# -- the PPO critic ----------------------------------------------------------------------------------------
def test_ppo_critic_shares_its_first_forward_with_gae(tmp_path, tiny_model_dir, tokenizer):
    """The critic's first step computes the values GAE needs (no separate values pass): the advantages and the
    critic after its ``critic_epochs`` steps are those of a values pass followed by the steps."""
    import copy

    from zerosim.training.algorithms import gae, whiten
    from zerosim.training.trainer import Critic

    torch.manual_seed(0)
    critic = Critic.from_pretrained(str(tiny_model_dir), "float32")
    torch.nn.init.normal_(critic.model.score.weight, std=0.5)  # non-zero values
    twin, initial = copy.deepcopy(critic), copy.deepcopy(critic)
    kwargs = {"critic_epochs": 2, "critic_micro_batch": 2, "critic_learning_rate": 1e-3}
    ours = make_trainer(tmp_path / "a", tiny_model_dir, tokenizer, "ppo", critic=critic, **kwargs)
    ref = make_trainer(tmp_path / "b", tiny_model_dir, tokenizer, "ppo", critic=twin, **kwargs)
    g = torch.Generator().manual_seed(5)
    B, P, T = 4, 4, 12
    prompt_mask = torch.tensor([[1] * 4, [0, 0, 1, 1], [0, 1, 1, 1], [1] * 4])
    completion_mask = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(COMPLETION_LENGTHS):
        completion_mask[i, :n] = 1
    tool_mask = torch.ones(B, T, dtype=torch.long)
    tool_mask[:, 2] = 0
    output = {
        "prompt_ids": torch.randint(10, 1000, (B, P), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(10, 1000, (B, T), generator=g) * completion_mask,
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
        "advantages": torch.zeros(B),
    }
    rewards = torch.tensor(REWARDS)
    calls = []
    forward = critic.forward

    def counting(ids, att, length):
        calls.append(ids.shape[0])
        return forward(ids, att, length)

    critic.forward = counting
    advantages = ours._ppo_advantages(output, rewards)["advantages"]

    # the same step done as before: a values pass over the batch, then critic_epochs steps against it
    ids, att, mask = ref._critic_inputs(output)
    with torch.no_grad():
        values = twin(ids, att, T)
    expected, returns = gae(ref._token_rewards(output, rewards, mask), values, mask, ref.gamma, ref.lam)
    ref._update_critic(ids, att, mask, values, returns, T)

    assert calls == [2, 2, 2, 2]  # 2 steps x 2 chunks: no separate values pass
    torch.testing.assert_close(advantages, whiten(expected, mask), rtol=1e-4, atol=1e-5)
    for p, q in zip(critic.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    moved = [(p - q).abs().sum() for p, q in zip(critic.parameters(), initial.parameters(), strict=True)]
    assert sum(moved) > 0  # the critic did step


def _one_optimizer_step(trainer) -> list[torch.Tensor]:
    """Each weight's change over one AdamW step (lr 1e-6, the ZeroSearch recipes') of TRL's loss."""
    trainer.args.learning_rate = 1e-6
    trainer.create_optimizer()
    before = [p.detach().float().clone() for p in trainer.model.parameters()]
    accumulate(trainer)
    trainer.optimizer.step()
    return [p.detach().float() - b for p, b in zip(trainer.model.parameters(), before, strict=True)]


def test_trained_weights_stay_fp32_so_small_updates_are_kept(
    tmp_path, tiny_model_dir, tokenizer, monkeypatch
):
    """The defect: AdamW stepping bf16 weights at lr 1e-6 leaves them where they were (an update ~1e-6 is far
    below bf16's spacing near a weight of 0.02). The fix: a trained model's weights are fp32 on a GPU too
    (``training_dtype``; bf16 only under DeepSpeed/FSDP, which keep fp32 masters) with the compute under bf16
    autocast, and one step through SearchTrainer moves them as the all-fp32 step does."""
    from zerosim.core.config import ConfigError
    from zerosim.core.models import default_dtype, training_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_dtype("auto") == torch.bfloat16  # inference (evaluation, an in-process simulator)
    assert training_dtype("auto") == training_dtype("float32") == torch.float32  # what AdamW steps
    with pytest.raises(ConfigError, match="policy.dtype=bfloat16 .* DeepSpeed or FSDP"):
        training_dtype("bfloat16")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert training_dtype("bfloat16") == torch.bfloat16
    monkeypatch.undo()

    lost = _one_optimizer_step(make_trainer(tmp_path / "a", tiny_model_dir, tokenizer, dtype=torch.bfloat16))
    moved = sum(int((d != 0).sum()) for d in lost) / sum(d.numel() for d in lost)
    assert moved < 0.02, f"{moved:.1%} of bf16 weights moved"

    reference = _one_optimizer_step(make_trainer(tmp_path / "b", tiny_model_dir, tokenizer))
    mixed = _one_optimizer_step(make_trainer(tmp_path / "c", tiny_model_dir, tokenizer, update_bf16=True))
    ref, got = torch.cat([d.flatten() for d in reference]), torch.cat([d.flatten() for d in mixed])
    assert (ref != 0).float().mean() > 0.9  # fp32 weights take the step
    assert ((got - ref).abs() <= 1e-8).float().mean() > 0.97  # bf16 compute, fp32 weights: the same step

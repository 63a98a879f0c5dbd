"""The RL trainer: TRL's ``GRPOTrainer`` (rollout, loss, KL, logging) with our advantage estimators and PPO.

TRL computes rewards and GRPO-family advantages; for the other algorithms this subclass keeps TRL's
rewards (gathered across ranks, exactly what TRL's own advantages see) and replaces the advantages:

- ``rloo``, ``reinforce``, ``reinforce_pp`` — sequence advantages from :mod:`zerosim.algorithms`;
- ``ppo`` — a separate critic (a small LM with a one-output token-classification head, its own AdamW and
  learning rate) values every completion token; GAE over the policy's tokens only (environment tokens are
  skipped, see :func:`zerosim.algorithms.gae`) gives per-token advantages (whitened) and returns; the critic
  then takes ``critic_epochs`` clipped-value-loss steps on that batch, in micro-batches of
  ``critic_micro_batch`` rows (the policy's ``per_device_train_batch_size``) with the gradient accumulated,
  so the critic's memory is bounded by the policy's micro-batch, not by the generation batch. The policy loss
  is TRL's clipped surrogate with those per-token advantages (TRL accepts ``(B, T)`` advantages).

The loss masks are TRL's: ``completion_mask × env_mask``, so ``<information>`` tokens never contribute.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from trl import GRPOTrainer

from zerosim.algorithms import ADVANTAGES, gae, masked_mean, outcome_token_rewards, value_loss, whiten

# Our algorithm names → the TRL loss type that aggregates the per-token surrogate.
LOSS_TYPES = {
    "grpo": "grpo",
    "dr_grpo": "dr_grpo",
    "dapo": "dapo",
    "rloo": "dapo",  # token-level mean over the batch: each token of a long answer counts once
    "reinforce": "dapo",
    "reinforce_pp": "dapo",
    "ppo": "dapo",
}


class Critic(torch.nn.Module):
    """Value model: a causal LM body with a scalar head per token (``AutoModelForTokenClassification``).

    Dropout is off (as in TRL's and veRL's value models): transformers' token-classification head drops 10% of
    its inputs by default, which would make the old values of GAE and the values the loss compares them with
    two different random functions of the same weights.
    """

    def __init__(self, model):
        super().__init__()
        from trl.trainer.utils import disable_dropout_in_model

        disable_dropout_in_model(model)
        self.model = model

    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: str = "auto") -> Critic:
        from transformers import AutoModelForTokenClassification

        from zerosim.models import default_dtype, resolve_model

        model = AutoModelForTokenClassification.from_pretrained(
            resolve_model(name_or_path), num_labels=1, dtype=default_dtype(dtype)
        )
        torch.nn.init.zeros_(model.score.weight)  # start from V = 0 everywhere: no random value signal
        if getattr(model.score, "bias", None) is not None:
            torch.nn.init.zeros_(model.score.bias)
        if model.config.pad_token_id is None:
            model.config.pad_token_id = model.config.eos_token_id
        return cls(model)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int
    ) -> torch.Tensor:
        """Values ``(B, T)`` of the completion tokens: ``V`` of the state each token is written from."""
        scores = self.model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1)
        return scores[:, -completion_length - 1 : -1].float()


class SearchTrainer(GRPOTrainer):
    """``GRPOTrainer`` with ``algorithm`` in grpo | dr_grpo | dapo | rloo | reinforce | reinforce_pp | ppo."""

    def __init__(
        self,
        *args: Any,
        algorithm: str = "grpo",
        critic: Critic | None = None,
        critic_learning_rate: float = 1e-5,
        gamma: float = 1.0,
        lam: float = 1.0,
        value_clip: float = 0.2,
        critic_epochs: int = 1,
        critic_micro_batch: int | None = None,
        **kwargs: Any,
    ):
        if algorithm not in LOSS_TYPES:
            raise ValueError(f"unknown algorithm {algorithm!r}; valid: {', '.join(LOSS_TYPES)}")
        if algorithm == "ppo" and critic is None:
            raise ValueError("algorithm=ppo needs a critic (Critic.from_pretrained)")
        if critic_micro_batch is not None and critic_micro_batch < 1:
            raise ValueError(
                f"critic_micro_batch must be >= 1 (or None: whole batch), got {critic_micro_batch}"
            )
        super().__init__(*args, **kwargs)
        self.algorithm = algorithm
        self.gamma, self.lam, self.value_clip, self.critic_epochs = gamma, lam, value_clip, critic_epochs
        self.critic = critic
        self.critic_micro_batch = critic_micro_batch
        self.critic_optimizer = None
        if critic is not None:
            critic.to(self.accelerator.device)
            self.critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=critic_learning_rate)
        self._last_rewards: torch.Tensor | None = None

    # -- rewards: keep what TRL's advantage computation sees -------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        self._last_rewards = rewards
        return rewards_per_func

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Times the update: the micro-step minus the rollout and scoring done inside it (``time/update_s``)."""
        started = time.perf_counter()
        self._scoring_seconds = 0.0
        loss = super().training_step(model, inputs, num_items_in_batch)
        update = time.perf_counter() - started - self._scoring_seconds
        self._metrics["train"]["time/update_s"].append(update)
        return loss

    def _generate_and_score_completions(self, inputs):
        started = time.perf_counter()
        try:
            return self._score(inputs)
        finally:
            self._scoring_seconds = getattr(self, "_scoring_seconds", 0.0) + time.perf_counter() - started

    def _score(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.algorithm in ("grpo", "dr_grpo", "dapo"):
            return output
        rewards = self._last_rewards
        local = output["completion_ids"].shape[0]
        start = self.accelerator.process_index * local
        if self.algorithm in ADVANTAGES:
            advantages = ADVANTAGES[self.algorithm](rewards, self.num_generations)
            output["advantages"] = advantages[start : start + local].to(output["advantages"].dtype)
        else:  # ppo
            output.update(self._ppo_advantages(output, rewards[start : start + local]))
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["algorithm/advantage_abs_mean"].append(output["advantages"].abs().mean().item())
        return output

    # -- PPO -----------------------------------------------------------------------------------------------
    def _critic_inputs(self, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        return input_ids, attention, mask

    def _ppo_advantages(self, output, rewards: torch.Tensor) -> dict[str, torch.Tensor]:
        input_ids, attention, mask = self._critic_inputs(output)
        T = output["completion_ids"].shape[1]
        with torch.no_grad():
            values = torch.cat(
                [
                    self.critic(input_ids[rows], attention[rows], T)
                    for rows in self._critic_chunks(len(input_ids))
                ]
            )
        rewards = rewards.to(values.device).clone()
        steps = getattr(self.rollout_func, "last_step_rewards", None) or []
        placed = torch.zeros_like(values)
        if len(steps) == len(rewards):
            # step rewards sit on their </search> tokens; the reward function added their sum to the
            # trajectory reward, so take it back off the last token
            for row, items in enumerate(steps):
                for index, value in items:
                    if index < placed.shape[1] and mask[row, index]:
                        placed[row, index] += value
                        rewards[row] -= value
        token_rewards = outcome_token_rewards(rewards, mask) + placed
        advantages, returns = gae(token_rewards, values, mask, self.gamma, self.lam)
        advantages = whiten(advantages, mask)
        stats = self._update_critic(input_ids, attention, mask, values, returns, T)
        mode = "train" if self.model.training else "eval"
        for name, value in stats.items():
            self._metrics[mode][name].append(value)
        return {"advantages": advantages.to(output["advantages"].dtype)}

    def _critic_chunks(self, n: int) -> list[slice]:
        """Row slices of at most ``critic_micro_batch`` rows covering ``n`` rows (one slice when unset)."""
        size = self.critic_micro_batch or max(n, 1)
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    def _update_critic(self, input_ids, attention, mask, old_values, returns, T) -> dict[str, float]:
        """``critic_epochs`` optimizer steps on the batch's clipped value loss, gradient accumulated over
        micro-batches: each chunk's masked mean is weighted by its share of the masked tokens, so the summed
        gradient is exactly the whole batch's (``value_loss`` over all rows at once)."""
        self.critic.train()
        losses = []
        total = mask.sum().clamp(min=1)
        for _ in range(self.critic_epochs):
            self.critic_optimizer.zero_grad(set_to_none=True)
            loss_value = 0.0
            for rows in self._critic_chunks(len(input_ids)):
                values = self.critic(input_ids[rows], attention[rows], T)
                chunk = value_loss(values, old_values[rows], returns[rows], mask[rows], self.value_clip)
                loss = chunk * mask[rows].sum() / total
                loss.backward()
                loss_value += loss.item()
            self._average_critic_grads()
            torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.args.max_grad_norm)
            self.critic_optimizer.step()
            losses.append(loss_value)
        explained = 1 - masked_mean((returns - old_values) ** 2, mask) / (
            masked_mean((returns - masked_mean(returns, mask)) ** 2, mask) + 1e-8
        )
        return {
            "critic/value_loss": sum(losses) / len(losses),
            "critic/value_mean": masked_mean(old_values, mask).item(),
            "critic/explained_variance": explained.item(),
        }

    def _average_critic_grads(self) -> None:
        """Data-parallel critic: every rank steps with the mean gradient, so the copies stay identical.

        The critic is a small LM kept whole on every rank (not sharded by DeepSpeed/FSDP), trained by its
        own optimizer; one all-reduce of its gradients per critic step is what DDP would do for it.
        """
        if self.accelerator.num_processes < 2:
            return
        for p in self.critic.parameters():
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.SUM)
                p.grad /= self.accelerator.num_processes

    def save_critic(self, path) -> None:
        if self.critic is not None:
            self.critic.model.save_pretrained(str(path))

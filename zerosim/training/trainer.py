"""The RL trainer: TRL's ``GRPOTrainer`` (rollout, loss, KL, logging) with our advantage estimators and PPO.

Each ``algorithm`` is defined by its entry in :data:`zerosim.training.algorithms.ALGORITHMS`: the TRL settings that make it what its paper says
(loss aggregation, reward scaling, clip range) — :class:`SearchTrainer` applies them to the ``GRPOConfig`` it
is given, so the name means the same from ``zerosim train`` and from Python — and, where TRL's advantages
are not the algorithm's, what replaces them. TRL computes rewards and GRPO-family advantages; this subclass
keeps TRL's rewards (gathered across ranks, exactly what TRL's own advantages see) and:

- ``dr_grpo`` — TRL's advantages without the division by the group's std (``scale_rewards="none"``) and
  TRL's constant-normaliser loss;
- ``dapo`` — TRL's token-level loss, clip-higher (``epsilon_high``, 0.28 as in the paper) and dynamic
  sampling: groups whose rewards are all equal are dropped from the loss (their rows' loss mask is zeroed,
  so they do not count in the token-level denominator either), and the number dropped is logged
  (``algorithm/groups_dropped``). The batch is not refilled: the step learns from the groups left;
- ``rloo``, ``reinforce`` — sequence advantages from :mod:`zerosim.training.algorithms`;
- ``reinforce_pp`` — REINFORCE++: the KL to the reference is a per-token *reward*
  ``-β·(log π_old - log π_ref)`` on every policy token, the outcome reward sits on the last one, the
  advantage of a token is its return-to-go (``trainer.gamma``), normalised over the policy tokens of the
  whole batch (all ranks); the KL is not in the loss;
- ``ppo`` — a separate critic (a small LM with a one-output token-classification head, its own AdamW and
  learning rate) values every completion token; GAE over the policy's tokens only (environment tokens are
  skipped, see :func:`zerosim.training.algorithms.gae`) gives per-token advantages (whitened) and returns; the critic
  then takes ``critic_epochs`` clipped-value-loss steps on that batch, in micro-batches of
  ``critic_micro_batch`` rows (the policy's ``per_device_train_batch_size``) with the gradient accumulated,
  so the critic's memory is bounded by the policy's micro-batch, not by the generation batch. The policy loss
  is TRL's clipped surrogate with those per-token advantages (TRL accepts ``(B, T)`` advantages).

The loss masks are TRL's: ``completion_mask × env_mask``, so ``<information>`` tokens never contribute.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
import weakref
from typing import Any

import torch
from accelerate.utils import is_peft_model
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from zerosim.training.algorithms import (
    DYNAMIC_SAMPLING,
    EPS,
    Estimator,
    algorithm_args,
    gae,
    masked_mean,
    outcome_token_rewards,
    prefix_credited_advantages,
    returns_to_go,
    spec_of,
    uniform_groups,
    value_loss,
    whiten,
)
from zerosim.training.precision import MasterWeightsCheck
from zerosim.training.speedups import (
    GROUPABLE_LOSSES,
    compact_log_prob_head,
    group_by_length,
    groupable,
)

log = logging.getLogger(__name__)

# per completion, the rollout's step rewards: [(index of the token that closed a </search>, value), ...]
StepRewards = list[list[tuple[int, float]]]


def _apply_algorithm(args: GRPOConfig, algorithm: str) -> GRPOConfig:
    """A copy of ``args`` with ``algorithm``'s defining fields (an explicit ``epsilon_high`` is kept)."""
    fields = algorithm_args(algorithm, args.epsilon_high)
    changed = {k: v for k, v in fields.items() if getattr(args, k) != v}
    if not changed:
        return args
    log.info(
        "algorithm=%s sets %s",
        algorithm,
        ", ".join(f"{k}={v!r} (was {getattr(args, k)!r})" for k, v in changed.items()),
    )
    args = copy.copy(args)
    for key, value in changed.items():
        setattr(args, key, value)
    return args


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

        from zerosim.core.models import resolve_model, training_dtype

        # ``dtype`` is refused where the policy's would be, but the critic's weights are fp32 whatever it allows the
        # policy (bf16 under DeepSpeed/FSDP): its own AdamW steps them, not their fp32 masters, and in bf16 its
        # updates would round away
        training_dtype(dtype)
        model = AutoModelForTokenClassification.from_pretrained(
            resolve_model(name_or_path), num_labels=1, dtype=torch.float32
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


class _StepClock(TrainerCallback):
    """``time/step_s``: wall time of each optimizer step, from its start to its end (the first ``on_step_end``:
    validation, logging and saving come after it)."""

    def __init__(self, trainer: SearchTrainer):
        self.trainer = trainer
        self.started: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.started is not None:
            self.trainer._add_time("step", time.perf_counter() - self.started)
            self.started = None


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GB (``getrusage``: kB on Linux, bytes on macOS)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e9 if sys.platform == "darwin" else peak / 1e6


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
        dynamic_sampling: bool | None = None,
        group_by_length: bool = True,
        update_bf16: bool = False,
        step_credit: str = "sequence",
        **kwargs: Any,
    ):
        spec = spec_of(algorithm)
        if spec.needs_critic and critic is None:
            raise ValueError(f"algorithm={algorithm} needs a critic (Critic.from_pretrained)")
        if critic_micro_batch is not None and critic_micro_batch < 1:
            raise ValueError(
                f"critic_micro_batch must be >= 1 (or None: whole batch), got {critic_micro_batch}"
            )
        if dynamic_sampling is None:
            dynamic_sampling = spec.dynamic_sampling
        if dynamic_sampling and not spec.allows_dynamic_sampling:
            raise ValueError(
                f"dynamic_sampling drops groups whose rewards are all equal; it needs a group baseline and a "
                f"token-level loss ({', '.join(DYNAMIC_SAMPLING)}), not algorithm={algorithm}: "
                "set trainer.dynamic_sampling=false or use trainer.algorithm=dapo"
            )
        if step_credit not in ("sequence", "prefix"):
            raise ValueError(f"step_credit is 'sequence' or 'prefix', got {step_credit!r}")
        if not isinstance(kwargs.get("args"), GRPOConfig):
            raise TypeError("SearchTrainer needs args=GRPOConfig(...), passed by keyword")
        kwargs["args"] = _apply_algorithm(kwargs["args"], algorithm)
        super().__init__(*args, **kwargs)
        self.algorithm = algorithm
        self.spec = spec
        self.dynamic_sampling = bool(dynamic_sampling)
        self.gamma, self.lam, self.value_clip, self.critic_epochs = gamma, lam, value_clip, critic_epochs
        self.critic = critic
        self.critic_micro_batch = critic_micro_batch
        self.group_by_length = group_by_length
        self.update_bf16 = update_bf16
        # ppo and reinforce_pp place each step reward on its </search> token whatever this says
        self.step_credit = step_credit
        # the loss's pass scores only its loss mask's positions (see compact_log_prob_head)
        self._scored_positions: torch.Tensor | None = None
        me = weakref.ref(self)
        patched = self.model.get_base_model() if is_peft_model(self.model) else self.model
        self.compact_head = not self.args.cast_lm_head_to_fp32 and compact_log_prob_head(
            patched,
            self.temperature,
            ("log_probs", "entropy"),
            scored=lambda: getattr(me(), "_scored_positions", None),
            enabled=lambda: getattr(me(), "compact_head", False),
        )
        if self.compact_head and self.ref_model is not None:
            compact_log_prob_head(
                self.ref_model, self.temperature, ("log_probs",), scored=lambda: None, enabled=lambda: True
            )
        self.critic_optimizer = None
        if critic is not None:
            critic.to(self.accelerator.device)
            self.critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=critic_learning_rate)
        self._last_rewards: torch.Tensor | None = None
        self._phase_seconds: dict[str, float] = {}  # time/<phase>_s accumulated since the last log
        self._phase_logged_at = 0
        # first in line, so its on_step_end runs before validation's: time/step_s is the training step alone
        self.callback_handler.callbacks.insert(0, _StepClock(self))
        # what the optimizers step is fp32, checked once accelerate and DeepSpeed/FSDP have built them
        self.add_callback(MasterWeightsCheck(self._own_optimizers, log=log))

    def _own_optimizers(self) -> list[tuple[Any, str]]:
        """The optimizers this trainer steps besides TRL's (the critic's), for :class:`MasterWeightsCheck`."""
        return [] if self.critic_optimizer is None else [(self.critic_optimizer, "the critic")]

    # -- rewards: keep what TRL's advantage computation sees -------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        self._last_rewards = rewards
        return rewards_per_func

    # -- where a step's time goes: time/<phase>_s, seconds per optimizer step ------------------------------
    # update (forward + backward of every micro-batch, less the scoring done inside them), logprob (no-grad
    # log-prob passes while scoring: old policy, reference), critic (PPO: values, GAE, critic update), save
    # (the checkpoint written after the previous logged step), step (wall time from the step's start to its
    # end; validation, logging and saving not). Summed over micro-batches, divided by the optimizer
    # steps since the last log. The rollout logs time/generate_s and time/search_s, the reward time/reward_s.
    def _add_time(self, phase: str, seconds: float) -> None:
        self._phase_seconds[phase] = self._phase_seconds.get(phase, 0.0) + seconds

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and self._phase_seconds:
            steps = max(1, self.state.global_step - self._phase_logged_at)
            logs.update({f"time/{phase}_s": sec / steps for phase, sec in self._phase_seconds.items()})
            self._phase_seconds.clear()
            self._phase_logged_at = self.state.global_step
            logs["memory/peak_rss_gb"] = peak_rss_gb()  # this process's high-water mark so far (CPU memory)
        super().log(logs, start_time)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Times the update: the micro-step minus the rollout and scoring done inside it (``time/update_s``)."""
        started = time.perf_counter()
        self._scoring_seconds = 0.0
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._add_time("update", time.perf_counter() - started - self._scoring_seconds)
        return loss

    # -- the update's micro-batches: grouped by length, trimmed (see group_by_length) ---------------------------
    def _prepare_inputs(self, generation_batch):
        fresh = self.model.training and (
            self._buffered_inputs is None
            or self._step % (self.args.steps_per_generation * self.num_iterations) == 0
        )
        inputs = super()._prepare_inputs(generation_batch)
        if fresh and self._groups_by_length(self._buffered_inputs[0]):
            self._buffered_inputs = group_by_length(self._buffered_inputs)
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    def _groups_by_length(self, batch: dict[str, Any]) -> bool:
        """Whether regrouping this generation batch's micro-batches leaves the step's gradient as it is: the
        rows stay in one optimizer step, the loss weighs a row the same in any micro-batch, and nothing is
        computed per micro-batch (entropy bonus or quantile mask, MoE aux loss, off-policy mask)."""
        a = self.args
        return (
            self.group_by_length
            and self.loss_type in GROUPABLE_LOSSES
            and a.gradient_accumulation_steps % a.steps_per_generation == 0
            and not getattr(self, "_entropy_bonus_enabled", False)
            and self.top_entropy_quantile >= 1.0
            and not self.aux_loss_enabled
            and getattr(self, "off_policy_mask_threshold", None) is None
            and groupable(batch)
        )

    def _generate_and_score_completions(self, inputs):
        started = time.perf_counter()
        try:
            return self._score(inputs)
        finally:
            self._scoring_seconds = getattr(self, "_scoring_seconds", 0.0) + time.perf_counter() - started

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        with self._update_precision():
            if torch.is_grad_enabled():  # the loss's own forward: part of the update
                return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            started = time.perf_counter()
            try:
                return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            finally:
                self._add_time("logprob", time.perf_counter() - started)

    def _update_precision(self):
        """bf16 autocast, with ``update_bf16``, over every log-prob pass (the loss's, old policy, reference) and
        the critic's passes; the weights, their gradients and the optimizer stay fp32."""
        if not self.update_bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.accelerator.device.type, dtype=torch.bfloat16)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """transformers maps the optimizer state to ``args.device`` when there are several ranks; on CPU that
        device is ``cpu:<rank>``, which torch's loader does not know ("don't know how to restore data location
        ... cpu:0"), so a launched CPU job could not resume. There the state loads to ``cpu``; everywhere
        else (GPUs, DeepSpeed, FSDP) transformers loads it as it does."""
        import os

        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

        several_on_cpu = self.args.world_size > 1 and self.args.device.type == "cpu"
        if checkpoint is None or not several_on_cpu or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return super()._load_optimizer_and_scheduler(checkpoint)
        optimizer, scheduler = (
            os.path.join(checkpoint, OPTIMIZER_NAME),
            os.path.join(checkpoint, SCHEDULER_NAME),
        )
        if os.path.isfile(optimizer) and os.path.isfile(scheduler):
            self.optimizer.load_state_dict(torch.load(optimizer, map_location="cpu", weights_only=True))
            self.lr_scheduler.load_state_dict(torch.load(scheduler, map_location="cpu", weights_only=True))

    def _save_checkpoint(self, model, trial):
        started = time.perf_counter()
        try:
            return super()._save_checkpoint(model, trial)
        finally:
            self._add_time("save", time.perf_counter() - started)

    def _score(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        # TRL merged the rollout's extra fields into these rows (for the reward functions): each completion's
        # step rewards, [(token index, value), ...] (zerosim.training.trl_rollout.TRLRollout), when it has them
        steps = [row.get("step_rewards") or [] for row in inputs]
        rewards = self._last_rewards
        local = output["completion_ids"].shape[0]
        start = self.accelerator.process_index * local
        mode = "train" if self.model.training else "eval"
        estimator = self.spec.estimator
        if self.step_credit == "prefix" and self.spec.prefix_credit is not None:  # every rank: it gathers
            output["advantages"] = self._prefix_credited(output, rewards, inputs, steps, start)
        elif estimator == Estimator.sequence:
            advantages = self.spec.advantages(rewards, self.num_generations)
            output["advantages"] = advantages[start : start + local].to(output["advantages"].dtype)
        elif estimator == Estimator.returns:
            output.update(self._reinforce_pp_advantages(output, rewards[start : start + local], steps))
        elif estimator == Estimator.gae:
            started = time.perf_counter()
            output.update(self._ppo_advantages(output, rewards[start : start + local], steps))
            self._add_time("critic", time.perf_counter() - started)
        if self.dynamic_sampling:
            self._drop_uniform_groups(output, rewards, start)
        if self.spec.own_advantages or self.step_credit == "prefix":
            self._metrics[mode]["algorithm/advantage_abs_mean"].append(
                output["advantages"].abs().mean().item()
            )
        return output

    def _prefix_credited(self, output, rewards: torch.Tensor, inputs, steps: StepRewards, start: int):
        """``(B, T)`` advantages for this rank's rows with each step reward credited to the tokens up to its
        ``</search>`` only (:func:`zerosim.training.algorithms.prefix_credited_advantages`); every rank's
        step rewards are gathered, since a group's baseline and scale read the whole group."""
        device = rewards.device
        local, width = output["completion_ids"].shape
        # at least one column: NCCL's gather cannot reshape a tensor of 0 elements (a batch without a search)
        most = max(1, max((len(items) for items in steps), default=0))
        values = torch.full((local, most), torch.nan, device=device)
        where = torch.full((local, most), -1, dtype=torch.long, device=device)
        for row, items in enumerate(steps):
            for s, (index, value) in enumerate(items):
                values[row, s], where[row, s] = value, index
        totals = torch.tensor([float(r.get("step_reward_total") or 0.0) for r in inputs], device=device)
        gather = self.accelerator
        values = gather.gather(gather.pad_across_processes(values, dim=1, pad_index=torch.nan))
        where = gather.gather(gather.pad_across_processes(where, dim=1, pad_index=-1))
        totals = gather.gather(totals)
        advantages = prefix_credited_advantages(
            rewards, totals, values, where, self.num_generations, width, self.algorithm
        )
        return advantages[start : start + local].to(output["advantages"].dtype)

    def _loss_mask(self, output) -> torch.Tensor:
        mask = output["completion_mask"]
        return mask * output["tool_mask"] if "tool_mask" in output else mask

    # -- DAPO's dynamic sampling ---------------------------------------------------------------------------
    def _drop_uniform_groups(self, output, rewards: torch.Tensor, start: int) -> None:
        """Zero the loss mask of this rank's rows whose group (over the whole batch) has all-equal rewards.

        Under the token-level loss the dropped rows then leave the denominator (``num_items_in_batch``,
        recounted across ranks) as well as the numerator: the step is the loss of the remaining groups only.
        """
        local = output["completion_ids"].shape[0]
        dropped = uniform_groups(rewards, self.num_generations)
        keep = (~dropped).repeat_interleave(self.num_generations)[start : start + local]
        mask = output.get("tool_mask", torch.ones_like(output["completion_mask"]))
        output["tool_mask"] = mask * keep.to(mask.device, mask.dtype).unsqueeze(1)
        output["num_items_in_batch"] = self.accelerator.gather(self._loss_mask(output).sum()).sum()
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["algorithm/groups_dropped"].append(float(dropped.sum().item()))

    # -- the loss --------------------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        """TRL's loss, its log-probs computed at the loss mask's positions only (the others read 0 in every
        log-prob the loss compares: its own, old policy, reference, sampling)."""
        if not self.compact_head:
            return self._algorithm_loss(model, inputs)
        mask = self._loss_mask(inputs).bool()
        inputs = dict(inputs)
        for key in ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps"):
            if isinstance(inputs.get(key), torch.Tensor) and inputs[key].shape == mask.shape:
                inputs[key] = inputs[key] * mask
        self._scored_positions = mask
        try:
            return self._algorithm_loss(model, inputs)
        finally:
            self._scored_positions = None

    # -- REINFORCE++ ---------------------------------------------------------------------------------------
    def _algorithm_loss(self, model, inputs):
        if not (self.spec.kl_in_reward and self.beta != 0.0):
            return super()._compute_loss(model, inputs)
        # REINFORCE++: the KL already is in the rewards (see _reinforce_pp_advantages), not in the loss. TRL
        # keeps beta for the reference log-probs it computes at generation time; the loss runs without it.
        beta, self.beta = self.beta, 0.0
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self.beta = beta

    def _reinforce_pp_advantages(
        self, output, rewards: torch.Tensor, steps: StepRewards | None = None
    ) -> dict[str, torch.Tensor]:
        """Token advantages of REINFORCE++: ``r_t = -β·(log π_old(y_t) - log π_ref(y_t))`` on every policy
        token (the k1 estimate of KL(π_old ‖ π_ref)), plus the outcome reward on the last one (step rewards on
        their ``</search>`` tokens); returns-to-go over policy tokens, normalised over the whole batch's."""
        mask = self._loss_mask(output)
        scorable = ~torch.isnan(rewards.to(mask.device))
        mask = mask * scorable.unsqueeze(1).to(mask.dtype)  # unscorable rows: advantage 0, outside the stats
        token_rewards = self._token_rewards(output, rewards, mask, steps)
        mode = "train" if self.model.training else "eval"
        if self.beta != 0.0:
            old = output.get("old_per_token_logps")
            if old is None:
                old = self._policy_logps(output)
            kl = (old - output["ref_per_token_logps"]).float() * mask
            token_rewards = token_rewards - self.beta * kl
            totals = self.accelerator.reduce(torch.stack([kl.sum(), mask.sum().float()]), reduction="sum")
            self._metrics[mode]["algorithm/kl_reward"].append((totals[0] / totals[1].clamp(min=1)).item())
        returns = returns_to_go(token_rewards, mask, self.gamma)
        return {"advantages": self._whiten_batch(returns, mask).to(output["advantages"].dtype)}

    @torch.no_grad()
    def _policy_logps(self, output) -> torch.Tensor:
        """Log-probs of the completion tokens under the policy that sampled them (no update yet this batch)."""
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        T = output["completion_ids"].shape[1]
        a = self.args
        size = a.per_device_train_batch_size if self.model.training else a.per_device_eval_batch_size
        return self._get_per_token_logps_and_entropies(self.model, ids, attention, T, batch_size=size)[0]

    def _whiten_batch(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``(x - mean) / (std + eps)`` with mean and (biased) std over the masked-in tokens of every rank."""
        m = mask.to(torch.float64)
        x64 = x.to(torch.float64)
        stats = torch.stack([(x64 * m).sum(), (x64 * x64 * m).sum(), m.sum()])
        total, squares, count = self.accelerator.reduce(stats, reduction="sum").unbind()
        count = count.clamp(min=1.0)
        mean = total / count
        std = (squares / count - mean**2).clamp(min=0.0).sqrt()
        return ((x64 - mean) / (std + EPS) * m).to(x.dtype)

    def _token_rewards(
        self, output, rewards: torch.Tensor, mask: torch.Tensor, steps: StepRewards | None = None
    ) -> torch.Tensor:
        """``(B, T)``: the outcome reward on each row's last policy token and the rollout's step rewards
        (``steps``: per row, ``[(token index, value), ...]``, the rollout's ``step_rewards`` field) on their
        ``</search>`` tokens (the reward function added their sum to the outcome: taken back off)."""
        rewards = rewards.to(mask.device).float().clone()
        steps = steps or []
        placed = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        if len(steps) == len(rewards):
            for row, items in enumerate(steps):
                for index, value in items:
                    if index < placed.shape[1] and mask[row, index]:
                        placed[row, index] += value
                        rewards[row] -= value
        return outcome_token_rewards(rewards, mask) + placed

    # -- PPO -----------------------------------------------------------------------------------------------
    def _critic_inputs(self, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        return input_ids, attention, mask

    def _ppo_advantages(
        self, output, rewards: torch.Tensor, steps: StepRewards | None = None
    ) -> dict[str, torch.Tensor]:
        """GAE with the critic's values. The values before the critic's first step are what that step's own
        forward computes (dropout is off), so the first critic epoch also gives GAE its values: one critic
        forward over the batch less than a separate values pass."""
        input_ids, attention, mask = self._critic_inputs(output)
        T = output["completion_ids"].shape[1]
        token_rewards = self._token_rewards(output, rewards, mask, steps)
        self.critic.train()
        values, first = self._critic_epoch(input_ids, attention, mask, T, token_rewards=token_rewards)
        advantages, returns = gae(token_rewards, values, mask, self.gamma, self.lam)
        advantages = whiten(advantages, mask)
        stats = self._update_critic(
            input_ids, attention, mask, values, returns, T, epochs=self.critic_epochs - 1, losses=[first]
        )
        mode = "train" if self.model.training else "eval"
        for name, value in stats.items():
            self._metrics[mode][name].append(value)
        return {"advantages": advantages.to(output["advantages"].dtype)}

    def _critic_chunks(self, attention: torch.Tensor) -> list[torch.Tensor]:
        """Row indices in chunks of at most ``critic_micro_batch`` rows (one chunk when unset), the rows
        sorted by length so that each chunk pads to a similar width."""
        n = attention.shape[0]
        order = torch.sort(attention.sum(1).cpu(), stable=True).indices
        size = self.critic_micro_batch or max(n, 1)
        return [order[i : i + size] for i in range(0, n, size)]

    def _critic_values(self, input_ids, attention, rows, T) -> torch.Tensor:
        """The critic's ``(len(rows), T)`` values of ``rows``, computed without the columns none of them uses
        (left padding of the prompts, right padding of the completions; those positions read 0)."""
        ids, att = input_ids[rows], attention[rows]
        used = att.any(0).nonzero()
        first = int(used[0]) if len(used) else 0
        end = max(int(used[-1]) + 1 if len(used) else 0, att.shape[1] - T + 1, first + 2)
        kept = T - (att.shape[1] - end)  # completion columns left
        with self._update_precision():
            values = self.critic(ids[:, first:end], att[:, first:end], kept)
        return torch.nn.functional.pad(values, (0, T - kept))

    def _critic_epoch(self, input_ids, attention, mask, T, old_values=None, returns=None, token_rewards=None):
        """One critic optimizer step on the clipped value loss, gradient accumulated over chunks: each chunk's
        masked mean weighted by its share of the masked tokens, so the summed gradient is the whole batch's.
        Without ``old_values``, each chunk's own values are the old ones and its returns GAE's over
        ``token_rewards``. Returns the values the step started from (detached) and the loss."""
        self.critic_optimizer.zero_grad(set_to_none=True)
        total = mask.sum().clamp(min=1)
        started = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        loss_value = 0.0
        for rows in self._critic_chunks(attention):
            values = self._critic_values(input_ids, attention, rows, T)
            started[rows] = values.detach()
            if old_values is None:  # the first step: the values it starts from are the old ones
                old = values.detach()
                ret = gae(token_rewards[rows], old, mask[rows], self.gamma, self.lam)[1]
            else:
                old, ret = old_values[rows], returns[rows]
            loss = value_loss(values, old, ret, mask[rows], self.value_clip) * mask[rows].sum() / total
            loss.backward()
            loss_value += loss.item()
        self._average_critic_grads()
        torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.args.max_grad_norm)
        self.critic_optimizer.step()
        return started, loss_value

    def _update_critic(
        self, input_ids, attention, mask, old_values, returns, T, epochs=None, losses=None
    ) -> dict[str, float]:
        """``epochs`` (default ``critic_epochs``) critic steps against ``old_values`` and ``returns``; the
        stats over those and the ``losses`` of steps already taken."""
        self.critic.train()
        losses = list(losses or [])
        for _ in range(self.critic_epochs if epochs is None else epochs):
            losses.append(self._critic_epoch(input_ids, attention, mask, T, old_values, returns)[1])
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

"""The agent loop as TRL ``GRPOTrainer``'s ``rollout_func``: what only training needs of a rollout.

:class:`TRLRollout` wraps a :class:`zerosim.agent.rollout.SearchRollout` (the loop, which knows no trainer) and
owns TRL's side of it:

- TRL's signature ``rollout_func(prompts, trainer)``: the policy as TRL holds it (ZeRO-3 shards gathered
  once for the whole rollout, or TRL's vLLM engine), this rank's slice of the global batch, the step;
- the output TRL trains on, one entry per completion: ``prompt_ids``, ``completion_ids``, ``logprobs``,
  ``env_mask`` (TRL's ``tool_mask``: 0 on the tokens the environment inserted), and the extra fields TRL
  hands the reward functions as keyword arguments — among them ``step_rewards``, each completion's
  ``[(token index, value), ...]`` of per-search rewards on the token that closed its ``</search>``, which
  :class:`zerosim.training.trainer.SearchTrainer` reads back from the same rows to place them;
- the rollout's metrics (:meth:`SearchRollout.metrics`), sent to one sink, ``log_metric(name, value)``:
  given at construction, or TRL's metric hook bound once with :meth:`bind` (averaged over the logging step
  and across ranks, like the reward functions' metrics);
- a few trajectories every ``sample_every`` steps kept in :attr:`samples` (the MLflow artifact).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

from trl.models import unwrap_model_for_generation

from zerosim.agent.rollout import SearchRollout, Trajectory, stop_strings, synced_decoding
from zerosim.core.distributed import TurnSync
from zerosim.core.generation import VLLMGenerator
from zerosim.core.metrics import normalize_answer

MetricSink = Callable[[str, float], None]


class TRLRollout:
    """TRL's ``rollout_func`` over ``loop``; the rollout's metrics go to ``log_metric`` (or, unset, to the
    trainer given to :meth:`bind`)."""

    def __init__(
        self,
        loop: SearchRollout,
        *,
        log_metric: MetricSink | None = None,
        num_samples: int = 4,
        sample_every: int = 1,
        answer_window: int = 16,
    ):
        self.loop = loop
        self.searches = 0  # searches this rank's rollouts made (the run's search ledger)
        self.log_metric = log_metric
        self.num_samples = num_samples
        self.sample_every = max(1, sample_every)
        self.samples: list[dict[str, Any]] = []  # a few trajectories per step, for the MLflow artifact
        # each recent question's most common answer (normalised): collapse/top_answer_share reads them
        self.recent_answers: deque[str] = deque(maxlen=max(1, answer_window))

    def bind(self, trainer) -> TRLRollout:
        """Send the rollout's metrics to ``trainer``'s metric hook (TRL's ``log_metric``, the one reward
        functions get); the trainer is built after its ``rollout_func``. Returns ``self``."""
        self.log_metric = trainer._log_metric
        return self

    def __call__(self, prompts: list[Any], trainer) -> dict[str, list]:
        if self.log_metric is None:
            raise RuntimeError(
                "TRLRollout has no metric sink: call rollout.bind(trainer) once the trainer is built (as "
                "zerosim.training.recipe does), or pass log_metric=... to TRLRollout"
            )
        loop = self.loop
        step = int(trainer.state.global_step)
        sync = TurnSync(trainer.accelerator)
        offset = sync.process_index * len(prompts)  # TRL hands every rank an equal slice, in rank order
        if getattr(trainer, "use_vllm", False):
            context = nullcontext(None)  # TRL synced the vLLM weights before calling us
        else:
            # ZeRO-3: gather the shards once for the whole rollout (TRL's ds3_gather_for_generation)
            context = unwrap_model_for_generation(
                trainer.model_wrapped,
                trainer.accelerator,
                gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            )
        with context as model:
            if model is None:
                generator = VLLMGenerator(
                    trainer.vllm_generation,
                    loop.tokenizer,
                    stop_strings=stop_strings(loop.config),
                    eos_token_ids=loop.eos_ids,
                )
            else:
                generator = loop.generator_for(model, collective=synced_decoding(model, sync))
            trajectories, timing = loop.run(generator, prompts, step, sync=sync, offset=offset)
        self.searches += sum(t.searches for t in trajectories)
        for name, value in loop.metrics(trajectories, step, timing).items():
            self.log_metric(name, value)
        for name, value in answer_signals(trajectories, self.recent_answers).items():
            self.log_metric(name, value)
        self._keep_samples(trajectories, step)
        return {
            "prompt_ids": [t.prompt_ids for t in trajectories],
            "completion_ids": [t.completion_ids for t in trajectories],
            "logprobs": [t.logprobs for t in trajectories],
            "env_mask": [t.env_mask for t in trajectories],
            "final_answer": [t.answer for t in trajectories],
            "num_searches": [t.searches for t in trajectories],
            "valid_format": [t.valid_format for t in trajectories],
            "step_reward_total": [sum(t.step_rewards) for t in trajectories],
            # per completion, [(index of the token that closed a </search>, its step reward), ...]: placed on
            # those tokens by SearchTrainer's token-level algorithms (reinforce_pp, ppo)
            "step_rewards": [t.step_reward_positions for t in trajectories],
            # mixed: each trajectory's source group, for the reward by source (train.instrumented)
            **({"search_source": [t.source_group for t in trajectories]} if loop.source is not None else {}),
        }

    def _keep_samples(self, trajectories: Sequence[Trajectory], step: int) -> None:
        if step % self.sample_every:
            return
        for traj in trajectories[: self.num_samples]:
            self.samples.append(
                {
                    "step": step,
                    "question": traj.question,
                    "golden_answers": list(traj.answers),
                    "completion": self.loop.tokenizer.decode(traj.completion_ids, skip_special_tokens=False),
                    "answer": traj.answer,
                    "finish": traj.finish,
                    "searches": traj.events,
                    "policy_tokens": sum(traj.env_mask),
                    "environment_tokens": len(traj.env_mask) - sum(traj.env_mask),
                }
            )


def answer_signals(trajectories: Sequence[Trajectory], recent: deque[str]) -> dict[str, float]:
    """Signs of a policy falling onto one answer, from a step's trajectories (answers normalised as EM reads
    them; a trajectory without an answer counts in none):

    - ``collapse/step_top_answer_share``: the share of the step's answers that are its most common one;
    - ``collapse/distinct_answers``: distinct answers per question (its group), averaged — 1 when every group
      agrees with itself, which a confident policy also does;
    - ``collapse/top_answer_share``: over the last ``recent.maxlen`` questions (each counted once, by its
      group's most common answer), the share given the most common one — one answer across *different*
      questions, which only a collapse does. Logged once ``recent`` is full (a short window reads high by
      chance); ``recent`` is updated in place.
    """
    groups: dict[str, list[str]] = {}
    for t in trajectories:
        answers = groups.setdefault(t.question, [])
        answer = normalize_answer(t.answer) if t.answer is not None else ""
        if answer:
            answers.append(answer)
    answered = [a for answers in groups.values() for a in answers]
    out: dict[str, float] = {}
    if answered:
        out["collapse/step_top_answer_share"] = Counter(answered).most_common(1)[0][1] / len(answered)
    if groups:
        out["collapse/distinct_answers"] = sum(len(set(a)) for a in groups.values()) / len(groups)
    for answers in groups.values():
        if answers:
            recent.append(Counter(answers).most_common(1)[0][0])
    if recent.maxlen is not None and len(recent) == recent.maxlen:
        out["collapse/top_answer_share"] = Counter(recent).most_common(1)[0][1] / len(recent)
    return out

"""The RL recipe: a search-agent policy trained with TRL's GRPOTrainer over our multi-turn rollout.

Read top to bottom: config → data → policy → search engine → curriculum → rollout → trainer → MLflow.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from curricula import CurriculumNoise, curriculum_schedule, find_mixed
from zerosim.agent.rewards import build_judge, make_reward_func
from zerosim.agent.rollout import SearchRollout, build_prompt
from zerosim.core.config import ConfigError
from zerosim.core.data.embedded import load_questions
from zerosim.core.distributed import broadcast_object, process_state, shared_atomic_directory
from zerosim.core.fsutil import atomic_directory, atomic_write_text, check_output_folder, named_write_fault
from zerosim.core.models import load_causal_lm, load_tokenizer
from zerosim.core.signals import Terminated, graceful, stop_reason, stop_requested
from zerosim.core.tracking import (
    log_config,
    log_jsonl,
    log_model,
    log_training_curves,
    mlflow_run,
    trainer_mlflow_callback,
)
from zerosim.engines import build_search_engine, curriculum_adds_noise, page_grouping
from zerosim.training.algorithms import algorithm_args, spec_of
from zerosim.training.checkpoint import (  # noqa: F401 (STATE_FILE, last_complete_checkpoint: public here too)
    RUN_FILE,
    STATE_FILE,
    ZerosimState,
    bound_config,
    discard_after,
    last_complete_checkpoint,
    resume_point,
    resumed_changes,
)
from zerosim.training.config import TrainConfig
from zerosim.training.guard import CollapseGuard
from zerosim.training.speedups import cpu_autocast_bf16, machine_line
from zerosim.training.stopping import StopControl
from zerosim.training.trainer import Critic, SearchTrainer
from zerosim.training.trl_rollout import TRLRollout
from zerosim.training.vllm_modes import require_vllm  # no CUDA, no vLLM, no server: refused

MERGED_DIR = "merged"  # policy.lora.merge_final: <run>/merged, the final adapter merged into its base


@dataclass
class TrainResult:
    run_id: str
    checkpoint: Path | None
    steps: int
    validation: list[dict[str, float]] = field(default_factory=list)  # one entry per validation pass


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def training_questions(cfg: TrainConfig) -> list:
    """The training questions: ``data.train`` (split ``data.split``), or a seeded draw of ``data.max_examples``."""
    examples = load_questions(cfg.data.train, cfg.data.split)
    if cfg.data.max_examples is not None:
        rng = random.Random(cfg.run.seed)
        examples = rng.sample(examples, min(cfg.data.max_examples, len(examples)))
    if not examples:
        raise ValueError(f"no training questions in {cfg.data.train} (split {cfg.data.split})")
    return examples


def build_dataset(examples: list):
    """The training prompts of ``examples`` as a ``datasets.Dataset`` plus the prompt → (question, answers) table.

    TRL hands the rollout only the prompt text, so rows whose questions read the same are one task: each gets
    the union of their gold answers (in order of first appearance), in the dataset column the reward reads
    and in the table the rollout (and the simulator) reads — the two never disagree.
    """
    from datasets import Dataset

    answers: dict[str, list[str]] = {}
    questions: dict[str, str] = {}
    for ex in examples:
        prompt = build_prompt(ex.question)
        questions.setdefault(prompt, ex.question)
        known = answers.setdefault(prompt, [])
        known += [a for a in ex.golden_answers if a not in known]
    prompts = [build_prompt(ex.question) for ex in examples]
    # the question too: the LLM judge reward (reward.metric=judge) asks about it
    rows = [{"prompt": p, "question": questions[p], "golden_answers": list(answers[p])} for p in prompts]
    table = {p: (questions[p], tuple(answers[p])) for p in answers}
    return Dataset.from_list(rows), table


def grpo_args(cfg: TrainConfig, output_dir: Path):
    from trl import GRPOConfig

    t = cfg.trainer
    on_gpu = torch.cuda.is_available()
    return GRPOConfig(
        output_dir=str(output_dir),
        run_name=cfg.run.name,
        seed=cfg.run.seed,
        max_steps=t.max_steps,
        learning_rate=t.learning_rate,
        # transformers' "constant" ignores warm-up; "constant_with_warmup" is the same curve when it is 0
        lr_scheduler_type="constant_with_warmup" if t.lr_scheduler == "constant" else t.lr_scheduler,
        warmup_steps=t.warmup_ratio,  # transformers reads a value below 1 as a share of max_steps
        per_device_train_batch_size=t.per_device_train_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        num_generations=t.num_generations,
        beta=t.beta,
        epsilon=t.epsilon,
        **algorithm_args(
            t.algorithm, t.epsilon_high
        ),  # loss type, reward scaling, upper clip: what the name means
        max_grad_norm=t.max_grad_norm,
        temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
        max_completion_length=cfg.rollout.max_completion_tokens,
        logging_steps=t.logging_steps,
        save_strategy="steps" if t.save_steps > 0 else "no",
        save_steps=max(t.save_steps, 1),
        save_total_limit=None,  # ZerosimState rotates, once a new checkpoint is complete (t.save_total_limit)
        save_only_model=False,  # optimizer, scheduler and RNG states too: what a resume needs
        report_to=[],  # MLflow: train() adds tracking.trainer_mlflow_callback (each metric once per step)
        use_cpu=not on_gpu,
        bf16=on_gpu and t.bf16 is not False,  # on CPU: SearchTrainer's own autocast (update_bf16)
        gradient_checkpointing=t.gradient_checkpointing,  # the memory plan: zerosim/training/memory.py
        dataloader_num_workers=0,
        disable_tqdm=False,
        **vllm_args(cfg),
    )


def vllm_args(cfg: TrainConfig) -> dict[str, Any]:
    """``GRPOConfig`` fields for ``trainer.generation`` (none for hf): TRL runs vLLM and syncs its weights."""
    from zerosim.agent.rollout import stop_strings

    t = cfg.trainer
    if t.generation == "hf":
        return {}
    r = cfg.rollout
    return {
        "use_vllm": True,
        "vllm_mode": "colocate" if t.generation == "vllm_colocate" else "server",
        "vllm_server_base_url": t.vllm_server_url,
        "vllm_gpu_memory_utilization": t.vllm_gpu_memory_utilization,
        "vllm_tensor_parallel_size": t.vllm_tensor_parallel_size,
        # room for the longest prompt (~256 tokens of instruction + question) and the whole trajectory
        "vllm_max_model_length": t.vllm_max_model_length or r.max_completion_tokens + 512,
        # under tags each turn stops at the first </search> or </answer>, kept in the text like the HF path does
        "generation_kwargs": {"stop": list(stop_strings(r)), "include_stop_str_in_output": True},
        "top_p": r.top_p,
    }


def _reusable_warmstart(cfg: TrainConfig, output_dir: Path) -> bool:
    from zerosim.training.warmstart import warmstart_folder

    return cfg.warmstart.reuse and (output_dir / warmstart_folder(cfg) / "final" / "config.json").is_file()


def warmstart_checkpoint(cfg: TrainConfig, output_dir: Path) -> Path:
    """The cold-start SFT checkpoint for this run: reused when present (``warmstart.reuse``), else trained."""
    from zerosim.training.warmstart import run_warmstart, warmstart_folder

    target = output_dir / warmstart_folder(cfg) / "final"
    if _reusable_warmstart(cfg, output_dir):
        return target
    return run_warmstart(
        cfg.warmstart,
        policy=cfg.policy.model,
        seed=cfg.run.seed,
        tracking=cfg.tracking,
        output_dir=output_dir / warmstart_folder(cfg),
        rollout=cfg.rollout,
    )


RESULT_FILE = "result.json"  # <output_dir>/<name>/result.json: written last, by a job that trained to its end
# <output_dir>/<name>/stopped.json: {step, reason} of a job that stopped cleanly (SIGTERM, STOP) after saving a
# checkpoint; torchrun and `accelerate launch` exit 1 when their ranks exit 143, so this tells a stop from a failure
STOPPED_FILE = "stopped.json"


LEDGER_FILE = "search_ledger.rank{rank}.json"  # each rank's searches and paid engines' ledgers, at the end


def _write_search_ledger(job, rollout, engine) -> None:
    """This rank's count of searches and the ledgers of its paid engines (web search), beside the result;
    :func:`read_search_ledger` sums the ranks. A resumed run counts from its resume."""
    import json

    from zerosim.core.search import ledgers

    entry = {"searches": rollout.searches, "web": ledgers(engine)}
    name = LEDGER_FILE.format(rank=job.procs.process_index)
    atomic_write_text(job.output_dir / name, json.dumps(entry))


def read_search_ledger(output_dir: Path) -> dict[str, Any] | None:
    """The run's search ledger, its ranks summed: ``searches`` and one merged ledger per web provider; None when
    no rank wrote one (a run of an older version)."""
    import json

    files = sorted(Path(output_dir).glob(LEDGER_FILE.format(rank="*")))
    if not files:
        return None
    searches, web = 0, {}
    for path in files:
        entry = json.loads(path.read_text())
        searches += int(entry.get("searches", 0))
        for ledger in entry.get("web", []):
            merged = web.get(ledger["provider"])
            if merged is None:
                web[ledger["provider"]] = dict(ledger)
                continue
            for key in ("requests", "cache_hits", "empty", "fallback", "cost_usd"):
                merged[key] = merged.get(key, 0) + ledger.get(key, 0)
    return {"searches": searches, "web": list(web.values())}


def read_result(output_dir: Path) -> dict[str, Any] | None:
    """What a finished training job wrote (:data:`RESULT_FILE`: run id, steps, final model), or None."""
    import json

    path = Path(output_dir) / RESULT_FILE
    try:
        found = json.loads(path.read_text()) if path.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return found if isinstance(found, dict) else None


def step_weights(cfg: TrainConfig) -> tuple[float, float] | None:
    """(gain, redundancy) weights of the StepSearch-style step rewards, or None when both are 0."""
    r = cfg.reward
    if r.step_gain_weight == 0 and r.step_redundancy_weight == 0:
        return None
    return r.step_gain_weight, r.step_redundancy_weight


def instrumented(schedule, reward_func, procs=None):
    """``reward_func`` timed (``time/reward_s``) and, for schedules with ``observe`` (adaptive), reporting
    each step's mean reward to the schedule. Under ``search.engine=mixed`` (the rollout passes each
    trajectory's ``search_source`` group) it also logs ``mixed/<group>/reward``, the mean reward per group.

    The mean is the whole batch's: with several processes (``procs``, accelerate's ``PartialState``) each
    rank's reward sum and count are all-reduced, so every rank's schedule sees the same signal and holds the
    same ``p`` (the one checkpointed by rank 0). Every rank calls the reward function once per generation
    batch, so the all-reduce is entered by all of them together.
    """
    import math
    import time

    observe = getattr(schedule, "observe", None)

    def reward(*args, trainer_state=None, log_metric=None, **kwargs):
        started = time.perf_counter()
        rewards = reward_func(*args, log_metric=log_metric, **kwargs)  # the judge logs judge/* through it
        if log_metric is not None:
            log_metric("time/reward_s", time.perf_counter() - started)
            for name, value in reward_by_source(rewards, kwargs.get("search_source")).items():
                log_metric(name, value)
        if observe is not None and trainer_state is not None:
            scored = [float(r) for r in rewards if r is not None and math.isfinite(r)]
            total, count = sum(scored), float(len(scored))
            if procs is not None and procs.num_processes > 1:
                both = torch.tensor([total, count], dtype=torch.float64, device=procs.device)
                torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.SUM)
                total, count = both.tolist()
            if count:
                observe(int(trainer_state.global_step), total / count)
        return rewards

    reward.__name__ = reward_func.__name__
    return reward


def reward_by_source(rewards, groups) -> dict[str, float]:
    """``mixed/<group>/reward``: the mean reward of the trajectories of each source group present
    (``groups``: the rollout's ``search_source`` column; ``None`` outside ``search.engine=mixed``)."""
    import math

    if not groups:
        return {}
    by_group: dict[str, list[float]] = {}
    for reward, group in zip(rewards, groups, strict=True):
        if reward is not None and math.isfinite(reward):
            by_group.setdefault(group, []).append(float(reward))
    return {f"mixed/{g}/reward": sum(v) / len(v) for g, v in by_group.items()}


def closing(resources: ExitStack | None, thing):
    """``thing``, its ``close()`` (if it has one) called when ``resources`` closes."""
    close = getattr(thing, "close", None)
    if resources is not None and callable(close):
        resources.callback(close)
    return thing


def build_validation(cfg: TrainConfig, questions, engine, tokenizer, resources: ExitStack | None = None):
    """The :class:`zerosim.training.validation.Validation` callback for ``cfg.validation``; ``bind`` it to the trainer.
    An engine of its own (``validation.engine`` other than ``train``) is closed with ``resources``."""
    import dataclasses

    from eval.harness import answers_override
    from zerosim.training.validation import Validation, validation_examples

    v = cfg.validation
    examples = validation_examples(v, questions)
    if v.engine != "train":  # a separate engine, e.g. the real retriever beside a simulator used for training
        engine = closing(
            resources,
            build_search_engine(
                dataclasses.replace(cfg.search, engine=v.engine, negatives="none"),
                seed=cfg.run.seed,
                dtype=cfg.policy.dtype,
            ),
        )
    # the gold answers reach the simulator in training only, unless search.simulator.pass_answers=true
    answers_shown = answers_override(cfg.search, cfg.search.engine if v.engine == "train" else v.engine)
    if answers_shown:
        import mlflow

        if mlflow.active_run() is not None:
            mlflow.set_tag("zerosim.simulator_sees_answers", "validation")
    return Validation(
        v,
        examples,
        rollout=cfg.rollout,
        k=cfg.search.k,
        engine=engine,
        tokenizer=tokenizer,
        seed=cfg.run.seed,
        answers_shown=answers_shown,
        page_by=page_grouping(
            dataclasses.replace(cfg.search, engine=v.engine) if v.engine != "train" else cfg.search
        ),
    )


def train(cfg: TrainConfig) -> TrainResult:
    """Run one RL job end to end and return the MLflow run id and the final checkpoint. The search engines
    and the judge it opens (HTTP sessions, cache databases) are closed when it returns or fails."""
    with ExitStack() as resources:
        return _train(cfg, resources)


@dataclass
class _Job:
    """What the steps of :func:`_train` hand each other."""

    cfg: TrainConfig
    procs: Any  # accelerate's PartialState: one of several ranks under `accelerate launch`
    output_dir: Path
    checkpoint_in: Path | None  # the checkpoint a resumed run continues from
    run_id: str | None  # its MLflow run (the resumed one's, then this run's)
    policy_model: str = ""  # what the policy starts from: policy.model, or the warm start's checkpoint

    @property
    def main(self) -> bool:
        return self.procs.is_main_process


def _train(cfg: TrainConfig, resources: ExitStack) -> TrainResult:
    """The job's steps, in order: every check before any weight loads, then the search engine (a damaged index
    or a server that is down stops the job before the policy loads), the policy, the rollout, the trainer under
    one MLflow run, training, and what it leaves behind."""
    job = _checked_job(cfg, resources)
    questions = training_questions(cfg)
    dataset, examples = build_dataset(questions)
    engine = closing(
        resources,
        build_search_engine(
            cfg.search,
            seed=cfg.run.seed,
            dtype=cfg.policy.dtype,
            noise=curriculum_adds_noise(cfg.curriculum),
            total_steps=cfg.trainer.max_steps,  # engine=mixed: the real share's schedule length by default
        ),
    )
    job.policy_model = _policy_source(job)
    tokenizer = load_tokenizer(job.policy_model)
    # fp32 master weights; a LoRA base is frozen and may stay bf16 (its fp32 adapters are what steps)
    policy = load_causal_lm(job.policy_model, cfg.policy.dtype, trained=True, frozen=cfg.policy.lora.enabled)
    schedule = curriculum_schedule(cfg.curriculum, cfg.trainer.max_steps)
    rollout = _rollout(cfg, tokenizer, engine, examples, schedule)
    with _mlflow_run(job):
        guard = _guard(cfg)
        validation = None
        if cfg.validation.every:
            validation = build_validation(cfg, questions, engine, tokenizer, resources)
        trainer, state_callback = _trainer(
            job, policy, tokenizer, dataset, rollout, schedule, guard, validation, resources
        )
        _fit(job, trainer, state_callback)
        _after_training(job, trainer, rollout, guard, validation)
        checkpoint = _save_final(job, trainer, tokenizer, validation, guard)
        _write_search_ledger(job, rollout, engine)
        if job.main:  # last: its presence says the job trained to its end (an experiment's launcher reads it)
            import json

            done = {"run_id": job.run_id, "steps": trainer.state.global_step, "final": checkpoint is not None}
            atomic_write_text(job.output_dir / RESULT_FILE, json.dumps(done))
        return TrainResult(
            run_id=job.run_id,
            checkpoint=checkpoint,
            steps=trainer.state.global_step,
            validation=list(validation.history) if validation is not None else [],
        )


def _checked_job(cfg: TrainConfig, resources: ExitStack | None = None) -> _Job:
    """The process set up (threads, seeds) and everything checked that can be without loading a weight: vLLM,
    the output folder (held by this job from here, ``resources`` closing it: a second run into it is refused),
    the run a resume continues (its id and config), and what ``--dry-run`` checks (data files, paths, URLs).
    Then the machine line, which the times printed after are measured on."""
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is the documented path we build on
    require_vllm(cfg)
    from zerosim.core.runtime import apply_precision, apply_threads

    apply_threads(cfg.runtime.threads)  # this process's share of the cores, before any work
    apply_precision(cfg.runtime.bf16)  # bf16 compute on CPU where it multiplies bf16 in hardware
    procs = process_state()  # under `accelerate launch`: one of several ranks
    seed_everything(cfg.run.seed)
    output_dir = Path(cfg.run.output_dir) / cfg.run.name
    check_output_folder(output_dir, "run.output_dir")
    if procs.is_main_process and resources is not None:  # the ranks of one job share it; another job may not
        from zerosim.core.fsutil import folder_lock

        resources.enter_context(folder_lock(output_dir, "zerosim train"))
    # which run this job continues, if any: checked (run id, config) before any weight loads
    checkpoint_in, run_id = resume_point(cfg, output_dir, main=procs.is_main_process)
    from zerosim.training.dry_run import plan

    plan(cfg, procs.num_processes, resume=(checkpoint_in, run_id))
    if procs.is_main_process:
        print(machine_line(cfg), file=sys.stderr, flush=True)
    return _Job(cfg, procs, output_dir, checkpoint_in, run_id)


def _policy_source(job: _Job) -> str:
    """What the policy starts from: ``policy.model``, or the warm start's checkpoint (trained here when absent,
    with one process only: several would each train one)."""
    cfg = job.cfg
    if not cfg.warmstart.enabled:
        return cfg.policy.model
    if job.procs.num_processes > 1 and not _reusable_warmstart(cfg, job.output_dir):
        raise ConfigError(
            "warmstart.enabled with several processes: run the warm start once first "
            "(`zerosim policy warmstart --config RECIPE`, one process), then launch training — it reuses "
            f"{job.output_dir / 'warmstart' / 'final'}"
        )
    return str(warmstart_checkpoint(cfg, job.output_dir))


def _rollout(cfg: TrainConfig, tokenizer, engine, examples, schedule) -> TRLRollout:
    """The multi-turn search rollout (the curriculum's noise draws, ``search.engine=mixed``'s source draws, the
    step rewards) as TRL's ``rollout_func``: its metrics go to the trainer's metric hook (bound later)."""
    c = cfg.curriculum
    mixed = find_mixed(engine)  # search.engine=mixed: the rollout draws each search's source
    loop = SearchRollout(
        tokenizer,
        engine,
        config=cfg.rollout,
        k=cfg.search.k,
        examples=examples,
        noise=CurriculumNoise(schedule, seed=cfg.run.seed, k=cfg.search.k, granularity=c.granularity),
        source=None if mixed is None else mixed.draw_source,
        step_metrics=lambda step: {
            "curriculum/noise_prob": schedule.probability(step),
            **({} if mixed is None else {"mixed/real_share": mixed.real_share(step)}),
        },
        step_rewards=step_weights(cfg),
        page_by=page_grouping(cfg.search),
    )
    return TRLRollout(
        loop,
        num_samples=cfg.tracking.num_sample_trajectories,
        sample_every=cfg.tracking.sample_every,
        answer_window=cfg.trainer.collapse_window,
    )


@contextmanager
def _mlflow_run(job: _Job) -> Iterator[None]:
    """One MLflow run per job, owned by the main process (TRL's callback logs from it only): a new one logs the
    config and writes the run file; a resumed one is tagged with where it resumed and what changed. Every rank
    leaves with ``job.run_id`` set."""
    cfg, main = job.cfg, job.main
    tags = {
        "zerosim.job": "train",
        "zerosim.policy_init": job.policy_model,
        "zerosim.processes": str(job.procs.num_processes),
        "zerosim.threads": str(torch.get_num_threads()),  # what this process computes with (runtime.threads)
    }
    tracking = mlflow_run(cfg.tracking, cfg.run.name, tags=tags, run_id=job.run_id) if main else nullcontext()
    with tracking as run:
        job.run_id = broadcast_object(run.info.run_id if main else None, job.procs)
        if main and job.checkpoint_in is None:
            import json

            log_config(cfg)
            atomic_write_text(job.output_dir / RUN_FILE, json.dumps({"run_id": run.info.run_id}))
        elif main:
            import mlflow

            mlflow.set_tag("zerosim.resumed_from", str(job.checkpoint_in.resolve()))
            discard_after(job.checkpoint_in)  # the killed attempt's later, incomplete saves
            changed = resumed_changes(cfg, mlflow.get_run(job.run_id).data.params)
            if changed:  # the params keep the first values (MLflow never changes one)
                mlflow.set_tag("zerosim.resumed_with", " ".join(f"{k}={v}" for k, v in changed.items()))
        yield


def _reward_funcs(cfg: TrainConfig, schedule, procs, resources: ExitStack) -> list:
    """The one reward function TRL calls: ``reward.*`` (the judge's server checked here), timed, feeding an
    adaptive curriculum."""
    reward = make_reward_func(
        cfg.reward.metric,
        cfg.reward.format_weight,
        step_rewards=step_weights(cfg) is not None,
        weights=dict(cfg.reward.weights) if cfg.reward.weights else None,
        judge=closing(resources, build_judge(cfg.reward)),  # reward.metric=judge: its server checked here
    )
    return [instrumented(schedule, reward, procs)]


def _trainer(job: _Job, policy, tokenizer, dataset, rollout, schedule, guard, validation, resources):
    """The :class:`SearchTrainer` with its callbacks (checkpoint state, collapse guard, MLflow, SIGTERM,
    validation), the critic its algorithm may need, and everything bound to it; a resumed run's state loaded.
    Returns the trainer and its state callback."""
    cfg, t = job.cfg, job.cfg.trainer
    state_callback = ZerosimState(
        schedule,
        run_id=job.run_id,
        config=bound_config(cfg),
        keep=t.save_total_limit,
        rollout=rollout,
        validation=validation,
        guard=guard,
    )
    # transformers' MLflow logging, synchronous and once per (metric, step), also across a resume; the guard
    # after validation, so that it reads each pass at the weights that pass scored
    stop = StopControl(job.output_dir, main=job.main)
    callbacks = [state_callback, trainer_mlflow_callback(), stop]
    if validation is not None:
        callbacks.append(validation)
    callbacks.append(guard)
    critic = None
    if spec_of(t.algorithm).needs_critic:
        # a LoRA policy's bf16 base says nothing of the critic, which trains every weight: fp32 then
        dtype = "auto" if cfg.policy.lora.enabled else cfg.policy.dtype
        critic = Critic.from_pretrained(t.critic_model or job.policy_model, dtype)
        if t.gradient_checkpointing:  # the critic's own backward, as the policy's
            critic.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer = SearchTrainer(
        algorithm=t.algorithm,
        critic=critic,
        critic_learning_rate=t.critic_learning_rate,
        gamma=t.gamma,
        lam=t.lam,
        value_clip=t.value_clip,
        critic_epochs=t.critic_epochs,
        critic_micro_batch=t.per_device_train_batch_size,
        # auto: not with a KL term (each batch is used once here: no old log-probs to compare either)
        update_bf16=cpu_autocast_bf16(t.bf16, compares_passes=t.beta != 0),
        dynamic_sampling=t.dynamic_sampling,
        # without step rewards, prefix credit is the algorithm's own advantage: TRL's (B,) one is kept
        step_credit=str(cfg.reward.step_credit) if step_weights(cfg) is not None else "sequence",
        model=policy,
        reward_funcs=_reward_funcs(cfg, schedule, job.procs, resources),
        args=grpo_args(cfg, job.output_dir),
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout,
        callbacks=callbacks,
        # policy.lora: TRL wraps the policy (peft) and scores the reference with the adapters disabled
        peft_config=cfg.policy.lora.peft_config() if cfg.policy.lora.enabled else None,
    )
    if cfg.policy.lora.enabled:  # the adapter names its base as this job's config does, not a cache path
        trainer.model.peft_config["default"].base_model_name_or_path = _named_base(job.policy_model)
    # the callbacks and the rollout exist before the trainer; each that needs it gets it here, before training
    state_callback.bind(trainer)
    rollout.bind(trainer)
    if validation is not None:
        validation.bind(trainer)
    guard.bind(trainer, job.output_dir, validation=validation, tokenizer=tokenizer)
    if job.checkpoint_in is not None:
        state_callback.load(job.checkpoint_in)
    return trainer, state_callback


def _named_base(model: str) -> str:
    """How an adapter names the model it sits on: an existing folder by its absolute path, else as given (an
    HF id, ``smollm2``), which :func:`~zerosim.core.models.resolve_model` resolves where the adapter loads."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def _fit(job: _Job, trainer: SearchTrainer, state_callback: ZerosimState) -> None:
    """``trainer.train()``, resumed where the job continues one. A full disk is named in one line; a SIGTERM
    finishes the step, saves a checkpoint, then stops (:mod:`zerosim.core.signals`) and raises ``Terminated``."""
    full = named_write_fault(
        job.output_dir,
        "saving a checkpoint",
        "then run again with resume=true (run.output_dir may point at another disk once the run folder is moved "
        "there): it continues from the last complete checkpoint, or says to start afresh if none is",
    )
    resume = str(job.checkpoint_in) if job.checkpoint_in is not None else None
    stopped = job.output_dir / STOPPED_FILE
    if job.main:
        stopped.unlink(missing_ok=True)  # an earlier attempt's
    with graceful(), full:
        trainer.train(resume_from_checkpoint=resume)
        if stop_requested():
            step = trainer.state.global_step
            if (
                job.main
            ):  # a launcher reports 1 for ranks that exit 143: this file says the job stopped cleanly
                atomic_write_text(stopped, json.dumps({"step": step, "reason": stop_reason()}))
            raise Terminated(
                f"stopped by {stop_reason()} after step {step}, checkpoint saved in "
                f"{job.output_dir}: run again with run.resume=true to continue"
            )


def _after_training(job: _Job, trainer, rollout, guard: CollapseGuard, validation) -> None:
    """What the main process logs once training ends: a collapse, the sample trajectories, the training and
    validation curves."""
    if not job.main:
        return
    import mlflow

    if guard.collapsed_at is not None:
        mlflow.set_tag("zerosim.collapsed_at_step", str(guard.collapsed_at))
        mlflow.set_tag("zerosim.collapse_events", "; ".join(e.line() for e in guard.events))
        if guard.events[-1].action == "stop":
            import logging

            logging.getLogger(__name__).warning(
                "stopped at step %d: %s. Lower trainer.learning_rate, add trainer.beta, or resume from an "
                "earlier checkpoint.",
                guard.events[-1].step,
                guard.events[-1].detail,
            )
    log_jsonl(rollout.samples, "samples/trajectories.jsonl")
    log_training_curves(trainer.state.log_history)
    if validation is not None and validation.history:
        from zerosim.training.validation import PLOTTED as VALIDATION_PLOTTED

        log_training_curves(validation.history, "plots/validation.png", VALIDATION_PLOTTED)
        log_jsonl(validation.last_rows, "samples/validation.jsonl")


def _save_final(
    job: _Job, trainer: SearchTrainer, tokenizer, validation, guard: CollapseGuard
) -> Path | None:
    """``trainer.save_final``: the policy (and tokenizer) in ``<run>/final``, written whole or not at all, the
    critic beside it; its path in MLflow, and the model itself with ``tracking.log_model``."""
    if not job.cfg.trainer.save_final:
        return None
    main = job.main
    checkpoint = job.output_dir / "final"
    best = guard.best_dir if job.cfg.trainer.final_policy == "best" else None
    with shared_atomic_directory(checkpoint, job.procs) as tmp:
        if best is not None:  # the best validated policy, as the guard kept it (model and tokenizer)
            if main:
                for item in best.iterdir():
                    shutil.copy2(item, tmp / item.name)
        else:
            trainer.save_model(str(tmp))  # every rank: ZeRO-3 / FSDP gather the shards; the main one writes
            if main:
                tokenizer.save_pretrained(str(tmp))
    if job.cfg.policy.lora.enabled and job.cfg.policy.lora.merge_final and main:
        save_merged(checkpoint, job.output_dir / MERGED_DIR)
    if trainer.critic is not None and main:  # the critic copies are identical (averaged gradients)
        with atomic_directory(job.output_dir / "critic") as tmp:
            trainer.save_critic(tmp)
    if main:
        import mlflow

        mlflow.set_tag("zerosim.checkpoint", str(checkpoint.resolve()))
        if best is not None:
            mlflow.set_tag(
                "zerosim.final_policy", f"best: step {guard.best_step}, val/em {guard.best_em:.4f}"
            )
        else:
            mlflow.set_tag("zerosim.final_policy", f"last: step {trainer.state.global_step}")
        mlflow.log_param("checkpoint_path", str(checkpoint.resolve()))
        if job.cfg.tracking.log_model:  # the final policy as the run's model; validation's table linked
            table = "samples/validation.jsonl" if validation is not None and validation.history else None
            logged = (
                job.output_dir / MERGED_DIR if job.cfg.policy.lora.enabled else checkpoint
            )  # a full model
            log_model(logged, name="policy", validation_table=table)
    return checkpoint


def save_merged(adapter: Path, out: Path) -> Path:
    """An adapter folder merged into its base, saved whole or not at all as a full model with the adapter's
    tokenizer (``policy.lora.merge_final``, ``zerosim policy merge``); loaded afresh, so a model in training
    keeps its adapters."""
    merged = load_causal_lm(
        str(adapter), "float32", device="cpu"
    )  # fp32: a bf16 merge would round the adapters away
    with atomic_directory(out) as tmp:
        merged.save_pretrained(str(tmp))
        load_tokenizer(str(adapter)).save_pretrained(str(tmp))
    return out


def _guard(cfg: TrainConfig) -> CollapseGuard:
    """The collapse guard of ``trainer.collapse_*`` and ``trainer.final_policy`` (:mod:`zerosim.training.guard`)."""
    t = cfg.trainer
    return CollapseGuard(
        t.collapse_patience,
        answer_share=t.collapse_answer_share,
        val_drop=t.collapse_val_drop,
        action=str(t.collapse_action),
        lr_factor=t.collapse_lr_factor,
        keep_best=t.final_policy == "best",
    )

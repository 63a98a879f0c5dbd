"""``zerosim train --dry-run``: resolve a recipe and print the plan, without loading any weights.

What a user wants to see before spending GPU hours: which model each part runs (and whether it is here),
the data, the search backend and its servers, the batch arithmetic across processes, the curriculum's
probabilities over the run, the algorithm, the generation backend, where results go. Anything that would
fail at start-up and can be checked without weights (a missing local path, an unknown embedded split, a
malformed URL, a malformed / non-UTF-8 / empty data file, a missing corpus or prompts file) fails here
with the same error. Every value was range-checked when the config loaded (each field's ``ranged`` range).
"""

from __future__ import annotations

import os
from pathlib import Path

from curricula import curriculum_schedule, describe_curve
from zerosim.core.config import EMBEDDED_DATA, ConfigError, check_url
from zerosim.core.fsutil import check_output_folder
from zerosim.core.http.retry import RetryPolicy
from zerosim.core.models import describe_model
from zerosim.core.tracking import check_tracking_uri
from zerosim.engines import EngineName, check_noise_config, describe_rerank, preflight
from zerosim.training.config import TrainConfig
from zerosim.training.vllm_modes import planned_generation


def _data(source: str, split: str, key: str, use: int | None = None) -> str:
    """Read every row of a local QA file as training will (a malformed, non-UTF-8 or empty file raises
    :class:`DataError` naming file and line); the embedded factbook is checked by split, a hub id by name."""
    from zerosim.core.data.embedded import load_questions
    from zerosim.core.data.qa import DataError
    from zerosim.core.data.spec import parse_qa_spec

    def count(n: int) -> str:
        return f"{n} questions" + (f", {min(use, n)} drawn (seeded)" if use is not None and use < n else "")

    if source == EMBEDDED_DATA:
        try:
            return f"factbook {split} ({count(len(load_questions(source, split)))}, embedded)"
        except DataError as exc:
            raise DataError(f"{key}: {exc}") from None
    try:
        spec = parse_qa_spec(source, split)  # a FlashRAG folder's DIR:nq:test resolves to its file here
    except DataError as exc:
        raise DataError(f"{key}: {exc}") from None
    path = spec.path
    if path is None:  # REPO[:NAME]:SPLIT: read with datasets.load_dataset at start
        return f"{source} ({spec.split}; Hugging Face dataset, read at start)"
    if not path.exists():
        raise ConfigError(
            f"{key}: data file {source} does not exist; pass a FlashRAG jsonl, an HF dataset id or factbook"
        )
    try:
        rows = load_questions(source, split)
    except DataError as exc:
        raise DataError(f"{key}: {exc}") from None  # which setting points at the bad file
    if not rows:
        raise DataError(
            f"{key}: {path} holds no questions; fill it with FlashRAG rows "
            '({"id", "question", "golden_answers"} per line) or point ' + key + " at another file"
        )
    return f"{path} ({count(len(rows))}, every row checked)"


def _judge(cfg: TrainConfig) -> list[tuple[str, str]]:
    """The LLM judge a reward asks (``reward.metric=judge`` or a ``judge`` weight): where, which model, how long."""
    if not cfg.reward.uses_judge():
        return []
    j = cfg.reward.judge
    where = check_url(j.url or "", "reward.judge.url")
    retry = RetryPolicy.of(j)
    bound = retry.retries * retry.attempt_timeout
    return [
        (
            "judge",
            f"{j.model} at {where} (/v1/{'chat/completions' if j.api == 'chat' else 'completions'}, yes/no, "
            f"cached per question and answer), {j.retries} attempts, <= {bound:g}s per request",
        )
    ]


def _protocol(cfg) -> list[tuple[str, str]]:
    """Under ``rollout.protocol=tools``: the protocol, its chat template, and each tool's JSON schema (nothing
    under tags: its dry run reads as before the setting). Refuses a tokenizer that cannot render tools."""
    import json

    from zerosim.agent.rollout import Protocol

    r = cfg.rollout
    if r.protocol != Protocol.tools:
        return []
    from zerosim.agent.tool_format import tools_template
    from zerosim.agent.tools import tools_named
    from zerosim.core.models import load_tokenizer, resolve_model
    from zerosim.engines import page_grouping

    tools = tools_named(r.tools)
    tokenizer = load_tokenizer(resolve_model(cfg.policy.model))
    template = tools_template(tokenizer)
    own = "its own chat template" if template == tokenizer.chat_template else "the Qwen2.5 layout TRL ships"
    return [
        (
            "protocol",
            f"tools: <tool_call> JSON calls rendered by {own}, <= {r.max_tool_calls} calls per trajectory, "
            "the answer between <answer> and </answer>"
            + (
                f"; pages <= {r.max_page_tokens} tokens, a corpus's grouped by {page_grouping(cfg.search)} "
                "(search.page_by)"
                if "read_page" in r.tools
                else ""
            ),
        ),
        *((f"tool {t.name}", json.dumps(t.schema()["function"], ensure_ascii=False)) for t in tools),
    ]


def _precision(cfg: TrainConfig) -> str:
    """What the optimizer steps and what the forward/backward compute in (:func:`training_dtype`)."""
    lora = cfg.policy.lora
    if lora.enabled:
        base = "bf16" if cfg.policy.dtype == "bfloat16" else "fp32"
        weights = (
            f"LoRA adapters (r {lora.r}, alpha {lora.alpha}, {lora.target_modules.strip()}) stepped in fp32 "
            f"over a frozen {base} base"
        )
    elif cfg.policy.dtype == "bfloat16":
        weights = "bf16 weights (only under DeepSpeed/FSDP, which keep fp32 masters; refused elsewhere)"
    else:
        weights = "fp32 weights"
    bf16 = cfg.trainer.bf16
    if bf16 is False:
        compute = "fp32 compute"
    elif bf16:
        compute = "bf16 compute (autocast)"
    else:
        compute = "bf16 compute on a GPU (autocast; on CPU as runtime.bf16 decides, with beta = 0)"
    return f"{weights}, {compute}"


def _validation(cfg: TrainConfig) -> str:
    v = cfg.validation
    if not v.every:
        return "off"
    data = "the first training questions" if v.data is None else _data(v.data, v.split, "validation.data")
    engine = "the training engine, no noise" if v.engine == "train" else v.engine
    if v.engine == "train" and cfg.search.engine == EngineName.mixed:
        engine = (
            f"the training mix at real share {cfg.search.mixed.real_share:g} (step 0's; the same routes "
            "every pass), no noise"
        )
    start = "step 0, " if v.on_start else ""
    return f"greedy, {start}every {v.every} steps and the last: <= {v.max_examples} of {data}; {engine}"


def _warmstart(cfg: TrainConfig) -> str:
    w = cfg.warmstart
    if not w.enabled:
        return "off"
    from zerosim.training.warmstart import warmstart_folder

    final = Path(cfg.run.output_dir) / cfg.run.name / warmstart_folder(cfg) / "final"
    if w.reuse and (final / "config.json").is_file():
        return f"reuses {final}"
    data = _data(w.data, w.split, "warmstart.data")
    search = f"{w.search.engine}"
    if w.search.rerank.model is not None:
        search += ", " + describe_rerank(w.search.rerank, "warmstart.search.rerank", str(w.search.engine))
    return f"{w.num_examples} trajectories from {data} over {search}, {w.max_steps} steps"


def _threads(cfg: TrainConfig) -> str:
    from zerosim.core.runtime import available_cores, thread_budget

    if cfg.runtime.threads is not None:
        return f"{cfg.runtime.threads} threads each (runtime.threads)"
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return (
        f"{thread_budget()} threads each ({available_cores()} cores here / {local} process(es) on this host)"
    )


def _check_start(cfg: TrainConfig) -> None:
    """What training starts from is a full model: a LoRA adapter folder (another run's final/) as
    ``policy.model`` would load merged, while TRL rebuilds the KL reference and the critic from the folder's
    name, and a new adapter would name the old one as its base."""
    from zerosim.core.models import is_adapter

    for key, model in (
        ("policy.model", cfg.policy.model),
        ("trainer.critic_model", cfg.trainer.critic_model),
    ):
        if model and is_adapter(model):
            raise ConfigError(
                f"{key}={model} is a LoRA adapter; training starts from a full model: merge it first "
                f"(`zerosim policy merge --adapter {model} --out MERGED`) and set {key}=MERGED"
            )


def plan(
    cfg: TrainConfig,
    processes: int | None = None,
    resume: tuple[Path | None, str | None] | None = None,
    *,
    launch_config: Path | None = None,
    gpu_memory: float | None = None,
) -> list[tuple[str, str]]:
    """The resolved job as (item, value) rows; raises what start-up would raise, before any weight loads:
    :class:`ConfigError`, ``ModelError`` (a missing local model) or ``DataError`` (a malformed, non-UTF-8 or
    empty data file: data.train, validation.data, warmstart.data — every row is read). ``resume``: the
    :func:`~zerosim.training.checkpoint.resume_point` the caller already took (``train`` does, before this).
    Last, the memory plan per GPU (:mod:`zerosim.training.memory`) under ``launch_config`` (an accelerate config;
    default: this process's launcher, else DDP over ``processes``) against a card of ``gpu_memory`` GB."""
    t, c, r = cfg.trainer, cfg.curriculum, cfg.rollout
    from zerosim.training.memory import launch_from_config, launch_from_environment, launch_plan, plan_rows
    from zerosim.training.speedups import machine_line

    requested = processes  # the launch's own count (its config's num_processes, $WORLD_SIZE) unless given
    launch = (
        launch_from_config(Path(launch_config), processes)
        if launch_config
        else launch_from_environment(processes)
    )
    processes = launch.processes
    # per_device_train_batch_size is a multiple of num_generations (checked when the config loads)
    trajectories = t.per_device_train_batch_size * processes * t.gradient_accumulation_steps
    curve = describe_curve(curriculum_schedule(c, t.max_steps), c.steps(t.max_steps))
    # checked as at start: no CUDA (TRL's weight sync needs it), no vLLM, a dead server
    generation = planned_generation(cfg, gpu_memory)
    from zerosim.training.checkpoint import resume_point

    check_noise_config(cfg.search, c)  # a noisy curriculum over a retriever that would leave its slots empty
    check_tracking_uri(cfg.tracking.tracking_uri)  # the MLflow store the run will write

    output_dir = Path(cfg.run.output_dir) / cfg.run.name
    check_output_folder(output_dir, "run.output_dir")  # not a file (mkdir would fail after the models load)
    # refuses a fresh run over another run's checkpoints and a resume of another run / config (files only)
    checkpoint, run_id = resume if resume is not None else resume_point(cfg, output_dir, main=False)
    run = f"{cfg.run.name} -> {output_dir}"
    if checkpoint is not None:
        run += f", resumes {checkpoint.name} of MLflow run {run_id}"
    from zerosim.training.algorithms import spec_of

    _check_start(cfg)
    spec = spec_of(t.algorithm)
    epsilon_high = next(e for e in (t.epsilon_high, spec.epsilon_high, t.epsilon) if e is not None)
    dynamic = t.dynamic_sampling if t.dynamic_sampling is not None else spec.dynamic_sampling
    rows = [
        ("run", run),
        ("policy", describe_model(cfg.policy.model) + f", {_precision(cfg)}"),
        ("warm start", _warmstart(cfg)),
        ("data", _data(cfg.data.train, cfg.data.split, "data.train", cfg.data.max_examples)),
        *preflight(cfg.search, total_steps=t.max_steps),  # what the build checks first, and its rows
        ("algorithm", f"{t.algorithm}, lr {t.learning_rate:g}, beta {t.beta:g}, clip [{t.epsilon:g}, {epsilon_high:g}]" + (", equal-reward groups dropped" if dynamic else "")),
        ("critic", (t.critic_model or "the policy's initial checkpoint") + f", lr {t.critic_learning_rate:g}" if spec.needs_critic else "none"),
        ("processes", f"{processes}, {_threads(cfg)}"),
        ("machine", machine_line(cfg).removeprefix("machine: ")),
        ("per step", f"{trajectories} trajectories = {trajectories // t.num_generations} prompts x {t.num_generations} rollouts"),
        ("steps", f"{t.max_steps} ({t.max_steps * trajectories // t.num_generations} prompts in all)"),
        ("rollout", f"<= {r.max_turns} turns, {r.max_new_tokens} tokens/turn, {r.max_obs_tokens} tokens/observation, {r.max_completion_tokens} in all"),
        *_protocol(cfg),
        ("curriculum", f"{c.schedule} ({c.granularity}): p = {curve}"),
        ("reward", ", ".join(f"{k} {v:g}" for k, v in (cfg.reward.weights or {cfg.reward.metric: 1.0}).items()) + f", format {cfg.reward.format_weight:g}"),
        *_judge(cfg),
        ("generation", generation),
        ("validation", _validation(cfg)),
        ("checkpoints", f"every {t.save_steps} steps, {t.save_total_limit} kept" if t.save_steps else "final only" if t.save_final else "none"),
        ("MLflow", f"{cfg.tracking.tracking_uri}, experiment {cfg.tracking.experiment}"),
    ]  # fmt: skip
    from zerosim.training.stopping import stop_row

    plan = launch_plan(cfg, requested, launch_config, gpu_memory)
    rows += plan_rows(plan, cfg.policy.model)
    if plan.launch.processes > 1:  # a launcher's job: how long a stop takes, and the grace to launch with
        rows += stop_row(cfg, plan)
    return rows

"""How long each stage should take: the shipped rates of :data:`zerosim.experiment.kinds.KINDS` (a quiet 2-core
CPU, the embedded models), or — for an experiment that runs on GPUs — :data:`GPU_RATES`, replaced by what this
experiment's own stages measured; only stages timed on a quiet machine teach it.

An experiment runs on GPUs when its recipe says so (:func:`on_gpu`): its training samples with vLLM
(``trainer.generation`` ``vllm_colocate`` / ``vllm_server``, which need CUDA) or its evaluation generates with
vLLM (``generation=vllm``). No GPU has timed a stage of this project yet: every GPU rate is a guess at paper
scale (a ~3B policy), marked ``measured=False``, and the dry run says so beside each estimate it gives
(:func:`estimate_notes`) until a stage finished here replaces it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerosim.experiment.kinds import KINDS, OVERHEAD_S, Kind, Stage, read_stage

# A stage during which other processes took more than this share of the machine's CPU ran contended: its
# time says little about this job's speed (on 2 cores, several-fold slower), so no estimate learns from it.
CONTENDED_SHARE = 0.25


@dataclass(frozen=True)
class Rate:
    """Seconds per unit of a stage kind (the units of ``KINDS[kind].units``), and where the figure comes from."""

    seconds: float
    measured: bool  # False: a guess, until a device has timed such a stage
    source: str


# Per unit of each kind on one node of H100/H200-class GPUs, for a Qwen2.5-3B policy as the GPU recipes train it
# (configs/zerosearch-qwen2.5-3b.yaml). None measured: guesses from the papers' scale, to be replaced by the
# first GPU run's own stage times (docs/scaling.md).
GPU_RATES: dict[Kind, Rate] = {
    Kind.collect: Rate(0.05, False, "guess: BM25 over wiki-18 and labelling, per question (CPU work)"),
    Kind.sft: Rate(2.0, False, "guess: one optimizer step of the simulator (batch 2), one GPU"),
    Kind.dpo: Rate(5.0, False, "guess: one DPO step (policy and reference), one GPU"),
    Kind.quality: Rate(0.5, False, "guess: a useful and a noisy request to the served simulator"),
    Kind.warmstart: Rate(1.0, False, "guess: one SFT step of the policy"),
    Kind.train: Rate(
        2.0,
        False,
        "guess: 80 s per GRPO step of 40 trajectories per GPU (2 turns x 500 tokens, vLLM colocate, ZeRO-2)",
    ),
    Kind.eval: Rate(
        0.3, False, "guess: per agent question, vLLM batches, 2 turns x 500 tokens, wiki-18 search"
    ),
}


def ran_quiet(record: dict[str, Any]) -> bool:
    """Whether a finished stage's time was taken with the machine to itself (None: not measurable here,
    e.g. not Linux, taken as quiet; no entry: an older record whose conditions are unknown)."""
    if "others_cpu" not in record:
        return False
    return record["others_cpu"] is None or record["others_cpu"] <= CONTENDED_SHARE


def on_gpu(stages: Sequence[Stage]) -> bool:
    """Whether the experiment runs on GPUs: a training stage samples with vLLM, or an eval stage generates
    with it (both need CUDA)."""
    for stage in stages:
        c = stage.config
        if stage.kind in (Kind.train, Kind.warmstart) and c.trainer.generation != "hf":
            return True
        if stage.kind == Kind.eval and c.generation == "vllm":
            return True
    return False


def _learned_rates(stages: Sequence[Stage], root: Path) -> dict[str, float]:
    """Seconds per unit of each kind, from the stages of this experiment that finished on a quiet machine."""
    total: dict[str, list[float]] = {}
    for stage in stages:
        if stage.kind == Kind.report:
            continue
        done = read_stage(stage, root)
        units = KINDS[stage.kind].units(stage.config)
        # a continued stage's time holds the steps its killed attempt did again: no rate learns from it
        if done and units and ran_quiet(done) and done.get("attempts", 1) == 1:
            total.setdefault(stage.kind, []).append(max(done["seconds"] - OVERHEAD_S, 0.0) / units)
    return {kind: sum(v) / len(v) for kind, v in total.items()}


def estimates(stages: Sequence[Stage], root: Path) -> dict[str, float]:
    """Seconds each stage should take (by name): at the rate learned here where there is one, else at the
    shipped rate — :data:`GPU_RATES` for an experiment :func:`on_gpu`."""
    learned = _learned_rates(stages, root)
    gpu = on_gpu(stages)
    out = {}
    for stage in stages:
        rate = learned.get(stage.kind)
        if rate is None and gpu and stage.kind in GPU_RATES:
            rate = GPU_RATES[stage.kind].seconds
        out[stage.name] = stage.estimate_s if rate is None else KINDS[stage.kind].estimate(stage, rate)
    return out


def estimate_notes(stages: Sequence[Stage], root: Path) -> dict[str, str]:
    """What each estimate of :func:`estimates` stands on, for the dry run to show beside it: ``""`` for the
    shipped CPU rates (or a report), ``"GPU rates, unmeasured"`` / ``"GPU rates"`` for :data:`GPU_RATES`
    (a guess / a measured figure), ``"measured here"`` for a GPU experiment's rate learned from its own
    stages."""
    if not on_gpu(stages):
        return {stage.name: "" for stage in stages}
    learned = _learned_rates(stages, root)
    notes = {}
    for stage in stages:
        if stage.kind in learned:
            notes[stage.name] = "measured here"
        elif stage.kind in GPU_RATES:
            notes[stage.name] = "GPU rates" if GPU_RATES[stage.kind].measured else "GPU rates, unmeasured"
        else:
            notes[stage.name] = ""
    return notes


def rates_basis(stages: Sequence[Stage]) -> str:
    """What the shipped rates the dry run's total rests on are, in words (its caption)."""
    if not on_gpu(stages):
        return "2 CPU cores, embedded models"
    if all(rate.measured for rate in GPU_RATES.values()):
        return "GPU rates"
    return "GPU rates, unmeasured: guesses for a ~3B policy until this experiment's own stages time them"


# -- web search: how many queries a plan may send, and what they cost ----------------------------------------


def web_queries(stage: Stage, processes: int) -> int | None:
    """The most queries ``stage`` sends to a web search API (``search.engine=web``, or mixed over web at its
    largest real share), or None when it sends none or the count is unknown (an evaluation of every row).
    A training step makes ``per_device_train_batch_size x gradient_accumulation_steps x processes``
    trajectories of at most ``rollout.max_turns`` searches each (``max_tool_calls`` under tools); an
    evaluation, one per question (rag) or up to ``max_turns`` (agent). Repeats come from the cache, free."""
    from zerosim.core.engine_names import EngineName

    c = stage.config
    search = getattr(c, "search", None)
    if search is None or stage.kind not in (Kind.train, Kind.eval):
        return None
    engine = EngineName(search.engine)
    share = 1.0
    if engine == EngineName.mixed and EngineName(search.mixed.real) == EngineName.web:
        m = search.mixed
        share = max(m.real_share, m.real_share if m.real_share_end is None else m.real_share_end)
    elif engine != EngineName.web:
        return None
    r = c.rollout
    per_trajectory = r.max_tool_calls if str(r.protocol) == "tools" else r.max_turns
    if stage.kind == Kind.train:
        t = c.trainer
        trajectories = t.max_steps * t.per_device_train_batch_size * t.gradient_accumulation_steps * processes
        return round(trajectories * per_trajectory * share)
    if str(c.method) == "direct" or c.limit is None:
        return None
    per_question = 1 if str(c.method) == "rag" else per_trajectory
    return c.limit * len(c.datasets) * per_question


def launcher_processes(launcher: str | None) -> int:
    """The processes a ``train_launcher`` starts (``--num_processes``, or its accelerate ``--config_file``); 1
    without a launcher, 1 where it says nothing readable."""
    import shlex

    if not launcher:
        return 1
    words = shlex.split(launcher)
    for i, word in enumerate(words):
        value = words[i + 1] if word in ("--num_processes", "--config_file") and i + 1 < len(words) else None
        if word == "--num_processes" and value and value.isdigit():
            return int(value)
        if word == "--config_file" and value and Path(value).is_file():
            from zerosim.training.memory import launch_from_config

            return launch_from_config(Path(value)).processes
    return 1


def web_plan(stages: Sequence[Stage], launcher: str | None) -> list[str]:
    """The dry run's lines on web search: each stage's most queries and their cost at its provider's price, and
    the sum; [] when no stage searches the web."""
    from eval.web import PRICE_DATE, PROVIDERS

    processes = launcher_processes(launcher)
    lines, total_q, total_usd = [], 0, 0.0
    for stage in stages:
        queries = web_queries(stage, processes)
        search = getattr(stage.config, "search", None)
        if search is None or (queries is None and not _searches_web(search)):
            continue
        w = search.web
        provider = PROVIDERS[str(w.provider)]
        price = provider.price_per_1k if w.price_per_1k is None else w.price_per_1k
        if queries is None:
            lines.append(
                f"  {stage.name}: one query per question or more ({provider.label}); set eval.limit to count"
            )
            continue
        usd = queries * price / 1000
        total_q, total_usd = total_q + queries, total_usd + usd
        source = f"list price of {PRICE_DATE}" if w.price_per_1k is None else "search.web.price_per_1k"
        lines.append(
            f"  {stage.name}: at most {queries:,} queries to {provider.label}, est. ${usd:,.2f} "
            f"(${price:.2f} per 1,000, {source})"
        )
    if not lines:
        return []
    return [
        f"web search: at most {total_q:,} queries, est. ${total_usd:,.2f} in all (repeats come from the cache, "
        "free; a replay asks nothing)",
        *lines,
    ]


def _searches_web(search: Any) -> bool:
    from zerosim.core.engine_names import EngineName

    engine = EngineName(search.engine)
    return engine == EngineName.web or (
        engine == EngineName.mixed and EngineName(search.mixed.real) == EngineName.web
    )

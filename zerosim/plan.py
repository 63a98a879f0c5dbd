"""``zerosim train --dry-run``: resolve a recipe and print the plan, without loading any weights.

What a user wants to see before spending GPU hours: which model each part runs (and whether it is here),
the data, the search backend and its servers, the batch arithmetic across processes, the curriculum's
probabilities over the run, the algorithm, the generation backend, where results go. Anything that would
fail at start-up and can be checked without weights (a missing local path, an unknown embedded split, a
malformed URL) fails here with the same error.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from urllib.parse import urlsplit

from curricula import build_schedule
from zerosim.config import EMBEDDED_DATA, EMBEDDED_MODEL, ConfigError, TrainConfig


def _model(name: str) -> str:
    from zerosim.models import resolve_model

    if name == EMBEDDED_MODEL:
        return f"{name} (embedded SmolLM2-135M-Instruct)"
    resolved = resolve_model(name)  # raises ModelError for a path-like name that does not exist
    if Path(resolved).is_dir():
        return f"{resolved} (local checkpoint)"
    return f"{resolved} (Hugging Face id, fetched or read from the HF cache at start)"


def _data(source: str, split: str) -> str:
    if source == EMBEDDED_DATA:
        from zerosim.data.embedded import load_questions

        return f"factbook {split} ({len(load_questions(source, split))} questions, embedded)"
    path = Path(source).expanduser()
    if path.exists():
        return f"{path} ({split})"
    if source.startswith((".", "/", "~")) or source.endswith((".jsonl", ".json", ".parquet")):
        raise ConfigError(
            f"data file {source} does not exist; pass a FlashRAG jsonl, an HF dataset id or factbook"
        )
    return f"{source} ({split}; Hugging Face dataset id, read at start)"


def _url(url: str, what: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{what} {url!r} must look like http://HOST:PORT")
    return url


def _search(cfg: TrainConfig) -> list[tuple[str, str]]:
    s = cfg.search
    rows = [("search", f"{s.engine}, k={s.k}")]
    if s.engine == "simulator":
        sim = s.simulator
        if sim.backend == "openai":
            rows.append(
                ("simulator", f"{sim.served_model or sim.model} at {_url(sim.url, 'search.simulator.url')}")
            )
            rows.append(
                (
                    "simulator client",
                    f"{sim.max_concurrency} concurrent request(s) per process, {sim.retries} tries",
                )
            )
        else:
            rows.append(("simulator", f"{_model(sim.model)}, in process on every rank"))
    elif s.engine == "http":
        rows.append(
            (
                "retriever",
                f"{_url(s.http.url, 'search.http.url')} ({s.http.max_connections} connection(s) per process)",
            )
        )
    elif s.engine in ("bm25", "hybrid"):
        rows.append(("corpus", s.bm25.corpus))
    if s.engine in ("dense", "hybrid"):
        rows.append(("dense encoder", f"{s.dense.encoder} over {s.dense.corpus} ({s.dense.faiss_type})"))
    if s.engine != "simulator":
        rows.append(("noise over a real retriever", s.negatives))
    return rows


def _validation(cfg: TrainConfig) -> str:
    v = cfg.validation
    if not v.every:
        return "off"
    data = "the first training questions" if v.data is None else _data(v.data, v.split)
    engine = "the training engine, no noise" if v.engine == "train" else v.engine
    start = "step 0, " if v.on_start else ""
    return f"greedy, {start}every {v.every} steps and the last: <= {v.max_examples} of {data}; {engine}"


def plan(cfg: TrainConfig, processes: int | None = None) -> list[tuple[str, str]]:
    """The resolved job as (item, value) rows."""
    t, c, r = cfg.trainer, cfg.curriculum, cfg.rollout
    processes = processes or int(os.environ.get("WORLD_SIZE", "1"))
    # per_device_train_batch_size is a multiple of num_generations (checked when the config loads)
    trajectories = t.per_device_train_batch_size * processes * t.gradient_accumulation_steps
    total = c.total_steps or t.max_steps
    schedule = build_schedule(
        c.schedule, p_start=c.p_start, p_end=c.p_end, base=c.base, total_steps=total, stages=c.stages,
        window=c.adaptive_window, raise_above=c.adaptive_raise_above, lower_below=c.adaptive_lower_below,
        delta=c.adaptive_delta,
    )  # fmt: skip
    marks = sorted({0, total // 4, total // 2, 3 * total // 4, total})
    curve = ", ".join(f"{schedule.probability(i):.2f}@{i}" for i in marks)
    vllm = (
        "installed"
        if importlib.util.find_spec("vllm")
        else "not installed here: needed on the training machine"
    )
    generation = t.generation if t.generation == "hf" else f"{t.generation} (vLLM {vllm})"
    if t.generation == "vllm_server":
        generation += f", server {_url(t.vllm_server_url, 'trainer.vllm_server_url')}"
    rows = [
        ("run", f"{cfg.run.name} -> {Path(cfg.run.output_dir) / cfg.run.name}"),
        ("policy", _model(cfg.policy.model) + f", dtype {cfg.policy.dtype}"),
        ("warm start", f"{cfg.warmstart.num_examples} trajectories, {cfg.warmstart.max_steps} steps" if cfg.warmstart.enabled else "off"),
        ("data", _data(cfg.data.train, cfg.data.split)),
        *_search(cfg),
        ("algorithm", f"{t.algorithm}, lr {t.learning_rate:g}, beta {t.beta:g}, clip {t.epsilon:g}"),
        ("critic", (t.critic_model or "the policy's initial checkpoint") + f", lr {t.critic_learning_rate:g}" if t.algorithm == "ppo" else "none"),
        ("processes", str(processes)),
        ("per step", f"{trajectories} trajectories = {trajectories // t.num_generations} prompts x {t.num_generations} rollouts"),
        ("steps", f"{t.max_steps} ({t.max_steps * trajectories // t.num_generations} prompts in all)"),
        ("rollout", f"<= {r.max_turns} turns, {r.max_new_tokens} tokens/turn, {r.max_obs_tokens} tokens/observation, {r.max_completion_tokens} in all"),
        ("curriculum", f"{c.schedule} ({c.granularity}): p = {curve}"),
        ("reward", ", ".join(f"{k} {v:g}" for k, v in (cfg.reward.weights or {cfg.reward.metric: 1.0}).items()) + f", format {cfg.reward.format_weight:g}"),
        ("generation", generation),
        ("validation", _validation(cfg)),
        ("checkpoints", f"every {t.save_steps} steps, {t.save_total_limit} kept" if t.save_steps else "final only" if t.save_final else "none"),
        ("MLflow", f"{cfg.tracking.tracking_uri}, experiment {cfg.tracking.experiment}"),
    ]  # fmt: skip
    return rows

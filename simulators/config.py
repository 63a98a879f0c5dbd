"""The simulator's settings (``search.simulator.*``) and those of the ``zerosim simulator`` commands.

``zerosim simulator collect`` also names the real retriever it labels documents from (``search.*``): the app
composes that part (``zerosim.job_config.SimulatorCollectConfig``); :class:`CollectConfig` holds the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from zerosim.agent.rollout import RolloutConfig
from zerosim.core.config import EMBEDDED_DATA, EMBEDDED_MODEL, ConfigError, ranged
from zerosim.core.judge import MAX_TOKENS
from zerosim.core.models import DType
from zerosim.core.runtime import RuntimeConfig
from zerosim.core.tracking import TrackingConfig, refuse_log_model


class Backend(StrEnum):
    """What generates the simulator's (or judge's) text."""

    transformers = "transformers"
    openai = "openai"


class OnShort(StrEnum):
    """Fewer documents than slots: ask once more (then fill), or fill with explicit failure documents."""

    reask = "reask"
    fill = "fill"


class PromptPreset(StrEnum):
    """The simulator's wording and output parser: zerosim's own, or the format ZeroSearch's simulators learnt."""

    default = "default"
    zerosearch = "zerosearch"


class OnLeak(StrEnum):
    """A noisy document holding a gold answer: ask once more (then relabel), mark it useful, or keep it."""

    reask = "reask"
    relabel = "relabel"
    keep = "keep"


class Queries(StrEnum):
    """``zerosim simulator collect``: where the queries come from."""

    question = "question"
    policy = "policy"


class Label(StrEnum):
    """``zerosim simulator collect``: how a document is labelled useful or noisy."""

    contains = "contains"
    judge = "judge"


class Objective(StrEnum):
    """``zerosim simulator train``: what the fine-tune optimises."""

    sft = "sft"
    dpo = "dpo"


@dataclass
class SimulatorConfig:
    # simulator LLM: HF id, local path, or "smollm2"
    model: str = EMBEDDED_MODEL
    # target length of each simulated document
    words_per_doc: int = ranged(30, ">=1")
    # generation budget for all k documents of one request
    max_new_tokens: int = ranged(192, ">=1")
    # simulator sampling temperature (0 = greedy)
    temperature: float = ranged(0.7, ">=0", "0 = greedy")
    # simulator nucleus sampling
    top_p: float = ranged(0.95, "(0,1]")
    # show the question and gold answers to the simulator: null = in training only (never at eval or validation), false = never, true = also at eval/validation (an override, warned about and tagged in MLflow)
    pass_answers: bool | None = None
    # shown answers only for a query holding this share of its question's content words; below it the query alone is written for, as at eval (0 = whatever the query, as ZeroSearch; docs/simulator.md)
    hint_min_coverage: float = ranged(0.0, "[0,1]")
    # fewer documents than slots: reask (once, then fill) / fill (explicit failure documents)
    on_short: OnShort = OnShort.reask
    # prompt preset: default (zerosim's wording) / zerosearch (the format of ZeroSearch's released simulators: Doc i outputs)
    prompts: PromptPreset = PromptPreset.default
    # YAML/JSON replacing any of the templates useful, noisy, useful_context, noisy_context
    prompts_file: str | None = None
    # noisy doc holding a gold answer: reask (once, then relabel) / relabel (mark it useful) / keep
    on_leak: OnLeak = OnLeak.reask
    # transformers (in-process) / openai (OpenAI-compatible server: vllm serve, zerosim simulator serve)
    backend: Backend = Backend.transformers
    # backend=openai: the server's base URL
    url: str = "http://127.0.0.1:8001"
    # backend=openai: model name asked of the server (a LoRA adapter name allowed); None = model
    served_model: str | None = None
    # backend=openai: wrap prompts in the chat template of model's tokenizer (False = send raw)
    chat_template: bool = True
    # backend=openai: seconds to connect before a retry
    connect_timeout: float = ranged(2.0, ">0", "seconds")
    # backend=openai: seconds to wait for an answer before a retry
    read_timeout: float = ranged(120.0, ">0", "seconds")
    # backend=openai: attempts per request before the search fails naming the URL
    retries: int = ranged(3, ">=1", "attempts per request, the first one included")
    # backend=openai: seconds before the 2nd attempt, doubled after each
    backoff: float = ranged(0.5, ">=0", "seconds")
    # backend=openai: most concurrent requests per search call (1 = one request carries all)
    max_concurrency: int = ranged(1, ">=1")
    # backend=transformers: each prompt decoded as if alone (slower; bit-exact)
    batch_invariant: bool = False
    # cache results (in-memory LRU; plus sqlite when cache_path is set)
    cache: bool = False
    # results kept in memory by the cache
    cache_size: int = ranged(10000, ">=1")
    # sqlite file shared across runs; None = memory only
    cache_path: str | None = None


@dataclass
class JudgeConfig:
    # judge LLM: HF id, local path, or "smollm2"
    model: str = EMBEDDED_MODEL
    # transformers (in-process) / openai (an OpenAI-compatible server at url)
    backend: Backend = Backend.transformers
    # backend=openai: the server's base URL
    url: str = "http://127.0.0.1:8001"
    # tokens the judge may write (it must start with yes or no)
    max_new_tokens: int = ranged(MAX_TOKENS, ">=1")


@dataclass
class CollectConfig:
    """``zerosim simulator collect``: queries + real-retriever documents labelled useful/noisy -> SFT jsonl."""

    # questions: FlashRAG jsonl/parquet, HF dataset id, or "factbook"
    data: str = EMBEDDED_DATA
    # split of those questions (keep the eval split out of the SFT data)
    split: str = "train"
    # use this many questions (seeded sample); None = all
    max_questions: int | None = ranged(400, ">=1", "null = all")
    # question (the question is the query) / policy (the policy's <search> queries)
    queries: Queries = Queries.question
    # queries=policy: the policy rolled out against the retriever
    policy: str = EMBEDDED_MODEL
    # documents retrieved per query and labelled
    depth: int = ranged(10, ">=1")
    # most documents per SFT example (match search.k of the RL runs)
    k: int = ranged(3, ">=1")
    # documents are cut to this many words, around the gold answer in useful ones
    words_per_doc: int = ranged(30, ">=1")
    # contains (a gold answer occurs in the document) / judge (an LLM decides)
    label: Label = Label.contains
    # keep as many useful as noisy examples (seeded down-sampling of the larger mode)
    balance: bool = True
    # prompts show question and gold answers (as simulator.pass_answers at RL time)
    pass_answers: bool = True
    # prompt preset of the SFT rows: default / zerosearch (as simulator.prompts at RL time)
    prompts: PromptPreset = PromptPreset.default
    # simulator templates file (as simulator.prompts_file at RL time)
    prompts_file: str | None = None
    # questions per retrieval / rollout batch
    batch_size: int = ranged(32, ">=1")
    # seeds the question sample, the balancing and policy sampling
    seed: int = ranged(0, ">=0")
    # the SFT dataset; a report goes next to it (<out>.report.json)
    out: str = "outputs/simulator/sft.jsonl"
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def validate(self, prefix: str) -> None:
        """The SFT example's documents come from the retrieved depth; ``data=factbook:SPLIT`` is the embedded
        split, as eval reads it (a conflicting split refused)."""
        from zerosim.core.data.spec import resolve_embedded

        resolve_embedded(self, "data", prefix)
        if self.depth < self.k:
            raise ConfigError(
                f"need 1 <= {prefix}k <= {prefix}depth, got {prefix}k={self.k}, {prefix}depth={self.depth}: "
                f"documents are taken from the retrieved depth; set e.g. {prefix}depth={max(10, self.k)}"
            )


@dataclass
class SimulatorTrainConfig:
    """``zerosim simulator train``: supervised fine-tuning of the simulator LLM (TRL SFTTrainer)."""

    # SFT jsonl from zerosim simulator collect
    data: str = "outputs/simulator/sft.jsonl"
    # base LLM: HF id, local path, or "smollm2"
    model: str = EMBEDDED_MODEL
    # the trained weights: auto | float32 = fp32 (bf16 compute on a GPU) | bfloat16 (LoRA's frozen base, or under DeepSpeed/FSDP)
    dtype: DType = DType.auto
    # checkpoint goes to <output_dir>/<name>/final
    output_dir: str = "outputs/simulator"
    # MLflow run name and output sub-folder
    name: str = "simulator-sft"
    # sft (imitate the documents) | dpo (prefer each mode's documents over the other's)
    objective: Objective = Objective.sft
    # DPO: strength of the pull toward the starting model
    dpo_beta: float = ranged(0.1, ">0")
    # DPO: weight of the NLL of the preferred documents (0 = pure DPO)
    dpo_sft_weight: float = ranged(1.0, ">=0", "0 = pure DPO")
    # optimizer steps
    max_steps: int = ranged(300, ">=1")
    # AdamW learning rate (LoRA: ~1e-3 is usual)
    learning_rate: float = ranged(1e-4, ">0")
    # examples per optimizer micro-batch
    batch_size: int = ranged(8, ">=1")
    # micro-batches per optimizer step
    gradient_accumulation_steps: int = ranged(1, ">=1")
    # longest tokenised example kept (longer ones are truncated)
    max_length: int = ranged(512, ">=1")
    # recompute activations in the backward instead of keeping them (less memory, ~30% more time)
    gradient_checkpointing: bool = False
    # train a LoRA adapter (peft) instead of all weights
    lora: bool = False
    # LoRA rank
    lora_r: int = ranged(16, ">=1")
    # LoRA scaling
    lora_alpha: int = ranged(32, ">=1")
    # LoRA dropout
    lora_dropout: float = ranged(0.05, "[0,1)")
    # modules to adapt ("all-linear" or comma-separated names)
    lora_target_modules: str = "all-linear"
    # save the adapter merged into the base weights (a plain checkpoint)
    merge_lora: bool = True
    # seeds data order and initialisation
    seed: int = ranged(0, ">=0")
    tracking: TrackingConfig = field(default_factory=lambda: TrackingConfig(experiment="zerosim-simulator"))
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


@dataclass
class SimulatorEvalConfig:
    """``zerosim simulator eval``: quality report of a simulator in useful and noisy mode."""

    # questions with gold answers: file, HF id, or "factbook"
    data: str = EMBEDDED_DATA
    # split of those questions (not the one the simulator was trained on)
    split: str = "test"
    # evaluate the first N questions; None = all
    limit: int | None = ranged(64, ">=1", "null = all")
    # documents per result
    k: int = ranged(3, ">=1")
    # questions per simulator call (each gives one useful and one noisy request)
    batch_size: int = ranged(16, ">=1")
    # seeds the simulator
    seed: int = ranged(0, ">=0")
    # table.json / table.md / samples.jsonl go to <output_dir>/<run_name>
    output_dir: str = "outputs/simulator-eval"
    # MLflow run name; None = "quality-<model folder name>" (the run folder for .../final)
    run_name: str | None = None
    # fill and keep: the report measures what the model writes, not what the guards make of it
    simulator: SimulatorConfig = field(
        default_factory=lambda: SimulatorConfig(on_short=OnShort.fill, on_leak=OnLeak.keep)
    )
    tracking: TrackingConfig = field(default_factory=lambda: TrackingConfig(experiment="zerosim-simulator"))
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def validate(self, prefix: str) -> None:
        """A quality report trains nothing, so it has no model of its own to log (``tracking.log_model``);
        ``data=factbook:SPLIT`` is the embedded split, as eval reads it (a conflicting split refused)."""
        from zerosim.core.data.spec import resolve_embedded

        resolve_embedded(self, "data", prefix)
        refuse_log_model(
            self.tracking,
            prefix,
            job="a simulator evaluation",
            trainer="`zerosim simulator train`, which writes the simulator",
        )

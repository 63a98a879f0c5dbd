"""The training recipe's schema (``zerosim train``, ``zerosim policy warmstart``), beside the recipe
(:mod:`zerosim.training.recipe`) as TRL keeps ``GRPOConfig`` beside ``GRPOTrainer``.

A part that belongs to a lower layer is defined there and composed here: ``search`` (:mod:`zerosim.engines`),
``curriculum`` (:mod:`curricula.config`), ``rollout`` (:mod:`zerosim.agent.rollout`), ``reward``
(:mod:`zerosim.agent.rewards`), ``tracking`` and ``runtime``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from curricula.config import CurriculumConfig
from zerosim.agent.rewards import RewardConfig
from zerosim.agent.rollout import RolloutConfig
from zerosim.core.config import EMBEDDED_DATA, EMBEDDED_MODEL, ConfigError, load_config, ranged
from zerosim.core.models import DType, lora_targets
from zerosim.core.runtime import RuntimeConfig
from zerosim.core.tracking import TrackingConfig
from zerosim.engines import EngineName, SearchConfig
from zerosim.training.algorithms import DYNAMIC_SAMPLING, Algorithm, spec_of


class Generation(StrEnum):
    """``trainer.generation``: what samples the policy (TRL's vLLM modes or transformers)."""

    hf = "hf"
    vllm_colocate = "vllm_colocate"
    vllm_server = "vllm_server"


class LRScheduler(StrEnum):
    """``trainer.lr_scheduler``: the learning rate over ``max_steps``."""

    constant = "constant"
    linear = "linear"
    cosine = "cosine"


# ``validation.engine``: the training engine (without curriculum noise) or a named one — the simulator or any
# real retriever, derived from ``EngineName`` so that a new retriever is a choice here too
ValidationEngine = StrEnum(
    "ValidationEngine",
    {"train": "train", **{e.name: e.value for e in EngineName if e == EngineName.simulator or e.real}},
)


class CollapseAction(StrEnum):
    """``trainer.collapse_action``: what the collapse guard does (:mod:`zerosim.training.guard`)."""

    stop = "stop"
    rollback = "rollback"


class FinalPolicy(StrEnum):
    """``trainer.final_policy``: which policy the final checkpoint holds."""

    last = "last"
    best = "best"


@dataclass
class RunConfig:
    # run name (MLflow run name, output sub-folder)
    name: str = "zerosim"
    # seeds torch, numpy, the curriculum draws and the simulator
    seed: int = ranged(0, ">=0")
    # checkpoints go to <output_dir>/<name>
    output_dir: str = "outputs"
    # continue from the last complete checkpoint in <output_dir>/<name> (same MLflow run); `resume=true` works too
    resume: bool = False


@dataclass
class PolicyLoraConfig:
    # train LoRA adapters (peft) over a frozen base instead of every weight (docs/training.md "LoRA")
    enabled: bool = False
    # adapter rank
    r: int = ranged(16, ">=1")
    # adapter scaling (the update is alpha/r x B A)
    alpha: int = ranged(32, ">=1")
    # 0: a log-prob pass must score the tokens as the rollout that sampled them did (dropout makes them differ)
    dropout: float = ranged(0.0, "[0,1)")
    # "all-linear" (every linear layer but the LM head: q/k/v/o_proj and gate/up/down_proj in Llama/Qwen2 blocks) or a comma list of module names
    target_modules: str = "all-linear"
    # also write the adapter merged into its base as <run>/merged, a full model for tools that read no adapters
    merge_final: bool = False

    def peft_config(self):
        """The ``peft.LoraConfig`` these settings describe."""
        from zerosim.core.models import lora_config

        return lora_config(self.r, self.alpha, self.dropout, self.target_modules)


@dataclass
class PolicyConfig:
    # HF id, local checkpoint path, or "smollm2" (embedded)
    model: str = EMBEDDED_MODEL
    # the trained weights: auto | float32 = fp32 (bf16 compute is trainer.bf16's) | bfloat16 (under DeepSpeed/FSDP, which keep fp32 masters, or as policy.lora's frozen base); in-process engines infer in it (auto: bf16 on GPU)
    dtype: DType = DType.auto
    lora: PolicyLoraConfig = field(default_factory=PolicyLoraConfig)


@dataclass
class DataConfig:
    # FlashRAG jsonl/parquet file, HF dataset id, or "factbook" (embedded)
    train: str = EMBEDDED_DATA
    # split name for HF ids and for the embedded factbook
    split: str = "train"
    # use only the first N rows (after a seeded shuffle); None = all
    max_examples: int | None = ranged(None, ">=1", "null = all")

    def validate(self, prefix: str) -> None:
        """``train=factbook:SPLIT`` is the embedded split, as eval reads it (a conflicting split refused)."""
        from zerosim.core.data.spec import resolve_embedded

        resolve_embedded(self, "train", prefix)


@dataclass
class TrainerConfig:
    # grpo | dr_grpo | dapo (TRL loss types) | rloo | reinforce | reinforce_pp | ppo (critic + GAE)
    algorithm: Algorithm = Algorithm.grpo
    # optimizer steps
    max_steps: int = ranged(5, ">=1")
    # AdamW learning rate
    learning_rate: float = ranged(1e-6, ">0")
    # constant (veRL's default, as ZeroSearch / Search-R1 run) | linear | cosine decay over max_steps
    lr_scheduler: LRScheduler = LRScheduler.constant
    # share of max_steps spent warming the learning rate up from 0
    warmup_ratio: float = ranged(0.0, "[0,1)", "a share of max_steps")
    # trajectories per device per step (prompts x num_generations)
    per_device_train_batch_size: int = ranged(8, ">=1", "trajectories per device per step")
    # group size: trajectories per prompt (GRPO needs >= 2)
    num_generations: int = ranged(4, ">=2", "group-relative advantages of a group of one are always 0")
    # micro-batches per optimizer step
    gradient_accumulation_steps: int = ranged(1, ">=1")
    # recompute each layer's activations in the backward instead of keeping them (less memory, ~30% more time); the PPO critic too
    gradient_checkpointing: bool = False
    # KL coefficient to the reference policy (0 = no reference model)
    beta: float = ranged(0.0, ">=0")
    # PPO-style clip range
    epsilon: float = ranged(0.2, ">0")
    # upper clip range (DAPO's clip-higher); None = 0.28 for dapo, epsilon otherwise
    epsilon_high: float | None = ranged(None, ">0", "null = 0.28 for dapo, epsilon otherwise")
    # drop groups whose rewards are all equal from the loss (DAPO; dapo, rloo); None = on for dapo
    dynamic_sampling: bool | None = None
    # gradient clipping
    max_grad_norm: float = ranged(1.0, ">0")
    # bf16 autocast of the update (fp32 weights); None = on with a GPU, or on CPU as runtime.bf16 decides (AMX, AVX512_BF16) when beta = 0
    bf16: bool | None = None
    # log every N steps
    logging_steps: int = ranged(1, ">=1")
    # save the final policy checkpoint
    save_final: bool = True
    # save a resumable checkpoint (model, optimizer, scheduler, RNG, curriculum) every N steps; 0 = never
    save_steps: int = ranged(0, ">=0", "0 = never")
    # resumable checkpoints kept (older ones deleted)
    save_total_limit: int = ranged(2, ">=1")
    # ppo: critic LM (HF id, path, smollm2); None = the policy's initial checkpoint
    critic_model: str | None = None
    # ppo: critic AdamW learning rate
    critic_learning_rate: float = ranged(1e-5, ">0")
    # ppo: critic optimizer steps per generation batch
    critic_epochs: int = ranged(1, ">=1")
    # ppo, reinforce_pp: discount over policy tokens (ZeroSearch / Search-R1: 1)
    gamma: float = ranged(1.0, "[0,1]")
    # ppo: GAE lambda (ZeroSearch / Search-R1: 1)
    lam: float = ranged(1.0, "[0,1]")
    # ppo: clip range of the value loss around the old values
    value_clip: float = ranged(0.2, ">0")
    # stop after N logged steps in a row where every trajectory scored 0 (no gradient); 0 = never. Also how many logged steps in a row collapse_answer_share must be exceeded
    collapse_patience: int = ranged(5, ">=0", "0 = never")
    # a collapse: one answer given to more than this share of the last collapse_window questions (the reward can stay above 0); null = not watched
    collapse_answer_share: float | None = ranged(None, "(0,1)", "null = not watched")
    # questions (each by its group's most common answer) collapse_answer_share is taken over, per process
    collapse_window: int = ranged(16, ">=2")
    # a collapse: validation EM (validation.every) falling more than this below its best; null = not watched
    collapse_val_drop: float | None = ranged(None, "[0,1]", "null = not watched")
    # on a collapse: stop | rollback (to the best validated policy, learning rate x collapse_lr_factor; once, then stop)
    collapse_action: CollapseAction = CollapseAction.stop
    # rollback: the learning rate's factor after it
    collapse_lr_factor: float = ranged(0.5, "(0,1]")
    # the final checkpoint: last (the last step's policy) | best (the best validated one: what an experiment evaluates)
    final_policy: FinalPolicy = FinalPolicy.last
    # policy sampling: hf (transformers generate) | vllm_colocate | vllm_server (TRL's vLLM modes)
    generation: Generation = Generation.hf
    # vllm_server: a `trl vllm-serve --model <policy>` server
    vllm_server_url: str = "http://127.0.0.1:8000"
    # vllm_colocate: GPU memory share vLLM may take beside training
    vllm_gpu_memory_utilization: float = ranged(0.3, "(0,1]", "a share of the GPU memory")
    # vllm_colocate: GPUs per vLLM engine
    vllm_tensor_parallel_size: int = ranged(1, ">=1")
    # vLLM context length; None = prompt + max_completion_tokens + 512
    vllm_max_model_length: int | None = ranged(None, ">=1", "null = prompt + max_completion_tokens + 512")

    def validate(self, prefix: str) -> None:
        """Whole groups per device batch; dynamic sampling only where a group baseline and a token-level loss
        make it sound."""
        if self.per_device_train_batch_size % self.num_generations:
            fit = -(-self.per_device_train_batch_size // self.num_generations) * self.num_generations
            raise ConfigError(
                f"{prefix}per_device_train_batch_size ({self.per_device_train_batch_size}) must be a multiple of "
                f"{prefix}num_generations ({self.num_generations}): each prompt's group is rolled out together; "
                f"set e.g. {prefix}per_device_train_batch_size={fit}"
            )
        if self.dynamic_sampling and not spec_of(self.algorithm).allows_dynamic_sampling:
            raise ConfigError(
                f"{prefix}dynamic_sampling=true needs a group baseline and a token-level loss "
                f"({', '.join(DYNAMIC_SAMPLING)}), not "
                f"{prefix}algorithm={self.algorithm}: set {prefix}dynamic_sampling=false or "
                f"{prefix}algorithm=dapo"
            )


@dataclass
class WarmstartConfig:
    # before RL, SFT the policy on synthetic search trajectories (cold start for small models)
    enabled: bool = False
    # questions to build trajectories from: file, HF id, or "factbook"
    data: str = EMBEDDED_DATA
    # split of those questions
    split: str = "train"
    # synthetic trajectories to build
    num_examples: int = ranged(256, ">=1")
    # keep only trajectories whose clipped documents hold the gold answer they write
    grounded: bool = True
    # SFT optimizer steps
    max_steps: int = ranged(40, ">=1")
    # SFT learning rate
    learning_rate: float = ranged(1e-4, ">0")
    # SFT batch size
    batch_size: int = ranged(8, ">=1")
    # SFT: recompute activations in the backward (less memory, more time)
    gradient_checkpointing: bool = False
    # documents kept per <information> block (match rollout.max_obs_tokens)
    max_obs_tokens: int = ranged(160, ">=1")
    # reuse <output_dir>/<name>/warmstart/final when it exists
    reuse: bool = True
    # retriever for the trajectories
    search: SearchConfig = field(default_factory=lambda: SearchConfig(engine=EngineName.bm25))

    def validate(self, prefix: str) -> None:
        """``data=factbook:SPLIT`` is the embedded split, as eval reads it (a conflicting split refused)."""
        from zerosim.core.data.spec import resolve_embedded

        resolve_embedded(self, "data", prefix)


@dataclass
class ValidationConfig:
    # greedy agent evaluation of the current policy every N steps, logged as val/* (0 = off)
    every: int = ranged(0, ">=0", "0 = off")
    # with every > 0: also evaluate the starting policy (step 0)
    on_start: bool = True
    # questions: file, HF id or "factbook"; None = the first training questions (data.*, after max_examples' draw)
    data: str | None = None
    # split of validation.data (unused when data is None)
    split: str = "dev"
    # questions evaluated (first N rows; the whole set when smaller)
    max_examples: int = ranged(64, ">=1")
    # questions per batched rollout
    batch_size: int = ranged(16, ">=1")
    # train (the training engine, no curriculum noise) | bm25 | dense | hybrid | http (search.<engine> settings)
    engine: ValidationEngine = ValidationEngine.train

    def validate(self, prefix: str) -> None:
        """``data=factbook:SPLIT`` is the embedded split, as eval reads it (a conflicting split refused)."""
        from zerosim.core.data.spec import resolve_embedded

        resolve_embedded(self, "data", prefix)


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

    def validate(self, prefix: str) -> None:
        """``tracking.log_model`` logs the final checkpoint, which only ``trainer.save_final`` writes; what the
        collapse guard reads of validation needs validation to run."""
        t = self.trainer
        needs = {
            "trainer.collapse_val_drop": t.collapse_val_drop is not None,
            "trainer.collapse_action=rollback": t.collapse_action == CollapseAction.rollback,
            "trainer.final_policy=best": t.final_policy == FinalPolicy.best,
        }
        for what, used in needs.items():
            if used and not self.validation.every:
                raise ConfigError(
                    f"{prefix}{what} reads greedy validation passes (the best validated policy), but "
                    f"{prefix}validation.every=0 runs none: set {prefix}validation.every=N (e.g. 4, with "
                    f"{prefix}validation.data and {prefix}validation.max_examples for its questions), or drop "
                    f"{prefix}{what.split('=')[0]}"
                )
        lora = self.policy.lora
        if lora.enabled and t.generation != Generation.hf:
            raise ConfigError(
                f"{prefix}policy.lora.enabled with {prefix}trainer.generation={t.generation.value}: the vLLM modes "
                "here sync a full policy's weights into vLLM each step, and no adapter sync is wired to them, so "
                f"vLLM would sample from the untrained base; set {prefix}trainer.generation=hf, or train every "
                f"weight ({prefix}policy.lora.enabled=false)"
            )
        if lora.enabled and self.tracking.log_model and not lora.merge_final:
            raise ConfigError(
                f"{prefix}tracking.log_model=true logs the final policy as a full transformers model, and "
                f"{prefix}policy.lora.enabled saves an adapter: set {prefix}policy.lora.merge_final=true (the adapter "
                f"merged into its base is what is logged) or {prefix}tracking.log_model=false"
            )
        if lora.enabled and lora_targets(lora.target_modules) == []:
            raise ConfigError(
                f"{prefix}policy.lora.target_modules is empty: name the layers the adapters wrap, e.g. "
                f"{prefix}policy.lora.target_modules=all-linear or q_proj,v_proj"
            )
        from zerosim.engines import check_pages

        check_pages(self.search, self.rollout, prefix)
        if self.validation.every and self.validation.engine != "train":
            check_pages(self.search, self.rollout, prefix, engine=self.validation.engine)
        if self.tracking.log_model and not self.trainer.save_final:
            raise ConfigError(
                f"{prefix}tracking.log_model=true logs the final policy checkpoint, but "
                f"{prefix}trainer.save_final=false saves none, so no model would be logged: set "
                f"{prefix}trainer.save_final=true, or {prefix}tracking.log_model=false"
            )


def load_train_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """A training recipe: :class:`TrainConfig` defaults, the YAML ``path`` and ``overrides``
    (:func:`zerosim.core.config.load_config`)."""
    return load_config(path, overrides, schema=TrainConfig)

"""The memory plan: what one GPU holds while a recipe trains, without loading a weight.

Per GPU: the policy's weights, gradients and optimizer states under the launch strategy (one process, DDP,
DeepSpeed ZeRO-1/2/3, FSDP2), the reference model (``trainer.beta > 0``), the PPO critic, vLLM's share
(``trainer.vllm_gpu_memory_utilization`` under ``vllm_colocate``), and the activations of one micro-batch at
the longest row the recipe allows, with and without gradient checkpointing — against the card's memory.

Model states follow DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs``: ``2P + 18P/N``
bytes; ZeRO-3: ``4 x largest layer + 18P/N``, plus the 16-bit shards ``2P/N`` it leaves out) and, for one process, ``accelerate estimate-memory``'s AdamW
figure (weights, gradients, two moments: 16 bytes per fp32 parameter). Activations per token are
:func:`activation_bytes_per_token`: a formula in width and depth whose coefficients are the saved-tensor
bytes counted by :func:`measure_activation_bytes` on Llama/Qwen2-shaped models (tests/test_memory_plan.py
holds the formula against that measurement at two sizes). Sizes are in GB (1e9 bytes).

With ``policy.lora``: the frozen base at its dtype (no gradients, no AdamW states), sharded as the weights are,
and the adapters at 16 bytes a parameter (:func:`adapter_params`; fp32 weight, gradient, two AdamW moments),
sharded as the optimizer states are; no reference copy (TRL scores it with the adapters disabled); activations as
a full fine-tune's (a tiny Qwen2's LoRA layer saves -9% to +13% of a trained one's, by its dtypes). Under ZeRO-3
with ``trainer.generation=hf`` the rollout gathers the whole 16-bit policy on every rank (TRL's
``ds3_gather_for_generation``): its own part.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

GB = 1e9
# tokens of instruction + question before the first turn (vllm_args leaves the same 512 for them)
PROMPT_BUDGET = 512
# tokens around each <information> block besides its max_obs_tokens of documents
OBSERVATION_WRAPPER = 16
# CUDA context, NCCL buffers, communication buckets, allocator slack
RUNTIME_RESERVE = 3.0 * GB
# vLLM beside its weights: CUDA graphs, sampler and activation buffers
VLLM_OVERHEAD = 1.5 * GB
# the GB a --gpu-memory card may have: the largest accelerators hold a few hundred GB (H200 141, MI355X 288)
CARD_GB_RANGE = (1.0, 4096.0)


@dataclass(frozen=True)
class ModelShape:
    """What a model's memory depends on: its config.json's sizes."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = True
    source: str = "config.json"

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_dim
        return 2 * h * h + 2 * h * kv + h + 2 * kv + 3 * h * self.intermediate + 2 * h

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * self.layer_params + self.hidden

    @property
    def largest_layer(self) -> int:
        """Parameters of the largest module DeepSpeed gathers at once (the embedding, or a decoder layer)."""
        return max(self.vocab * self.hidden, self.layer_params)


def _shape(hidden, layers, heads, kv_heads, intermediate, vocab, tied) -> ModelShape:
    return ModelShape(hidden, layers, heads, kv_heads, intermediate, vocab, tied, source="known config")


_QWEN = {"0.5B": (896, 24, 14, 2, 4864, 151936, True), "1.5B": (1536, 28, 12, 2, 8960, 151936, True)}
_QWEN |= {"3B": (2048, 36, 16, 2, 11008, 151936, True), "7B": (3584, 28, 28, 4, 18944, 152064, False)}
_QWEN |= {"14B": (5120, 48, 40, 8, 13824, 152064, False)}
# hub ids whose config.json sizes are known here (a hub id is never downloaded for the plan)
KNOWN_SHAPES: dict[str, ModelShape] = {
    f"Qwen/Qwen2.5-{size}{suffix}": _shape(*dims)
    for size, dims in _QWEN.items()
    for suffix in ("", "-Instruct")
}
KNOWN_SHAPES |= {
    f"HuggingFaceTB/SmolLM2-135M{s}": _shape(576, 30, 9, 3, 1536, 49152, True) for s in ("", "-Instruct")
}
KNOWN_SHAPES["smollm2"] = KNOWN_SHAPES["HuggingFaceTB/SmolLM2-135M-Instruct"]


def shape_from_config(config: dict, source: str = "config.json") -> ModelShape:
    """A :class:`ModelShape` from a config.json's fields (its text config for a multimodal one)."""
    c = config.get("text_config") or config
    heads = c["num_attention_heads"]
    return ModelShape(
        hidden=c["hidden_size"],
        layers=c["num_hidden_layers"],
        heads=heads,
        kv_heads=c.get("num_key_value_heads") or heads,
        intermediate=c["intermediate_size"],
        vocab=c["vocab_size"],
        tied=bool(config.get("tie_word_embeddings", c.get("tie_word_embeddings", True))),
        source=source,
    )


def model_shape(name: str) -> ModelShape | None:
    """The sizes of model ``name`` without loading (or downloading) it: a local checkpoint's config.json, the
    Hugging Face cache's, or :data:`KNOWN_SHAPES`; None when none of them knows it."""
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return shape_from_config(json.loads((path / "config.json").read_text()), f"{path}/config.json")
    if name in KNOWN_SHAPES:
        return KNOWN_SHAPES[name]
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
    except Exception:  # not a valid repo id: no cached config either
        cached = None
    if isinstance(cached, str):
        return shape_from_config(json.loads(Path(cached).read_text()), "Hugging Face cache")
    return None


# -- activations ----------------------------------------------------------------------------------------------

# Saved-tensor bytes per token of one decoder layer, as coefficients of (hidden, intermediate, kv_dim, heads),
# measured with saved-tensor hooks (measure_activation_bytes) on Llama/Qwen2 models whose sizes were varied
# one at a time, sdpa attention without a padding mask (no T x T term). "bf16": bf16 weights (DeepSpeed's
# bf16 module, FSDP2's bf16 compute); "autocast": fp32 weights under bf16 autocast (the residual stream and
# the norms stay fp32); "fp32": fp32 throughout (the PPO critic on a GPU). Outside the layers: the final norm.
ACTIVATION_COEFFICIENTS = {
    "bf16": ((20, 8, 4, 4.5), 6),
    "autocast": ((30, 8, 4, 4.5), 9),
    "fp32": ((32, 16, 8, 4.5), 9),
}
RESIDUAL_BYTES = {"bf16": 2, "autocast": 4, "fp32": 4}  # a layer's input, what checkpointing keeps


def layer_activation_bytes(shape: ModelShape, compute: str) -> float:
    """Saved bytes per token of one decoder layer under ``compute`` (a key of ACTIVATION_COEFFICIENTS)."""
    (a, b, c, d), _ = ACTIVATION_COEFFICIENTS[compute]
    return a * shape.hidden + b * shape.intermediate + c * shape.kv_dim + d * shape.heads


def saved_bytes_per_token(shape: ModelShape, compute: str) -> float:
    """Bytes per token the body's forward saves for its backward without checkpointing: every layer's saved
    tensors and the final norm's (what :func:`measure_activation_bytes` counts)."""
    outside = ACTIVATION_COEFFICIENTS[compute][1] * shape.hidden
    return shape.layers * layer_activation_bytes(shape, compute) + outside


def activation_bytes_per_token(
    shape: ModelShape, compute: str, checkpointing: bool = False, fused_head: bool = True
) -> float:
    """Bytes per token the loss's forward keeps for its backward, plus one layer's working space.

    Without checkpointing: :func:`saved_bytes_per_token` (every layer's saved tensors); with it: ``layers x
    residual`` (each layer's input) plus one layer recomputed. Both add one more layer for the backward's
    gradients of the activations. The head: TRL's fused log-prob head (chunked, no ``[tokens, vocab]`` logits
    kept) adds nothing per token; an unfused one keeps the logits and their log-softmax (``vocab x 6``)."""
    layer = layer_activation_bytes(shape, compute)
    if checkpointing:
        outside = ACTIVATION_COEFFICIENTS[compute][1] * shape.hidden
        body = shape.layers * RESIDUAL_BYTES[compute] * shape.hidden + outside + layer
    else:
        body = saved_bytes_per_token(shape, compute)
    head = 0 if fused_head else 6 * shape.vocab
    return body + layer + head


def measure_activation_bytes(model, batch: int, tokens: int, autocast: bool = False) -> int:
    """Bytes of the distinct storages the forward of ``model``'s body saves for backward (saved-tensor hooks;
    parameters not counted), on ``batch`` rows of ``tokens`` random token ids, no padding mask."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), device=device)
    cast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
        model.base_model(input_ids=ids, use_cache=False)
    return sum(saved.values())


# -- the strategy ---------------------------------------------------------------------------------------------


class Strategy(StrEnum):
    """How the policy's states are spread over the processes."""

    plain = "one process"
    ddp = "DDP"
    zero1 = "ZeRO-1"
    zero2 = "ZeRO-2"
    zero3 = "ZeRO-3"
    fsdp2 = "FSDP2"

    @property
    def sharded(self) -> bool:
        return self in (Strategy.zero1, Strategy.zero2, Strategy.zero3, Strategy.fsdp2)


@dataclass(frozen=True)
class Launch:
    """The strategy, how many processes and, under DeepSpeed, whether its module is cast to bf16."""

    strategy: Strategy
    processes: int
    bf16_module: bool = True
    source: str = ""


# accelerate's distributed types zerosim plans and trains under: one process, DDP (every MULTI_* device kind),
# DeepSpeed ZeRO 0-3, FSDP
DDP_TYPES = (
    "MULTI_CPU",
    "MULTI_GPU",
    "MULTI_NPU",
    "MULTI_XPU",
    "MULTI_MLU",
    "MULTI_MUSA",
    "MULTI_HPU",
    "MULTI_SDAA",
)
LAUNCH_TYPES = ("NO", *DDP_TYPES, "DEEPSPEED", "FSDP")
ZERO_STAGES = {0: Strategy.ddp, 1: Strategy.zero1, 2: Strategy.zero2, 3: Strategy.zero3}


def launch_from_config(path: Path, processes: int | None = None) -> Launch:
    """The :class:`Launch` an ``accelerate launch --config_file PATH`` job runs under, read through one
    validator: a file that is no YAML mapping, a distributed type zerosim does not train under (Megatron-LM,
    XLA), a ZeRO stage outside 0-3, a process count below 1 are refused in one line naming the key."""
    import yaml

    from zerosim.core.config import ConfigError, _yaml_error

    key = f"--launch-config {path}"
    if not path.is_file():
        raise ConfigError(
            f"--launch-config: {path} does not exist; pass an accelerate config (configs/accelerate/)"
        )
    try:
        c = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"--launch-config: {_yaml_error(path, exc)}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: not UTF-8 text; pass an accelerate config (configs/accelerate/)") from None
    c = {} if c is None else c
    if not isinstance(c, dict):
        raise ConfigError(
            f"{key}: an accelerate config is a YAML mapping (distributed_type: ..., num_processes: ...), "
            f"this file holds a {type(c).__name__}"
        )
    kind = str(c.get("distributed_type", "NO")).upper()
    if kind not in LAUNCH_TYPES:
        raise ConfigError(
            f"{key}: distributed_type {kind} is not one zerosim plans or trains under; use NO, MULTI_GPU "
            "(or another MULTI_* device: DDP), DEEPSPEED or FSDP (configs/accelerate/ has one of each)"
        )
    n = processes if processes is not None else _count(c.get("num_processes", 1), f"{key}: num_processes")
    _count(n, "--processes")
    bf16 = str(c.get("mixed_precision", "no")).lower() == "bf16"
    if kind == "DEEPSPEED":
        section = c.get("deepspeed_config") or {}
        if not isinstance(section, dict):
            raise ConfigError(f"{key}: deepspeed_config is a {type(section).__name__}, not a mapping")
        strategy = zero_strategy(section.get("zero_stage", 2), f"{key}: deepspeed_config.zero_stage")
    elif kind == "FSDP":
        strategy = Strategy.fsdp2
    else:
        strategy = Strategy.ddp if n > 1 else Strategy.plain
    return Launch(strategy, n, bf16_module=bf16, source=str(path))


def _count(value: Any, key: str) -> int:
    """A process count: an integer of at least 1, else a :class:`ConfigError` naming ``key``."""
    from zerosim.core.config import ConfigError

    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} is {value!r}: a number of processes, at least 1 (e.g. 8 for 8 GPUs)")
    return value


def zero_strategy(stage: Any, key: str) -> Strategy:
    """The :class:`Strategy` of DeepSpeed ZeRO ``stage`` (0-3), else a :class:`ConfigError` naming ``key``."""
    from zerosim.core.config import ConfigError

    if isinstance(stage, str) and stage.strip().isdigit():
        stage = int(stage)
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ConfigError(f"{key} is {stage!r}: DeepSpeed's ZeRO stages are 0, 1, 2 and 3")
    return ZERO_STAGES[stage]


def launch_from_environment(processes: int | None = None) -> Launch:
    """The :class:`Launch` of this process: what ``accelerate launch`` put in the environment, else DDP over
    ``processes`` (or $WORLD_SIZE) processes, one process without either."""
    n = processes or int(os.environ.get("WORLD_SIZE", "1"))
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
        strategy = zero_strategy(stage, "$ACCELERATE_DEEPSPEED_ZERO_STAGE")
        return Launch(strategy, n, source="accelerate launch")
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        return Launch(Strategy.fsdp2, n, source="accelerate launch")
    return Launch(Strategy.ddp if n > 1 else Strategy.plain, n, source="no --launch-config")


# -- the plan -------------------------------------------------------------------------------------------------


@dataclass
class MemoryPlan:
    """Per-GPU bytes by part (``parts``: name -> (bytes, how)), the card, and what to change when over."""

    model: str
    shape: ModelShape
    launch: Launch
    parts: dict[str, tuple[float, str]] = field(default_factory=dict)
    card: float | None = None
    fixes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    adapter_params: int = 0  # LoRA's trainable parameters (policy.lora), 0 for a full fine-tune

    @property
    def total(self) -> float:
        return sum(b for b, _ in self.parts.values())

    @property
    def fits(self) -> bool | None:
        return None if self.card is None else self.total <= self.card


def policy_states(shape: ModelShape, launch: Launch, bf16_weights: bool) -> dict[str, tuple[float, str]]:
    """Weights, gradients and AdamW states of the trained policy on one GPU (DeepSpeed's estimators)."""
    P, N, s = shape.params, launch.processes, launch.strategy
    if s in (Strategy.plain, Strategy.ddp):
        buckets = 4 * P if s == Strategy.ddp else 0  # DDP's gradient buckets are a second copy
        how = "fp32 gradients" + (" + DDP's bucket copy" if buckets else "")
        return {
            "weights": (4 * P, "fp32, whole"),
            "gradients": (4 * P + buckets, how),
            "optimizer": (8 * P, "AdamW moments, fp32, whole"),
        }
    if s == Strategy.fsdp2:
        gathered = 2 * 2 * shape.largest_layer  # bf16 copies of the layer computed and the one prefetched
        return {
            "weights": (4 * P / N + gathered, f"fp32 shards 1/{N} + 2 gathered bf16 layers"),
            "gradients": (4 * P / N, f"fp32 shards 1/{N}"),
            "optimizer": (8 * P / N, f"AdamW moments 1/{N}"),
        }
    w = 2 if launch.bf16_module or bf16_weights else 4
    if s == Strategy.zero3:
        weights = (w * P / N + 4 * shape.largest_layer, f"{w}-byte shards 1/{N} + the largest layer gathered")
    else:
        weights = (w * P, f"{'bf16' if w == 2 else 'fp32'} module, whole")
    grads = (w * P if s == Strategy.zero1 else (w + 4) * P / N, "whole" if s == Strategy.zero1 else f"1/{N}")
    return {
        "weights": weights,
        "gradients": (grads[0], f"{grads[1]} (DeepSpeed's estimator)"),
        "optimizer": (12 * P / N, f"fp32 masters + AdamW moments 1/{N}"),
    }


# -- LoRA (policy.lora) ---------------------------------------------------------------------------------------

# TRL scores a LoRA policy's reference with the adapters disabled: the base it already holds, no copy
LORA_REFERENCE = (
    0.0,
    "none: TRL scores the reference with the LoRA adapters disabled (policy.lora), no copy",
)


def lora_linears(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of a Llama/Qwen2 decoder layer: what ``all-linear`` targets
    there (the LM head and the embeddings are not adapted)."""
    h, kv, i = shape.hidden, shape.kv_dim, shape.intermediate
    return {
        "q_proj": (h, h),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (h, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def adapter_params(shape: ModelShape, r: int, target_modules: str) -> tuple[int, list[str]]:
    """LoRA's trainable parameters over the decoder layers, and the names in ``target_modules`` no Llama/Qwen2
    layer has (not counted). A linear layer of (in, out) features gains ``A`` (r x in) and ``B`` (out x r):
    ``r x (in + out)``. ``target_modules``: ``all-linear`` or a comma list of module names, as
    ``policy.lora.target_modules``."""
    from zerosim.core.models import lora_targets

    linears = lora_linears(shape)
    names = lora_targets(target_modules)
    names = list(linears) if names is None else names
    known = [n for n in dict.fromkeys(names) if n in linears]
    unknown = [n for n in dict.fromkeys(names) if n not in linears]
    per_layer = sum(r * (linears[n][0] + linears[n][1]) for n in known)
    return shape.layers * per_layer, unknown


def lora_states(shape: ModelShape, launch: Launch, bf16_weights: bool, lora) -> tuple[dict, int]:
    """The parts of a LoRA policy (``lora``: :class:`~zerosim.training.config.PolicyLoraConfig`) on one GPU,
    and its adapter parameter count.

    The frozen base: its dtype (``policy.dtype=bfloat16``: 2 bytes a parameter, else 4; DeepSpeed's bf16
    module: 2), no gradients, no AdamW states; whole under one process, DDP and ZeRO-1/2, sharded 1/N under
    ZeRO-3 and FSDP2 with the same gathered layers as a full fine-tune's weights. The adapters: 16 bytes a
    parameter (fp32 weight, gradient, two AdamW moments; DeepSpeed: bf16 weight and gradient + fp32 master and
    moments, the same 16), whole under one process and DDP, 1/N under ZeRO and FSDP2 (as the optimizer states:
    ZeRO-1/2 keep their 16-bit weights whole, a few bytes a parameter of a part that is small anyway)."""
    P, N, s = shape.params, launch.processes, launch.strategy
    A, unknown = adapter_params(shape, lora.r, lora.target_modules)
    deepspeed_bf16 = launch.bf16_module and s in (Strategy.zero1, Strategy.zero2, Strategy.zero3)
    w = 2 if bf16_weights or deepspeed_bf16 else 4
    kind = f"frozen base, {'bf16' if w == 2 else 'fp32'}"
    if s == Strategy.zero3:
        weights = (w * P / N + 4 * shape.largest_layer, f"{kind} shards 1/{N} + the largest layer gathered")
    elif s == Strategy.fsdp2:
        weights = (w * P / N + 2 * 2 * shape.largest_layer, f"{kind} shards 1/{N} + 2 gathered bf16 layers")
    else:
        weights = (w * P, f"{kind}, whole")
    weights = (weights[0], weights[1] + " (policy.lora: no gradients or AdamW states for the base)")
    targets = lora.target_modules.strip()
    how = (
        f"LoRA r={lora.r} on {targets} x {shape.layers} layers: {A / 1e6:.1f} M params x 16 bytes (fp32 "
        f"weight, gradient, AdamW moments), " + (f"1/{N} as the optimizer states" if s.sharded else "whole")
    )
    if unknown:
        how += (
            f"; not counted, no such linear in a Llama/Qwen2 layer: {', '.join(unknown)} "
            f"(known: {', '.join(lora_linears(shape))})"
        )
    adapters = (16 * A / (N if s.sharded else 1), how)
    return {"weights": weights, "adapters": adapters}, A


# -- the reference, the rollout -------------------------------------------------------------------------------

# zerosim.training.recipe.grpo_args leaves TRL's default (True): under ZeRO-3 the hf rollout gathers the whole
# policy once rather than layer by layer (tests/test_memory_plan.py holds the two equal)
DS3_GATHER_FOR_GENERATION = True


def rollout_gather(
    shape: ModelShape, launch: Launch, bf16_weights: bool, adapters: int = 0
) -> tuple[float, str]:
    """ZeRO-3 with ``trainer.generation=hf``: the whole policy (base and any adapters) gathered in its 16-bit
    module on every rank for the rollout (TRL's ``ds3_gather_for_generation``), beside the shards."""
    w = 2 if launch.bf16_module or bf16_weights else 4
    return (
        w * (shape.params + adapters),
        f"the whole {'bf16' if w == 2 else 'fp32'} policy gathered on every rank for the hf rollout "
        "(ZeRO-3, TRL's ds3_gather_for_generation=True)",
    )


def reference_bytes(shape: ModelShape, launch: Launch, bf16_weights: bool) -> tuple[float, str]:
    """TRL's reference model: the policy's dtype, prepared like it (DeepSpeed: stage 0 below ZeRO-3)."""
    P, N, s = shape.params, launch.processes, launch.strategy
    if s == Strategy.zero3:
        return 2 * P / N, f"bf16 shards 1/{N}"
    if s == Strategy.fsdp2:
        return 4 * P / N, f"fp32 shards 1/{N}"
    if s.sharded:
        return 2 * P, "bf16, whole"
    return (2 if bf16_weights else 4) * P, f"{'bf16' if bf16_weights else 'fp32'}, whole"


def kv_bytes_per_token(shape: ModelShape, width: int = 2) -> int:
    """Key/value cache bytes per token (vLLM's bf16 cache by default)."""
    return shape.layers * 2 * shape.kv_dim * width


def longest_row(cfg) -> tuple[int, int, int]:
    """(prompt, completion, row) tokens of the longest row the recipe allows: the prompt budget and every
    turn at its cap, each search's observation at ``max_obs_tokens`` (the last turn searches no more), no
    more than ``rollout.max_completion_tokens`` in all, nor than ``trainer.vllm_max_model_length``."""
    r = cfg.rollout
    turns = r.max_turns * r.max_new_tokens + (r.max_turns - 1) * (r.max_obs_tokens + OBSERVATION_WRAPPER)
    completion = min(r.max_completion_tokens, turns)
    row = PROMPT_BUDGET + completion
    if cfg.trainer.generation != "hf" and cfg.trainer.vllm_max_model_length:
        row = min(row, cfg.trainer.vllm_max_model_length)
    return row - completion, completion, row


def policy_compute(cfg, launch: Launch) -> str:
    """What the loss's forward computes in on a GPU: a key of ACTIVATION_COEFFICIENTS."""
    if cfg.trainer.bf16 is False:
        return "fp32"
    if launch.strategy.sharded and (launch.bf16_module or cfg.policy.dtype == "bfloat16"):
        return "bf16"  # DeepSpeed's bf16 module, FSDP2's bf16 compute
    return "bf16" if cfg.policy.dtype == "bfloat16" else "autocast"


@dataclass(frozen=True)
class Knobs:
    """What the fixes vary: the micro-batch, gradient checkpointing, vLLM's share, the strategy."""

    micro: int
    checkpointing: bool
    vllm_share: float
    launch: Launch


def _activations(cfg, shape: ModelShape, knobs: Knobs, row: int) -> dict[str, tuple[float, str]]:
    compute = policy_compute(cfg, knobs.launch)
    per_token = activation_bytes_per_token(shape, compute, knobs.checkpointing)
    tokens = knobs.micro * row
    how = "checkpointed" if knobs.checkpointing else "no checkpointing"
    parts = {
        "activations": (
            per_token * tokens,
            f"{knobs.micro} rows x {row:,} tokens x {per_token / 1e6:.2f} MB/token ({compute}, {how})",
        )
    }
    if cfg.trainer.generation == "hf":  # the rollout's key/value cache over the whole generation batch
        rows = cfg.trainer.per_device_train_batch_size * cfg.trainer.gradient_accumulation_steps
        width = 2 if compute == "bf16" else 4
        parts["generation"] = (
            kv_bytes_per_token(shape, width) * rows * row,
            f"transformers' KV cache, {rows} rows x {row:,} tokens",
        )
    return parts


def _critic(cfg, shape: ModelShape, knobs: Knobs, row: int) -> dict[str, tuple[float, str]]:
    """The PPO critic: fp32 weights with their own AdamW, whole on every rank, computed in fp32; its
    micro-batch is the policy's (``critic_micro_batch = per_device_train_batch_size``)."""
    per_token = activation_bytes_per_token(shape, "fp32", knobs.checkpointing)
    return {
        "critic": (
            16 * shape.params,
            f"{shape.params / 1e9:.2f} B params, fp32 weights + grads + AdamW, whole",
        ),
        "critic activations": (
            per_token * knobs.micro * row,
            f"micro-batch {knobs.micro} rows (trainer.per_device_train_batch_size) x {row:,} tokens x "
            f"{per_token / 1e6:.2f} MB/token (fp32)",
        ),
    }


def _vllm(cfg, shape: ModelShape, knobs: Knobs, card: float | None, row: int) -> dict[str, tuple[float, str]]:
    if cfg.trainer.generation != "vllm_colocate":
        return {}
    share = knobs.vllm_share
    if card is None:
        return {"vLLM": (0.0, f"{share:g} of the card (trainer.vllm_gpu_memory_utilization; no card given)")}
    weights = 2 * shape.params / max(1, cfg.trainer.vllm_tensor_parallel_size)
    cache = share * card - weights - VLLM_OVERHEAD
    tokens = max(0, int(cache // kv_bytes_per_token(shape)))
    return {
        "vLLM": (
            share * card,
            f"trainer.vllm_gpu_memory_utilization {share:g}: {weights / GB:.1f} GB weights, KV cache for "
            f"{tokens:,} tokens ({tokens // row} rows of {row:,} at once)",
        )
    }


def plan_parts(cfg, knobs: Knobs, card: float | None = None) -> MemoryPlan | None:
    """The plan at ``knobs``; None when the policy's sizes are not known here (:func:`model_shape`)."""
    shape = model_shape(cfg.policy.model)
    if shape is None:
        return None
    bf16_weights = cfg.policy.dtype == "bfloat16"
    _, _, row = longest_row(cfg)
    plan = MemoryPlan(cfg.policy.model, shape, knobs.launch, card=card)
    lora = cfg.policy.lora
    if lora.enabled:
        plan.parts, plan.adapter_params = lora_states(shape, knobs.launch, bf16_weights, lora)
    else:
        plan.parts = policy_states(shape, knobs.launch, bf16_weights)
    if cfg.trainer.beta > 0:
        plan.parts["reference"] = (
            LORA_REFERENCE if lora.enabled else reference_bytes(shape, knobs.launch, bf16_weights)
        )
    if knobs.launch.strategy == Strategy.zero3 and cfg.trainer.generation == "hf":
        plan.parts["rollout gather"] = rollout_gather(shape, knobs.launch, bf16_weights, plan.adapter_params)
    plan.parts |= _activations(cfg, shape, knobs, row)
    from zerosim.training.algorithms import spec_of

    if spec_of(cfg.trainer.algorithm).needs_critic:
        critic = model_shape(cfg.trainer.critic_model) if cfg.trainer.critic_model else shape
        if critic is None:
            plan.notes.append(f"critic {cfg.trainer.critic_model}: sizes unknown here, not counted")
        else:
            plan.parts |= _critic(cfg, critic, knobs, row)
    plan.parts |= _vllm(cfg, shape, knobs, card, row)
    plan.parts["runtime"] = (RUNTIME_RESERVE, "CUDA context, NCCL, buckets, allocator slack")
    return plan


def knobs_of(cfg, launch: Launch) -> Knobs:
    t = cfg.trainer
    return Knobs(
        t.per_device_train_batch_size, t.gradient_checkpointing, t.vllm_gpu_memory_utilization, launch
    )


def memory_plan(cfg, launch: Launch, card: float | None = None) -> MemoryPlan | None:
    """The recipe's plan on a card of ``card`` bytes (None: not compared); over it, ``fixes`` names each key
    that alone would make it fit, and by how much."""
    knobs = knobs_of(cfg, launch)
    plan = plan_parts(cfg, knobs, card)
    if plan is None:
        return plan
    other = plan_parts(cfg, Knobs(knobs.micro, not knobs.checkpointing, knobs.vllm_share, launch), card)
    plan.notes.append(
        f"with trainer.gradient_checkpointing={str(not knobs.checkpointing).lower()}: {other.total / GB:.1f} GB "
        f"({abs(plan.total - other.total) / GB:.1f} GB {'less' if other.total < plan.total else 'more'})"
    )
    if card is None:
        return plan
    if not plan.fits:
        plan.fixes = _fixes(cfg, plan, knobs, card)
    elif cfg.trainer.generation == "vllm_colocate":
        room = (card - plan.total) / card
        plan.notes.append(
            f"free {(card - plan.total) / GB:.1f} GB: vLLM could take up to "
            f"trainer.vllm_gpu_memory_utilization={int((knobs.vllm_share + room) * 100) / 100:g} on this card"
        )
    return plan


def _fixes(cfg, plan: MemoryPlan, knobs: Knobs, card: float) -> list[str]:
    """Each single change that brings ``plan`` under ``card``: checkpointing, a smaller micro-batch with
    the same trajectories per step, a smaller vLLM share, ZeRO-3."""
    t, fixes = cfg.trainer, []

    def fits(**change) -> MemoryPlan | None:
        other = plan_parts(cfg, Knobs(**{**knobs.__dict__, **change}), card)
        return other if other.fits else None

    if not knobs.checkpointing and (other := fits(checkpointing=True)):
        fixes.append(f"trainer.gradient_checkpointing=true (-{(plan.total - other.total) / GB:.1f} GB)")
    per_gpu = t.per_device_train_batch_size * t.gradient_accumulation_steps
    for checkpointing in dict.fromkeys((knobs.checkpointing, True)):
        micros = [m for m in range(knobs.micro - 1, 0, -1) if per_gpu % m == 0 and m % t.num_generations == 0]
        micro = next((m for m in micros if fits(micro=m, checkpointing=checkpointing)), None)
        if micro is not None:
            extra = " trainer.gradient_checkpointing=true" if checkpointing != knobs.checkpointing else ""
            fixes.append(
                f"trainer.per_device_train_batch_size={micro} trainer.gradient_accumulation_steps="
                f"{per_gpu // micro}{extra} (the same {per_gpu} trajectories per GPU per step)"
            )
            break
    if t.generation == "vllm_colocate":
        needed = 2 * plan.shape.params + VLLM_OVERHEAD + kv_bytes_per_token(plan.shape) * longest_row(cfg)[2]
        share = knobs.vllm_share - (plan.total - card) / card
        share = int(share * 100) / 100
        if share * card >= needed:
            fixes.append(
                f"trainer.vllm_gpu_memory_utilization={share:g} (-{(knobs.vllm_share - share) * card / GB:.1f} GB)"
            )
    if knobs.launch.strategy != Strategy.zero3 and knobs.launch.processes > 1:
        zero3 = Launch(Strategy.zero3, knobs.launch.processes)
        if other := fits(launch=zero3):
            fixes.append(
                f"launch with configs/accelerate/zero3.yaml (-{(plan.total - other.total) / GB:.1f} GB)"
            )
    return fixes or [
        "none of the recipe's keys alone: a bigger card, more GPUs under ZeRO-3, or a smaller model"
    ]


def plan_rows(plan: MemoryPlan | None, policy: str) -> list[tuple[str, str]]:
    """The plan as dry-run rows: one per part, then the total against the card and what to change."""
    if plan is None:
        return [
            (
                "memory",
                f"{policy}: sizes unknown here (no local config.json, not in the Hugging Face cache nor the "
                "known configs); point policy.model at a local checkpoint to plan memory",
            )
        ]
    s = plan.shape
    where = plan.launch.source and f" ({plan.launch.source})"
    rows = [
        (
            "memory per GPU",
            f"{plan.model}: {s.params / 1e9:.2f} B params ({s.source}); {plan.launch.strategy.value} over "
            f"{plan.launch.processes} process(es){where}",
        )
    ]
    rows += [(f"  {name}", f"{size / GB:6.1f} GB  {how}") for name, (size, how) in plan.parts.items()]
    if plan.card is None:
        total = f"{plan.total / GB:.1f} GB; no card to compare with: pass --gpu-memory 80 (or 141)"
    elif plan.fits:
        total = f"{plan.total / GB:.1f} of {plan.card / GB:g} GB: fits ({(plan.card - plan.total) / GB:.1f} GB free)"
    else:
        total = (
            f"{plan.total / GB:.1f} of {plan.card / GB:g} GB: OVER by {(plan.total - plan.card) / GB:.1f} GB; "
            "change one of: " + "; ".join(plan.fixes)
        )
    rows.append(("  total", total))
    rows += [("  note", n) for n in plan.notes]
    return rows


def check_gpu_memory(gpu_memory: float | None) -> None:
    """Refuse a ``--gpu-memory`` no card has: not a number (inf, nan), under :data:`CARD_GB_RANGE`'s 1 GB, or
    over its 4096 GB (the largest cards hold a few hundred GB: more is a typo or MB given for GB)."""
    import math

    low, high = CARD_GB_RANGE
    if gpu_memory is None or (math.isfinite(gpu_memory) and low <= gpu_memory <= high):
        return
    from zerosim.core.config import ConfigError

    raise ConfigError(
        f"--gpu-memory {gpu_memory:g}: give one GPU's memory in GB, a number from {low:g} to {high:g} "
        "(80 for an H100, 141 for an H200; no card holds more than a few hundred GB, so a larger value is a "
        "typo or MB given for GB)"
    )


def card_bytes(gpu_memory: float | None) -> float | None:
    """``--gpu-memory`` GB (checked: :func:`check_gpu_memory`), else this machine's first GPU, else None."""
    if gpu_memory is not None:
        check_gpu_memory(gpu_memory)
        return gpu_memory * GB
    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return None


def launch_plan(
    cfg, processes: int | None = None, launch_config: Path | None = None, gpu_memory: float | None = None
) -> MemoryPlan:
    """The memory plan of ``cfg`` under the launch a dry run describes (a config file, or this environment)."""
    if launch_config is not None:
        launch = launch_from_config(Path(launch_config), processes)
    else:
        launch = launch_from_environment(processes)
    return memory_plan(cfg, launch, card_bytes(gpu_memory))


def memory_rows(
    cfg, processes: int | None = None, launch_config: Path | None = None, gpu_memory: float | None = None
) -> list[tuple[str, str]]:
    """What ``zerosim train --dry-run`` prints about memory (after its other rows)."""
    return plan_rows(launch_plan(cfg, processes, launch_config, gpu_memory), cfg.policy.model)

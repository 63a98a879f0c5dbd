"""The one-call device check: PASS/FAIL and figures for what only a GPU machine can show, in minutes.

    python benchmarks/gpu_check.py            # on one NVIDIA GPU (benchmarks/gpu_check.sh installs the kit first)
    python benchmarks/gpu_check.py --cpu      # the same script end to end on CPU, with a tiny model (the suite runs it)

1. versions and the device;
2. GRPO steps through ``SearchTrainer`` on a randomly initialised model of Qwen2.5-3B's shape (its config only:
   no weights travel), fp32 weights and bf16 compute as ``zerosim train`` runs it: seconds per step and its
   split (log-prob passes, update), policy tokens per second, peak GPU memory;
3. the recipe's shape (``--recipe``, default configs/zerosearch-qwen2.5-3b.yaml): a step of its micro-batch at
   the longest row it allows, with its reference model and checkpointing, on a random model of its policy's
   shape; the peak allocated GPU memory against the memory plan's prediction for that step, within 15%;
   the same for a LoRA recipe (``--lora-recipe``, default configs/zerosearch-qwen2.5-7b-lora.yaml): its frozen
   base at its dtype under its adapters (peft; skipped, said so, where peft is not installed);
4. precision (docs/scaling.md): one AdamW step at lr 1e-6 — bf16 weights barely move, fp32 weights with bf16
   compute take the all-fp32 step;
5. one PPO step with its critic: finite loss, the critic's weights move;
6. zerosim's decode loop against transformers ``generate``: greedy tokens identical, and the speed ratio.

Rollouts are synthetic (random prompt and completion ids with an environment-token mask), so the figures are
the trainer's; ``benchmarks/step.py`` times whole steps with search. Exit code 0 when every check passes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

# JAX, where the image has it and anything initialises its backend, takes 75% of the GPU at once (its default
# preallocation): the recipe-shape check sizes its model by the memory free, so JAX allocates as it goes
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

QWEN25_3B = dict(  # Qwen/Qwen2.5-3B's config.json, the shape that matters for memory and speed
    vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
    num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
)  # fmt: skip
TINY = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
)  # fmt: skip

# the recipe-shape check: the recipe it reads by default, what its step allocates (the plan's parts it compares
# with the peak), why the others are left out, and how far the peak may be from the prediction
DEFAULT_RECIPE = Path(__file__).resolve().parents[1] / "configs" / "zerosearch-qwen2.5-3b.yaml"
DEFAULT_LORA_RECIPE = DEFAULT_RECIPE.with_name("zerosearch-qwen2.5-7b-lora.yaml")
COMPARED = ("weights", "gradients", "optimizer", "adapters", "reference", "activations")
EXCLUDED = {
    "vLLM": "no vLLM runs here (share 0)",
    "generation": "synthetic rollouts: no KV cache",
    "critic": "the critic is not built here",
    "critic activations": "the critic is not built here",
    "runtime": "not tensors: outside max_memory_allocated",
}
TOLERANCE = 0.15
# on CPU the recipe's rows shrink to one 16-token turn (the 512-token prompt budget stays): seconds, not minutes
CPU_RECIPE_OVERRIDES = [
    "rollout.max_turns=1",
    "rollout.max_new_tokens=16",
    "rollout.max_completion_tokens=16",
]


class Check:
    def __init__(self) -> None:
        self.results: list[tuple[str, bool, str]] = []
        self.skipped: list[tuple[str, str]] = []
        self.figures: dict[str, object] = {}

    def record(self, name: str, ok: bool, detail: str) -> None:
        self.results.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)

    def skip(self, name: str, why: str) -> None:
        """A check this machine cannot run: said so, counted neither passed nor failed."""
        self.skipped.append((name, why))
        print(f"SKIP  {name}: {why}", flush=True)


def random_model(shape: dict, device: str, dtype=torch.float32, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(dtype)


def synthetic_rollout(prompt_len: int, completion_len: int, vocab: int):
    """A TRL ``rollout_func``: random prompt and completion ids; every 8th completion token an environment
    token (out of the loss, as ``<information>`` tokens are)."""
    g = torch.Generator().manual_seed(7)

    def rollout(prompts, trainer):
        n = len(prompts)
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
        for _ in range(n):
            out["prompt_ids"].append(torch.randint(10, vocab, (prompt_len,), generator=g).tolist())
            out["completion_ids"].append(torch.randint(10, vocab, (completion_len,), generator=g).tolist())
            out["logprobs"].append([0.0] * completion_len)
            out["env_mask"].append([0 if j % 8 == 7 else 1 for j in range(completion_len)])
        return out

    return rollout


def make_trainer(
    model, tokenizer, out: Path, *, cpu: bool, steps: int, batch: int, completion: int,
    prompt_len: int | None = None, grpo: dict | None = None, **kwargs,
):  # fmt: skip
    """A ``SearchTrainer`` on synthetic rollouts of ``prompt_len`` + ``completion`` tokens; ``grpo``: GRPOConfig
    fields over the defaults here (the recipe-shape check passes the recipe's)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig

    from zerosim.training.trainer import SearchTrainer

    prompt_len = prompt_len or (64 if not cpu else 8)
    bf16 = kwargs.pop("bf16", not cpu)
    fields = dict(
        output_dir=str(out), beta=0.0, num_generations=4, per_device_train_batch_size=batch,
        gradient_accumulation_steps=2, max_completion_length=completion, max_steps=steps,
        learning_rate=kwargs.pop("learning_rate", 1e-6), use_cpu=cpu, bf16=bf16, report_to=[], logging_steps=1,
        save_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    args = GRPOConfig(**(fields | (grpo or {})))
    history: list[dict] = []

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            history.append(dict(logs or {}))

    rewards = torch.Generator().manual_seed(3)
    trainer = SearchTrainer(
        model=model,
        reward_funcs=[lambda completions, **kw: torch.rand(len(completions), generator=rewards).tolist()],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "q"}] * (batch * 2 * steps + batch * 2)),
        processing_class=tokenizer,
        rollout_func=synthetic_rollout(prompt_len, completion, min(model.config.vocab_size, len(tokenizer))),
        callbacks=[Keep()],
        **kwargs,
    )
    return trainer, history


def check_versions(check: Check, cpu: bool) -> None:
    import transformers
    import trl

    device = (
        "cpu"
        if cpu
        else f"{torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB"
    )
    text = (
        f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"transformers {transformers.__version__}, trl {trl.__version__}; device: {device}"
    )
    check.figures["versions"] = text
    check.record("versions", cpu or torch.cuda.is_available(), text)


def check_grpo(check: Check, tokenizer, cpu: bool, steps: int, tmp: Path) -> None:
    device = "cpu" if cpu else "cuda"
    shape = TINY if cpu else QWEN25_3B
    model = random_model(shape, device)  # fp32 weights: what the optimizer steps (training_dtype)
    batch, completion = (4, 16) if cpu else (8, 512)
    trainer, logs = make_trainer(
        model, tokenizer, tmp / "grpo", cpu=cpu, steps=steps, batch=batch, completion=completion
    )
    if not cpu:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    per_step = [entry for entry in logs if "time/step_s" in entry]
    last = per_step[-1] if per_step else {}
    split = {
        k.removeprefix("time/").removesuffix("_s"): round(v, 3)
        for k, v in last.items()
        if k.startswith("time/")
    }
    trajectories = batch * 2  # per optimizer step: micro-batch x accumulation
    policy_tokens = trajectories * completion * 7 / 8  # the environment tokens are out of the loss
    step_s = last.get("time/step_s", seconds / steps)
    figures = {
        "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
        "steps": steps,
        "trajectories_per_step": trajectories,
        "completion_tokens": completion,
        "step_s": round(step_s, 3),
        "split_s": split,
        "policy_tokens_per_s": round(policy_tokens / step_s, 1),
        "peak_gib": None if cpu else round(torch.cuda.max_memory_allocated() / 2**30, 1),
        "loss_finite": all(torch.isfinite(torch.tensor(e["loss"])).item() for e in logs if "loss" in e),
    }
    check.figures["grpo"] = figures
    ok = len(per_step) == steps and figures["loss_finite"]
    check.record("grpo steps", ok, json.dumps(figures))
    del trainer, model
    gc.collect()  # the trainer's reference cycles hold the model until collected
    if not cpu:
        torch.cuda.empty_cache()


def recipe_dims(shape, layers: int, row: int) -> dict:
    """A Qwen2 config's sizes for ``shape`` (a :class:`~zerosim.training.memory.ModelShape`) at ``layers``
    decoder layers, with positions for a row of ``row`` tokens."""
    return dict(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max(4096, row), tie_word_embeddings=shape.tied,
    )  # fmt: skip


def check_plan(cfg, folder: Path, dims: dict):
    """The memory plan (``zerosim.training.memory.plan_parts``) of exactly what the check runs: the recipe with
    ``policy.model`` a folder holding the config of ``dims``, one process (no launcher on one GPU), the
    recipe's micro-batch and checkpointing, vLLM's share 0 (no vLLM runs). Returns the plan and the bytes
    of the parts the check's step allocates (:data:`COMPARED`)."""
    import copy

    from transformers import Qwen2Config

    from zerosim.training.memory import Knobs, Launch, Strategy, plan_parts

    Qwen2Config(**dims, pad_token_id=0, bos_token_id=1, eos_token_id=2).save_pretrained(folder)
    planned = copy.deepcopy(cfg)
    planned.policy.model = str(folder)
    t = planned.trainer
    knobs = Knobs(
        t.per_device_train_batch_size,
        t.gradient_checkpointing,
        0.0,
        Launch(Strategy.plain, 1, source="gpu_check"),
    )
    plan = plan_parts(planned, knobs)
    return plan, sum(size for name, (size, _) in plan.parts.items() if name in COMPARED)


def check_recipe(
    check: Check, tokenizer, cpu: bool, recipe: Path, tmp: Path, name: str = "recipe shape"
) -> None:
    """One GRPO step at the recipe's shape — its micro-batch of rows at the longest row it allows, its
    reference model (``trainer.beta > 0``), its gradient checkpointing, fp32 weights under bf16 autocast —
    on a random model of its policy's width, and the step's peak allocated GPU memory against the memory
    plan's prediction for exactly that: PASS within 15%.

    One process holds the policy whole (fp32 weights, gradients and AdamW: 16 bytes a parameter) and the
    reference; where the plan of the recipe's full depth, 15% over and with the 3 GB runtime reserve, exceeds
    the GPU's free memory, the model keeps the recipe's width and row and drops decoder layers until it fits
    (the plan is linear in depth). A warm-up step first: the measured one holds AdamW's moments, as every
    step of a run after its first does. On CPU (``--cpu``): a tiny model, the recipe's micro-batch and
    reference, one 16-token turn; the prediction is printed, the peak is not measurable there, and the live
    tensors of the states (weights, AdamW moments, reference) are counted against the plan's instead.

    A LoRA recipe (``policy.lora.enabled``): the random base at the recipe's ``policy.dtype`` (bf16 allowed:
    it is frozen), the trainer given its ``peft_config`` as ``zerosim train`` does (TRL wraps it and scores the
    reference with the adapters disabled); the plan's adapter parameter count must equal the trainable
    parameters, and its states are the frozen base, the adapters' fp32 weights and AdamW moments. Where peft
    is not installed the check is skipped, said so."""

    from transformers import TrainerCallback

    from zerosim.core.config import load_config
    from zerosim.training.algorithms import algorithm_args, spec_of
    from zerosim.training.config import TrainConfig
    from zerosim.training.memory import GB, RUNTIME_RESERVE, longest_row, model_shape

    device = "cpu" if cpu else "cuda"
    cfg = load_config(recipe, CPU_RECIPE_OVERRIDES if cpu else [], schema=TrainConfig)
    t, notes, lora = cfg.trainer, [], cfg.policy.lora
    shape = model_shape(cfg.policy.model)
    if shape is None:
        raise ValueError(f"{recipe}: the sizes of policy.model {cfg.policy.model} are unknown here")
    if lora.enabled:
        try:
            import peft  # noqa: F401
        except ImportError:
            check.skip(
                name, f"{recipe.name} trains LoRA adapters and peft is not installed here (pip install peft)"
            )
            return
    if cfg.policy.dtype == "bfloat16" and not lora.enabled:  # refused in one process: fp32 weights
        cfg.policy.dtype = "auto"
        notes.append("policy.dtype=bfloat16 needs DeepSpeed/FSDP: one process steps fp32 weights")
    elif cfg.policy.dtype == "bfloat16" and cpu:  # a frozen bf16 base is allowed, but slow on a CPU
        cfg.policy.dtype = "auto"
        notes.append(
            "CPU: the LoRA base in fp32 (bf16 matmuls crawl on a CPU); on a GPU it is the recipe's bf16"
        )
    base_dtype = torch.bfloat16 if cfg.policy.dtype == "bfloat16" else torch.float32
    algorithm = t.algorithm
    if spec_of(algorithm).needs_critic:  # the critic is the ppo step's check; not built here
        algorithm = "grpo"
        notes.append(f"{t.algorithm}'s critic not built (the ppo step checks it): the policy's side, as grpo")
    if t.beta == 0:
        notes.append("trainer.beta=0: no reference model, as the recipe")
    prompt, completion, row = longest_row(cfg)
    slug = name.removesuffix(" shape").replace(" ", "-")  # recipe, lora-recipe: each check's own folders
    folder = tmp / f"{slug}-policy"
    folder.mkdir()
    if cpu:
        dims = dict(TINY, max_position_embeddings=max(4096, row))
        free = baseline = None
        notes.append("CPU: a tiny model, rows of one 16-token turn (" + " ".join(CPU_RECIPE_OVERRIDES) + ")")
    else:
        gc.collect()
        torch.cuda.empty_cache()
        baseline = torch.cuda.memory_allocated()  # what earlier checks still hold: not this step's
        free = torch.cuda.mem_get_info()[0]
        for layers in range(shape.layers, 0, -1):  # the recipe's depth, else the deepest that fits
            dims = recipe_dims(shape, layers, row)
            if check_plan(cfg, folder, dims)[1] * (1 + TOLERANCE) + RUNTIME_RESERVE <= free:
                break
        else:
            raise RuntimeError(
                f"one layer of {cfg.policy.model}'s width does not fit {free / GB:.1f} GB free"
            )
        if layers < shape.layers:
            notes.append(
                f"{layers} of the recipe's {shape.layers} layers: its full depth, +15% and the 3 GB runtime "
                f"reserve, exceeds the {free / GB:.1f} GB free in one process"
            )
    plan, predicted = check_plan(cfg, folder, dims)
    adapted = (
        f", LoRA r={lora.r} ({plan.adapter_params / 1e6:.3g} M params) over a frozen "
        f"{'bf16' if base_dtype == torch.bfloat16 else 'fp32'} base"
        if lora.enabled
        else ""
    )
    print(
        f"      {name}: {recipe.name}, {dims['num_hidden_layers']} layers x {dims['hidden_size']} wide "
        f"({plan.shape.params / 1e9:.3g} B params){adapted}, micro-batch {t.per_device_train_batch_size} x "
        f"{row:,} tokens ({prompt} prompt + {completion:,} completion), beta {t.beta:g}, checkpointing "
        f"{str(t.gradient_checkpointing).lower()}; the plan for one process:",
        flush=True,
    )
    for part, (size, how) in plan.parts.items():
        why = "" if part in COMPARED else f"  [not compared: {EXCLUDED.get(part, 'not built here')}]"
        print(f"        {part:<12} {size / GB:8.3f} GB  {how}{why}", flush=True)
    print(f"        {'predicted':<12} {predicted / GB:8.3f} GB  ({' + '.join(COMPARED)})", flush=True)
    for note in notes:
        print(f"      note: {note}", flush=True)

    # fp32 weights, what the optimizer steps (training_dtype); a LoRA recipe's frozen base at its dtype
    model = random_model(dims, device, base_dtype)
    # TRL builds the reference from the policy's path, as from a checkpoint (LoRA: none, the adapters disabled)
    if t.beta > 0 and not lora.enabled:
        model.save_pretrained(folder)
    model.config._name_or_path = str(folder)
    peak: dict[str, int] = {}

    class Window(TrainerCallback):
        """The peak of the second step, from its start (rollout and reference pass) to its end."""

        def on_step_begin(self, args, state, control, **kwargs):
            if not cpu and state.global_step == 1:
                torch.cuda.synchronize()
                gc.collect()
                torch.cuda.reset_peak_memory_stats()
                peak["before"] = torch.cuda.memory_allocated()

        def on_step_end(self, args, state, control, **kwargs):
            if not cpu and state.global_step == 2:
                torch.cuda.synchronize()
                peak["allocated"] = torch.cuda.max_memory_allocated()
                peak["reserved"] = torch.cuda.max_memory_reserved()

    grpo = dict(
        beta=t.beta, epsilon=t.epsilon, num_generations=t.num_generations, gradient_accumulation_steps=1,
        gradient_checkpointing=t.gradient_checkpointing, max_grad_norm=t.max_grad_norm,
        learning_rate=t.learning_rate, max_completion_length=completion,
        **algorithm_args(algorithm, t.epsilon_high),
    )  # fmt: skip
    trainer, logs = make_trainer(
        model, tokenizer, tmp / slug, cpu=cpu, steps=2, batch=t.per_device_train_batch_size,
        completion=completion, prompt_len=prompt, grpo=grpo, algorithm=algorithm,
        bf16=not cpu and t.bf16 is not False,  # as grpo_args: bf16 autocast on a GPU unless trainer.bf16=false
        peft_config=lora.peft_config() if lora.enabled else None,  # as zerosim train: TRL wraps the policy
    )  # fmt: skip
    trainer.add_callback(Window())
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    # the states' live tensors: what the plan's weights, optimizer and reference parts count (LoRA: the frozen
    # base, and of the adapters part their fp32 weights and AdamW moments, 12 of its 16 bytes a parameter: the
    # gradients are freed after each step)
    live = lambda tensors: sum(x.numel() * x.element_size() for x in tensors)  # noqa: E731
    counted = live(trainer.model.parameters()) + live(
        v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
    )
    if trainer.ref_model is not None:
        counted += live(trainer.ref_model.parameters())
    states = sum(plan.parts[n][0] for n in ("weights", "optimizer", "reference") if n in plan.parts)
    states += 12 * plan.adapter_params
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    finite = all(torch.isfinite(torch.tensor(e["loss"])).item() for e in logs if "loss" in e)
    figures = {
        "recipe": str(recipe),
        "layers": f"{dims['num_hidden_layers']}" + (" (tiny model)" if cpu else f" of {shape.layers}"),
        "params_b": round(plan.shape.params / 1e9, 3),
        "micro_batch": t.per_device_train_batch_size,
        "row_tokens": row,
        "reference": trainer.ref_model is not None,
        "checkpointing": t.gradient_checkpointing,
        "lora": lora.enabled,
        "trainable_params": trainable,
        "adapter_params_planned": plan.adapter_params if lora.enabled else None,
        "plan_gb": {name: round(size / GB, 3) for name, (size, _) in plan.parts.items()},
        "predicted_gb": round(predicted / GB, 3),
        "states_counted_gb": round(counted / GB, 3),
        "states_planned_gb": round(states / GB, 3),
        "two_steps_s": round(seconds, 1),
        "notes": notes,
    }
    states_ok = abs(counted - states) <= 0.01 * states
    ok = finite and states_ok and len([e for e in logs if "loss" in e]) == 2
    if lora.enabled:  # exactly the adapters the plan counts are trained, and no reference copy is built
        ok = ok and trainable == plan.adapter_params and trainer.ref_model is None
    parts = "weights + adapters' weights and moments" if lora.enabled else "weights + optimizer + reference"
    line = f"states counted {counted / GB:.3f} GB, planned {states / GB:.3f} GB ({parts})"
    if lora.enabled:
        line += f"; trainable {trainable:,} params, planned adapters {plan.adapter_params:,}"
    if cpu:
        figures["peak"] = "not measurable on CPU (no allocator statistics)"
        line = f"peak: {figures['peak']}; predicted {predicted / GB:.3f} GB; {line}"
    else:
        measured = peak["allocated"] - baseline
        figures |= {
            "free_gb": round(free / GB, 1),
            "held_before_gb": round(baseline / GB, 3),
            "peak_allocated_gb": round(measured / GB, 3),
            "peak_reserved_gb": round((peak["reserved"] - baseline) / GB, 3),
            "ratio": round(measured / predicted, 3),
            "allocated_at_step_start_gb": round((peak["before"] - baseline) / GB, 3),
        }
        ok = ok and abs(measured / predicted - 1) <= TOLERANCE
        line = (
            f"peak allocated {measured / GB:.2f} GB (reserved {figures['peak_reserved_gb']:.2f}) against "
            f"predicted {predicted / GB:.2f} GB: ratio {measured / predicted:.3f}, within 15%: "
            f"{abs(measured / predicted - 1) <= TOLERANCE}; {line}"
        )
    print(f"      {line}", flush=True)
    check.figures[slug.replace("-", "_")] = figures
    check.record(name, ok, json.dumps(figures))
    del trainer, model
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()


def check_precision(check: Check, tokenizer, cpu: bool, tmp: Path) -> None:
    """bf16 weights stepped by AdamW at lr 1e-6 barely move; fp32 weights under bf16 autocast match fp32."""
    device = "cpu" if cpu else "cuda"
    small = dict(TINY, hidden_size=256, intermediate_size=512) if not cpu else TINY

    refused = []

    def one_step(dtype, bf16: bool, name: str):
        from zerosim.core.config import ConfigError
        from zerosim.training.precision import MasterWeightsCheck

        model = random_model(small, device, dtype)
        before = [p.detach().float().clone() for p in model.parameters()]
        extra = {"update_bf16": bf16} if cpu else {}  # on CPU SearchTrainer autocasts; on GPU TRL's bf16 does
        trainer, _ = make_trainer(
            model,
            tokenizer,
            tmp / name,
            cpu=cpu,
            steps=1,
            batch=4,
            completion=16,
            bf16=bf16 and not cpu,
            **extra,
        )
        if dtype != torch.float32:  # the trainer refuses to step bf16 weights; shown, then stepped regardless
            try:
                trainer.train()
            except ConfigError:
                refused.append(name)
            trainer.remove_callback(MasterWeightsCheck)
        trainer.train()
        return torch.cat(
            [
                (p.detach().float() - b).flatten().cpu()
                for p, b in zip(model.parameters(), before, strict=True)
            ]
        )

    lost = one_step(torch.bfloat16, True, "bf16-weights")
    reference = one_step(torch.float32, False, "fp32")
    mixed = one_step(torch.float32, True, "mixed")
    moved_bf16 = float((lost != 0).float().mean())
    moved_fp32 = float((reference != 0).float().mean())
    agree = float(((mixed - reference).abs() <= 1e-8).float().mean())
    figures = {
        "bf16_weights_refused": bool(refused),
        "bf16_weights_moved": round(moved_bf16, 4),
        "fp32_weights_moved": round(moved_fp32, 4),
        "mixed_matches_fp32": round(agree, 4),
    }
    check.figures["precision"] = figures
    ok = bool(refused) and moved_bf16 < 0.05 and moved_fp32 > 0.9 and agree > 0.9
    check.record("precision", ok, json.dumps(figures))


def check_ppo(check: Check, tokenizer, cpu: bool, tmp: Path) -> None:
    from zerosim.training.trainer import Critic

    device = "cpu" if cpu else "cuda"
    shape = TINY if cpu else dict(TINY, hidden_size=512, intermediate_size=1024, num_hidden_layers=4)
    model = random_model(shape, device)
    with tempfile.TemporaryDirectory() as folder:
        random_model(shape, "cpu").save_pretrained(folder)
        critic = Critic.from_pretrained(folder, "float32").to(device)
    before = [p.detach().clone() for p in critic.parameters()]
    trainer, logs = make_trainer(
        model, tokenizer, tmp / "ppo", cpu=cpu, steps=1, batch=4, completion=16, algorithm="ppo", critic=critic,
        critic_learning_rate=1e-4, learning_rate=1e-5,
    )  # fmt: skip
    trainer.train()
    moved = any(not torch.equal(p.detach(), b) for p, b in zip(critic.parameters(), before, strict=True))
    finite = all(torch.isfinite(torch.tensor(e["loss"])).item() for e in logs if "loss" in e)
    check.record("ppo step", moved and finite, f"critic moved: {moved}, loss finite: {finite}")


def check_decode(check: Check, tokenizer, cpu: bool) -> None:
    from zerosim.core.generation import HFGenerator
    from zerosim.core.sampling import GREEDY

    device = "cpu" if cpu else "cuda"
    shape = (
        TINY
        if cpu
        else dict(TINY, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8)
    )
    model = random_model(shape, device, torch.float32 if cpu else torch.bfloat16).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(10, 1000, (int(n),), generator=g).tolist()
        for n in torch.randint(8, 64, (16,), generator=g)
    ]
    new_tokens = 16 if cpu else 128
    timings, outputs = {}, {}
    for decoder in ("zerosim", "transformers"):
        gen = HFGenerator(model, tokenizer, sampling=GREEDY, decoder=decoder, logprobs=False)
        gen.generate(prompts[:2], 4)  # warm-up
        if not cpu:
            torch.cuda.synchronize()
        started = time.perf_counter()
        outputs[decoder] = [o.token_ids for o in gen.generate(prompts, new_tokens)]
        if not cpu:
            torch.cuda.synchronize()
        timings[decoder] = time.perf_counter() - started
    same = sum(a == b for a, b in zip(outputs["zerosim"], outputs["transformers"], strict=True))
    ratio = timings["transformers"] / timings["zerosim"]
    figures = {
        "identical": f"{same}/{len(prompts)}",
        "speedup_vs_generate": round(ratio, 2),
        "seconds": {k: round(v, 3) for k, v in timings.items()},
    }
    check.figures["decode"] = figures
    # greedy bf16 on a GPU may break a near-tie differently: most rows, not all, must agree there
    check.record(
        "decode loop", same == len(prompts) if cpu else same >= len(prompts) - 2, json.dumps(figures)
    )


def _unwritable(out: Path) -> str | None:
    """Why the figures could not be written to ``out`` (its folder made, a file made and removed there)."""
    if out.is_dir():
        return "is a folder"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".gpu-check-", dir=out.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot write in {out.parent} ({exc.strerror or exc})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cpu", action="store_true", help="run on CPU with a tiny model (the test suite's way)"
    )
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps to time")
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer folder (default: the kit's, else smollm2)"
    )
    parser.add_argument(
        "--recipe", type=Path, default=DEFAULT_RECIPE, help="the recipe the recipe-shape check reads"
    )
    parser.add_argument(
        "--lora-recipe",
        type=Path,
        default=DEFAULT_LORA_RECIPE,
        help="the LoRA recipe (policy.lora) the lora-recipe-shape check reads",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    # refused before any check runs: a bad count, or figures that could not be written at the end
    if args.steps < 1:
        parser.error(f"--steps must be >= 1 (GRPO steps to time), got {args.steps}")
    for flag, recipe in (("--recipe", args.recipe), ("--lora-recipe", args.lora_recipe)):
        if not recipe.is_file():
            parser.error(f"{flag} {recipe}: no such file; give a training recipe (configs/*.yaml)")
    if args.out is not None and (problem := _unwritable(args.out)):
        parser.error(f"--out {args.out}: {problem}; give a file in a writable folder")
    if not args.cpu and not torch.cuda.is_available():
        print("FAIL  device: torch sees no CUDA device (use --cpu for the CPU run)")
        return 2
    from zerosim.core.models import load_tokenizer

    kit = Path(__file__).resolve().parents[1] / ".kit" / "tokenizer"
    tokenizer = load_tokenizer(args.tokenizer or (str(kit) if kit.is_dir() and not args.cpu else "smollm2"))
    check = Check()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        for name, run in (
            ("versions", lambda: check_versions(check, args.cpu)),
            ("grpo steps", lambda: check_grpo(check, tokenizer, args.cpu, args.steps, tmp)),
            ("recipe shape", lambda: check_recipe(check, tokenizer, args.cpu, args.recipe, tmp)),
            (
                "lora recipe shape",
                lambda: check_recipe(
                    check, tokenizer, args.cpu, args.lora_recipe, tmp, name="lora recipe shape"
                ),
            ),
            ("precision", lambda: check_precision(check, tokenizer, args.cpu, tmp)),
            ("ppo step", lambda: check_ppo(check, tokenizer, args.cpu, tmp)),
            ("decode loop", lambda: check_decode(check, tokenizer, args.cpu)),
        ):
            try:
                run()
            except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others' figures
                traceback.print_exc()
                check.record(name, False, f"{type(exc).__name__}: {exc}")
    passed = sum(ok for _, ok, _ in check.results)
    total = len(check.results)
    skipped = (
        f" ({len(check.skipped)} skipped: {', '.join(n for n, _ in check.skipped)})" if check.skipped else ""
    )
    print(f"== {passed}/{total} checks passed{skipped} in {time.perf_counter() - started:.0f} s", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        figures = {"results": check.results, "skipped": check.skipped, "figures": check.figures}
        args.out.write_text(json.dumps(figures, indent=2, default=str))
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())

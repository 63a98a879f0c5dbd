"""The memory plan (zerosim/training/memory.py): the activation formula against saved-tensor-hook measurements
on tiny Llama/Qwen2 models built here, model states against DeepSpeed's own estimators, LoRA's adapter count
against a live peft model, and every shipped GPU recipe's dry run fitting an H100 80 GB and an H200 141 GB card
under the launch config its header names."""

import re
from pathlib import Path

import pytest
import torch

from zerosim.core.config import load_config
from zerosim.training.config import TrainConfig
from zerosim.training.memory import (
    Launch,
    Strategy,
    launch_from_config,
    measure_activation_bytes,
    memory_plan,
    model_shape,
    policy_states,
    saved_bytes_per_token,
    shape_from_config,
)

ROOT = Path(__file__).resolve().parents[1]
# the recipes whose header says how to check them on a GPU (`# Check: ... --launch-config X --gpu-memory 80`)
GPU_RECIPES = [
    p for p in sorted((ROOT / "configs").glob("*.yaml")) if re.search(r"^# Check:", p.read_text(), re.M)
]


def tiny(kind: str, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[kind]
    config = config_class(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        vocab_size=512,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return model_class(config)


@pytest.mark.parametrize(
    "kind, size",
    [("qwen2", (96, 3, 6, 2, 288)), ("llama", (320, 5, 10, 5, 864))],
    ids=["qwen2-96x3", "llama-320x5"],
)
@pytest.mark.parametrize("compute", ["bf16", "autocast"])
def test_activation_formula_matches_saved_tensor_hooks(kind, size, compute):
    """Bytes per token the body saves for backward: the formula within 15% of what saved-tensor hooks count
    (distinct storages, per token from two lengths so that nothing per sequence is counted)."""
    model = tiny(kind, *size)
    if compute == "bf16":
        model = model.to(torch.bfloat16)
    autocast = compute == "autocast"
    short, long = 32, 96
    measured = (
        measure_activation_bytes(model, 2, long, autocast)
        - measure_activation_bytes(model, 2, short, autocast)
    ) / (2 * (long - short))
    shape = shape_from_config(model.config.to_dict())
    predicted = saved_bytes_per_token(shape, compute)
    assert abs(predicted - measured) / measured < 0.15, (kind, size, compute, predicted, measured)


def test_model_shape_counts_parameters_from_config_json(tmp_path):
    """The parameter count from config.json equals the built model's, and the known table's Qwen2.5-3B is 3.09 B."""
    model = tiny("qwen2", 64, 2, 4, 2, 176)
    model.config.save_pretrained(tmp_path)
    shape = model_shape(str(tmp_path))
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert round(model_shape("Qwen/Qwen2.5-3B").params / 1e9, 2) == 3.09
    assert model_shape("no-such-org/no-such-model-here") is None


def test_model_states_follow_deepspeeds_estimators():
    """ZeRO-2 and ZeRO-3 weights + gradients + optimizer states per GPU equal DeepSpeed's own estimate
    (``estimate_zero2/zero3_model_states_mem_needs``, no offload)."""
    stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    shape = model_shape("Qwen/Qwen2.5-3B")
    P = shape.params
    ours = sum(b for b, _ in policy_states(shape, Launch(Strategy.zero2, 8), False).values())
    _, theirs = stage_1_and_2.estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=8, cpu_offload=False)
    assert ours == pytest.approx(theirs, rel=1e-6)
    ours = sum(b for b, _ in policy_states(shape, Launch(Strategy.zero3, 8), False).values())
    _, theirs, _ = stage3.estimate_zero3_model_states_mem_needs(
        P, shape.largest_layer, num_gpus_per_node=8, cpu_offload=False
    )
    # DeepSpeed's ZeRO-3 figure leaves out the 16-bit parameter shards themselves (2P/N): counted here
    assert ours == pytest.approx(theirs + 2 * P / 8, rel=1e-6)


@pytest.mark.parametrize(
    "name, strategy, processes",
    [("zero2", Strategy.zero2, 8), ("zero3", Strategy.zero3, 8), ("fsdp2", Strategy.fsdp2, 8),
     ("multi-gpu", Strategy.ddp, 8), ("ddp-cpu", Strategy.ddp, 2), ("multi-node", Strategy.zero2, 16)],
)  # fmt: skip
def test_strategy_from_the_launch_config(name, strategy, processes):
    launch = launch_from_config(ROOT / "configs" / "accelerate" / f"{name}.yaml")
    assert (launch.strategy, launch.processes) == (strategy, processes)


def header_check(recipe: Path) -> tuple[Path | None, float]:
    """The accelerate config the recipe's `# Check:` line plans with (`--launch-config X`; none: one process)
    and the GB of an 80 GB card it plans against (`--gpu-memory N`: less where something shares the card, as a
    simulator served beside the policy)."""
    line = re.search(r"^# Check:.*$", recipe.read_text(), re.M).group(0)
    memory = re.search(r"--gpu-memory (\d+)", line)
    assert memory, f"{recipe.name}: its '# Check:' line names no --gpu-memory"
    launch = re.search(r"--launch-config (\S+)", line)
    return (ROOT / launch.group(1) if launch else None), float(memory.group(1))


@pytest.mark.parametrize("card", [80, 141])
@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.stem)
def test_every_gpu_recipe_fits_the_card(recipe, card, tmp_path, monkeypatch):
    """The dry run of each GPU recipe, as its header says to run it, ends with a plan that fits the card (less
    what the header leaves to something beside the policy on it)."""
    from zerosim.training.dry_run import plan

    monkeypatch.chdir(tmp_path)  # the recipe's MLflow store and outputs land here
    cfg = load_config(recipe, [], schema=TrainConfig)
    launch, on_80 = header_check(recipe)
    gpu_memory = card - (80 - on_80)
    processes = launch_from_config(launch).processes if launch else 1
    rows = dict(plan(cfg, processes, launch_config=launch, gpu_memory=gpu_memory))
    assert "memory per GPU" in rows, rows
    assert re.match(rf"[\d.]+ of {gpu_memory:g} GB: fits", rows["  total"]), rows["  total"]


def test_over_budget_names_the_key_and_a_fix_that_fits(tmp_path):
    """The 3B recipe as it shipped before the plan (40 rows at once, no checkpointing, vLLM 35%) is over an
    80 GB card; the plan names the keys to change, and each micro-batch fix it names fits when applied."""
    old = [
        "trainer.per_device_train_batch_size=40",
        "trainer.gradient_accumulation_steps=1",
        "trainer.gradient_checkpointing=false",
        "trainer.vllm_gpu_memory_utilization=0.35",
    ]
    cfg = load_config(ROOT / "configs" / "zerosearch-qwen2.5-3b.yaml", old, schema=TrainConfig)
    launch = launch_from_config(ROOT / "configs" / "accelerate" / "zero2.yaml")
    before = memory_plan(cfg, launch, 80e9)
    assert not before.fits and before.total > 300e9
    assert any("trainer.per_device_train_batch_size=" in f for f in before.fixes), before.fixes
    for fix in before.fixes:
        if "per_device_train_batch_size" in fix:
            keys = [k for k in fix.split(" (")[0].split() if "=" in k]
            fixed = load_config(
                ROOT / "configs" / "zerosearch-qwen2.5-3b.yaml", [*old, *keys], schema=TrainConfig
            )
            after = memory_plan(fixed, launch, 80e9)
            assert after.fits, (fix, after.total)
            t = fixed.trainer
            assert t.per_device_train_batch_size * t.gradient_accumulation_steps == 40  # same trajectories


def test_gradient_checkpointing_reaches_grpo_config(tmp_path):
    from zerosim.training.recipe import grpo_args

    cfg = load_config(
        ROOT / "configs" / "demo.yaml", ["trainer.gradient_checkpointing=true"], schema=TrainConfig
    )
    assert grpo_args(cfg, tmp_path).gradient_checkpointing is True
    cfg = load_config(ROOT / "configs" / "demo.yaml", [], schema=TrainConfig)
    assert grpo_args(cfg, tmp_path).gradient_checkpointing is False


@pytest.mark.parametrize(
    ("text", "words"),
    [
        pytest.param("distributed_type: MEGATRON_LM\nnum_processes: 8\n", "distributed_type MEGATRON_LM is not one", id="megatron"),
        pytest.param("distributed_type: MULTI_GPU\nnum_processes: 0\n", "num_processes is 0: a number of processes", id="zero-processes"),
        pytest.param("distributed_type: MULTI_GPU\nnum_processes: -2\n", "num_processes is -2", id="negative-processes"),
        pytest.param("distributed_type: DEEPSPEED\nnum_processes: 8\ndeepspeed_config:\n  zero_stage: 4\n",
                     "deepspeed_config.zero_stage is 4: DeepSpeed's ZeRO stages are 0, 1, 2 and 3", id="zero-stage-4"),
        pytest.param("- distributed_type: MULTI_GPU\n", "is a YAML mapping", id="a-list"),
        pytest.param("distributed_type: [MULTI_GPU\n", "malformed YAML", id="broken"),
    ],
)  # fmt: skip
def test_a_launch_config_zerosim_cannot_plan_is_refused_in_one_line(text, words, tmp_path):
    from zerosim.core.config import ConfigError
    from zerosim.training.memory import launch_from_config

    path = tmp_path / "launch.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        launch_from_config(path)
    assert words in str(refused.value) and "\n" not in str(refused.value) and str(path) in str(refused.value)


def recipe_plan(recipe: str, overrides: list[str], launch: Launch):
    """The plan of ``configs/<recipe>.yaml`` with ``overrides``, on an 80 GB card."""
    cfg = load_config(ROOT / "configs" / f"{recipe}.yaml", overrides, schema=TrainConfig)
    return memory_plan(cfg, launch, 80e9)


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj", "gate_proj, down_proj"])
def test_lora_adapters_counted_as_a_live_peft_model_trains(targets, tmp_path):
    """The plan's adapter parameters equal what peft makes trainable on the tiny model (the LoRA config
    ``zerosim train`` gives TRL), at 16 bytes each in one process; the frozen base has no gradients or AdamW."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from zerosim.core.models import build_tiny_model
    from zerosim.training.config import PolicyLoraConfig

    folder = build_tiny_model(tmp_path / "tiny")
    lora = [f"policy.model={folder}", "policy.lora.enabled=true", f"policy.lora.target_modules={targets}"]
    plan = recipe_plan("demo", lora, Launch(Strategy.plain, 1))
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(folder), PolicyLoraConfig(target_modules=targets).peft_config()
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert plan.adapter_params == trainable > 0
    assert plan.parts["adapters"][0] == 16 * trainable
    assert plan.parts["weights"][0] == 4 * plan.shape.params  # auto: an fp32 base
    assert "gradients" not in plan.parts and "optimizer" not in plan.parts, plan.parts


def test_lora_target_no_llama_layer_has_is_named_not_counted():
    """A comma list naming a module a Llama/Qwen2 layer lacks counts the others and says which was not."""
    lora = ["trainer.generation=hf", "policy.lora.enabled=true"]
    one = Launch(Strategy.plain, 1)
    plan = recipe_plan("zerosearch-qwen2.5-3b", [*lora, "policy.lora.target_modules=q_proj,qkv_proj"], one)
    only_q = recipe_plan("zerosearch-qwen2.5-3b", [*lora, "policy.lora.target_modules=q_proj"], one)
    assert plan.adapter_params == only_q.adapter_params > 0
    assert "not counted" in plan.parts["adapters"][1] and "qkv_proj" in plan.parts["adapters"][1]


def test_lora_with_a_kl_term_holds_no_reference_copy():
    """beta > 0 with LoRA: TRL scores the reference with the adapters disabled, so the reference part is 0
    (a full fine-tune's is the bf16 policy); under ZeRO-2 the adapters' states shard 1/N, the base stays whole."""
    launch = launch_from_config(ROOT / "configs" / "accelerate" / "zero2.yaml")
    full = recipe_plan("zerosearch-qwen2.5-3b", [], launch)
    lora = recipe_plan("zerosearch-qwen2.5-3b", ["trainer.generation=hf", "policy.lora.enabled=true"], launch)
    assert full.parts["reference"][0] == 2 * full.shape.params
    assert lora.parts["reference"][0] == 0 and "adapters disabled" in lora.parts["reference"][1]
    assert lora.parts["adapters"][0] == pytest.approx(16 * lora.adapter_params / 8)
    assert lora.parts["weights"][0] == 2 * lora.shape.params  # DeepSpeed's bf16 module, whole under ZeRO-2


def test_a_bf16_lora_base_takes_half_the_weight_bytes():
    """policy.dtype=bfloat16 with LoRA (allowed: the base is frozen) holds the base in 2 bytes a parameter,
    auto in 4, in one process; the adapters are the same."""
    lora = ["trainer.generation=hf", "policy.lora.enabled=true"]
    fp32 = recipe_plan("zerosearch-qwen2.5-3b", lora, Launch(Strategy.plain, 1))
    bf16 = recipe_plan("zerosearch-qwen2.5-3b", [*lora, "policy.dtype=bfloat16"], Launch(Strategy.plain, 1))
    assert fp32.parts["weights"][0] == 4 * fp32.shape.params
    assert bf16.parts["weights"][0] == fp32.parts["weights"][0] / 2
    assert bf16.parts["adapters"] == fp32.parts["adapters"]


def test_zero3_hf_rollout_gathers_the_whole_bf16_policy(tmp_path):
    """Under ZeRO-3 with trainer.generation=hf, TRL gathers the whole 16-bit policy on every rank for the rollout
    (ds3_gather_for_generation, which grpo_args leaves at TRL's True): a part of 2 bytes a parameter; under
    ZeRO-2, or with vLLM, no such part."""
    from zerosim.training.memory import DS3_GATHER_FOR_GENERATION
    from zerosim.training.recipe import grpo_args

    zero2, zero3 = (
        launch_from_config(ROOT / "configs" / "accelerate" / f"{n}.yaml") for n in ("zero2", "zero3")
    )
    hf = ["trainer.generation=hf"]
    plan = recipe_plan("zerosearch-qwen2.5-3b", hf, zero3)
    assert plan.parts["rollout gather"][0] == 2 * plan.shape.params
    assert "rollout gather" not in recipe_plan("zerosearch-qwen2.5-3b", hf, zero2).parts
    assert "rollout gather" not in recipe_plan("zerosearch-qwen2.5-3b", [], zero3).parts  # vLLM colocate
    cfg = load_config(ROOT / "configs" / "zerosearch-qwen2.5-3b.yaml", hf, schema=TrainConfig)
    assert grpo_args(cfg, tmp_path).ds3_gather_for_generation is DS3_GATHER_FOR_GENERATION is True

"""The memory plan (zerosim/training/memory.py): the activation formula against saved-tensor-hook measurements
on tiny Llama/Qwen2 models built here, model states against DeepSpeed's own estimators, and every shipped GPU
recipe's dry run fitting an H100 80 GB and an H200 141 GB card under the launch config its header names."""

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
GPU_RECIPES = [
    p
    for p in sorted((ROOT / "configs").glob("*.yaml"))
    if load_config(p, [], schema=TrainConfig).trainer.generation != "hf"
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


def header_launch_config(recipe: Path) -> Path:
    """The accelerate config the recipe's `# Check:` line plans with (`--launch-config X`)."""
    found = re.search(r"^# Check:.*--launch-config (\S+)", recipe.read_text(), re.M)
    assert found, f"{recipe.name}: its '# Check:' line names no --launch-config"
    return ROOT / found.group(1)


@pytest.mark.parametrize("gpu_memory", [80, 141])
@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.stem)
def test_every_gpu_recipe_fits_the_card(recipe, gpu_memory, tmp_path, monkeypatch):
    """The dry run of each GPU recipe, as its header says to run it, ends with a plan that fits the card."""
    from zerosim.training.dry_run import plan

    monkeypatch.chdir(tmp_path)  # the recipe's MLflow store and outputs land here
    cfg = load_config(recipe, [], schema=TrainConfig)
    launch = header_launch_config(recipe)
    rows = dict(plan(cfg, launch_from_config(launch).processes, launch_config=launch, gpu_memory=gpu_memory))
    assert "memory per GPU" in rows, rows
    assert re.match(rf"[\d.]+ of {gpu_memory} GB: fits", rows["  total"]), rows["  total"]


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

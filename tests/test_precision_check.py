"""Mixed precision checked, not assumed: what an optimizer steps is fp32 — plain, DeepSpeed-shaped (ZeRO-1/2,
ZeRO-3, wrapped as accelerate wraps it), and through ``SearchTrainer`` when training begins."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch

from zerosim.core.config import ConfigError
from zerosim.training.precision import MASTER_PARTITIONS, check_master_weights, check_sharding


def adamw(*tensors: torch.Tensor) -> torch.optim.AdamW:
    return torch.optim.AdamW([torch.nn.Parameter(t) for t in tensors], lr=1e-6)


def test_plain_fp32_passes_and_bf16_is_refused_with_the_fix():
    assert "fp32, 2 tensors" in check_master_weights(adamw(torch.zeros(4), torch.zeros(2, 2)))
    wrapped = types.SimpleNamespace(
        optimizer=adamw(torch.zeros(4))
    )  # accelerate's AcceleratedOptimizer shape
    assert "fp32, 1 tensors" in check_master_weights(wrapped)
    bf16 = adamw(torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(
        ConfigError, match=r"steps bfloat16 weights \(optimizer param_groups\).*policy\.dtype=auto"
    ):
        check_master_weights(bf16)


def zero_optimizer(attribute: str, dtype: torch.dtype):
    """An object shaped like DeepSpeed's ZeRO optimizer: bf16 model weights, master partitions of ``dtype`` in
    ``attribute``, which its inner optimizer steps; wrapped as accelerate's DeepSpeedOptimizerWrapper is."""
    masters = [
        torch.nn.Parameter(torch.zeros(8, dtype=dtype)),
        torch.nn.Parameter(torch.zeros(3, dtype=dtype)),
    ]
    zero = types.SimpleNamespace(
        optimizer=torch.optim.AdamW(masters, lr=1e-6), bit16_groups=[[torch.zeros(8, dtype=torch.bfloat16)]]
    )
    setattr(zero, attribute, masters)
    return types.SimpleNamespace(optimizer=zero)


@pytest.mark.parametrize(("attribute", "what"), MASTER_PARTITIONS)
def test_deepspeed_master_partitions_are_checked(attribute, what):
    assert what in check_master_weights(zero_optimizer(attribute, torch.float32))
    with pytest.raises(
        ConfigError, match=rf"steps bfloat16 weights \({what}.*bf16_master_weights_and_gradients"
    ):
        check_master_weights(zero_optimizer(attribute, torch.bfloat16))


def test_the_attributes_are_deepspeeds_own():
    """The names read above are where the installed DeepSpeed keeps its master partitions (read from its source,
    not imported)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None:
        pytest.skip("deepspeed is not installed")
    runtime = Path(spec.origin).parent / "runtime"
    sources = {
        "single_partition_of_fp32_groups": runtime / "zero" / "stage_1_and_2.py",
        "fp32_partitioned_groups_flat": runtime / "zero" / "stage3.py",
        "fp32_groups_flat_partition": runtime / "bf16_optimizer.py",
    }
    assert set(sources) == {attribute for attribute, _ in MASTER_PARTITIONS}
    for attribute, source in sources.items():
        assert f"self.{attribute}.append(" in source.read_text(), (attribute, source)


def test_fsdp_flat_parameters_in_bf16_are_refused_with_the_fsdp_fix(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match="mixed_precision: bf16"):
        check_master_weights(adamw(torch.zeros(16, dtype=torch.bfloat16)))


def test_a_launch_whose_sharding_accelerate_did_not_turn_on_is_refused(monkeypatch):
    """accelerate 1.16 runs an FSDP launch config on CPU processes as MULTI_CPU (plain DDP): refused, naming
    the CPU configs that do shard; the sharding asked for, or none asked for, passes."""
    from accelerate.utils import DistributedType

    check_sharding(DistributedType.MULTI_CPU)  # no sharded launch: nothing to compare
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match=r"asks for FSDP but accelerate runs MULTI_CPU.*zero2-cpu\.yaml"):
        check_sharding(DistributedType.MULTI_CPU)
    check_sharding(DistributedType.FSDP)
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    check_sharding(DistributedType.DEEPSPEED)
    with pytest.raises(ConfigError, match="asks for DEEPSPEED but accelerate runs NO"):
        check_sharding(DistributedType.NO)


def test_the_critic_keeps_fp32_weights_under_deepspeed(tiny_model_dir, monkeypatch):
    """Under ZeRO, ``policy.dtype=bfloat16`` is allowed (DeepSpeed keeps fp32 masters of the policy), but the PPO
    critic is stepped by its own AdamW: its weights stay fp32."""
    from zerosim.training.trainer import Critic

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    critic = Critic.from_pretrained(str(tiny_model_dir), "bfloat16")
    assert {p.dtype for p in critic.parameters()} == {torch.float32}
    check_master_weights(torch.optim.AdamW(critic.parameters()), what="the critic")


def test_search_trainer_refuses_bf16_weights_when_training_begins(tmp_path, tiny_model_dir, tokenizer):
    from datasets import Dataset
    from trl import GRPOConfig

    from zerosim.core.models import load_causal_lm
    from zerosim.training.trainer import SearchTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=2, max_steps=1,
        max_completion_length=4, use_cpu=True, report_to=[], save_strategy="no",
    )  # fmt: skip
    trainer = SearchTrainer(
        model=load_causal_lm(str(tiny_model_dir), "bfloat16"),  # bf16 weights, stepped directly
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "q"}] * 4),
        processing_class=tokenizer,
    )
    with pytest.raises(ConfigError, match=r"optimizer of the policy steps bfloat16 weights"):
        trainer.train()
    assert trainer.state.global_step == 0  # refused before the first step

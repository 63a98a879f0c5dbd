"""Mixed precision, checked rather than assumed: the weights an optimizer steps are fp32.

An AdamW update is about the learning rate per weight (1e-6 in the ZeroSearch recipes) and bf16 resolves ~1e-4
on a weight of 0.02, so an optimizer that steps bf16 weights rounds most updates away (docs/scaling.md,
``tests/test_update.py``). :func:`zerosim.core.models.training_dtype` lets ``policy.dtype=bfloat16`` through
only under DeepSpeed or FSDP, on the grounds that they step fp32 master copies of their own — which holds only
as they are configured: DeepSpeed's ``bf16_master_weights_and_gradients`` makes its master partitions bf16, and
accelerate upcasts FSDP's parameters to fp32 only when ``mixed_precision`` is on. So once the optimizer is
built and prepared, :func:`check_master_weights` looks at what it actually steps:

- DeepSpeed: the fp32 master partitions of its ZeRO optimizer (``single_partition_of_fp32_groups`` for ZeRO-1/2,
  ``fp32_partitioned_groups_flat`` for ZeRO-3, ``fp32_groups_flat_partition`` for its bf16 optimizer), found
  under accelerate's wrapper (``.optimizer``);
- FSDP, DDP, one process: the tensors in the innermost optimizer's ``param_groups`` (FSDP's flat parameters
  or sharded DTensors: their dtype is what is stored and stepped; ``mixed_precision.param_dtype`` only casts
  the forward's copy).

:class:`MasterWeightsCheck` runs it when training begins (after ``accelerator.prepare``), after
:func:`check_sharding` has seen that accelerate runs the DeepSpeed or FSDP the launch config asked for.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from transformers import TrainerCallback

from zerosim.core.config import ConfigError

# (attribute of a DeepSpeed optimizer holding the master partitions it steps, what it is)
MASTER_PARTITIONS = (
    ("single_partition_of_fp32_groups", "DeepSpeed ZeRO-1/2 master partitions"),
    ("fp32_partitioned_groups_flat", "DeepSpeed ZeRO-3 master partitions"),
    ("fp32_groups_flat_partition", "DeepSpeed bf16-optimizer master partitions"),
)


def _wrapped(optimizer: Any) -> Iterator[Any]:
    """``optimizer`` and the optimizers it wraps (accelerate's, DeepSpeed's: ``.optimizer``), outermost first."""
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        yield optimizer
        optimizer = getattr(optimizer, "optimizer", None)


def stepped_tensors(optimizer: Any) -> tuple[str, list[torch.Tensor]]:
    """What ``optimizer`` updates, and where that was found: a DeepSpeed optimizer's master partitions, else
    the tensors of its innermost optimizer's ``param_groups``."""
    levels = list(_wrapped(optimizer))
    for level in levels:
        for attribute, what in MASTER_PARTITIONS:
            partitions = getattr(level, attribute, None)
            if partitions:
                return f"{what} ({attribute})", [t for t in partitions if isinstance(t, torch.Tensor)]
    groups = getattr(levels[-1], "param_groups", None) or []
    return "optimizer param_groups", [p for g in groups for p in g["params"] if isinstance(p, torch.Tensor)]


def _fix(what: str, key: str) -> str:
    from zerosim.core.models import sharded_optimizer

    if what.startswith("DeepSpeed"):
        return (
            "remove bf16_master_weights_and_gradients / fp16_master_weights_and_gradients from the DeepSpeed "
            f"config, or set {key}=auto (fp32 weights)"
        )
    if sharded_optimizer() == "fsdp":
        return (
            f"launch FSDP with mixed_precision: bf16 (accelerate then upcasts the parameters it shards to fp32) "
            f"or set {key}=auto (fp32 weights)"
        )
    return f"set {key}=auto (fp32 weights; the forward and backward in bf16 where trainer.bf16 says)"


def check_master_weights(optimizer: Any, *, key: str = "policy.dtype", what: str = "the policy") -> str:
    """Refuse (:class:`ConfigError`, naming ``key`` and the fix) an optimizer of ``what`` that steps weights other
    than fp32; returns what it checked, in words, for the log."""
    where, tensors = stepped_tensors(optimizer)
    if not tensors:
        raise ConfigError(f"the optimizer of {what} steps no tensors ({where}): nothing would be trained")
    low = sorted({str(t.dtype).removeprefix("torch.") for t in tensors if t.dtype != torch.float32})
    if low:
        raise ConfigError(
            f"the optimizer of {what} steps {'/'.join(low)} weights ({where}), where an update near the learning "
            f"rate rounds away; fix: {_fix(where, key)}"
        )
    return f"{what}: fp32, {len(tensors)} tensors ({where})"


def check_sharding(distributed_type: Any = None) -> None:
    """Refuse (:class:`ConfigError`) a launch whose config asked for DeepSpeed or FSDP when accelerate runs
    something else (``distributed_type``: the ``AcceleratorState``'s): the memory plan and the precision check
    assume the sharding the config names. accelerate 1.16 switches an FSDP config on only from GPU-like
    processes (``AcceleratorState.__init__``), so on CPU ranks it silently trains unsharded DDP. Without
    ``distributed_type`` the running ``AcceleratorState``'s is read, and only when a launch asked for one."""
    from accelerate.utils import DistributedType

    from zerosim.core.models import sharded_optimizer

    asked = sharded_optimizer()
    wanted = {"deepspeed": DistributedType.DEEPSPEED, "fsdp": DistributedType.FSDP}.get(asked or "")
    if wanted is None:
        return
    if distributed_type is None:
        from accelerate.state import AcceleratorState

        distributed_type = AcceleratorState().distributed_type
    if distributed_type == wanted:
        return
    got = getattr(distributed_type, "value", distributed_type)
    fix = (
        "on CPU processes use DeepSpeed (configs/accelerate/zero2-cpu.yaml or zero3-cpu.yaml) or plain DDP "
        "(ddp-cpu.yaml); FSDP needs GPUs"
        if asked == "fsdp" and not torch.cuda.is_available()
        else "check the launch config's distributed_type and that every process sees its device"
    )
    raise ConfigError(
        f"the launch config asks for {wanted.value} but accelerate runs {got}: the weights, gradients and "
        f"optimizer states would not be sharded as the memory plan assumes; {fix}"
    )


class MasterWeightsCheck(TrainerCallback):
    """Runs :func:`check_master_weights` on the trainer's optimizer (and ``extra`` optimizers, each
    ``(optimizer, what)``) when training begins: by then accelerate and DeepSpeed/FSDP have built what steps."""

    def __init__(self, extra: Any = None, *, log=None):
        self.extra = extra  # a callable returning [(optimizer, what), ...]: the trainer's own optimizers
        self.log = log

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        check_sharding()  # the sharding the launch asked for, or stop
        checked = [check_master_weights(optimizer)]
        for extra, what in self.extra() if self.extra is not None else []:
            checked.append(check_master_weights(extra, what=what))
        if self.log is not None:
            self.log.info("mixed precision checked: %s", "; ".join(checked))

"""What the multi-turn rollout needs from the process group when several training processes run.

Each rank rolls out its own slice of the batch, but some steps are collectives — TRL's vLLM server-mode
generate gathers every rank's prompts, and transformers ``generate`` under ZeRO-3 or FSDP synchronises
every decoding step (``synced_gpus``). A rank whose trajectories all finished early must therefore keep
taking part, turn by turn, until every rank is done. :class:`TurnSync` is that agreement: one small
all-reduce per turn answering "is anyone still active, and what is the largest token budget?".

Launching, sharding and gradient synchronisation stay with accelerate (DeepSpeed / FSDP / DDP); nothing
here is a distributed layer of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TurnState:
    """The batch-wide view of one turn: the most unfinished trajectories on any rank, the largest budget."""

    width: int  # max over ranks of the unfinished trajectories (0: every rank is done)
    budget: int  # max over ranks of the tokens this turn may generate

    @property
    def active(self) -> bool:
        return self.width > 0


class TurnSync:
    """Per-turn agreement across the ranks of an ``accelerate.Accelerator``.

    With one process it is free (no communication); with several, one ``all_reduce(MAX)`` of two integers
    per turn on the accelerator's device.
    """

    def __init__(self, accelerator):
        self.accelerator = accelerator

    @property
    def num_processes(self) -> int:
        return int(self.accelerator.num_processes)

    @property
    def process_index(self) -> int:
        return int(self.accelerator.process_index)

    def turn(self, active: int, budget: int) -> TurnState:
        """``active``: this rank's unfinished trajectories; ``budget``: the tokens it would generate."""
        if self.num_processes == 1:
            return TurnState(active, budget)
        local = torch.tensor([int(active), int(budget)], dtype=torch.long, device=self.accelerator.device)
        torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX)
        return TurnState(int(local[0].item()), int(local[1].item()))


class SingleProcess:
    """The :class:`TurnSync` of a run without a process group (evaluation, benchmarks, tests)."""

    num_processes = 1
    process_index = 0

    def turn(self, active: int, budget: int) -> TurnState:
        return TurnState(active, budget)


def process_state():
    """accelerate's ``PartialState``: initialises the process group under ``accelerate launch``."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    # Without CUDA the ranks talk over gloo: PartialState only picks it when told it runs on CPU
    # (accelerate's Accelerator reads ACCELERATE_USE_CPU itself; PartialState does not).
    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available())


def broadcast_object(value, state):
    """``value`` as the main process has it, on every rank (a no-op with one process)."""
    if state.num_processes < 2:
        return value
    from accelerate.utils import broadcast_object_list

    holder = [value]
    broadcast_object_list(holder, from_process=0)
    return holder[0]


@contextlib.contextmanager
def shared_atomic_directory(target: str | Path, state) -> Iterator[Path]:
    """:func:`zerosim.core.fsutil.atomic_directory` for a save every rank takes part in (ZeRO-3/FSDP gather).

    The main process makes the temporary directory and tells the others; all write into it; after a
    barrier the main process renames it over ``target``. With one process it is ``atomic_directory``.
    """
    from zerosim.core.fsutil import atomic_directory

    if state.num_processes < 2:
        with atomic_directory(target) as tmp:
            yield tmp
        return
    if state.is_main_process:
        with atomic_directory(target) as tmp:
            broadcast_object(str(tmp), state)
            yield tmp
            state.wait_for_everyone()
    else:
        tmp = Path(broadcast_object(None, state))
        yield tmp
        state.wait_for_everyone()
    state.wait_for_everyone()  # the rename is done before anyone reads the target

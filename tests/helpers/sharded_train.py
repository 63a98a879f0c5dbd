"""Run ``zerosim train`` (the CLI, unchanged) in one process of an ``accelerate launch`` group under a sharded
strategy (DeepSpeed ZeRO), so that its one GRPO step moves the weights and what the trainer logs is kept.

- The rewards alternate 1, 0 over each rank's rows, so every group of two generations has a spread and a
  nonzero advantage: a random tiny policy alone would earn 0 everywhere, and the step would move nothing.
  Sampling, search, the loss, the sharded backward and the optimizer step stay the real ones.
- DeepSpeed's shared-memory all-reduce (a C++ op it compiles on a machine's first run, ~2 minutes) is left out:
  its communication falls back to torch.distributed over gloo, which is what the test checks anyway.
- The trainer's log (``zerosim.training.trainer``, INFO: the mixed-precision check's line) goes to
  ``$ZEROSIM_TRACE/log<R>.txt``, one file per rank.
Usage: accelerate launch --config_file configs/accelerate/zero2-cpu.yaml tests/helpers/sharded_train.py ARGS
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import zerosim.training.recipe as train_module
from zerosim.cli import app

RANK = int(os.environ.get("RANK", "0"))
TRACE = Path(os.environ["ZEROSIM_TRACE"])
_make_reward_func = train_module.make_reward_func


def alternating_make_reward_func(*args, **kwargs):
    inner = _make_reward_func(*args, **kwargs)

    def reward(*a, **kw):
        rewards = inner(*a, **kw)  # computed as usual, then replaced
        return [float(i % 2 == 0) for i in range(len(rewards))]

    reward.__name__ = inner.__name__
    return reward


train_module.make_reward_func = alternating_make_reward_func

import deepspeed.comm.torch as ds_torch_comm  # noqa: E402  (after zerosim: the same import order as a real run)

ds_torch_comm.build_shm_op = lambda: None

if __name__ == "__main__":
    TRACE.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(TRACE / f"log{RANK}.txt")
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    trainer_log = logging.getLogger("zerosim.training.trainer")
    trainer_log.setLevel(logging.INFO)
    trainer_log.addHandler(handler)
    sys.exit(app(["train", *sys.argv[1:]], standalone_mode=True))

"""Run ``zerosim train`` (the CLI, unchanged) in one process of an ``accelerate launch`` group, sending a SIGTERM
to one rank only — as when one node's agent or one pod is stopped — while it rolls out step ``$SIGNAL_STEP``
(0-based). Each rank writes ``$ZEROSIM_TRACE/rank<R>.json`` with the steps it rolled out, and
``exit<R>`` with its exit code.
Usage: SIGNAL_RANK=1 SIGNAL_STEP=1 accelerate launch --config_file configs/accelerate/ddp-cpu.yaml \
    tests/helpers/signal_one_rank.py ARGS
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import zerosim.agent.rollout as rollout_module
from zerosim.cli import app

RANK = int(os.environ.get("RANK", "0"))
TRACE = Path(os.environ["ZEROSIM_TRACE"])
SIGNAL_RANK, SIGNAL_STEP = int(os.environ["SIGNAL_RANK"]), int(os.environ["SIGNAL_STEP"])
steps: list[int] = []

_run = rollout_module.SearchRollout.run


def signalled_run(self, generator, prompts, step, **kwargs):
    if self.noise is not None:  # a training rollout (validation ones draw no curriculum noise)
        steps.append(step)
        (TRACE / f"rank{RANK}.json").write_text(json.dumps({"rolled_out": steps}))
        if RANK == SIGNAL_RANK and step == SIGNAL_STEP:
            os.kill(os.getpid(), signal.SIGTERM)
    return _run(self, generator, prompts, step, **kwargs)


rollout_module.SearchRollout.run = signalled_run

if __name__ == "__main__":
    TRACE.mkdir(parents=True, exist_ok=True)
    try:
        code = app(["train", *sys.argv[1:]], standalone_mode=True)
    except SystemExit as exc:
        code = exc.code
    (TRACE / f"exit{RANK}").write_text(str(code))
    sys.exit(code)

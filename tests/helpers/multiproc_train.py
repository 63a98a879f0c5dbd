"""Run ``zerosim train`` (the CLI, unchanged) in one process of an ``accelerate launch`` group, with the
policy's sampling scripted so that the ranks' trajectories finish on different turns.

Rank 0's trajectories answer at their first turn, correctly; rank 1's search first and answer at the second,
wrongly — so the ranks' local rewards differ. Each rank writes what it did to ``$ZEROSIM_TRACE/rank<R>.jsonl``
(generate / engine calls per rollout, the noise patterns it drew, the scheduled probability) and what its
adaptive curriculum observed to ``$ZEROSIM_TRACE/observe<R>.jsonl`` (its local rewards, the mean it was
given, ``p`` after), for the test to compare across ranks.
Usage: accelerate launch --config_file configs/accelerate/ddp-cpu.yaml tests/helpers/multiproc_train.py ARGS
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import zerosim.agent.rollout as rollout_module
import zerosim.training.recipe as train_module
from curricula.schedules import AdaptiveSchedule
from zerosim.cli import app
from zerosim.core.generation import Generation

RANK = int(os.environ.get("RANK", "0"))
TRACE = Path(os.environ["ZEROSIM_TRACE"])
TURNS = {0: ["<think>known</think><answer> City{letter} </answer>"],  # the right answer
         1: ["<think>look</think><search> capital </search>", "<think>ok</think><answer> City </answer>"]}  # fmt: skip


class ScriptedPolicy:
    """Writes this rank's scripted turn for each row (its turn = the observations already in its context)."""

    collective = True  # exercise the idle path: a rank with nothing left still takes part in each turn

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls: list[int] = []  # rows per call; 0 = idle

    def idle(self, max_new_tokens):
        self.calls.append(0)

    def generate(self, prompts, max_new_tokens, width=None):
        self.calls.append(len(prompts))
        outs = []
        for ids in prompts:
            context = self.tokenizer.decode(ids)
            turn = context.count(rollout_module.INFO_OPEN)  # the prompt names the tag too
            letter = re.findall(r"country ([A-H])\?", context)[-1]
            text = TURNS[RANK][min(turn, len(TURNS[RANK]) - 1)].format(letter=letter)
            tok = self.tokenizer(text, add_special_tokens=False)["input_ids"][:max_new_tokens]
            outs.append(Generation(tok, [-1.0] * len(tok), "stop"))
        return outs


class CountingEngine:
    def __init__(self, inner):
        self.inner, self.calls, self.noise = inner, [], []

    def search(self, requests, k):
        self.calls.append(len(requests))
        self.noise.extend(r.noise_for(k) for r in requests)
        return self.inner.search(requests, k)


_run = rollout_module.SearchRollout.run


def traced_run(self, generator, prompts, step, *, sync=None, offset=0):
    policy = ScriptedPolicy(self.tokenizer)
    engine, self.engine = self.engine, CountingEngine(self.engine)
    try:
        trajectories, timing = _run(self, policy, prompts, step, sync=sync, offset=offset)
    finally:
        counted, self.engine = self.engine, engine
    record = {
        "rank": RANK,
        "step": step,
        # training rollouts draw the curriculum's noise (CurriculumNoise); validation ones none (p 0)
        "p": self.noise.schedule.probability(step) if self.noise is not None else 0.0,
        "offset": offset,
        "generate_calls": policy.calls,
        "engine_calls": counted.calls,
        "noise": [[t.index, e["noisy"]] for t in trajectories for e in t.events],
        "finish": [t.finish for t in trajectories],
    }
    with (TRACE / f"rank{RANK}.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
    return trajectories, timing


rollout_module.SearchRollout.run = traced_run

LOCAL_REWARDS: list[list[float]] = []  # this rank's rewards, one list per reward call
_make_reward_func = train_module.make_reward_func


def traced_make_reward_func(*args, **kwargs):
    inner = _make_reward_func(*args, **kwargs)

    def reward(*a, **kw):
        rewards = inner(*a, **kw)
        LOCAL_REWARDS.append(list(rewards))
        return rewards

    reward.__name__ = inner.__name__
    return reward


_observe = AdaptiveSchedule.observe


def traced_observe(self, step, mean_reward):
    _observe(self, step, mean_reward)
    record = {"step": step, "mean": mean_reward, "p": self.p, "local": LOCAL_REWARDS[-1]}
    with (TRACE / f"observe{RANK}.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")


train_module.make_reward_func = traced_make_reward_func
AdaptiveSchedule.observe = traced_observe

if __name__ == "__main__":
    TRACE.mkdir(parents=True, exist_ok=True)
    sys.exit(app(["train", *sys.argv[1:]], standalone_mode=True))

"""The rollout in lockstep across ranks: threads stand in for processes, a barrier for the all-reduce."""

from __future__ import annotations

import threading

import pytest

from curricula import ConstantSchedule, CurriculumNoise, trajectory_noise
from zerosim.agent.rollout import RolloutConfig, SearchRollout, build_prompt
from zerosim.core.distributed import SingleProcess, TurnState
from zerosim.core.generation import Generation
from zerosim.core.search import Document


class ThreadGroup:
    """An all-reduce(MAX) over ``n`` threads; each rank holds a :class:`ThreadSync` view of it."""

    def __init__(self, n: int):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.values: list[tuple[int, int]] = [(0, 0)] * n
        self.reductions = [0] * n

    def rank(self, index: int) -> ThreadSync:
        return ThreadSync(self, index)


class ThreadSync:
    def __init__(self, group: ThreadGroup, index: int):
        self.group, self.process_index, self.num_processes = group, index, group.n

    def turn(self, active: int, budget: int) -> TurnState:
        g = self.group
        g.values[self.process_index] = (active, budget)
        g.barrier.wait()
        width, most = max(v[0] for v in g.values), max(v[1] for v in g.values)
        g.reductions[self.process_index] += 1
        g.barrier.wait()  # everyone has read before the next turn writes
        return TurnState(width, most)


class CollectiveScript:
    """A collective generator: every call meets the other ranks at a barrier (as vLLM server mode does).

    ``turns`` says, per trajectory number on this rank, what it writes at each turn.
    """

    def __init__(self, tokenizer, barrier: threading.Barrier, turns: dict[int, list[str]]):
        self.tokenizer, self.barrier, self.turns = tokenizer, barrier, turns
        self.collective = True
        self.calls: list[tuple[int, int | None]] = []  # (rows, width)
        self.rows_of: dict[tuple[int, ...], int] = {}
        self.seen: dict[int, int] = {}  # turns written so far, per trajectory

    def idle(self, max_new_tokens: int) -> None:
        self.calls.append((0, None))
        self.barrier.wait()

    def generate(self, prompts, max_new_tokens, width=None):
        self.calls.append((len(prompts), width))
        self.barrier.wait()
        outs = []
        for ids in prompts:
            owner = next(n for p, n in self.rows_of.items() if tuple(ids[: len(p)]) == p)
            text = self.turns[owner][self._turn_of(owner)]
            tok = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            outs.append(Generation(tok, [-0.1] * len(tok), "stop"))
        return outs

    def _turn_of(self, owner: int) -> int:
        self.seen[owner] = self.seen.get(owner, -1) + 1
        return self.seen[owner]


class CountingEngine:
    def __init__(self):
        self.calls: list[int] = []
        self.patterns: dict[str, tuple[bool, ...]] = {}

    def search(self, requests, k):
        self.calls.append(len(requests))
        for r in requests:
            self.patterns[r.question] = tuple(r.noise_for(k))
        return [
            [Document(f"d{i}", "t", f"passage {i}", noisy=r.noise_for(k)[i]) for i in range(k)]
            for r in requests
        ]


SEARCH = "<think>look it up</think><search> capital </search>"
ANSWER = "<answer> Lima </answer>"


def _rollout(tokenizer, engine, questions):
    examples = {build_prompt(q): (q, ("Lima",)) for q in questions}
    config = RolloutConfig(max_turns=3, max_new_tokens=32, max_completion_tokens=300)
    rollout = SearchRollout(
        tokenizer,
        engine,
        config=config,
        k=3,
        noise=CurriculumNoise(ConstantSchedule(0.5), seed=5, k=3, granularity="document"),
        examples=examples,
    )
    return rollout, list(examples)


def test_ranks_finishing_early_keep_step_with_the_others(tokenizer):
    """Rank 0 answers at once; rank 1 searches first. Both take part in every turn; neither hangs."""
    group = ThreadGroup(2)
    gen_barrier = threading.Barrier(2, timeout=30)
    scripts = {0: {0: [ANSWER], 1: [ANSWER]}, 1: {0: [SEARCH, ANSWER], 1: [SEARCH, SEARCH, ANSWER]}}
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def rank(index: int) -> None:
        try:
            engine = CountingEngine()
            rollout, prompts = _rollout(tokenizer, engine, [f"r{index} q{j}" for j in range(2)])
            gen = CollectiveScript(tokenizer, gen_barrier, scripts[index])
            gen.rows_of = {tuple(rollout.encode_prompt(p)): j for j, p in enumerate(prompts)}
            trajectories, _ = rollout.run(gen, prompts, step=3, sync=group.rank(index), offset=2 * index)
            results[index] = (trajectories, gen, engine)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)
            group.barrier.abort()
            gen_barrier.abort()

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert not errors, errors

    (t0, gen0, eng0), (t1, gen1, eng1) = results[0], results[1]
    assert [t.finish for t in t0] == ["answer", "answer"] and [t.searches for t in t0] == [0, 0]
    assert [t.searches for t in t1] == [1, 2]
    # the same number of generate calls and of engine calls on both ranks, turn by turn
    assert len(gen0.calls) == len(gen1.calls) == 3
    assert gen0.calls == [(2, 2), (0, None), (0, None)]  # rank 0 idles through turns 2 and 3
    assert gen1.calls == [(2, 2), (2, 2), (1, 1)]  # widths: the batch-wide max of unfinished rows
    assert eng0.calls == [0, 0, 0] and eng1.calls == [2, 1, 0]
    assert group.reductions == [3, 3]  # one all-reduce per turn; the loop ends when nobody is active


def test_noise_draws_follow_the_global_trajectory_index(tokenizer):
    """What a rank draws for trajectory g is what one process rolling out the whole batch draws for g."""
    engine = CountingEngine()
    rollout, prompts = _rollout(tokenizer, engine, [f"q{j}" for j in range(4)])
    always = {j: [SEARCH, ANSWER] for j in range(4)}

    class Local(CollectiveScript):
        def __init__(self):
            super().__init__(tokenizer, threading.Barrier(1), always)
            self.rows_of = {tuple(rollout.encode_prompt(p)): j for j, p in enumerate(prompts)}

    rollout.run(Local(), prompts, step=2, sync=SingleProcess())
    whole = dict(engine.patterns)

    per_rank = {}
    for index in range(2):  # the same batch split over two ranks, each with its offset
        engine.patterns.clear()
        part = prompts[2 * index : 2 * index + 2]
        gen = Local()
        rollout.run(gen, part, step=2, sync=SingleProcess(), offset=2 * index)
        per_rank.update(engine.patterns)
    assert per_rank == whole
    assert len(set(whole.values())) > 1  # distinct per trajectory, not one draw shared by all
    assert whole["q1"] == trajectory_noise(
        seed=5, step=2, trajectory=1, search=0, k=3, p=0.5, granularity="document"
    )


@pytest.mark.parametrize("granularity", ["call", "document"])
def test_trajectory_noise_share_converges_to_p(granularity):
    draws = [
        trajectory_noise(seed=0, step=7, trajectory=t, search=s, k=5, p=0.3, granularity=granularity)
        for t in range(400)
        for s in range(2)
    ]
    flat = [x for d in draws for x in d]
    assert abs(sum(flat) / len(flat) - 0.3) < 0.03
    if granularity == "call":
        assert all(len(set(d)) == 1 for d in draws)

"""StepSearch-style step rewards: information gain, redundancy, placement on the </search> token."""

import pytest

from zerosim.config import RolloutConfig
from zerosim.generation import Generation
from zerosim.rewards import make_reward_func
from zerosim.rollout import SearchRollout, build_prompt
from zerosim.search import Document
from zerosim.step_rewards import search_step_rewards


def doc(id, text):
    return Document(id=id, title="", text=text)


def test_gain_is_the_improvement_over_earlier_searches():
    off = [doc("a", "Peru has mountains"), doc("b", "Chile is long")]
    on = [doc("c", "The capital of Peru is Lima"), doc("d", "Peru exports copper")]
    again = [doc("e", "The capital of Peru is Lima")]  # no closer than before: no gain
    closer = [doc("f", "Lima")]  # the reference itself: the closest possible
    r = search_step_rewards([off, on, again, closer], "Lima", gain_weight=2.0, redundancy_weight=0.0)
    assert r[0] == 0.0  # nothing mentions the answer
    assert r[1] > 0.1  # the first document that does
    assert r[2] == 0.0
    assert r[3] == pytest.approx(2.0 * 1.0 - r[1])  # cosine 1, minus the best before (gain weight 2)


def test_redundancy_counts_documents_already_seen():
    first = [doc("a", "Peru has mountains"), doc("b", "Chile is long")]
    second = [doc("a", "Peru has mountains"), doc("z", "chile is LONG!"), doc("c", "new text")]
    r = search_step_rewards([first, second], "Lima", gain_weight=0.0, redundancy_weight=0.3)
    assert r == pytest.approx([0.0, -0.3 * 2 / 3])  # same id, and same normalised text
    assert search_step_rewards([], "Lima", gain_weight=1, redundancy_weight=1) == []


def test_rollout_places_step_rewards_on_the_search_closing_token(tokenizer):
    class Engine:
        def search(self, requests, k):
            return [
                [
                    doc(f"{r.query}-{i}", f"{r.query} text Lima" if "capital" in r.query else "noise")
                    for i in range(k)
                ]
                for r in requests
            ]

    turns = iter(
        ["<search> weather </search>", "<search> capital of Peru </search>", "<answer> Lima </answer>"]
    )

    class Scripted:
        def generate(self, prompts, n):
            ids = tokenizer(next(turns), add_special_tokens=False)["input_ids"]
            return [Generation(ids, [0.0] * len(ids), "stop") for _ in prompts]

    q = "What is the capital of Peru?"
    rollout = SearchRollout(
        tokenizer, Engine(), config=RolloutConfig(max_turns=3, max_new_tokens=32, max_completion_tokens=400),
        k=2, examples={build_prompt(q): (q, ("Lima",))}, step_rewards=(1.0, 0.5),
    )  # fmt: skip
    (traj,), _ = rollout.run(Scripted(), [build_prompt(q)], step=0)
    assert traj.searches == 2 and len(traj.step_rewards) == 2
    assert traj.step_rewards[0] == 0.0 and traj.step_rewards[1] > 0
    for index in traj.search_close:
        assert (
            traj.env_mask[index] == 1 and traj.env_mask[index + 1] == 0
        )  # last policy token before <information>
        assert tokenizer.decode(traj.completion_ids[: index + 1]).rstrip().endswith("</search>")
    assert rollout.last_step_rewards == [list(zip(traj.search_close, traj.step_rewards, strict=True))]
    # sequence-level algorithms see outcome + the sum of step rewards
    reward = make_reward_func("em", step_rewards=True)
    total = reward([None], [None], final_answer=["Lima"], golden_answers=[["Lima"]], step_reward_total=[0.25])
    assert total == [1.25]
    assert make_reward_func("em")(
        [None], [None], final_answer=["Lima"], golden_answers=[["Lima"]], step_reward_total=[9]
    ) == [1.0]

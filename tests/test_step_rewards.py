"""StepSearch-style step rewards: information gain, redundancy, placement on the </search> token."""

import pytest
import torch

from zerosim.agent.rewards import make_reward_func
from zerosim.agent.rollout import RolloutConfig, SearchRollout, build_prompt
from zerosim.agent.step_rewards import search_step_rewards
from zerosim.core.generation import Generation
from zerosim.core.search import Document, SearchRequest


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


class CapitalEngine:
    """Documents that mention Lima for a query about the capital, noise otherwise."""

    def search(self, requests, k):
        return [
            [
                doc(f"{r.query}-{i}", f"{r.query} text Lima" if "capital" in r.query else "noise")
                for i in range(k)
            ]
            for r in requests
        ]


TURNS = ("<search> weather </search>", "<search> capital of Peru </search>", "<answer> Lima </answer>")
QUESTION = "What is the capital of Peru?"


class Scripted:
    """A policy that writes ``TURNS`` one per turn, the same for every trajectory of the batch."""

    def __init__(self, tokenizer):
        self.tokenizer, self.turn = tokenizer, 0

    def generate(self, prompts, n, **kwargs):
        ids = self.tokenizer(TURNS[self.turn], add_special_tokens=False)["input_ids"]
        self.turn += 1
        return [Generation(ids, [0.0] * len(ids), "stop") for _ in prompts]


def capital_loop(tokenizer) -> SearchRollout:
    return SearchRollout(
        tokenizer, CapitalEngine(), config=RolloutConfig(max_turns=3, max_new_tokens=32, max_completion_tokens=400),
        k=2, examples={build_prompt(QUESTION): (QUESTION, ("Lima",))}, step_rewards=(1.0, 0.5),
    )  # fmt: skip


def test_rollout_places_step_rewards_on_the_search_closing_token(tokenizer):
    rollout = capital_loop(tokenizer)
    (traj,), _ = rollout.run(Scripted(tokenizer), [build_prompt(QUESTION)], step=0)
    assert traj.searches == 2 and len(traj.step_rewards) == 2
    assert traj.step_rewards[0] == 0.0 and traj.step_rewards[1] > 0
    for index in traj.search_close:
        assert (
            traj.env_mask[index] == 1 and traj.env_mask[index + 1] == 0
        )  # last policy token before <information>
        assert tokenizer.decode(traj.completion_ids[: index + 1]).rstrip().endswith("</search>")
    assert traj.step_reward_positions == list(zip(traj.search_close, traj.step_rewards, strict=True))
    # sequence-level algorithms see outcome + the sum of step rewards
    reward = make_reward_func("em", step_rewards=True)
    total = reward([None], [None], final_answer=["Lima"], golden_answers=[["Lima"]], step_reward_total=[0.25])
    assert total == [1.25]
    assert make_reward_func("em")(
        [None], [None], final_answer=["Lima"], golden_answers=[["Lima"]], step_reward_total=[9]
    ) == [1.0]


def test_trl_rollout_hands_step_rewards_to_the_trainer_and_metrics_to_its_sink(
    tmp_path, tiny_model_dir, tokenizer, monkeypatch
):
    """The TRL adapter's output carries each completion's step-reward positions, which the trainer places on
    those tokens (REINFORCE++: outcome on the last policy token, step rewards on the </search> ones); the
    rollout's metrics reach the one sink the adapter was given, and nothing is left on the rollout to read."""
    from datasets import Dataset
    from trl import GRPOConfig

    from zerosim.core.models import load_causal_lm
    from zerosim.training.algorithms import returns_to_go
    from zerosim.training.trainer import SearchTrainer
    from zerosim.training.trl_rollout import TRLRollout

    loop = capital_loop(tokenizer)
    monkeypatch.setattr(loop, "generator_for", lambda model, collective=False: Scripted(tokenizer))
    logged: list[tuple[str, float]] = []
    rollout = TRLRollout(loop, log_metric=lambda name, value: logged.append((name, value)), num_samples=1)
    row = {"prompt": build_prompt(QUESTION), "golden_answers": ["Lima"]}
    args = GRPOConfig(
        output_dir=str(tmp_path), beta=0.0, num_generations=2, per_device_train_batch_size=2,
        max_completion_length=400, use_cpu=True, report_to=[], logging_steps=1,
    )  # fmt: skip
    trainer = SearchTrainer(
        model=load_causal_lm(str(tiny_model_dir), "float32"),
        reward_funcs=[make_reward_func("em", step_rewards=True)],
        algorithm="reinforce_pp",
        args=args,
        train_dataset=Dataset.from_list([row] * 2),
        processing_class=tokenizer,
        rollout_func=rollout,
    )

    out = rollout([row["prompt"]] * 2, trainer)
    gain = search_step_rewards(
        [CapitalEngine().search([SearchRequest(q)], 2)[0] for q in ("weather", "capital of Peru")],
        "Lima", gain_weight=1.0, redundancy_weight=0.5,
    )  # fmt: skip
    assert gain[0] == 0.0 and gain[1] > 0
    assert len(out["step_rewards"]) == 2  # one list per completion
    for ids, env, steps in zip(out["completion_ids"], out["env_mask"], out["step_rewards"], strict=True):
        assert [value for _, value in steps] == pytest.approx(gain)
        for index, _ in steps:  # the policy token that closed </search>, right before <information>
            assert env[index] == 1 and env[index + 1] == 0
            assert tokenizer.decode(ids[: index + 1]).rstrip().endswith("</search>")
    metrics = dict(logged)
    assert len(logged) == len(metrics)  # each metric once per rollout
    assert metrics["rollout/step_reward_per_traj"] == pytest.approx(sum(gain))
    assert metrics["rollout/searches_per_traj"] == 2 and metrics["rollout/em"] == 1.0
    assert set(metrics) >= {"rollout/f1", "time/generate_s", "time/search_s", "search/noisy_doc_share"}
    assert [s["answer"] for s in rollout.samples] == ["Lima"]  # num_samples=1
    assert not hasattr(loop, "last_step_rewards") and not hasattr(rollout, "last_step_rewards")

    # through TRL's scoring: the trainer reads the positions from the rows TRL gave the rollout's fields
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    scored = trainer._generate_and_score_completions([dict(row) for _ in range(2)])
    mask = trainer._loss_mask(scored)
    expected = torch.zeros(mask.shape)
    for r, steps in enumerate(out["step_rewards"]):
        for index, value in steps:
            expected[r, index] = value
        expected[r, int(mask[r].nonzero()[-1])] = 1.0  # EM 1 (+ the steps' sum, taken back off)
    want = trainer._whiten_batch(returns_to_go(expected, mask.float(), trainer.gamma), mask.float())
    torch.testing.assert_close(scored["advantages"].float(), want.float(), rtol=1e-4, atol=1e-5)

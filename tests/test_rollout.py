"""The rollout's token/mask contract, on scripted and on real (tiny, random) policies."""

import random

import pytest

from curricula import ConstantSchedule, CurriculumNoise
from zerosim.agent.protocol import parse_action
from zerosim.agent.rollout import INVALID_ACTION, RolloutConfig, SearchRollout, build_prompt
from zerosim.core.generation import Generation, HFGenerator
from zerosim.core.sampling import GREEDY, Sampling
from zerosim.core.search import Document, SearchError

TURN_TEXTS = [
    "<think>I should look this up.</think><search> capital of Peru </search>",
    "<think>ok</think><answer> Lima </answer>",
    "I am not sure what to do here at all",  # invalid: no tag, ran out of tokens
    "<search>population of Chile</search>",
    "<answer>the answer</answer>",
]


class ScriptedGenerator:
    """Emits random scripted turns and remembers what it emitted for each trajectory."""

    def __init__(self, tokenizer, seed):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.emitted: dict[tuple[int, ...], list[int]] = {}
        self.prompts: list[tuple[int, ...]] = []

    def generate(self, prompts, max_new_tokens):
        outs = []
        for ids in prompts:
            text = self.rng.choice(TURN_TEXTS)
            tok = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            finish = "stop" if text.endswith(">") else "length"
            if self.rng.random() < 0.1:  # sometimes the policy ends its turn with EOS
                tok, finish = tok + [self.tokenizer.eos_token_id], "eos"
            tok = tok[:max_new_tokens]
            key = next(p for p in self.prompts if tuple(ids[: len(p)]) == p)
            self.emitted.setdefault(key, []).extend(tok)
            outs.append(Generation(tok, [-0.5] * len(tok), finish))
        return outs


class FakeEngine:
    def __init__(self):
        self.calls = []

    def search(self, requests, k):
        self.calls.append(list(requests))
        return [
            [
                Document(f"d{i}", "Peru", f"ZZINFO passage {i} about {r.query}", noisy=r.noise_for(k)[i])
                for i in range(k)
            ]
            for r in requests
        ]


def make_rollout(tokenizer, engine, questions, **cfg):
    examples = {build_prompt(q): (q, ("Lima",)) for q in questions}
    config = RolloutConfig(**{"max_turns": 4, "max_new_tokens": 64, "max_completion_tokens": 400, **cfg})
    return SearchRollout(
        tokenizer,
        engine,
        config=config,
        k=3,
        noise=CurriculumNoise(ConstantSchedule(0.5), seed=1, k=3),
        examples=examples,
    ), list(examples)


def spans(mask):
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


@pytest.mark.parametrize("seed", range(5))
def test_mask_contract_on_random_trajectories(tokenizer, seed):
    engine = FakeEngine()
    questions = [f"Question number {i} about country {chr(65 + i)}?" for i in range(12)]
    rollout, prompts = make_rollout(tokenizer, engine, questions)
    gen = ScriptedGenerator(tokenizer, seed)
    gen.prompts = [tuple(rollout.encode_prompt(p)) for p in prompts]
    trajs, _ = rollout.run(gen, prompts, step=3)
    invalid_ids = tokenizer(INVALID_ACTION, add_special_tokens=False)["input_ids"]
    for t in trajs:
        assert len(t.completion_ids) == len(t.env_mask) == len(t.logprobs) <= 400
        policy = [tok for tok, m in zip(t.completion_ids, t.env_mask, strict=True) if m == 1]
        # every policy token is one the generator sampled, in order, and carries its logprob
        assert policy == gen.emitted[tuple(t.prompt_ids)][: len(policy)]
        assert all(lp == (-0.5 if m else 0.0) for lp, m in zip(t.logprobs, t.env_mask, strict=True))
        for m, a, b in spans(t.env_mask):
            if m == 0:
                text = tokenizer.decode(t.completion_ids[a:b])
                is_info = text.strip().startswith("<information>") and "</information>" in text
                closes_answer = b == len(t.env_mask) and t.completion_ids[a:b] == [tokenizer.eos_token_id]
                assert is_info or closes_answer or t.completion_ids[a:b] == invalid_ids, text
        # every token of every <information> block is masked
        full = tokenizer.decode(t.completion_ids)
        assert full.count("ZZINFO") == tokenizer.decode(
            [tok for tok, m in zip(t.completion_ids, t.env_mask, strict=True) if m == 0]
        ).count("ZZINFO")
        assert "ZZINFO" not in tokenizer.decode(policy)
    # one engine call per turn, carrying all searching trajectories
    assert len(engine.calls) <= 3
    assert sum(len(c) for c in engine.calls) == sum(t.searches for t in trajs)


def test_search_answer_flow_and_metrics(tokenizer):
    engine = FakeEngine()
    rollout, prompts = make_rollout(tokenizer, engine, ["What is the capital of Peru?"], max_turns=3)

    class Fixed:
        turns = iter([TURN_TEXTS[0], TURN_TEXTS[1]])

        def generate(self, prompts, n):
            tok = tokenizer(next(self.turns), add_special_tokens=False)["input_ids"]
            return [Generation(tok, [-1.0] * len(tok), "stop") for _ in prompts]

    trajs, timing = rollout.run(Fixed(), prompts, step=0)
    (t,) = trajs
    assert t.answer == "Lima" and t.finish == "answer" and t.searches == 1 and t.valid_format
    assert t.completion_ids[-1] == tokenizer.eos_token_id and t.env_mask[-1] == 0  # turn closed, not trained
    assert engine.calls[0][0].query == "capital of Peru"
    assert engine.calls[0][0].question == "What is the capital of Peru?" and engine.calls[0][0].answers == (
        "Lima",
    )
    m = rollout.metrics(trajs, 0, timing)
    assert m["rollout/searches_per_traj"] == 1 and m["rollout/answer_rate"] == 1
    assert m["rollout/em"] == 1 and m["rollout/f1"] == 1 and m["rollout/answer_echo_rate"] == 0
    assert "curriculum/noise_prob" not in m  # the loop knows no schedule: the caller's step_metrics add it
    rollout.step_metrics = lambda step: {"curriculum/noise_prob": 0.25 * (step + 2)}
    assert rollout.metrics(trajs, 0, timing)["curriculum/noise_prob"] == 0.5


def test_answer_echo_flags_an_answer_that_restates_the_question():
    from zerosim.agent.rollout import Trajectory, answer_echoes_question

    def traj(answer):
        return Trajectory(
            prompt_ids=[], question="Which currency does Eritrea use?", answers=("nakfa",), answer=answer
        )

    assert answer_echoes_question(traj("Which currency does Eritrea use?"))
    assert answer_echoes_question(traj("which currency does Eritrea use"))  # normalised
    assert not answer_echoes_question(traj("nakfa"))
    assert not answer_echoes_question(traj("Eritrea"))  # one question word is an answer attempt, not an echo
    assert not answer_echoes_question(traj(None))


def test_last_turn_search_ends_without_answer(tokenizer):
    rollout, prompts = make_rollout(tokenizer, FakeEngine(), ["q?"], max_turns=1)

    class Searcher:
        def generate(self, prompts, n):
            tok = tokenizer(TURN_TEXTS[3], add_special_tokens=False)["input_ids"]
            return [Generation(tok, [0.0] * len(tok), "stop") for _ in prompts]

    (t,), _ = rollout.run(Searcher(), prompts, step=0)
    assert t.answer is None and t.finish == "no_answer" and t.searches == 0


def test_empty_search_result_raises(tokenizer):
    class Broken:
        def search(self, requests, k):
            return [[] for _ in requests]

    rollout, prompts = make_rollout(tokenizer, Broken(), ["q?"])

    class Searcher:
        def generate(self, prompts, n):
            tok = tokenizer(TURN_TEXTS[3], add_special_tokens=False)["input_ids"]
            return [Generation(tok, [0.0] * len(tok), "stop") for _ in prompts]

    with pytest.raises(SearchError, match="no documents"):
        rollout.run(Searcher(), prompts, step=0)


def test_parse_action():
    assert parse_action("<think>x</think><search> a b </search>") == ("search", "a b")
    assert parse_action("<answer> Lima </answer>") == ("answer", "Lima")
    assert parse_action("<search>  </search>") == ("invalid", "")
    assert parse_action("no tags") == ("invalid", "")
    assert parse_action("<search>a</search> then <answer>b</answer>") == ("answer", "b")


def test_real_generation_keeps_contract(tiny_model_dir, tokenizer):
    import torch

    from zerosim.core.models import load_causal_lm

    torch.manual_seed(0)
    model = load_causal_lm(str(tiny_model_dir))
    rollout, prompts = make_rollout(
        tokenizer, FakeEngine(), ["A?", "B?", "C?"], max_new_tokens=12, max_turns=3
    )
    trajs, timing = rollout.run(rollout.generator_for(model), prompts, step=0)
    assert timing["generate"] > 0
    for t in trajs:
        assert len(t.completion_ids) == len(t.env_mask) == len(t.logprobs)
        assert all(lp <= 0 for lp in t.logprobs)
        assert sum(t.env_mask) > 0


def test_hf_generator_stops_at_stop_string(tokenizer):
    """A model that always predicts the tokens of '</answer>' then junk is cut right after the tag."""
    import torch

    target = tokenizer("<answer>x</answer> junk junk junk", add_special_tokens=False)["input_ids"]

    class Echo(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.generation_config = None

        def generate(self, input_ids, max_new_tokens, **kw):
            from types import SimpleNamespace

            n = min(max_new_tokens, len(target))
            new = torch.tensor([target[:n]] * input_ids.shape[0])
            logits = [torch.nn.functional.one_hot(new[:, i], len(tokenizer)).float() * 10 for i in range(n)]
            return SimpleNamespace(sequences=torch.cat([input_ids, new], 1), logits=logits)

    gen = HFGenerator(Echo(), tokenizer, sampling=Sampling(temperature=1.0, stop_strings=["</answer>"]))
    (out,) = gen.generate([[1, 2, 3]], 20)
    assert tokenizer.decode(out.token_ids).endswith("</answer>") and out.finish == "stop"
    assert len(out.logprobs) == len(out.token_ids)


def test_stop_criterion_is_built_once_per_tokenizer(tiny_model_dir, tokenizer, monkeypatch):
    """transformers rebuilds StopStringCriteria (a pass over the 49k vocabulary) on every generate call that
    names stop strings; HFGenerator builds it once per (tokenizer, stop strings) and still stops there."""
    import torch
    import transformers

    from zerosim.core.generation import _STOP_CRITERIA
    from zerosim.core.models import load_causal_lm

    _STOP_CRITERIA.clear()
    built = []
    original = transformers.StopStringCriteria.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(transformers.StopStringCriteria, "__init__", counting)
    model = load_causal_lm(str(tiny_model_dir), "float32")
    # a stop string the tiny model writes at once: its first sampled token's text
    torch.manual_seed(0)
    probe = HFGenerator(model, tokenizer, sampling=GREEDY).generate([[1, 2, 3]], 1)[0]
    stop = tokenizer.decode(probe.token_ids).strip() or tokenizer.decode(probe.token_ids)
    sampling = Sampling(temperature=0.0, stop_strings=[stop])
    for _ in range(3):  # e.g. one generator per training step
        gen = HFGenerator(model, tokenizer, sampling=sampling, decoder="transformers")
        (out,) = gen.generate([[1, 2, 3]], 8)
        assert out.finish == "stop" and len(out.token_ids) == 1
    assert len(built) == 1


def test_rows_with_the_same_question_carry_the_same_gold_answers():
    """TRL gives the rollout the prompt text only: two rows asking the same question must not score the
    reward against one row's answers while the simulator is told the other's."""
    from zerosim.core.data.qa import QAExample
    from zerosim.training.recipe import build_dataset

    rows = [
        QAExample(id="a", question="Capital of Peru?", golden_answers=["Lima"]),
        QAExample(id="b", question="Capital of Chile?", golden_answers=["Santiago"]),
        QAExample(id="c", question="Capital of Peru?", golden_answers=["Lima, Peru", "Lima"]),
    ]
    dataset, table = build_dataset(rows)
    peru = build_prompt("Capital of Peru?")
    assert dataset["golden_answers"] == [["Lima", "Lima, Peru"], ["Santiago"], ["Lima", "Lima, Peru"]]
    assert table[peru] == ("Capital of Peru?", ("Lima", "Lima, Peru"))
    for prompt, golds in zip(dataset["prompt"], dataset["golden_answers"], strict=True):
        assert list(table[prompt][1]) == golds  # the reward's answers are the rollout's

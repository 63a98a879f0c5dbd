"""rollout.protocol=tools: the tool table, the hermes call parser, bad calls as invalid turns, the token contract
(tool replies masked, the policy's ids as sampled, the whole trajectory as the chat template renders it), and the
same scripted actions under tags and tools giving the same engine calls and rewards."""

from __future__ import annotations

import copy
import json

import pytest

from zerosim.agent.rewards import answer_reward, format_shaped
from zerosim.agent.rollout import Protocol, RolloutConfig, SearchRollout, build_prompt
from zerosim.agent.tool_format import TemplateError, ToolTokens, tools_template
from zerosim.agent.tools import INVALID_KINDS, TOOLS, InvalidCall, ToolCall, parse_tool_calls, tools_named
from zerosim.core.generation import Generation
from zerosim.core.search import Document


def call(name="search", **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class FakeEngine:
    def __init__(self):
        self.requests = []

    def search(self, requests, k):
        self.requests += [(r.query, r.noise) for r in requests]
        return [
            [Document(f"d{i}", "Peru", f"Lima is the capital ({r.query}) {i}") for i in range(k)]
            for r in requests
        ]


class Scripted:
    """Writes each trajectory's next scripted turn (text; under tools it ends with the end-of-turn token)."""

    def __init__(self, tokenizer, turns: list[str], eos: int | None):
        self.tokenizer, self.turns, self.eos = tokenizer, turns, eos
        self.sampled: list[list[int]] = []
        self.at: dict[int, int] = {}

    def generate(self, prompts, max_new_tokens):
        out = []
        for ids in prompts:
            n = self.at.get(ids[0], 0)  # one trajectory per test: its turn number
            self.at[ids[0]] = n + 1
            tok = self.tokenizer(self.turns[n], add_special_tokens=False)["input_ids"]
            finish = "stop"
            if self.eos is not None:
                tok, finish = tok + [self.eos], "eos"
            self.sampled.append(tok)
            out.append(Generation(tok, [-0.25] * len(tok), finish))
        return out


def rollout_of(tokenizer, protocol: str, **cfg):
    question = "What is the capital of Peru?"
    config = RolloutConfig(
        protocol=Protocol(protocol),
        **{"max_turns": 3, "max_new_tokens": 64, "max_completion_tokens": 900, **cfg},
    )
    engine = FakeEngine()
    loop = SearchRollout(
        tokenizer, engine, config=config, k=2, examples={build_prompt(question): (question, ("Lima",))},
        noise=lambda step, index, number: (number % 2 == 1, False),
    )  # fmt: skip
    return loop, engine, build_prompt(question)


def test_every_tool_of_the_table_has_a_schema_an_executor_and_its_bounds():
    assert set(TOOLS) >= {"search", "read_page"}
    for name, tool in TOOLS.items():
        assert (
            tool.name == name and tool.description and tool.noise and tool.reply_tokens.startswith("rollout.")
        )
        assert callable(getattr(SearchRollout, f"execute_{name}", None)), name
        assert tool.schema()["function"]["parameters"]["additionalProperties"] is False
    with pytest.raises(ValueError, match=r"not tools; the tools are \['read_page', 'search'\]"):
        tools_named(["search", "browse"])


def test_a_call_in_the_template_format_is_parsed_as_trl_and_transformers_parse_it(tokenizer):
    """The hermes format the Qwen2.5 template writes (rendered here from an assistant message with tool_calls),
    read back by zerosim's parser as TRL's parse_response reads it."""
    from trl.chat_template_utils import add_response_schema, parse_response

    tokens = ToolTokens(tokenizer, tools_named(["search"]), 64)
    message = {"role": "assistant", "content": "<think>look up</think>", "tool_calls": [
        {"type": "function", "function": {"name": "search", "arguments": {"query": "capital of Peru"}}},
        {"type": "function", "function": {"name": "search", "arguments": {"query": "Peru"}}},
    ]}  # fmt: skip
    ids = tokens.render([{"role": "user", "content": "q"}, message], generation_prompt=False)
    text = tokenizer.decode(ids)
    turn = text[text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n") :]
    ours = parse_tool_calls(turn, {"search": TOOLS["search"]})
    assert ours == [ToolCall("search", {"query": "capital of Peru"}), ToolCall("search", {"query": "Peru"})]
    clone = copy.deepcopy(tokenizer)  # the session's tokenizer keeps its own template
    clone.chat_template = tokens.template
    add_response_schema(clone)
    prefix = tokens.render([{"role": "user", "content": "q"}], generation_prompt=True)
    theirs = parse_response(clone, tokenizer(turn, add_special_tokens=False)["input_ids"], prefix=prefix)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in theirs["tool_calls"]] == [
        (c.name, c.arguments) for c in ours
    ]


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ('<tool_call>\n{"name": "search", "arguments": {"query": "x"}\n</tool_call>', "malformed_json"),
        ("<tool_call>\nsearch(query='x')\n</tool_call>", "malformed_json"),
        (call("browse", url="x"), "unknown_tool"),
        (call("search"), "bad_arguments"),  # missing
        (call("search", query="x", k=3), "bad_arguments"),  # extra
        (call("search", query=7), "bad_arguments"),  # wrong type
        (call("search", query=""), "bad_arguments"),  # empty
        ('<tool_call>\n{"name": "search", "arguments": {"query": "x"}}', "unclosed_call"),
    ],
)
def test_each_bad_call_is_an_invalid_turn_whose_reply_says_why(tokenizer, text, kind):
    loop, engine, prompt = rollout_of(tokenizer, "tools")
    policy = Scripted(tokenizer, [text, "<answer> Lima </answer>"], loop.tool_tokens.eos_id)
    [traj], _ = loop.run(policy, [prompt], step=0)
    (found,) = parse_tool_calls(text, {"search": TOOLS["search"]})
    assert isinstance(found, InvalidCall) and found.kind == kind
    assert traj.invalid_calls == {kind: 1} and traj.invalid_actions == 1 and not traj.valid_format
    assert traj.answer == "Lima" and engine.requests == []  # nothing ran; the policy went on and answered
    replies = tokenizer.decode([t for t, m in zip(traj.completion_ids, traj.env_mask, strict=True) if m == 0])
    assert f"Error: {found.reason}" in replies and "<tool_response>" in replies
    metrics = loop.metrics([traj], 0, {})
    assert metrics[f"tools/invalid/{kind}"] == 1.0
    assert sum(metrics[f"tools/invalid/{k}"] for k in INVALID_KINDS) == 1.0
    assert format_shaped(1.0, True, traj.valid_format, 0.2) < 1.0  # the format reward is lost


def test_no_action_and_a_call_past_the_budget_are_invalid_turns(tokenizer):
    loop, engine, prompt = rollout_of(tokenizer, "tools", max_tool_calls=1, max_turns=4)
    policy = Scripted(
        tokenizer,
        ["I think it is Lima.", call(query="Peru") + call(query="Lima"), "<answer> Lima </answer>"],
        loop.tool_tokens.eos_id,
    )
    [traj], _ = loop.run(policy, [prompt], step=0)
    assert traj.invalid_calls == {"no_action": 1, "over_budget": 1} and traj.invalid_actions == 2
    assert engine.requests == [
        ("Peru", (False, False))
    ]  # the first call ran; the one past the budget did not
    assert traj.answer == "Lima" and traj.tool_calls == 2


def test_tool_replies_are_masked_the_policy_ids_are_as_sampled_and_the_whole_is_the_templates(tokenizer):
    """Token in, token out: every policy token is one the generator sampled (mask 1, its log-prob), every other
    is the environment's (mask 0, log-prob 0), and the trajectory's tokens are exactly the chat template's
    rendering of the conversation it holds — so a tools-trained policy reads at inference what it trained on."""
    loop, engine, prompt = rollout_of(tokenizer, "tools")
    turns = ["<think>look it up</think>\n" + call(query="capital of Peru"), "<answer> Lima </answer>"]
    policy = Scripted(tokenizer, turns, loop.tool_tokens.eos_id)
    [traj], _ = loop.run(policy, [prompt], step=0)
    assert len(traj.completion_ids) == len(traj.env_mask) == len(traj.logprobs)
    sampled = [t for t, m in zip(traj.completion_ids, traj.env_mask, strict=True) if m == 1]
    assert sampled == [t for turn in policy.sampled for t in turn]
    assert all((lp == -0.25) == (m == 1) for lp, m in zip(traj.logprobs, traj.env_mask, strict=True))
    docs = loop.tool_tokens.clip("\n".join(
        f"Doc {i} (Title: Peru) Lima is the capital (capital of Peru) {i - 1}" for i in (1, 2)
    ))  # fmt: skip
    conversation = loop.tool_tokens.messages("What is the capital of Peru?") + [
        {"role": "assistant", "content": "<think>look it up</think>", "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": {"query": "capital of Peru"}}}]},
        {"role": "tool", "name": "search", "content": docs},
        {"role": "assistant", "content": "<answer> Lima </answer>"},
    ]  # fmt: skip
    rendered = loop.tool_tokens.render(conversation, generation_prompt=False)
    assert traj.prompt_ids + traj.completion_ids == rendered[: len(traj.prompt_ids + traj.completion_ids)]
    assert (
        tokenizer.decode(rendered[len(traj.prompt_ids + traj.completion_ids) :]).strip() == ""
    )  # its newline
    assert traj.valid_format and traj.answer == "Lima" and traj.searches == 1


def test_the_same_actions_under_tags_and_tools_give_the_same_engine_calls_and_rewards(tokenizer):
    """One scripted agent — search, search again, answer — written in each protocol: the engine sees the same
    queries with the same curriculum noise (search number 0, 1), and the trajectories score the same."""
    tags = ["<search> capital of Peru </search>", "<search> Peru </search>", "<answer> Lima </answer>"]
    tools = [call(query="capital of Peru"), call(query="Peru"), "<answer> Lima </answer>"]
    seen = {}
    for protocol, turns in (("tags", tags), ("tools", tools)):
        loop, engine, prompt = rollout_of(tokenizer, protocol)
        eos = loop.tool_tokens.eos_id if protocol == "tools" else None
        [traj], _ = loop.run(Scripted(tokenizer, turns, eos), [prompt], step=3)
        reward = format_shaped(
            answer_reward(traj.answer, traj.answers), traj.answer is not None, traj.valid_format, 0.2
        )
        seen[protocol] = (engine.requests, traj.searches, traj.answer, traj.valid_format, traj.finish, reward)
    assert seen["tags"] == seen["tools"]
    assert seen["tools"][0] == [("capital of Peru", (False, False)), ("Peru", (True, False))]


def test_a_template_that_cannot_render_tools_without_chatml_tokens_is_refused(tokenizer):
    assert tools_template(tokenizer)  # SmolLM2's: the Qwen2.5 layout, its ChatML tokens in the vocabulary

    class NoChatML:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

        def get_vocab(self):
            return {"<s>": 0}

        def apply_chat_template(self, messages, tools=None, **_):  # renders no tools
            return "".join(m["content"] for m in messages)

    with pytest.raises(TemplateError, match="rollout.protocol=tags"):
        tools_template(NoChatML())

"""The tools a policy may call under ``rollout.protocol=tools``: one table, one entry per tool.

A tool is its name, the JSON schema of its arguments (what the chat template shows the policy, and what a call
is checked against), the executor that answers it, how the curriculum's noise reaches it, and the setting that
bounds its reply. A new tool is one :data:`TOOLS` entry plus its executor (an ``execute_<name>`` method of
:class:`zerosim.agent.rollout.SearchRollout`); ``tests/test_tools.py`` checks that every entry has one.

Bad calls are actions, not crashes (:class:`InvalidCall`): the turn that made one is invalid — its reply
says why, the trajectory loses its format reward as an invalid ``<search>`` does under ``tags`` — and each
kind is counted per step in MLflow as ``tools/invalid/<kind>``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator


@dataclass(frozen=True)
class Tool:
    """One entry of the table (see the module)."""

    name: str
    description: str
    # JSON schema of the arguments object (``additionalProperties: false``: an extra argument is a bad call)
    parameters: Mapping[str, Any]
    # how the curriculum's noise applies to a call (docs/agents.md)
    noise: str
    # the rollout setting that bounds the reply's tokens
    reply_tokens: str
    # what a bad call of this tool costs the trajectory
    invalid_cost: str = "the turn is invalid: its reply says why, and the format reward is lost"
    validator: Draft202012Validator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        Draft202012Validator.check_schema(self.parameters)
        object.__setattr__(self, "validator", Draft202012Validator(self.parameters))

    def schema(self) -> dict[str, Any]:
        """The OpenAI / chat-template form: ``{"type": "function", "function": {name, description, parameters}}``."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }

    def check(self, arguments: Any) -> str | None:
        """Why ``arguments`` is not a valid call of this tool, or None."""
        errors = sorted(self.validator.iter_errors(arguments), key=lambda e: list(e.path))
        if not errors:
            return None
        e = errors[0]
        where = ".".join(str(p) for p in e.path)
        return f"{self.name}: {where + ': ' if where else ''}{e.message}"


TOOLS: dict[str, Tool] = {
    "search": Tool(
        name="search",
        description="Search the knowledge source for documents about a query. Returns the top documents.",
        parameters={
            "type": "object",
            "properties": {"query": {"type": "string", "minLength": 1, "description": "What to search for."}},
            "required": ["query"],
            "additionalProperties": False,
        },
        noise="per result slot, as <search> under tags: the curriculum's pattern of (step, trajectory, search)",
        reply_tokens="rollout.max_obs_tokens",
    ),
    "read_page": Tool(
        name="read_page",
        description=(
            "Open a search result and read its whole page. doc is the result's number, as in 'Doc 2' of an "
            "earlier search's reply."
        ),
        parameters={
            "type": "object",
            "properties": {
                "doc": {"type": "integer", "minimum": 1, "description": "The number of the result to open."}
            },
            "required": ["doc"],
            "additionalProperties": False,
        },
        noise=(
            "a corpus page is the real document (no noise); a simulated page is written useful or noisy by its "
            "own curriculum draw of (seed, step, trajectory, page number): curricula.noise.page_noise"
        ),
        reply_tokens="rollout.max_page_tokens",
        invalid_cost=(
            "the turn is invalid (a doc no earlier search returned: tools/invalid/no_such_result): its reply says "
            "why, and the format reward is lost"
        ),
    ),
}


def tools_named(names: Sequence[str]) -> list[Tool]:
    """The table's entries for ``names`` (``rollout.tools``), in that order; an unknown name is refused."""
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ValueError(
            f"rollout.tools names {unknown}, which are not tools; the tools are {sorted(TOOLS)} "
            "(zerosim/agent/tools.py)"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"rollout.tools names a tool twice: {list(names)}")
    if not names:
        raise ValueError("rollout.tools is empty: name at least one of " + ", ".join(sorted(TOOLS)))
    return [TOOLS[n] for n in names]


# -- calls in the hermes / Qwen format: <tool_call>{"name": ..., "arguments": {...}}</tool_call> ----------------
INVALID_KINDS = (
    "malformed_json",  # the text between the tags is not one JSON object
    "unknown_tool",  # a name that is not one of the offered tools
    "bad_arguments",  # missing, extra or wrong-typed arguments (the tool's schema)
    "over_budget",  # past rollout.max_tool_calls for the trajectory
    "unclosed_call",  # <tool_call> without its </tool_call>
    "no_such_result",  # read_page of a result number no earlier search returned
    "no_action",  # a message with neither a tool call nor an <answer>
)


@dataclass(frozen=True)
class ToolCall:
    """A call the policy wrote: the tool's name and its arguments (checked against its schema)."""

    name: str
    arguments: dict[str, Any]

    def openai(self, call_id: str) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry (arguments as a JSON string)."""
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


@dataclass(frozen=True)
class InvalidCall:
    """A call that cannot run: its kind (:data:`INVALID_KINDS`), why (what the reply tells the policy), and the
    tool's name where the call named one."""

    kind: str
    reason: str
    name: str | None = None


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, tools: Mapping[str, Tool]) -> list[ToolCall | InvalidCall]:
    """Every ``<tool_call>…</tool_call>`` of a message, in order: a :class:`ToolCall` where it is one JSON object
    ``{"name": <an offered tool>, "arguments": {...}}`` whose arguments its schema accepts, else an
    :class:`InvalidCall` saying why. A ``<tool_call>`` left open after the last complete one is an invalid call too.
    """
    out: list[ToolCall | InvalidCall] = []
    for body in _CALL.findall(text):
        out.append(_one_call(body.strip(), tools))
    tail = text[text.rfind("</tool_call>") + len("</tool_call>") :] if "</tool_call>" in text else text
    if "<tool_call>" in tail:
        out.append(
            InvalidCall("unclosed_call", "a <tool_call> was opened and never closed with </tool_call>")
        )
    return out


def _one_call(body: str, tools: Mapping[str, Tool]) -> ToolCall | InvalidCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return InvalidCall(
            "malformed_json", f"the tool call is not valid JSON ({e.msg} at character {e.pos})"
        )
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return InvalidCall(
            "malformed_json", 'a tool call is one JSON object {"name": <tool>, "arguments": {...}}'
        )
    name = call["name"]
    if name not in tools:
        return InvalidCall("unknown_tool", f"there is no tool {name!r}; the tools are {sorted(tools)}", name)
    extra = sorted(set(call) - {"name", "arguments"})
    if extra:
        return InvalidCall("malformed_json", f"a tool call holds only name and arguments, not {extra}", name)
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # the OpenAI wire form: arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return InvalidCall("malformed_json", f"the arguments are not valid JSON ({e.msg})", name)
    problem = tools[name].check(arguments)
    if problem is not None:
        return InvalidCall("bad_arguments", problem, name)
    return ToolCall(name, arguments)

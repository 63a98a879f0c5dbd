"""The token pieces of ``rollout.protocol=tools``: the prompt the policy's chat template renders with the tools'
schemas, and each tool reply as the template renders ``tool`` messages — the counterpart of
:class:`zerosim.agent.rollout.ProtocolTokens` under ``tags``.

The policy's own tokens are never re-tokenized: a turn is what it sampled, up to and including its end-of-turn
token; what follows (the template's closing of the turn if the policy did not close it, the ``tool`` messages,
the next assistant header) is environment text, masked out of the loss. A reply's tokens are the template's
rendering of the tool messages less the rendering of the turn before them (TRL's ``_get_tool_suffix_ids``
method, which checks the one is a prefix of the other).

The template: the tokenizer's own where it renders tools (Qwen2.5/Qwen3, Llama-3.1+, Hermes); one that cannot
(the embedded SmolLM2's) gets the Qwen2.5 layout TRL ships (``trl.chat_template_utils.qwen2_5_chat_template``)
when its vocabulary holds the ChatML turn tokens that layout writes (``<|im_start|>``, ``<|im_end|>`` — SmolLM2
does), and is refused otherwise: another layout's turn tokens would be text to a model that never saw them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zerosim.agent.tools import Tool

TOOLS_SYSTEM = (
    "Answer the user's question. Reason first. If you lack a fact, call a tool to find it; you may call tools "
    "several times. When you know the answer, reply with it, in a few words, between <answer> and </answer>, "
    "for example <answer> Paris </answer>, and call no tool in that reply."
)
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


class TemplateError(ValueError):
    """The policy's tokenizer cannot render tool calls (see the module)."""


def tools_template(tokenizer) -> str:
    """The chat template to render tools with (see the module)."""
    from trl.chat_template_utils import qwen2_5_chat_template, supports_tool_calling

    if supports_tool_calling(tokenizer):
        return tokenizer.chat_template
    vocab = tokenizer.get_vocab()
    if all(t in vocab for t in CHATML_TOKENS):
        return qwen2_5_chat_template
    raise TemplateError(
        f"rollout.protocol=tools: the policy's chat template cannot render tools, and its vocabulary lacks the "
        f"ChatML turn tokens {list(CHATML_TOKENS)} of the Qwen2.5 layout zerosim would use instead. Use a policy "
        "whose template renders tools (Qwen2.5/Qwen3-Instruct, Llama-3.1+-Instruct, Hermes), or "
        "rollout.protocol=tags"
    )


class ToolTokens:
    """Prompt and reply tokens under the tools protocol, for ``tools`` (see the module)."""

    def __init__(self, tokenizer, tools: Sequence[Tool], max_reply_tokens: int):
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.schemas = [t.schema() for t in self.tools]
        self.template = tools_template(tokenizer)
        self.max_reply_tokens = max_reply_tokens
        chatml = CHATML_TOKENS[1] in self.template and all(t in tokenizer.get_vocab() for t in CHATML_TOKENS)
        self.eos_id = tokenizer.convert_tokens_to_ids(CHATML_TOKENS[1]) if chatml else tokenizer.eos_token_id
        self._prefixes: dict[str, list[int]] = {}  # _after's renderings of a turn, by its shape

    def render(self, messages: list[dict[str, Any]], *, generation_prompt: bool) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                messages,
                tools=self.schemas,
                chat_template=self.template,
                add_generation_prompt=generation_prompt,
                tokenize=True,
                return_dict=False,
            )
        )

    def messages(self, question: str) -> list[dict[str, Any]]:
        return [{"role": "system", "content": TOOLS_SYSTEM}, {"role": "user", "content": question.strip()}]

    def prompt(self, question: str) -> list[int]:
        """System instructions + the tools' schemas + the question, ready for the assistant's first token."""
        return self.render(self.messages(question), generation_prompt=True)

    def clip(self, text: str, max_tokens: int | None = None) -> str:
        """``text`` cut to ``max_tokens`` tokens (``max_reply_tokens`` where None)."""
        limit = self.max_reply_tokens if max_tokens is None else max_tokens
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= limit:
            return text
        return self.tokenizer.decode(ids[:limit], skip_special_tokens=True)

    def reply(self, replies: Sequence[tuple[str, str]]) -> list[int]:
        """The tokens after a turn the policy closed with its end-of-turn token: the ``tool`` messages
        ``(tool name, content)`` as the template renders them, then the next assistant header."""
        calls = [{"type": "function", "function": {"name": name, "arguments": {}}} for name, _ in replies]
        turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        tools = [{"role": "tool", "name": name, "content": content} for name, content in replies]
        return self._after(turn, turn + tools)

    def correction(self, text: str) -> list[int]:
        """The tokens after a closed turn that called nothing and answered nothing: a user message saying so."""
        turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        return self._after(turn, turn + [{"role": "user", "content": text}])

    def _after(self, before: list[dict[str, Any]], full: list[dict[str, Any]]) -> list[int]:
        key = repr(before)  # a handful of shapes (the calls' names): rendered once each
        prefix = self._prefixes.get(key)
        if prefix is None:
            prefix = self.render(before, generation_prompt=False)
            ends = [i for i, t in enumerate(prefix) if t == self.eos_id]
            if (
                ends
            ):  # the policy's turn ends at its end-of-turn token; the template's newline after it is ours
                prefix = prefix[: ends[-1] + 1]
            self._prefixes[key] = prefix
        ids = self.render(full, generation_prompt=True)
        if ids[: len(prefix)] != prefix:
            raise TemplateError(
                "rollout.protocol=tools: the chat template renders a turn differently once a reply follows it "
                "(the turn is not a prefix of the conversation), so a reply's tokens cannot be cut from it"
            )
        return ids[len(prefix) :]

"""Prompt templates for the LLM search simulator (useful and noisy modes).

Templates are ``str.format`` strings with the fields ``query``, ``k``, ``words``, ``context`` (a line
about the user's question and gold answers, or empty when answers are withheld). The context line tells the
simulator the answer, so it is rendered only for requests that carry answers — training requests; evaluation
and validation withhold them (see :mod:`simulators.llm`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

USEFUL_TEMPLATE = (
    "You are a web search engine. For the search query below, write {k} short search results of about "
    "{words} words each. Each result must state facts that help answer the query.{context}\n"
    "Query: {query}\n"
    "Write exactly {k} results, one per line, each starting with 'Doc <number>:'."
)

NOISY_TEMPLATE = (
    "You are a web search engine. For the search query below, write {k} short search results of about "
    "{words} words each. The results must look related to the query but must not contain the answer or "
    "anything that helps find it.{context}\n"
    "Query: {query}\n"
    "Write exactly {k} results, one per line, each starting with 'Doc <number>:'."
)

USEFUL_CONTEXT = " The user's question is: {question} The correct answer is: {answers}. Mention it."
NOISY_CONTEXT = " The user's question is: {question} Never mention the correct answer ({answers})."


@dataclass(frozen=True)
class SimulatorPrompts:
    """The wording the simulator is prompted with; replace any part from config or a template file."""

    useful: str = USEFUL_TEMPLATE
    noisy: str = NOISY_TEMPLATE
    useful_context: str = USEFUL_CONTEXT
    noisy_context: str = NOISY_CONTEXT

    @classmethod
    def from_file(cls, path) -> SimulatorPrompts:
        """Templates from a YAML/JSON file (any of useful, noisy, useful_context, noisy_context)."""
        from simulators.llm import load_prompts

        return load_prompts(path)

    def render(
        self, *, query: str, k: int, words: int, noisy: bool, question: str | None, answers: Sequence[str]
    ) -> str:
        context = ""
        if question and answers:
            template = self.noisy_context if noisy else self.useful_context
            context = template.format(question=question.strip(), answers="; ".join(answers))
        body = self.noisy if noisy else self.useful
        return body.format(query=query.strip(), k=k, words=words, context=context)

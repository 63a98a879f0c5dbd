"""Prompt templates for the LLM search simulator (useful and noisy modes).

Templates are ``str.format`` strings with the fields ``query``, ``k`` (``k_word``: the same number spelled
out, "five"), ``words``, ``context`` (a line about the user's question and gold answers, or empty when
answers are withheld). The context line tells the simulator the answer, so it is rendered only for requests
that carry answers — training requests; evaluation and validation withhold them (see :mod:`simulators.llm`).

Two presets (``search.simulator.prompts``): ``default``, zerosim's own wording, and ``zerosearch``, the layout
ZeroSearch's released simulators were fine-tuned on — a search-engine persona, the number and mode of the
documents, the user's question and its answer (in both modes), the length, the query, and a
``Useful Output:`` / ``Noisy Output:`` cue; the model answers ``Doc 1: ...`` lines. A template file replaces
any template of either preset (:func:`preset_prompts`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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

# ZeroSearch's layout, in our words. No output-format line: their fine-tuned simulators learnt the
# "Doc i:" format from their SFT data (an untuned model is better served by the default preset).
ZEROSEARCH_USEFUL_TEMPLATE = (
    "You are a web search engine like Google.\n"
    "For the query below, your task is to write {k_word} useful documents.\n"
    "{context}"
    "Keep each document near {words} words, and make the documents carry useful information.\n\n"
    "Query: {query}\n"
    "Useful Output:\n"
)
ZEROSEARCH_NOISY_TEMPLATE = (
    "You are a web search engine like Google.\n"
    "For the query below, your task is to write {k_word} noisy documents.\n"
    "{context}"
    "Keep each document near {words} words, and make the documents carry noisy information.\n\n"
    "Query: {query}\n"
    "Noisy Output:\n"
)
# Both modes are told the answer, as in ZeroSearch: the noisy mode needs it to stay away from it.
ZEROSEARCH_CONTEXT = (
    '\nThe user is looking for the answer to the question "{question}", which is {answers}.\n'
)

_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def number_word(n: int) -> str:
    """``n`` spelled out up to ten ("five"), as digits above."""
    return _NUMBER_WORDS[n] if 0 <= n < len(_NUMBER_WORDS) else str(n)


@dataclass(frozen=True)
class SimulatorPrompts:
    """The wording the simulator is prompted with; replace any part from config or a template file."""

    useful: str = USEFUL_TEMPLATE
    noisy: str = NOISY_TEMPLATE
    useful_context: str = USEFUL_CONTEXT
    noisy_context: str = NOISY_CONTEXT

    @classmethod
    def from_file(cls, path, base: SimulatorPrompts | None = None) -> SimulatorPrompts:
        """Templates from a YAML/JSON file (any of useful, noisy, useful_context, noisy_context); the keys
        it leaves out keep ``base``'s wording (default: the ``default`` preset's)."""
        return load_prompts(path, base=base)

    def render(
        self, *, query: str, k: int, words: int, noisy: bool, question: str | None, answers: Sequence[str]
    ) -> str:
        context = ""
        if question and answers:
            template = self.noisy_context if noisy else self.useful_context
            context = template.format(question=question.strip(), answers="; ".join(answers))
        body = self.noisy if noisy else self.useful
        return body.format(query=query.strip(), k=k, k_word=number_word(k), words=words, context=context)


ZEROSEARCH_PROMPTS = SimulatorPrompts(
    useful=ZEROSEARCH_USEFUL_TEMPLATE,
    noisy=ZEROSEARCH_NOISY_TEMPLATE,
    useful_context=ZEROSEARCH_CONTEXT,
    noisy_context=ZEROSEARCH_CONTEXT,
)
# ZeroSearch's released simulators (sunhaonlp/Simulation_LLM_google_{3B,7B,14B}_V2, ...): trained on this layout
ZEROSEARCH_RELEASE_MARK = "simulation_llm"


def is_zerosearch_release(model: str | None) -> bool:
    """Whether ``model`` (an HF id or a local folder named after one) is one of ZeroSearch's released
    simulators, which learnt :data:`ZEROSEARCH_PROMPTS`' layout (``search.simulator.prompts=zerosearch``)."""
    return model is not None and ZEROSEARCH_RELEASE_MARK in Path(model).name.lower()


# ``search.simulator.prompts`` -> its templates (simulators.parsing.DOCUMENT_PARSERS has the same keys)
PRESETS: dict[str, SimulatorPrompts] = {"default": SimulatorPrompts(), "zerosearch": ZEROSEARCH_PROMPTS}


def preset_prompts(preset: str = "default", prompts_file: str | Path | None = None) -> SimulatorPrompts:
    """The templates of ``preset``, any of them replaced from ``prompts_file``."""
    try:
        base = PRESETS[str(preset)]
    except KeyError:
        raise ValueError(
            f"unknown simulator prompt preset {preset!r}; use one of {', '.join(PRESETS)}"
        ) from None
    return load_prompts(prompts_file, base=base) if prompts_file else base


# -- template files -------------------------------------------------------------------------------------

_BODY_FIELDS = {"query": "q", "k": 3, "k_word": "three", "words": 30, "context": ""}
_CONTEXT_FIELDS = {"question": "q", "answers": "a"}


def load_prompts(path: str | Path, base: SimulatorPrompts | None = None) -> SimulatorPrompts:
    """Simulator templates from a YAML (``.yaml``/``.yml``) or JSON file.

    The file is a mapping with any of the keys ``useful``, ``noisy`` (``str.format`` templates with the
    fields ``{query}``, ``{k}``, ``{k_word}``, ``{words}``, ``{context}``) and ``useful_context``,
    ``noisy_context`` (fields ``{question}``, ``{answers}``); keys left out keep ``base``'s wording (the
    ``default`` preset when ``None``). Unknown keys, non-string values and templates naming unknown fields
    raise :class:`ValueError` naming the file and the fix.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"simulator template file {path} does not exist")
    raw = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(raw)
        else:
            import yaml

            data = yaml.safe_load(raw)
    except Exception as exc:  # json.JSONDecodeError or yaml.YAMLError (no common base)
        raise ValueError(f"simulator template file {path} cannot be parsed: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"simulator template file {path} must hold a mapping of template names to strings")
    valid = [f.name for f in dataclasses.fields(SimulatorPrompts)]
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ValueError(
            f"simulator template file {path}: unknown keys {unknown}; valid keys: {', '.join(valid)}"
        )
    for key, template in data.items():
        if not isinstance(template, str):
            raise ValueError(
                f"simulator template file {path}: {key} must be a string, not {type(template).__name__}"
            )
        fields = _CONTEXT_FIELDS if key.endswith("_context") else _BODY_FIELDS
        try:
            template.format(**fields)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"simulator template file {path}: {key} is not a valid template ({type(exc).__name__}: {exc}); "
                f"it may use the fields {', '.join('{' + f + '}' for f in fields)} and must double literal braces"
            ) from exc
        if key in ("useful", "noisy") and "{query}" not in template:
            raise ValueError(
                f"simulator template file {path}: {key} never uses {{query}}; the simulator must see it"
            )
    return dataclasses.replace(base or SimulatorPrompts(), **data)

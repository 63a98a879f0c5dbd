"""Reading the search protocol's tags out of a policy's text: one parser for the rollout, rewards and eval.

A tag pair is ``<tag>content</tag>``; only complete pairs count (an unclosed ``<answer>`` is no answer), the
content is stripped, and the **last** pair in the text wins. :func:`parse_action` and :func:`extract_answer`
differ only in which tags they look for, on purpose: a turn's action is its last ``<search>`` *or*
``<answer>`` (generation stops at the first closing tag, so that is the one the turn ends with), while the
final answer of a text is its last ``<answer>``, whatever follows it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

ACTION_TAGS = ("search", "answer")


@functools.cache
def _pair_re(tags: tuple[str, ...]) -> re.Pattern[str]:
    names = "|".join(re.escape(t) for t in tags)
    return re.compile(rf"<({names})>(.*?)</\1>", re.DOTALL)


def last_tag(text: str, tags: Sequence[str]) -> tuple[str, str] | None:
    """``(tag, stripped content)`` of the last complete ``<tag>...</tag>`` pair in ``text`` for any of
    ``tags``; ``None`` if there is none."""
    matches = _pair_re(tuple(tags)).findall(text)
    return (matches[-1][0], matches[-1][1].strip()) if matches else None


def extract_answer(text: str) -> str | None:
    """The content of the last complete ``<answer>...</answer>`` in ``text``, stripped; ``None`` if none."""
    found = last_tag(text, ("answer",))
    return None if found is None else found[1]


def parse_action(text: str) -> tuple[str, str]:
    """The action a turn's text ends with: ``("search", query)``, ``("answer", answer)`` or ``("invalid", "")``.

    Generation stops at the first closing tag, so the last complete tag pair is the turn's action. An empty
    query is invalid; an empty answer is still an answer (it scores 0).
    """
    found = last_tag(text, ACTION_TAGS)
    if found is None or (found[0] == "search" and not found[1]):
        return "invalid", ""
    return found

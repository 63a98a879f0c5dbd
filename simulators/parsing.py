"""Cutting a simulator's free text into documents.

:func:`split_documents` (preset ``default``) reads ``Doc i:`` markers at line starts; :func:`split_numbered_documents`
(preset ``zerosearch``) reads ``Doc 1: ... Doc 2: ...`` wherever the markers stand, as ZeroSearch's simulators
write them. Both return at most ``k`` non-empty documents and leave a short answer to the caller.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_DOC_MARKER = re.compile(
    r"(?:^|\n)\s*[*#]*\s*(?:Doc(?:ument)?|Result)\s*\d+\s*[*]*\s*[:.)\-][ \t]*(?:\*\*?(?![*\w]))?",
    re.IGNORECASE,
)
_LIST_MARKER = re.compile(r"^\s*(?:\d+[.)]|[-*•])\s+")


def split_documents(text: str, k: int) -> list[str]:
    """At most ``k`` non-empty document texts from ``text``.

    Prefers explicit ``Doc i:`` markers; without them, falls back to one document per non-empty line
    (list bullets stripped). Returns fewer than ``k`` when the text holds fewer, and ``[]`` for text with
    no content at all — the caller decides what a short answer means.
    """
    text = text.replace("\r\n", "\n")
    parts = _DOC_MARKER.split(text)
    # With markers, the text before the first one is preamble; without, one document per line.
    candidates = parts[1:] if len(parts) > 1 else [_LIST_MARKER.sub("", line) for line in text.split("\n")]
    docs = [" ".join(c.split()) for c in candidates]
    return [d for d in docs if d][:k]


# "Doc 3:" anywhere (not inside a word), optionally bold/heading-marked; the separator is not followed by a
# digit, so "Doc 1.5" is no marker.
_NUMBERED_MARKER = re.compile(
    r"(?<!\w)[*#]*[ \t]*Doc(?:ument)?[ \t]*(\d+)[ \t]*\**[ \t]*[:.)\-](?!\d)[ \t]*(?:\*\*?(?![*\w]))?",
    re.IGNORECASE,
)


def split_numbered_documents(text: str, k: int) -> list[str]:
    """At most ``k`` non-empty documents from ``Doc 1: ... Doc 2: ...`` text (ZeroSearch's output format).

    Markers count wherever they stand (one document per line, or several on one line), as long as their
    numbers rise: a "Doc 2" mentioned after "Doc 4" is text, not a new document. Text before the first
    marker is preamble (an echoed ``Useful Output:``); a marker with nothing after it, or a number skipped,
    gives no document, so the caller sees fewer than ``k``. Without any marker it falls back to
    :func:`split_documents` (one document per line).
    """
    text = text.replace("\r\n", "\n")
    markers: list[re.Match[str]] = []
    for match in _NUMBERED_MARKER.finditer(text):
        if not markers or int(match.group(1)) > int(markers[-1].group(1)):
            markers.append(match)
    if not markers:
        return split_documents(text, k)
    ends = [m.start() for m in markers[1:]] + [len(text)]
    docs = [" ".join(text[m.end() : end].split()) for m, end in zip(markers, ends, strict=True)]
    return [d for d in docs if d][:k]


# ``search.simulator.prompts`` -> how that preset's output is cut into documents (keys of prompts.PRESETS)
DOCUMENT_PARSERS: dict[str, Callable[[str, int], list[str]]] = {
    "default": split_documents,
    "zerosearch": split_numbered_documents,
}

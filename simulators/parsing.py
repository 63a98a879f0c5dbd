"""Cutting a simulator's free text into documents."""

from __future__ import annotations

import re

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

"""The one search interface: everything that answers a ``<search>`` implements :class:`SearchEngine`.

A search engine is batch-first: the rollout sends one call per turn carrying every active trajectory's
query, and gets back one ranked list of :class:`Document` per request. Simulators, real retrievers, HTTP
clients and caches all speak this protocol, so one config key swaps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class SearchError(RuntimeError):
    """A search could not be answered (engine down, garbage answer, ...). Never turned into an empty result."""


@dataclass(frozen=True)
class Document:
    """One retrieved (or simulated) passage.

    ``noisy`` is ``None`` for a plain retriever, and ``True``/``False`` when a simulator or the noise
    injection decided the document's mode.
    """

    id: str
    title: str
    text: str
    score: float | None = None
    noisy: bool | None = None

    @property
    def contents(self) -> str:
        """FlashRAG ``contents`` form: title on the first line, text after."""
        return f"{self.title}\n{self.text}" if self.title else self.text

    @classmethod
    def from_contents(cls, id: str, contents: str, score: float | None = None) -> Document:
        """Build from a FlashRAG ``contents`` string (``"Title"\\ntext``; quotes around the title optional)."""
        title, sep, text = contents.partition("\n")
        if not sep:
            title, text = "", contents
        return cls(id=id, title=title.strip().strip('"'), text=text.strip(), score=score)


@dataclass(frozen=True)
class SearchRequest:
    """One query, plus what a training-time simulator may see.

    ``question`` and ``answers`` are the user's question and gold answers (a simulator uses them to write
    useful or noisy documents; real retrievers ignore them). ``noise`` holds one bool per result slot,
    decided by the curriculum: ``True`` means that slot should be a noisy (unhelpful) document. ``None``
    means no curriculum noise (all useful). ``source`` routes the request under ``search.engine=mixed``:
    ``"real"`` or ``"sim"``, drawn by the rollout (:func:`curricula.search_source`); every other engine
    ignores it, and ``None`` leaves the choice to the mixed engine (:class:`curricula.MixedSearchEngine`).
    """

    query: str
    question: str | None = None
    answers: tuple[str, ...] = ()
    noise: tuple[bool, ...] | None = field(default=None)
    source: str | None = None

    def noise_for(self, k: int) -> tuple[bool, ...]:
        """The per-slot noise pattern for ``k`` results (all useful when unset)."""
        if self.noise is None:
            return (False,) * k
        if len(self.noise) != k:
            raise ValueError(
                f"SearchRequest.noise has {len(self.noise)} slots but k={k} documents were asked for"
            )
        return self.noise


@runtime_checkable
class SearchEngine(Protocol):
    """Batch-first search: ``search(requests, k)`` returns one list of at most ``k`` documents per request.

    Implementations raise :class:`SearchError` when they cannot answer; they never return an empty list
    in place of a failure.
    """

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]: ...


def format_documents(docs: Sequence[Document], start: int = 1) -> str:
    """Render documents the way Search-R1 policies read them: ``Doc i (Title: t) text``, one per line, numbered
    from ``start``."""
    return "\n".join(f"Doc {i} (Title: {d.title}) {d.text}" for i, d in enumerate(docs, start=start))

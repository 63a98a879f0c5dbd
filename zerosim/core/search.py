"""The one search interface: everything that answers a ``<search>`` implements :class:`SearchEngine`.

A search engine is batch-first: the rollout sends one call per turn carrying every active trajectory's
query, and gets back one ranked list of :class:`Document` per request. Simulators, real retrievers, HTTP
clients and caches all speak this protocol, so one config key swaps them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


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
    in place of a failure. An engine whose empty list is an answer ("no results": a web search API) says so
    with ``empty_is_answer = True`` (:func:`answers_empty`); the policy then reads :data:`NO_RESULTS`.
    """

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]: ...


# what the policy reads for a search that found nothing (an engine with empty_is_answer)
NO_RESULTS = "No results found for this query."


def format_documents(docs: Sequence[Document], start: int = 1) -> str:
    """Render documents the way Search-R1 policies read them: ``Doc i (Title: t) text``, one per line, numbered
    from ``start``; :data:`NO_RESULTS` for none."""
    if not docs:
        return NO_RESULTS
    return "\n".join(f"Doc {i} (Title: {d.title}) {d.text}" for i, d in enumerate(docs, start=start))


def engine_layers(engine: Any) -> Iterator[Any]:
    """``engine`` and every engine it wraps, outermost first: a wrapper exposes what it wraps as ``.engine``
    or ``.retriever``, or several as ``.parts`` (a mapping: the mixed engine's simulator and real retriever)."""
    seen: set[int] = set()
    pending = [engine]
    while pending:
        engine = pending.pop(0)
        if engine is None or id(engine) in seen:
            continue
        seen.add(id(engine))
        yield engine
        parts = getattr(engine, "parts", None)
        pending += list(parts.values()) if isinstance(parts, Mapping) else []
        pending.append(getattr(engine, "engine", None) or getattr(engine, "retriever", None))


def answers_empty(engine: Any) -> bool:
    """Whether an empty result from ``engine`` is an answer (some layer has ``empty_is_answer``: web search, an
    HTTP server in front of one) rather than a fault."""
    return any(getattr(layer, "empty_is_answer", False) is True for layer in engine_layers(engine))


def ledgers(engine: Any) -> list[dict[str, Any]]:
    """What every paid layer of ``engine`` spent so far (its ``ledger()``: web search's requests, cache hits
    and estimated cost), outermost first; empty for an engine that costs nothing per search."""
    return [layer.ledger() for layer in engine_layers(engine) if callable(getattr(layer, "ledger", None))]

"""Pages: the full text behind a search result, for the ``read_page`` tool (:mod:`zerosim.agent.tools`).

A search result is a passage (or, from the simulator, a short written document); its *page* is the document it
was cut from. Engines answer pages through :class:`PageReader`:

- a passage corpus (BM25, dense, hybrid — whatever holds the corpus as ``.docs``): :class:`CorpusPages`, the
  passages of the result's document in corpus order, as many around the result as the page's budget holds. A
  document is the passages that share the result's title (FlashRAG's wiki corpora: one article), or — for the
  embedded factbook, whose passage ids are ``{country}-{section}-{i}`` — the country's section;
- the simulator (:meth:`simulators.llm.LLMSimulator.read_pages`): a page it writes about the result's title,
  useful or noisy as the curriculum draws for that call (:func:`curricula.noise.page_noise`);
- mixed search: each result's page from the engine that returned it.

An engine with no pages (an HTTP search server) is refused when the rollout starts (:func:`page_reader`), never
answered with an empty page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from zerosim.core.config import EMBEDDED_DATA, ConfigError
from zerosim.core.search import Document, SearchError

PAGE_BY = ("auto", "title", "id")


@dataclass(frozen=True)
class PageRequest:
    """Open ``document`` (a result the policy was shown). ``question``/``answers``: what a training-time
    simulator may see, as in :class:`~zerosim.core.search.SearchRequest`; ``noisy``: the curriculum's draw for
    this call (None: no curriculum, a useful page)."""

    document: Document
    question: str | None = None
    answers: tuple[str, ...] = ()
    noisy: bool | None = None


@dataclass(frozen=True)
class Page:
    title: str
    text: str
    noisy: bool | None = None  # set where a simulator decided the page's mode


@runtime_checkable
class PageReader(Protocol):
    """``read_pages(requests, max_words)``: one :class:`Page` per request, of at most about ``max_words``
    words; raises :class:`~zerosim.core.search.SearchError` where it cannot (never an empty page)."""

    def read_pages(self, requests: Sequence[PageRequest], max_words: int) -> list[Page]: ...


def page_grouping(search: Any) -> str:
    """``search.page_by`` resolved (``search``: the ``search.*`` settings): ``title`` or ``id``
    (:class:`CorpusPages`); ``auto`` is ``id`` over the embedded corpus, ``title`` over any other."""
    if search.page_by != "auto":
        return search.page_by
    kind = str(search.mixed.real if str(search.engine) == "mixed" else search.engine)
    corpora = [getattr(search, part).corpus for part in ("bm25", "dense") if kind in (part, "hybrid")]
    return "id" if corpora and all(c == EMBEDDED_DATA for c in corpora) else "title"


def reading_pages(engine: Any, search: Any, prefix: str = "search.") -> PageReader:
    """The pages behind ``engine``'s results for the read_page tool (:func:`page_reader`, grouped as
    ``search.page_by`` says); an engine with none is refused, naming the engines that have them."""
    reader = page_reader(engine, by=page_grouping(search))
    if reader is None:
        raise ConfigError(
            f"rollout.tools offers read_page, but {prefix}engine={search.engine} has no pages to open (an HTTP "
            "search server returns passages only). Use an engine with pages — bm25, dense, hybrid (the corpus's "
            "documents), simulator (pages it writes) or mixed of those — or drop read_page from rollout.tools"
        )
    return reader


def factbook_document(doc_id: str) -> str:
    """The embedded factbook's document of a passage: its country's section (``{code}-{section}``)."""
    return doc_id.rsplit("-", 1)[0]


class CorpusPages:
    """Pages of a passage corpus (see the module). ``by``: ``title`` (passages sharing a title are one
    document) or ``id`` (the id less its last ``-<n>``: the embedded factbook's sections)."""

    def __init__(self, docs: Sequence[Document], by: str = "title"):
        if by not in ("title", "id"):
            raise ValueError(f"pages by {by!r}: title or id")
        self.by = by
        self.documents: dict[str, list[Document]] = {}
        self.position: dict[str, tuple[str, int]] = {}  # passage id -> (document, index in it)
        for d in docs:
            key = self._key(d)
            passages = self.documents.setdefault(key, [])
            self.position[d.id] = (key, len(passages))
            passages.append(d)

    def _key(self, d: Document) -> str:
        return d.title if self.by == "title" else factbook_document(d.id)

    def read_pages(self, requests: Sequence[PageRequest], max_words: int) -> list[Page]:
        return [self._page(r.document, max_words) for r in requests]

    def _page(self, doc: Document, max_words: int) -> Page:
        where = self.position.get(doc.id)
        if where is None:
            raise SearchError(
                f"read_page: result {doc.id!r} is not a passage of the search corpus, so it has no page; "
                "the pages come from the corpus the results were retrieved from"
            )
        key, at = where
        passages = self.documents[key]
        # the result's passage, then its neighbours after and before it in turn, while the budget holds
        order = [at] + [
            i for d in range(1, len(passages)) for i in (at + d, at - d) if 0 <= i < len(passages)
        ]
        chosen, words = [], 0
        for i in order:
            n = len(passages[i].text.split())
            if chosen and words + n > max_words:
                break
            chosen.append(i)
            words += n
        # a factbook section's title is "Country - Section" (a long field's chunks add " - Field")
        title = " - ".join(passages[at].title.split(" - ")[:2]) if self.by == "id" else passages[at].title
        return Page(title=title, text="\n".join(passages[i].text for i in sorted(chosen)))


class RoutedPages:
    """Mixed search's pages: a result of the real retriever's corpus from it, any other from the simulator."""

    def __init__(self, real: CorpusPages, simulated: PageReader):
        self.real, self.simulated = real, simulated

    def read_pages(self, requests: Sequence[PageRequest], max_words: int) -> list[Page]:
        out: list[Page | None] = [None] * len(requests)
        mine = [r.document.id in self.real.position for r in requests]
        real = [i for i, m in enumerate(mine) if m]
        sim = [i for i, m in enumerate(mine) if not m]
        for part, reader in ((real, self.real), (sim, self.simulated)):
            if part:
                for i, page in zip(
                    part, reader.read_pages([requests[i] for i in part], max_words), strict=True
                ):
                    out[i] = page
        return out  # type: ignore[return-value]


# attributes under which wrappers (cache, reranker, corpus negatives, ...) hold the engine they wrap
_WRAPPED = ("engine", "retriever")


def page_reader(engine: Any, *, by: str = "title") -> PageReader | None:
    """The pages behind ``engine``'s results, or None where it has none. An engine (or a wrapper that changes
    what pages may see: evaluation's withheld answers) with ``read_pages`` answers itself; a corpus
    retriever's pages are its ``.docs``; other wrappers are looked through. ``by``: how a corpus's passages
    group into documents (:class:`CorpusPages`)."""
    if callable(getattr(engine, "read_pages", None)):
        return engine
    if callable(getattr(engine, "pages", None)):  # a wrapper that reads its engine's pages its own way
        return engine.pages(by=by)
    if callable(getattr(engine, "draw_source", None)) and hasattr(engine, "real"):  # mixed search
        real, sim = page_reader(engine.real, by=by), page_reader(engine.simulator, by=by)
        if isinstance(real, CorpusPages) and sim is not None:
            return RoutedPages(real, sim)
        return None
    docs = getattr(engine, "docs", None)
    corpus = isinstance(docs, list) and docs and isinstance(docs[0], Document) and hasattr(engine, "search")
    if corpus and not hasattr(
        getattr(engine, "retriever", None), "search"
    ):  # not corpus negatives: its inner's
        return CorpusPages(docs, by=by)
    engines = getattr(engine, "engines", None)  # hybrid: both halves index the same passages
    if isinstance(engines, tuple) and engines:
        return page_reader(engines[0], by=by)
    for name in _WRAPPED:
        inner = getattr(engine, name, None)
        if inner is not None and inner is not engine and hasattr(inner, "search"):
            return page_reader(inner, by=by)
    return None

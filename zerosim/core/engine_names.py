"""The names ``search.engine`` takes and what kind of engine each is: the one list every other choice of engines
is derived from (``validation.engine`` in ``zerosim.training.config``, ``search.mixed.real`` in
``curricula.config``, the index kinds ``eval.index.KINDS``).

It lives in the foundation so that the components (``curricula``, ``eval``) can derive their choices from it;
the app re-exports it as ``zerosim.engines.EngineName`` beside the builders. A new engine is one member here
and its place in the kinds below; what it is then offered as follows (``tests/test_engine_preflight.py``).
"""

from __future__ import annotations

from enum import StrEnum


class EngineName(StrEnum):
    """``search.engine``: what answers the policy's searches."""

    simulator = "simulator"
    bm25 = "bm25"
    dense = "dense"
    hybrid = "hybrid"
    http = "http"
    web = "web"
    mixed = "mixed"

    @property
    def real(self) -> bool:
        """A real retriever (bm25, dense, hybrid, http; web: a web search API): what evaluation searches with,
        what ``validation.engine`` and ``search.mixed.real`` may name."""
        return self in (EngineName.bm25, EngineName.dense, EngineName.hybrid, EngineName.http, EngineName.web)

    @property
    def simulated(self) -> bool:
        """The simulator writes (some of) the documents: simulator, mixed."""
        return self in (EngineName.simulator, EngineName.mixed)

    @property
    def indexed(self) -> bool:
        """A retriever over an index this process loads (bm25, dense, hybrid): its noisy slots are filled here,
        with corpus negatives (``search.negatives``); over http the server behind the URL fills them."""
        return self.index_kind or self == EngineName.hybrid  # hybrid fuses a bm25 and a dense index

    @property
    def index_kind(self) -> bool:
        """Searches an index of its own kind (bm25, dense): what ``zerosim index build --kind`` writes, a
        manifest's ``kind``, and a ``search.<engine>.corpus`` of its own."""
        return self in (EngineName.bm25, EngineName.dense)

"""Curriculum noise over a real retriever: noisy result slots get corpus negatives.

A simulator writes noisy documents on request; a real retriever cannot, so :class:`CorpusNegatives` puts
real passages that do not help into the noisy slots of each request's noise pattern:

- ``hard`` — passages the retriever ranks just below the top ``k`` (ranks ``k+1 .. depth``): on topic,
  plausible, and not what the retriever considers best. With gold answers in the request, passages
  containing one are skipped (they would help). When the hard pool runs dry, random ones fill in.
- ``random`` — passages drawn uniformly from the corpus (again never one containing a gold answer, nor
  one of the request's own top ``k``).

Useful slots take the retriever's top-ranked passages in rank order. Every returned document is marked
``noisy``. The random draws are seeded from ``(seed, query, question)``, so the same request gets the same
negatives whatever else is in the batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from zerosim.core.metrics import answer_in_text
from zerosim.core.search import Document, SearchEngine, SearchError, SearchRequest

NEGATIVES = ("hard", "random")


class CorpusNegatives:
    """Wraps a real retriever (``SearchEngine``) so that it honours ``SearchRequest.noise``.

    Args:
        retriever: the real retriever (BM25, dense, hybrid, ...).
        docs: the corpus passages random negatives are drawn from (``None``: hard negatives only; a request
            whose hard pool runs dry then raises :class:`SearchError` rather than returning fewer documents).
        mode: ``"hard"`` or ``"random"``.
        depth: how deep to retrieve for hard negatives (ranks ``k+1 .. depth``).
        seed: seeds the random draws.
    """

    honours_noise = True  # noisy slots come back as corpus negatives marked noisy (engines.py checks this)

    def __init__(
        self,
        retriever: SearchEngine,
        docs: Sequence[Document] | None = None,
        *,
        mode: str = "hard",
        depth: int = 30,
        seed: int = 0,
        max_draws: int = 64,
    ):
        if mode not in NEGATIVES:
            raise ValueError(f"negatives mode {mode!r} is not one of {', '.join(NEGATIVES)}")
        if mode == "random" and not docs:
            raise ValueError("random negatives need the corpus passages (docs)")
        self.retriever = retriever
        # a list is kept as it is, not copied: a server wraps its index's passages once per request
        self.docs = docs if isinstance(docs, list) else list(docs or ())
        self.mode = mode
        self.depth = depth
        self.seed = seed
        self.max_draws = max_draws

    def _rng(self, request: SearchRequest) -> np.random.Generator:
        key = f"{self.seed}\x00{request.query}\x00{request.question or ''}".encode()
        return np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))

    def _random(self, request: SearchRequest, exclude: set[str], n: int) -> list[Document]:
        rng = self._rng(request)
        out: list[Document] = []
        for _ in range(self.max_draws * max(n, 1)):
            if len(out) == n:
                break
            doc = self.docs[int(rng.integers(len(self.docs)))]
            if doc.id in exclude or (request.answers and answer_in_text(doc.contents, request.answers)):
                continue
            exclude.add(doc.id)
            out.append(doc)
        return out

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        patterns = [r.noise_for(k) for r in requests]
        if not any(any(p) for p in patterns):  # no noise asked: the retriever as it is
            return self.retriever.search(requests, k)
        depth = max(k, self.depth) if self.mode == "hard" else k
        ranked_lists = self.retriever.search(requests, depth)
        if len(ranked_lists) != len(requests):
            raise SearchError(f"retriever answered {len(ranked_lists)} results for {len(requests)} requests")
        results = []
        for request, pattern, ranked in zip(requests, patterns, ranked_lists, strict=True):
            n_noisy = sum(pattern)
            top = list(ranked[: k - n_noisy])
            exclude = {d.id for d in ranked[:k]}
            negatives: list[Document] = []
            if self.mode == "hard":
                negatives = [
                    d
                    for d in ranked[k:]
                    if not (request.answers and answer_in_text(d.contents, request.answers))
                ][:n_noisy]
                exclude.update(d.id for d in negatives)
            if len(negatives) < n_noisy and self.docs:
                negatives += self._random(request, exclude, n_noisy - len(negatives))
            if len(negatives) < n_noisy:
                raise SearchError(
                    f"found {len(negatives)} of {n_noisy} negatives for query {request.query!r} "
                    f"(mode {self.mode}, depth {self.depth}); retrieve deeper or give the corpus"
                )
            useful_iter, noisy_iter = iter(top), iter(negatives)
            out = []
            for noisy in pattern:
                doc = next(noisy_iter) if noisy else next(useful_iter, None)
                if doc is not None:
                    out.append(replace(doc, noisy=noisy))
            results.append(out)
        return results

"""Cross-encoder reranking on top of any search engine."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import numpy as np

from zerosim.core.search import Document, SearchEngine, SearchError, SearchRequest


@functools.lru_cache(maxsize=2)
def load_cross_encoder(model: str, device: str | None = None, max_length: int | None = None):
    """A ``sentence_transformers.CrossEncoder`` (local folder or Hugging Face id); cached, inference only."""
    from sentence_transformers import CrossEncoder

    return CrossEncoder(model, device=device, max_length=max_length)


class CrossEncoderReranker:
    """Rerank an engine's results with a cross-encoder; a :class:`SearchEngine` itself.

    With ``model=None`` it passes searches through unchanged. With a model, each ``search`` asks the engine
    for ``max(k, depth)`` candidates in one call, scores every (query, passage) pair of the call in one
    ``predict``, and returns the ``k`` best per request by cross-encoder score (ties keep retriever order),
    each document carrying that score.

    Curriculum noise: the candidates are asked for without the requests' noise patterns (a pattern holds
    ``k`` slots, not ``depth``), so over a plain retriever the reranker orders useful passages only and
    :class:`curricula.negatives.CorpusNegatives` goes on top (``zerosim.engines`` builds it that way: hard
    negatives are then ranks ``k+1 ..`` of the reranked list). ``engine_fills_noise=True`` is for an engine
    that fills the noisy slots itself (an HTTP search server): a request with noisy slots is sent as it is
    for ``k`` documents, and only its useful documents are reordered, among the useful slots.
    """

    metrics_name = "rerank"

    def __init__(
        self,
        engine: SearchEngine,
        model: str | None = None,
        *,
        depth: int = 20,
        batch_size: int = 32,
        max_length: int | None = 512,
        device: str | None = None,
        engine_fills_noise: bool = False,
    ):
        if depth < 1:
            raise ValueError(f"CrossEncoderReranker needs depth >= 1 (got {depth})")
        self.engine = engine
        self.model_name = model
        self.model = load_cross_encoder(model, device, max_length) if model is not None else None
        self.depth = depth
        self.batch_size = batch_size
        self.engine_fills_noise = engine_fills_noise
        # cumulative since start: logged as search/rerank/<counter> by the rollout
        self.stats: dict[str, float] = {"pairs": 0, "seconds": 0.0}

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        if self.model is None:
            return self.engine.search(requests, k)
        if not requests:
            return []
        held = [self.engine_fills_noise and any(r.noise_for(k)) for r in requests]
        deep = [dataclasses.replace(r, noise=None) for r, h in zip(requests, held, strict=True) if not h]
        as_is = [r for r, h in zip(requests, held, strict=True) if h]
        deep_docs = self.engine.search(deep, max(k, self.depth)) if deep else []
        as_is_docs = self.engine.search(as_is, k) if as_is else []
        if len(deep_docs) != len(deep) or len(as_is_docs) != len(as_is):
            raise SearchError(
                f"{type(self.engine).__name__} answered {len(deep_docs) + len(as_is_docs)} results for "
                f"{len(requests)} requests"
            )
        deep_iter, as_is_iter = iter(deep_docs), iter(as_is_docs)
        candidates = [list(next(as_is_iter) if h else next(deep_iter)) for h in held]
        # which candidates the cross-encoder orders: all, or a held request's useful ones (noisy slots stay)
        scored = [
            [i for i, d in enumerate(docs) if not (h and d.noisy)]
            for docs, h in zip(candidates, held, strict=True)
        ]
        pairs = [
            (r.query, docs[i].contents)
            for r, docs, idx in zip(requests, candidates, scored, strict=True)
            for i in idx
        ]
        started = time.perf_counter()
        scores = (
            np.asarray(
                self.model.predict(pairs, batch_size=self.batch_size, show_progress_bar=False),
                dtype=np.float64,
            ).reshape(len(pairs), -1)[:, -1]  # one logit per pair; a 2-label model: the "relevant" one
            if pairs
            else np.zeros(0)
        )
        self.stats["pairs"] += len(pairs)
        self.stats["seconds"] += time.perf_counter() - started
        results, start = [], 0
        for docs, idx, h in zip(candidates, scored, held, strict=True):
            row = scores[start : start + len(idx)]
            start += len(idx)
            order = [idx[j] for j in np.argsort(-row, kind="stable")]
            score = {idx[j]: float(row[j]) for j in range(len(idx))}
            if h:  # the useful documents in score order, each into the next useful slot
                ranked = iter(order)
                order = [i if i not in score else next(ranked) for i in range(len(docs))]
            results.append(
                [dataclasses.replace(docs[i], score=score.get(i, docs[i].score)) for i in order[:k]]
            )
        return results

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

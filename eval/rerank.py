"""Cross-encoder reranking on top of any search engine."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from zerosim.search import Document, SearchEngine, SearchRequest


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
    """

    def __init__(
        self,
        engine: SearchEngine,
        model: str | None = None,
        *,
        depth: int = 20,
        batch_size: int = 32,
        max_length: int | None = 512,
        device: str | None = None,
    ):
        if depth < 1:
            raise ValueError(f"CrossEncoderReranker needs depth >= 1 (got {depth})")
        self.engine = engine
        self.model_name = model
        self.model = load_cross_encoder(model, device, max_length) if model is not None else None
        self.depth = depth
        self.batch_size = batch_size

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        if self.model is None:
            return self.engine.search(requests, k)
        if not requests:
            return []
        candidates = self.engine.search(requests, max(k, self.depth))
        pairs = [(r.query, d.contents) for r, docs in zip(requests, candidates, strict=True) for d in docs]
        scores = (
            np.asarray(
                self.model.predict(pairs, batch_size=self.batch_size, show_progress_bar=False),
                dtype=np.float64,
            ).reshape(len(pairs), -1)[:, -1]  # one logit per pair; a 2-label model: the "relevant" one
            if pairs
            else np.zeros(0)
        )
        results, start = [], 0
        for docs in candidates:
            row = scores[start : start + len(docs)]
            start += len(docs)
            order = np.argsort(-row, kind="stable")[:k]
            results.append(
                [
                    Document(
                        id=docs[i].id,
                        title=docs[i].title,
                        text=docs[i].text,
                        score=float(row[i]),
                        noisy=docs[i].noisy,
                    )
                    for i in order
                ]
            )
        return results

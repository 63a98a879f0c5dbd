"""Hybrid retrieval: reciprocal-rank fusion (RRF) of two search engines (typically BM25 + dense)."""

from __future__ import annotations

from collections.abc import Sequence

from zerosim.core.search import Document, SearchEngine, SearchRequest


def reciprocal_rank_fusion(rankings: Sequence[Sequence[Document]], k: int, rrf_k: int = 60) -> list[Document]:
    """Fuse ranked lists into one: ``score(d) = sum over lists holding d of 1 / (rrf_k + rank)``, rank 1-based.

    Documents are matched by id. Ties keep the order in which documents were first seen (list by list),
    so the result is deterministic. Returns at most ``k`` documents carrying their fused score.
    """
    fused: dict[str, float] = {}
    first: dict[str, Document] = {}
    for ranking in rankings:
        for rank, doc in enumerate(ranking, start=1):
            fused[doc.id] = fused.get(doc.id, 0.0) + 1.0 / (rrf_k + rank)
            first.setdefault(doc.id, doc)
    order = sorted(fused, key=lambda i: -fused[i])  # stable: ties stay in first-seen order
    return [
        Document(id=i, title=first[i].title, text=first[i].text, score=fused[i], noisy=first[i].noisy)
        for i in order[:k]
    ]


def _describe(engine) -> str:
    manifest = getattr(engine, "manifest", None)
    where = f" (index {engine.index_dir})" if manifest is not None else ""
    return f"{type(engine).__name__}{where}: {len(engine.docs)} passages"


def _check_same_passages(first, second) -> None:
    """Two retrievers that both expose their passages (``docs``) must hold the same ones in the same order:
    fusion matches documents by id, so two corpora would be merged silently. Loaded indexes compare their
    manifests' corpus fingerprints; others their passage ids."""
    a, b = getattr(first, "docs", None), getattr(second, "docs", None)
    if a is None or b is None or a is b:
        return
    ma, mb = getattr(first, "manifest", None), getattr(second, "manifest", None)
    if ma is not None and mb is not None:
        same = (ma["corpus"]["sha256"], ma["corpus"]["passages"]) == (
            mb["corpus"]["sha256"],
            mb["corpus"]["passages"],
        )
    else:
        same = len(a) == len(b) and all(x.id == y.id for x, y in zip(a, b, strict=True))
    if not same:
        raise ValueError(
            f"hybrid retrieval over two different corpora: {_describe(first)}; {_describe(second)}. Fusion "
            "matches passages by id, so both engines must index the same corpus: build the BM25 and the dense "
            "index from the same corpus file (zerosim index build --corpus FILE --kind bm25|dense ...)"
        )


class HybridRetriever:
    """Reciprocal-rank fusion of two :class:`SearchEngine` s; itself a :class:`SearchEngine`.

    Each ``search`` makes exactly one batched call into each engine, asking for ``max(k, depth)`` candidates,
    and fuses the two lists per request with :func:`reciprocal_rank_fusion`.
    """

    def __init__(self, first: SearchEngine, second: SearchEngine, *, rrf_k: int = 60, depth: int = 50):
        if rrf_k < 0 or depth < 1:
            raise ValueError(
                f"HybridRetriever needs rrf_k >= 0 and depth >= 1 (got rrf_k={rrf_k}, depth={depth})"
            )
        _check_same_passages(first, second)
        self.engines = (first, second)
        self.rrf_k = rrf_k
        self.depth = depth

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        if not requests:
            return []
        depth = max(k, self.depth)
        first, second = (engine.search(requests, depth) for engine in self.engines)
        return [reciprocal_rank_fusion([a, b], k, self.rrf_k) for a, b in zip(first, second, strict=True)]

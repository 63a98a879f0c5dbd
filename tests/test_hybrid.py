"""Engines built on engines: reciprocal-rank fusion (HybridRetriever) and cross-encoder reranking.

Fusion quality with real retrievers is tested in test_dense.py; here fake engines pin the plumbing.
"""

import numpy as np
import pytest

from eval.hybrid import HybridRetriever, reciprocal_rank_fusion
from eval.rerank import CrossEncoderReranker
from zerosim.core.search import Document, SearchEngine, SearchRequest


def _doc(i: str) -> Document:
    return Document(id=i, title=f"title {i}", text=f"passage {i} about topic {i}")


class FixedEngine:
    """Answers every request with the same ranked ids; records each call's batch size and k."""

    def __init__(self, ids):
        self.ids = ids
        self.calls = []

    def search(self, requests, k):
        self.calls.append((len(requests), k))
        return [[_doc(i) for i in self.ids[:k]] for _ in requests]


def test_rrf_scores_are_the_sum_of_reciprocal_ranks():
    fused = reciprocal_rank_fusion(
        [[_doc("a"), _doc("b"), _doc("c")], [_doc("c"), _doc("a")]], k=10, rrf_k=60
    )
    scores = {d.id: d.score for d in fused}
    assert scores == pytest.approx({"a": 1 / 61 + 1 / 62, "c": 1 / 63 + 1 / 61, "b": 1 / 62})
    assert [d.id for d in fused] == ["a", "c", "b"]


def test_rrf_ties_keep_first_seen_order_and_k_is_respected():
    fused = reciprocal_rank_fusion([[_doc("x"), _doc("y")], [_doc("y"), _doc("x")], [_doc("z")]], k=2)
    assert [d.id for d in fused] == ["x", "y"]  # x and y tie; x was seen first; z (one list) is cut by k


def test_hybrid_makes_one_batched_call_per_engine_at_candidate_depth():
    first, second = FixedEngine(list("abcdefgh")), FixedEngine(list("hgfedcba"))
    hybrid = HybridRetriever(first, second, depth=6)
    assert isinstance(hybrid, SearchEngine)
    results = hybrid.search([SearchRequest("q1"), SearchRequest("q2"), SearchRequest("q3")], k=3)
    assert first.calls == [(3, 6)] and second.calls == [(3, 6)]
    assert len(results) == 3 and all(len(r) == 3 for r in results)
    # depth 6: first holds a..f, second h..c; c, d, e, f are in both lists at ranks summing to 9
    assert {d.id for d in results[0]} <= set("cdef")
    hybrid.search([SearchRequest("q")], k=10)  # k deeper than depth: ask for k
    assert first.calls[-1] == (1, 10)
    assert hybrid.search([], 3) == [] and len(first.calls) == 2


def test_hybrid_rejects_bad_settings():
    with pytest.raises(ValueError, match="depth >= 1"):
        HybridRetriever(FixedEngine([]), FixedEngine([]), depth=0)


def test_reranker_orders_by_cross_encoder_score(tiny_cross_encoder):
    engine = FixedEngine([str(i) for i in range(30)])
    reranker = CrossEncoderReranker(engine, tiny_cross_encoder, depth=12)
    assert isinstance(reranker, SearchEngine)
    requests = [SearchRequest("capital of Peru"), SearchRequest("currency of Japan")]
    results = reranker.search(requests, k=4)
    assert engine.calls == [(2, 12)]  # one call, deeper than k
    assert [len(r) for r in results] == [4, 4]
    for request, docs in zip(requests, results, strict=True):
        candidates = [_doc(str(i)) for i in range(12)]
        scores = reranker.model.predict(
            [(request.query, d.contents) for d in candidates], show_progress_bar=False
        )
        expected = [candidates[i].id for i in np.argsort(-scores, kind="stable")[:4]]
        assert [d.id for d in docs] == expected
        assert [d.score for d in docs] == pytest.approx(sorted(scores, reverse=True)[:4], abs=1e-5)
    assert results[0] != results[1]  # the query matters


def test_reranker_without_a_model_passes_through():
    engine = FixedEngine(list("abcdef"))
    results = CrossEncoderReranker(engine).search([SearchRequest("q")], k=3)
    assert engine.calls == [(1, 3)] and [d.id for d in results[0]] == ["a", "b", "c"]

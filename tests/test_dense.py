"""Dense (MiniLM + faiss) and hybrid retrieval quality on a factbook subset, and DenseRetriever plumbing.

Encoding the whole factbook (~14k passages) takes minutes on 2 cores, so these tests encode once (per
module) only the passages of the sections that hold the gold answers of 32 one-hop dev questions, for the
32 countries asked about (343 passages; every other country's passages of the same sections are the
distractors). Measured hit rates are in docs/retrieval.md; each floor sits a little below its measurement.
"""

import numpy as np
import pytest

from eval.bm25 import BM25Retriever
from eval.dense import DenseRetriever, load_encoder
from eval.hybrid import HybridRetriever
from zerosim.core.data.embedded import ensure_factbook, load_questions
from zerosim.core.data.qa import load_corpus
from zerosim.core.metrics import normalize_answer
from zerosim.core.search import SearchEngine, SearchRequest


def _section(passage_id: str) -> tuple[str, str]:
    code, section, _ = passage_id.split("-", 2)
    return code, section


@pytest.fixture(scope="module")
def questions():
    one_hop = [q for q in load_questions("factbook", "dev") if q.metadata.get("hops") == 1]
    return one_hop[::5]  # 32 questions over 8 kinds, one per country


@pytest.fixture(scope="module")
def subset(questions):
    sections = {_section(q.metadata["passage_ids"][0]) for q in questions}
    gold = {p for q in questions for p in q.metadata["passage_ids"]}
    docs = load_corpus(ensure_factbook(progress=False).corpus)
    return [d for d in docs if _section(d.id) in sections or d.id in gold]


@pytest.fixture(scope="module")
def embeddings(subset, tmp_path_factory):
    path = tmp_path_factory.mktemp("embeddings") / "subset.f32"
    return DenseRetriever(subset).encode_passages(path, chunk_size=128)


def _dense(subset, embeddings, faiss_type, **options):
    return DenseRetriever(subset, faiss_type=faiss_type, faiss_options=options or None).add_embeddings(
        embeddings
    )


def hit_rate(engine: SearchEngine, questions, k: int = 5) -> float:
    """Share of questions with a gold answer (normalised) inside one of the top-k passages."""
    results = engine.search([SearchRequest(q.question) for q in questions], k)
    hits = sum(
        any(normalize_answer(a) in normalize_answer(d.contents) for d in docs for a in q.golden_answers)
        for q, docs in zip(questions, results, strict=True)
    )
    return hits / len(questions)


def test_subset_holds_every_gold_passage(questions, subset):
    assert len(questions) == 32 and len(subset) == 343
    ids = {d.id for d in subset}
    assert all(set(q.metadata["passage_ids"]) <= ids for q in questions)


@pytest.mark.parametrize(
    ("retriever", "floor"),  # measured on this subset: 32/32 for each (BM25 alone too)
    [("flat", 0.9), ("hnsw", 0.9), ("hybrid", 0.9)],
)
def test_gold_answer_in_top5(retriever, floor, questions, subset, embeddings):
    dense = _dense(subset, embeddings, "hnsw" if retriever == "hnsw" else "flat")
    engine = HybridRetriever(BM25Retriever(subset).index(), dense) if retriever == "hybrid" else dense
    assert isinstance(engine, SearchEngine)
    rate = hit_rate(engine, questions)
    assert rate >= floor, f"{retriever}: top-5 hit rate {rate:.3f} < {floor}"


def test_hnsw_agrees_with_flat(questions, subset, embeddings):
    requests = [SearchRequest(q.question) for q in questions]
    flat = _dense(subset, embeddings, "flat").search(requests, 5)
    hnsw = _dense(subset, embeddings, "hnsw").search(requests, 5)
    overlap = np.mean(
        [len({d.id for d in a} & {d.id for d in b}) / 5 for a, b in zip(flat, hnsw, strict=True)]
    )
    assert overlap >= 0.95


def test_ivfpq_runs_on_a_small_corpus(questions, subset, embeddings):
    ivfpq = _dense(subset, embeddings, "ivfpq", nlist=8, pq_m=16, nbits=6, nprobe=8)
    assert ivfpq.index_.ntotal == len(subset) and ivfpq.faiss_options["nlist"] == 8
    results = ivfpq.search([SearchRequest(q.question) for q in questions], 5)
    assert all(len(r) == 5 for r in results)
    assert hit_rate(ivfpq, questions) >= 0.8  # measured 30/32, with 12 bytes a passage (flat: 1,536)


def test_ivfpq_with_too_few_passages_names_the_fix(subset, embeddings):
    with pytest.raises(ValueError, match="lower nlist"):
        _dense(subset, embeddings, "ivfpq", nlist=1000)


def test_search_encodes_all_queries_of_a_call_in_one_batch(subset, embeddings, monkeypatch):
    dense = _dense(subset, embeddings, "flat")
    model, calls = load_encoder("minilm"), []
    real = model.encode
    monkeypatch.setattr(model, "encode", lambda texts, **kw: calls.append(len(texts)) or real(texts, **kw))
    results = dense.search([SearchRequest("capital of Peru"), SearchRequest("currency of Japan")] * 20, k=3)
    assert calls == [40] and len(results) == 40 and all(len(r) == 3 for r in results)
    assert all(r[0].score >= r[1].score >= r[2].score for r in results)


def test_search_edge_cases(subset, embeddings):
    dense = _dense(subset, embeddings, "flat")
    assert dense.search([], 5) == []
    (everything,) = dense.search([SearchRequest("anything")], k=len(subset) + 10)
    assert len(everything) == len(subset) and len({d.id for d in everything}) == len(subset)
    assert all(d.noisy is None for d in everything)


def test_prefixes_follow_the_encoder(subset):
    from eval.dense import default_prefixes

    assert default_prefixes("intfloat/e5-base-v2") == ("query: ", "passage: ")
    assert DenseRetriever(subset).query_prefix == "" and DenseRetriever(subset).passage_prefix == ""
    custom = DenseRetriever(subset, query_prefix="q: ", passage_prefix="p: ")
    assert custom.manifest_fields()["dense"]["query_prefix"] == "q: "


def test_bad_config_names_the_valid_choices(subset):
    with pytest.raises(ValueError, match="valid: flat, hnsw, ivfpq"):
        DenseRetriever(subset, faiss_type="annoy")
    with pytest.raises(ValueError, match="do not apply to faiss_type 'hnsw'; valid: hnsw_m, ef_construction"):
        DenseRetriever(subset, faiss_type="hnsw", faiss_options={"nlist": 10})

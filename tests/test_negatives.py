"""Curriculum noise over real retrievers: noisy slots get corpus negatives, document by document."""

import pytest

from curricula import draw_noise
from curricula.negatives import CorpusNegatives
from eval.bm25 import BM25Retriever
from zerosim.core.metrics import answer_in_text
from zerosim.core.search import Document, SearchError, SearchRequest


@pytest.fixture(scope="module")
def corpus():
    docs = [Document(id="peru-cap", title="Peru", text="The capital of Peru is Lima.")]
    docs += [
        Document(id=f"peru-{i}", title="Peru", text=f"Peru fact number {i} about mountains and rivers.")
        for i in range(8)
    ]
    docs += [Document(id="lima-city", title="Peru", text="Lima, the capital of Peru, lies on the coast.")]
    docs += [
        Document(id=f"other-{i}", title="Chile", text=f"Chile fact {i} about copper.") for i in range(20)
    ]
    return docs


@pytest.fixture(scope="module")
def bm25(corpus):
    return BM25Retriever(corpus).index()


def req(noise, answers=("Lima",)):
    return SearchRequest(
        query="capital of Peru", question="What is the capital of Peru?", answers=answers, noise=noise
    )


def test_no_noise_is_the_retriever_as_it_is(bm25, corpus):
    engine = CorpusNegatives(bm25, corpus, mode="hard", depth=10)
    plain = bm25.search([SearchRequest(query="capital of Peru")], 3)
    assert engine.search([req(None)], 3) == plain
    assert engine.search([req((False, False, False))], 3) == plain


@pytest.mark.parametrize("mode", ["hard", "random"])
def test_mixed_noise_is_honoured_slot_by_slot(bm25, corpus, mode):
    engine = CorpusNegatives(bm25, corpus, mode=mode, depth=12, seed=3)
    top = bm25.search([SearchRequest(query="capital of Peru")], 3)[0]
    pattern = (False, True, False)
    (docs,) = engine.search([req(pattern)], 3)
    assert [d.noisy for d in docs] == list(pattern)
    assert [docs[0].id, docs[2].id] == [top[0].id, top[1].id]  # useful slots: top ranks, in order
    negative = docs[1]
    assert not answer_in_text(negative.contents, ["Lima"])  # a negative never holds the answer
    assert negative.id not in {d.id for d in top}
    if mode == "hard":  # from ranks beyond k of the same query
        deep = [d.id for d in bm25.search([SearchRequest(query="capital of Peru")], 12)[0][3:]]
        assert negative.id in deep
    # same request, same negatives, whatever the batch
    again = engine.search([req((True, True, True)), req(pattern)], 3)[1]
    assert again == docs


def test_all_noisy_and_shares_follow_the_draw(bm25, corpus):
    engine = CorpusNegatives(bm25, corpus, mode="random", seed=0)
    patterns = draw_noise(seed=0, step=0, call=0, n_requests=300, k=3, p=0.4, granularity="document")
    results = engine.search([req(p) for p in patterns], 3)
    flags = [d.noisy for docs in results for d in docs]
    assert flags == [f for p in patterns for f in p]
    assert abs(sum(flags) / len(flags) - 0.4) < 0.05
    for p, docs in zip(patterns, results, strict=True):
        assert all(
            not answer_in_text(d.contents, ["Lima"]) for d, noisy in zip(docs, p, strict=True) if noisy
        )


def test_hard_pool_falls_back_to_random_then_errors_without_corpus(bm25, corpus):
    shallow = CorpusNegatives(bm25, corpus, mode="hard", depth=3)  # nothing beyond k: random fills in
    (docs,) = shallow.search([req((True, True, True))], 3)
    assert len(docs) == 3 and all(d.noisy for d in docs)
    blind = CorpusNegatives(bm25, None, mode="hard", depth=3)
    with pytest.raises(SearchError, match="0 of 3 negatives"):
        blind.search([req((True, True, True))], 3)
    with pytest.raises(ValueError, match="random negatives need the corpus"):
        CorpusNegatives(bm25, None, mode="random")

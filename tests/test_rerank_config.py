"""``search.rerank``: a cross-encoder from config over the real retrievers, for training, warm start and eval."""

from __future__ import annotations

import numpy as np
import pytest

from eval.rerank import CrossEncoderReranker, load_cross_encoder
from zerosim.core.config import ConfigError, load_config
from zerosim.core.search import Document, SearchRequest
from zerosim.engines import build_search_engine, real_retriever
from zerosim.job_config import EvalConfig
from zerosim.training.config import load_train_config

QUERIES = ["capital of country C", "what city is the capital of country F", "country A"]


def _expected(model: str, corpus, query: str, depth: int, k: int) -> list[str]:
    """The top ``k`` of BM25's ``depth`` candidates by the cross-encoder's score (ties: BM25 order)."""
    (candidates,) = real_retriever("bm25", str(corpus), None).search([SearchRequest(query)], depth)
    scores = load_cross_encoder(model, None, 512).predict(
        [(query, d.contents) for d in candidates], show_progress_bar=False
    )
    return [candidates[i].id for i in np.argsort(-np.asarray(scores), kind="stable")[:k]]


def test_rerank_model_reranks_bm25_by_cross_encoder_score(
    tmp_path, capitals, tiny_cross_encoder, monkeypatch
):
    monkeypatch.setenv("ZEROSIM_HOME", str(tmp_path / "home"))  # the bm25 index is built here
    _, corpus = capitals()
    cfg = load_train_config(
        None,
        ["search.engine=bm25", f"search.bm25.corpus={corpus}", f"search.rerank.model={tiny_cross_encoder}",
         "search.rerank.depth=6", "search.negatives=none"],
    )  # fmt: skip
    engine = build_search_engine(cfg.search)
    assert isinstance(engine, CrossEncoderReranker) and engine.depth == 6
    results = engine.search([SearchRequest(q) for q in QUERIES], k=3)
    (plain,) = real_retriever("bm25", str(corpus), None).search([SearchRequest(QUERIES[0])], 3)
    for query, docs in zip(QUERIES, results, strict=True):
        assert [d.id for d in docs] == _expected(tiny_cross_encoder, corpus, query, depth=6, k=3)
        scores = [d.score for d in docs]  # the cross-encoder's, best first
        assert scores == sorted(scores, reverse=True)
    assert [d.id for d in results[0]] != [d.id for d in plain]  # the cross-encoder, not BM25, decided
    assert engine.stats["pairs"] == 3 * 6


def test_rerank_sits_under_the_curriculum_negatives(tmp_path, capitals, tiny_cross_encoder, monkeypatch):
    """search.negatives=hard over a reranked bm25: useful slots take the reranked top, the noisy slot a
    reranked candidate below the top k."""
    monkeypatch.setenv("ZEROSIM_HOME", str(tmp_path / "home"))
    _, corpus = capitals()
    cfg = load_train_config(
        None,
        ["search.engine=bm25", f"search.bm25.corpus={corpus}", f"search.rerank.model={tiny_cross_encoder}",
         "search.rerank.depth=6", "search.negatives=hard", "search.negatives_depth=8"],
    )  # fmt: skip
    engine = build_search_engine(cfg.search, noise=True)  # a noisy curriculum is honoured
    assert isinstance(engine.retriever, CrossEncoderReranker)
    (docs,) = engine.search([SearchRequest(QUERIES[1], noise=(False, True, False))], k=3)
    reranked = _expected(tiny_cross_encoder, corpus, QUERIES[1], depth=8, k=8)
    assert [d.noisy for d in docs] == [False, True, False]
    assert [docs[0].id, docs[2].id] == reranked[:2] and docs[1].id in reranked[3:]


class NoiseFillingEngine:
    """An engine that fills noisy slots itself (as an HTTP search server does); records (n, k, noise)."""

    def __init__(self):
        self.calls = []

    def search(self, requests, k):
        self.calls.append([(k, r.noise) for r in requests])
        return [
            [Document(id=f"{r.query}-{i}", title="t", text=f"passage {i} {r.query}", noisy=noisy)
             for i, noisy in enumerate(r.noise or (False,) * k)]
            for r in requests
        ]  # fmt: skip


def test_rerank_over_an_engine_that_fills_noise_keeps_its_noisy_slots(tiny_cross_encoder):
    engine = NoiseFillingEngine()
    reranker = CrossEncoderReranker(engine, tiny_cross_encoder, depth=5, engine_fills_noise=True)
    noisy = SearchRequest("q1", noise=(True, False, True, False))
    plain = SearchRequest("q2", noise=(False,) * 4)
    out = reranker.search([noisy, plain], k=4)
    # the noisy request goes as it is, for k; the other deep, without a k-slot pattern
    assert sorted(engine.calls) == sorted([[(5, None)], [(4, noisy.noise)]])
    assert [d.noisy for d in out[0]] == [True, False, True, False]
    assert [out[0][0].id, out[0][2].id] == ["q1-0", "q1-2"]  # noisy documents stay in their slots
    assert {out[0][1].id, out[0][3].id} == {"q1-1", "q1-3"} and out[0][1].score >= out[0][3].score
    assert len(out[1]) == 4 and [d.score for d in out[1]] == sorted((d.score for d in out[1]), reverse=True)


def test_mixed_reranks_its_real_part(tmp_path, capitals, tiny_cross_encoder, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("ZEROSIM_HOME", str(tmp_path / "home"))
    _, corpus = capitals()
    cfg = load_train_config(
        None,
        ["search.engine=mixed", "search.mixed.real=bm25", f"search.bm25.corpus={corpus}",
         f"search.simulator.model={tiny_model_dir}", f"search.rerank.model={tiny_cross_encoder}",
         "search.negatives=none"],
    )  # fmt: skip
    engine = build_search_engine(cfg.search)
    assert isinstance(engine.real, CrossEncoderReranker)
    assert not isinstance(engine.simulator, CrossEncoderReranker)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["search.rerank.model=cross-encoder/ms-marco-MiniLM-L-6-v2"], "search.rerank.model"),
        (
            ["warmstart.search.engine=simulator", "warmstart.search.rerank.model=x/y"],
            "warmstart.search.rerank",
        ),
    ],
)
def test_rerank_over_the_simulator_is_refused(overrides, key):
    with pytest.raises(ConfigError, match=rf"{key}.*engine=simulator.*Fix: set {key}"):
        load_train_config(None, overrides)


def test_rerank_over_the_simulator_is_refused_for_eval_and_by_the_factory():
    with pytest.raises(ConfigError, match="search.rerank.model.*search.engine=bm25"):
        load_config(None, ["search.engine=simulator", "search.rerank.model=x/y"], schema=EvalConfig)
    cfg = load_config(
        None, ["search.engine=bm25", "search.rerank.model=x/y", "search.rerank.depth=7"], schema=EvalConfig
    )
    assert cfg.search.rerank.depth == 7
    cfg.search.engine = "simulator"  # built by hand, past the loader's check
    with pytest.raises(ConfigError, match="search.rerank.model"):
        build_search_engine(cfg.search)
    with pytest.raises(ConfigError, match="search.rerank.depth"):
        load_train_config(None, ["search.engine=bm25", "search.rerank.model=x/y", "search.rerank.depth=0"])


def test_dry_run_shows_the_reranker(tmp_path, capitals, tiny_cross_encoder, zerosim_cli, monkeypatch):
    from zerosim.training.dry_run import plan

    monkeypatch.chdir(tmp_path)
    _, corpus = capitals()
    common = ["search.engine=hybrid", f"search.bm25.corpus={corpus}", f"search.dense.corpus={corpus}"]
    rows = dict(plan(load_train_config(None, [*common, f"search.rerank.model={tiny_cross_encoder}",
                                              "search.rerank.depth=12"])))  # fmt: skip
    assert rows["reranker"] == (
        f"{tiny_cross_encoder} (local folder) reorders the top 12 hybrid candidates of each search"
    )
    rows = dict(plan(load_train_config(None, ["warmstart.enabled=true", f"warmstart.search.bm25.corpus={corpus}",
                                              f"warmstart.search.rerank.model={tiny_cross_encoder}"])))  # fmt: skip
    assert "over bm25, " in rows["warm start"] and "top 20 bm25 candidates" in rows["warm start"]
    assert "reranker" not in rows  # search.rerank is the RL engine's; the warm start has its own
    # the command prints it, and refuses a local folder that is not there before anything loads
    out = zerosim_cli("train", "--dry-run", *common, f"search.rerank.model={tiny_cross_encoder}").stdout
    assert "reranker" in out and "(local folder)" in out
    missing = tmp_path / "no-such-model"
    result = zerosim_cli("train", "--dry-run", *common, f"search.rerank.model={missing}", code=2)
    assert "search.rerank.model" in result.stderr and "does not exist" in result.stderr

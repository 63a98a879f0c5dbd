"""The search server: Search-R1 /retrieve compatibility, validation, engine failures (loopback only)."""

from collections.abc import Sequence

import httpx
import pytest

from curricula.negatives import CorpusNegatives
from eval.bm25 import BM25Retriever
from zerosim.core.http.server import create_app, running_server
from zerosim.core.search import Document, SearchEngine, SearchError, SearchRequest

CORPUS = [
    Document("peru-0", "Peru - Government", "The capital of Peru is Lima."),
    Document("peru-1", "Peru - Economy", "Peru exports copper, gold and fishmeal."),
    Document("chile-0", "Chile - Government", "The capital of Chile is Santiago."),
    Document("chile-1", "Chile - Geography", "Chile stretches along the Andes and the Pacific coast."),
    Document("france-0", "France - Government", "The capital of France is Paris."),
    Document("france-1", "France - Economy", "France is a leading producer of wine and aircraft."),
    Document("japan-0", "Japan - Government", "The capital of Japan is Tokyo."),
    Document("japan-1", "Japan - Geography", "Japan is an archipelago of volcanic islands."),
    Document("kenya-0", "Kenya - Government", "The capital of Kenya is Nairobi."),
    Document("kenya-1", "Kenya - Economy", "Kenya exports tea, coffee and cut flowers."),
]


class FakeEngine:
    """Records every call; answers one document per slot, marked noisy as the request asks."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[SearchRequest], int]] = []
        self.fail: Exception | None = None
        self.answer_empty = False

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        self.calls.append((list(requests), k))
        if self.fail is not None:
            raise self.fail
        if self.answer_empty:
            return [[] for _ in requests]
        return [
            [
                Document(f"q{i}-{s}", f"About {r.query}", f"document {s}", score=None, noisy=noisy)
                for s, noisy in enumerate(r.noise_for(k))
            ]
            for i, r in enumerate(requests)
        ]


@pytest.fixture(scope="module")
def bm25_url():
    with running_server(BM25Retriever(CORPUS).index(), name="tiny-bm25", negatives=CorpusNegatives) as url:
        yield url


@pytest.fixture(scope="module")
def fake_server():
    engine = FakeEngine()
    with running_server(engine, name="fake", max_topk=5, max_queries=4) as url:
        yield engine, url


@pytest.fixture
def fake(fake_server):
    engine, url = fake_server
    engine.calls.clear()
    engine.fail, engine.answer_empty = None, False
    return engine, url


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/retrieve", json=body, timeout=5)


def test_round_trip_search_r1_shape_with_scores(bm25_url):
    resp = post(
        bm25_url, {"queries": ["capital of Peru", "Kenya tea exports"], "topk": 3, "return_scores": True}
    )
    assert resp.status_code == 200
    result = resp.json()["result"]
    assert len(result) == 2 and all(len(r) == 3 for r in result)
    top = result[0][0]
    assert set(top) == {"document", "score"} and set(top["document"]) == {"id", "contents"}
    assert top["document"] == {"id": "peru-0", "contents": "Peru - Government\nThe capital of Peru is Lima."}
    assert isinstance(top["score"], float) and top["score"] > 0
    assert result[1][0]["document"]["id"] == "kenya-1"
    scores = [e["score"] for e in result[0]]
    assert scores == sorted(scores, reverse=True)


def test_same_ranking_as_the_engine_in_process(bm25_url):
    queries = ["capital of Japan", "volcanic islands", "wine"]
    direct = BM25Retriever(CORPUS).index().search([SearchRequest(q) for q in queries], 4)
    result = post(bm25_url, {"queries": queries, "topk": 4, "return_scores": True}).json()["result"]
    assert [[e["document"]["id"] for e in r] for r in result] == [[d.id for d in docs] for docs in direct]
    # JSON floats round-trip exactly
    assert [[e["score"] for e in r] for r in result] == [[d.score for d in docs] for docs in direct]


def test_return_scores_false_gives_plain_documents(bm25_url):
    result = post(bm25_url, {"queries": ["capital of France"], "topk": 2, "return_scores": False}).json()[
        "result"
    ]
    assert len(result) == 1 and len(result[0]) == 2
    assert result[0][0] == {
        "id": "france-0",
        "contents": "France - Government\nThe capital of France is Paris.",
    }
    # return_scores defaults to false, as in Search-R1
    assert post(bm25_url, {"queries": ["capital of France"], "topk": 2}).json()["result"] == result


@pytest.mark.parametrize("topk", [1, 4, 10])
def test_topk_is_honoured(bm25_url, topk):
    result = post(bm25_url, {"queries": ["capital", "exports"], "topk": topk}).json()["result"]
    assert [len(r) for r in result] == [topk, topk]


def test_topk_defaults_to_three_like_search_r1(bm25_url):
    assert [len(r) for r in post(bm25_url, {"queries": ["capital"]}).json()["result"]] == [3]


def test_health(bm25_url, fake):
    assert httpx.get(f"{bm25_url}/health").json() == {
        "status": "ok",
        "engine": "BM25Retriever",
        "name": "tiny-bm25",
        "documents": 10,
        "max_topk": 50,
        "max_queries": 1024,
        "default_topk": 3,
        "noise": "negatives",  # a retriever over a corpus: noisy slots get corpus negatives
        "negatives": ["hard", "random"],
    }
    health = httpx.get(f"{fake[1]}/health").json()
    assert health["engine"] == "FakeEngine" and health["documents"] is None and health["max_topk"] == 5
    assert (health["noise"], health["negatives"]) == ("engine", [])  # it writes noisy documents itself


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"topk": 3}, "queries", "required"),
        ({"queries": [], "topk": 3}, "queries", "at least 1"),
        ({"queries": "capital", "topk": 3}, "queries", "list"),
        ({"queries": [1, 2], "topk": 3}, "queries.0", "string"),
        ({"queries": ["a"], "topk": 0}, "topk", "greater than or equal to 1"),
        ({"queries": ["a"], "topk": "3"}, "topk", "integer"),
        ({"queries": ["a"], "topk": 2.5}, "topk", "integer"),
        ({"queries": ["a"], "topk": 6}, "topk", "at most 5"),
        ({"queries": ["a"] * 5, "topk": 1}, "queries", "at most 4"),
        ({"queries": ["a"], "topk": 1, "return_scores": "yes"}, "return_scores", "boolean"),
        ({"queries": ["a", "b"], "topk": 1, "questions": ["q"]}, "questions", "one per query"),
        ({"queries": ["a"], "topk": 1, "answers": ["x"]}, "answers.0", "list"),
        ({"queries": ["a"], "topk": 2, "noise": [[True]]}, "noise.0", "topk=2"),
    ],
)
def test_malformed_request_is_422_naming_the_field(fake, body, field, words):
    engine, url = fake
    resp = post(url, body)
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert f"{field}:" in error and words in error, error
    assert engine.calls == []


def test_body_that_is_not_json_is_422(fake):
    resp = httpx.post(
        f"{fake[1]}/retrieve", content=b"{queries", headers={"content-type": "application/json"}
    )
    assert resp.status_code == 422 and "not valid JSON" in resp.json()["error"]


def test_one_engine_call_per_request(fake):
    engine, url = fake
    result = post(url, {"queries": ["a", "b", "c"], "topk": 2, "return_scores": True}).json()["result"]
    assert len(engine.calls) == 1
    requests, k = engine.calls[0]
    assert k == 2 and [r.query for r in requests] == ["a", "b", "c"]
    assert all(r.question is None and r.answers == () and r.noise is None for r in requests)
    # an engine without scores answers null scores; plain retriever documents carry no "noisy" key,
    # documents whose mode was decided carry it
    assert result[0][0] == {
        "document": {"id": "q0-0", "contents": "About a\ndocument 0", "noisy": False},
        "score": None,
    }


def test_training_fields_reach_the_engine_and_noisy_comes_back(fake):
    engine, url = fake
    body = {
        "queries": ["capital of Peru", "largest lake"],
        "topk": 3,
        "return_scores": True,
        "questions": ["What is the capital of Peru?", None],
        "answers": [["Lima"], []],
        "noise": [[False, True, False], None],
    }
    result = post(url, body).json()["result"]
    ((requests, _),) = engine.calls
    assert requests == [
        SearchRequest("capital of Peru", "What is the capital of Peru?", ("Lima",), (False, True, False)),
        SearchRequest("largest lake", None, (), None),
    ]
    assert [e["document"]["noisy"] for e in result[0]] == [False, True, False]
    assert [e["document"]["noisy"] for e in result[1]] == [False, False, False]


def test_engine_search_error_is_503_with_its_message(fake):
    engine, url = fake
    engine.fail = SearchError("simulator backend is down")
    resp = post(url, {"queries": ["a"], "topk": 1})
    assert resp.status_code == 503
    assert resp.json() == {"error": "FakeEngine could not answer: simulator backend is down"}


def test_engine_crash_is_500_without_a_stack_trace(fake):
    engine, url = fake
    engine.fail = KeyError("boom")
    resp = post(url, {"queries": ["a"], "topk": 1})
    assert resp.status_code == 500
    assert resp.json() == {"error": "FakeEngine failed: KeyError: 'boom'"}
    assert "Traceback" not in resp.text


def test_engine_answering_nothing_is_500_not_an_empty_result(fake):
    engine, url = fake
    engine.answer_empty = True
    resp = post(url, {"queries": ["a", "b"], "topk": 1})
    assert resp.status_code == 500 and "no documents for query 0" in resp.json()["error"]


def test_running_server_stops_on_exit():
    engine = FakeEngine()
    assert isinstance(engine, SearchEngine)
    with running_server(engine) as url:
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{url}/health").status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=1)


def test_running_server_reports_a_port_it_cannot_bind(fake):
    port = int(fake[1].rsplit(":", 1)[1])
    with pytest.raises(RuntimeError, match="failed to start"), running_server(FakeEngine(), port=port):
        pass


def test_a_retriever_served_without_a_negatives_factory_offers_no_negatives():
    """The server is handed what fills a retriever's noisy slots (``zerosim serve retriever`` passes
    CorpusNegatives); without it, ``/health`` lists no modes and a noisy request is refused, naming the fix."""
    with running_server(BM25Retriever(CORPUS).index()) as url:
        health = httpx.get(f"{url}/health").json()
        assert (health["noise"], health["negatives"]) == ("negatives", [])
        assert len(post(url, {"queries": ["capital of Peru"], "topk": 2}).json()["result"][0]) == 2
        response = post(url, {"queries": ["capital of Peru"], "topk": 2, "noise": [[True, False]]})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert "negatives.mode: hard negatives" in error and "negatives=CorpusNegatives" in error, error


def test_serve_retriever_hands_the_server_corpus_negatives(monkeypatch):
    """``zerosim serve retriever`` (the app) gives the server CorpusNegatives, so a served index honours noise."""
    from typer.testing import CliRunner

    import eval.index
    import zerosim.core.http.server
    import zerosim.core.runtime
    from zerosim.cli import app

    engine, served = BM25Retriever(CORPUS).index(), []
    monkeypatch.setattr(eval.index, "load_index", lambda index: engine)
    monkeypatch.setattr(zerosim.core.runtime, "apply_threads", lambda threads: 1)
    monkeypatch.setattr(
        zerosim.core.http.server, "serve", lambda *args, **kwargs: served.append((args, kwargs))
    )
    result = CliRunner().invoke(app, ["serve", "retriever", "--index", "idx", "--port", "8123"])
    assert result.exit_code == 0, result.output
    assert served == [((engine,), {"host": "127.0.0.1", "port": 8123, "negatives": CorpusNegatives})]


def test_create_app_checks_its_limits():
    with pytest.raises(ValueError, match="default_topk"):
        create_app(FakeEngine(), max_topk=2)
    with pytest.raises(ValueError, match="max_queries"):
        create_app(FakeEngine(), max_queries=0)

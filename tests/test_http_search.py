"""HTTPSearchEngine: round trips, bounded retries, and every way a server can fail (loopback only)."""

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eval.bm25 import BM25Retriever
from zerosim.core.http.client import HTTPSearchEngine
from zerosim.core.http.retry import RetryPolicy
from zerosim.core.http.server import running_server
from zerosim.core.search import Document, SearchEngine, SearchError, SearchRequest

CORPUS = [
    Document("peru-0", "Peru - Government", "The capital of Peru is Lima."),
    Document("chile-0", "Chile - Government", "The capital of Chile is Santiago."),
    Document("japan-0", "Japan - Government", "The capital of Japan is Tokyo."),
    Document("japan-1", "Japan - Geography", "Japan is an archipelago of volcanic islands."),
    Document("kenya-1", "Kenya - Economy", "Kenya exports tea, coffee and cut flowers."),
]


class FakeEngine:
    """Records every call; answers one document per slot, marked noisy as the request asks."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[SearchRequest], int]] = []
        self.fail: Exception | None = None

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        self.calls.append((list(requests), k))
        if self.fail is not None:
            raise self.fail
        return [
            [
                Document(f"q{i}-{s}", f"About {r.query}", f"document {s}", None, noisy)
                for s, noisy in enumerate(r.noise_for(k))
            ]
            for i, r in enumerate(requests)
        ]


FAST = RetryPolicy(retries=2, backoff=0.05, connect_timeout=0.5, read_timeout=2.0)


# A stub HTTP server: reply(method, path, body) -> (status, body bytes, seconds to wait before answering).
Reply = Callable[[str, str, bytes], tuple[int, bytes, float]]


@contextlib.contextmanager
def stub_server(reply: Reply) -> Iterator[tuple[str, list[str]]]:
    """Serve ``reply`` on a free loopback port; yields (base url, list of "METHOD path" hits)."""
    hits: list[str] = []
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            hits.append(f"{self.command} {self.path}")
            status, payload, delay = reply(self.command, self.path, body)
            if delay and stop.wait(delay):
                return
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:  # keep test output quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", hits
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def search_r1_reply(result: object, health_status: int = 404) -> Reply:
    """A plain Search-R1 server: no /health, /retrieve answers ``{"result": result}``."""

    def reply(method: str, path: str, body: bytes) -> tuple[int, bytes, float]:
        if path == "/health":
            return health_status, b'{"detail": "Not Found"}', 0.0
        return 200, json.dumps({"result": result}).encode(), 0.0

    return reply


def dead_url() -> str:
    """A loopback URL nobody listens on: bind a port, note it, close it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def bm25_url():
    with running_server(BM25Retriever(CORPUS).index()) as url:
        yield url


@pytest.fixture(scope="module")
def fake_server():
    engine = FakeEngine()
    with running_server(engine, max_topk=5) as url:
        yield engine, url


@pytest.fixture
def fake(fake_server):
    engine, url = fake_server
    engine.calls.clear()
    engine.fail = None
    return engine, url


# -- round trips against zerosim.core.http.server ------------------------------------------------------------


def test_same_documents_as_the_engine_in_process(bm25_url):
    requests = [
        SearchRequest("capital of Peru"),
        SearchRequest("Kenya tea"),
        SearchRequest("volcanic islands"),
    ]
    with HTTPSearchEngine(bm25_url, retry=FAST) as client:
        assert isinstance(client, SearchEngine)
        assert client.server_info["engine"] == "BM25Retriever"
        got = client.search(requests, 3)
    assert got == BM25Retriever(CORPUS).index().search(requests, 3)
    assert got[0][0] == Document(
        "peru-0", "Peru - Government", "The capital of Peru is Lima.", got[0][0].score
    )


@pytest.mark.parametrize("suffix", ["", "/", "/retrieve", "/retrieve/"])
def test_url_may_be_the_base_or_the_retrieve_endpoint(bm25_url, suffix):
    with HTTPSearchEngine(bm25_url + suffix, retry=FAST) as client:
        assert client.retrieve_url == f"{bm25_url}/retrieve"
        assert [d.id for d in client.search([SearchRequest("capital of Chile")], 1)[0]] == ["chile-0"]


def test_one_post_per_search_carrying_every_query(fake):
    engine, url = fake
    with HTTPSearchEngine(url, retry=FAST) as client:
        got = client.search([SearchRequest(q) for q in "abcd"], 2)
        assert client.search([], 2) == []  # nothing to ask: no POST
    assert len(engine.calls) == 1 and [r.query for r in engine.calls[0][0]] == list("abcd")
    assert [len(docs) for docs in got] == [2, 2, 2, 2]


def test_training_fields_reach_the_engine_through_the_server(fake):
    engine, url = fake
    requests = [
        SearchRequest(
            "capital of Peru", "What is the capital of Peru?", ("Lima", "Lima, Peru"), (True, False)
        ),
        SearchRequest("largest lake"),
        SearchRequest("andes", "Which range?", (), None),
    ]
    with HTTPSearchEngine(url, retry=FAST) as client:
        got = client.search(requests, 2)
    ((seen, k),) = engine.calls
    assert seen == requests and k == 2
    assert [d.noisy for d in got[0]] == [True, False] and [d.noisy for d in got[1]] == [False, False]
    assert got[0][0] == Document("q0-0", "About capital of Peru", "document 0", None, True)


def test_training_fields_can_be_withheld(fake):
    engine, url = fake
    with HTTPSearchEngine(url, send_training_fields=False, retry=FAST) as client:
        client.search([SearchRequest("q", "question?", ("a",), (True,))], 1)
    ((seen, _),) = engine.calls
    assert seen == [SearchRequest("q")]


def test_engine_search_error_becomes_search_error_after_retries(fake):
    engine, url = fake
    engine.fail = SearchError("simulator backend is down")
    with HTTPSearchEngine(url, retry=FAST) as client, pytest.raises(SearchError) as err:
        client.search([SearchRequest("a")], 1)
    assert len(engine.calls) == 2  # retried once, then gave up
    message = str(err.value)
    assert f"{url}/retrieve did not answer after 2 attempts" in message
    assert "HTTP 503" in message and "simulator backend is down" in message


def test_a_rejected_request_is_not_retried(fake):
    engine, url = fake
    started = time.perf_counter()
    with (
        HTTPSearchEngine(url, retry=RetryPolicy(retries=3, backoff=5.0)) as client,
        pytest.raises(SearchError) as err,
    ):
        client.search([SearchRequest("a")], 6)  # the server takes topk <= 5
    assert time.perf_counter() - started < 2.0  # no backoff sleep happened
    assert "HTTP 422" in str(err.value) and "topk" in str(err.value) and "not retried" in str(err.value)
    assert engine.calls == []


def test_a_500_then_an_answer_succeeds():
    good = search_r1_reply([[{"document": {"id": "1", "contents": "T\nx"}, "score": 1.0}]])
    failures = [(500, b'{"error": "hiccup"}', 0.0)]

    def reply(method: str, path: str, body: bytes) -> tuple[int, bytes, float]:
        return failures.pop() if failures else good(method, path, body)

    with stub_server(reply) as (url, hits), HTTPSearchEngine(url, check_health=False, retry=FAST) as client:
        assert client.search([SearchRequest("q")], 1) == [[Document("1", "T", "x", 1.0)]]
    assert hits == ["POST /retrieve", "POST /retrieve"]


# -- a plain Search-R1 server -------------------------------------------------------------------------


def test_plain_search_r1_server_without_health_warns_and_works():
    result = [
        # Search-R1's BM25 server sends documents without an id, and extra fields
        [{"document": {"contents": '"Lima"\nCapital of Peru.', "title": "Lima", "text": "x"}, "score": 3.5}],
        [{"document": {"id": 7, "contents": "Tokyo\nCapital of Japan."}, "score": 2.0}],
    ]
    with stub_server(search_r1_reply(result)) as (url, hits):
        with pytest.warns(UserWarning, match="no /health"):
            client = HTTPSearchEngine(f"{url}/retrieve", retry=FAST)
        with client:
            assert client.server_info is None
            got = client.search([SearchRequest("lima"), SearchRequest("tokyo")], 1)
    assert hits == ["GET /health", "POST /retrieve"]
    lima, tokyo = got[0][0], got[1][0]
    assert (lima.title, lima.text, lima.score, lima.noisy) == ("Lima", "Capital of Peru.", 3.5, None)
    assert lima.id.startswith("sha1-") and tokyo.id == "7"


def test_plain_documents_without_scores_are_accepted():
    answer = search_r1_reply([[{"id": "a", "contents": "A\ntext"}]])
    with stub_server(answer) as (url, _), HTTPSearchEngine(url, check_health=False, retry=FAST) as client:
        assert client.search([SearchRequest("q")], 3) == [[Document("a", "A", "text")]]


def test_plain_requests_stay_plain_search_r1_requests():
    bodies: list[dict] = []
    answer = search_r1_reply([[{"id": "a", "contents": "A\ntext"}]])

    def reply(method: str, path: str, body: bytes) -> tuple[int, bytes, float]:
        bodies.append(json.loads(body))
        return answer(method, path, body)

    with stub_server(reply) as (url, _), HTTPSearchEngine(url, check_health=False, retry=FAST) as client:
        client.search([SearchRequest("q")], 3)
    assert bodies == [{"queries": ["q"], "topk": 3, "return_scores": True}]


# -- failures ----------------------------------------------------------------------------------------


def test_dead_port_fails_after_the_configured_retries_in_bounded_time():
    url = dead_url()
    client = HTTPSearchEngine(url, check_health=False, retry=FAST)
    started = time.perf_counter()
    with client, pytest.raises(SearchError) as err:
        client.search([SearchRequest("q")], 3)
    elapsed = time.perf_counter() - started
    # 2 attempts, each at most connect_timeout, one backoff sleep between them
    assert elapsed < FAST.retries * FAST.connect_timeout + FAST.backoff + 0.5
    assert str(err.value) == f"search server {url}/retrieve did not answer after 2 attempts: " + (
        "cannot connect (connection refused)"
    )


def test_dead_port_at_start_fails_the_health_check():
    url = dead_url()
    with pytest.raises(SearchError, match=rf"search server {url}/health did not answer after 2 attempts"):
        HTTPSearchEngine(url, retry=FAST)


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        (b"<html>not json</html>", "invalid JSON"),
        (b'{"results": []}', "no 'result' key"),
        (
            json.dumps({"result": [[{"id": "a", "contents": "A\nx"}]]}).encode(),
            "1 result lists for 2 queries",
        ),
        (
            json.dumps({"result": [[{"id": "a", "contents": "A\nx"}], []]}).encode(),
            "no documents for query 1",
        ),
        (json.dumps({"result": [[{"id": "a"}], [{"id": "b"}]]}).encode(), "no 'contents' string"),
        (json.dumps({"result": [[{"id": "a", "contents": "A\nx"}] * 3] * 2}).encode(), "3 documents"),
        (
            json.dumps(
                {"result": [[{"document": {"id": "a", "contents": "x"}, "score": "hi"}]] * 2}
            ).encode(),
            "score",
        ),
    ],
)
def test_garbage_answers_fail_after_retries(answer, problem):
    with stub_server(lambda m, p, b: (200, answer, 0.0)) as (url, hits):
        with (
            HTTPSearchEngine(url, check_health=False, retry=FAST) as client,
            pytest.raises(SearchError) as err,
        ):
            client.search([SearchRequest("q1"), SearchRequest("q2")], 2)
        assert hits == ["POST /retrieve"] * 2
    assert "did not answer after 2 attempts" in str(err.value) and problem in str(err.value)


def test_slow_server_times_out_after_retries():
    config = replace(FAST, read_timeout=0.2)
    with stub_server(lambda m, p, b: (200, b'{"result": [[]]}', 3.0)) as (url, hits):
        started = time.perf_counter()
        with (
            HTTPSearchEngine(url, check_health=False, retry=config) as client,
            pytest.raises(SearchError) as err,
        ):
            client.search([SearchRequest("q")], 1)
        elapsed = time.perf_counter() - started
        assert len(hits) == 2
    assert elapsed < 2 * config.read_timeout + config.backoff + 1.0
    assert "after 2 attempts: no answer within read_timeout=0.2s (timed out)" in str(err.value)


def test_backoff_doubles_and_is_capped(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr("zerosim.core.http.retry.time.sleep", sleeps.append)
    client = HTTPSearchEngine(
        dead_url(), retry=RetryPolicy(retries=6, backoff=0.5, max_backoff=3.0), check_health=False
    )
    with client, pytest.raises(SearchError, match="after 6 attempts"):
        client.search([SearchRequest("q")], 1)
    assert sleeps == [0.5, 1.0, 2.0, 3.0, 3.0]


@pytest.mark.parametrize(
    ("url", "retry", "words"),
    [
        ("localhost:8000", {}, "http://HOST:PORT"),
        ("http://127.0.0.1:9", {"retries": 0}, "retries=0"),
        ("http://127.0.0.1:9", {"read_timeout": 0}, "timeouts must be positive"),
        ("http://127.0.0.1:9", {"backoff": -1}, "must not be negative"),
    ],
)
def test_bad_settings_are_refused(url, retry, words):
    with pytest.raises(ValueError, match=words):
        HTTPSearchEngine(url, retry=RetryPolicy(**retry), check_health=False)


@pytest.mark.parametrize("limit", [1, 3])
def test_each_process_keeps_to_its_connection_limit(limit):
    """Threads sharing one engine never hold more than ``max_connections`` requests open to the server."""
    lock, state = threading.Lock(), {"open": 0, "most": 0}

    def reply(method, path, body):
        if path == "/health":
            return 404, b"{}", 0.0
        with lock:
            state["open"] += 1
            state["most"] = max(state["most"], state["open"])
        time.sleep(0.2)
        with lock:
            state["open"] -= 1
        doc = {"document": {"id": "d", "contents": "T\nx"}, "score": 1.0}
        return 200, json.dumps({"result": [[doc]]}).encode(), 0.0

    with stub_server(reply) as (url, _):
        engine = HTTPSearchEngine(url, max_connections=limit, retry=replace(FAST, read_timeout=10.0))
        try:
            with ThreadPoolExecutor(6) as pool:
                results = list(pool.map(lambda i: engine.search([SearchRequest(f"q{i}")], 1), range(6)))
        finally:
            engine.close()
    assert all(len(r) == 1 for r in results)
    assert state["most"] == limit

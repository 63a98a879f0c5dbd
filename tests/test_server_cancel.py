"""The simulator server (``zerosim simulator serve`` without vLLM) under clients that go away, crowd in, or
never finish a request: an abandoned generation stops at its next decode step (a waiting one never runs),
the waiting queue is bounded (429 with ``Retry-After``, which both HTTP clients honour), a tiny temperature
decodes greedily, and idle or half-sent connections are closed.

Work is measured in model forwards (a prefill or one decode step each), counted by a hook on the model, not
in seconds: the assertions hold however busy the machine is.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import fastapi
import httpx
import pytest
from fastapi.responses import JSONResponse

from simulators import OpenAIBackend, TransformersBackend
from simulators.openai_server import create_openai_app
from zerosim.core.http.client import HTTPSearchEngine
from zerosim.core.http.retry import RetryPolicy
from zerosim.core.http.server import running_app
from zerosim.core.search import SearchError, SearchRequest

LONG = 1000  # tokens an abandoned client asks for: thousands of forwards if nobody stops them
PROMPT = "Write a document about Lima."


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    from zerosim.core.models import load_causal_lm

    return load_causal_lm(str(tiny_model_dir), "float32")


class Forwards:
    """Counts the model's forwards (a hook on its input embeddings, which every forward calls), slows each
    by ``delay`` seconds, holds each while ``gate`` is closed, and fails every forward once the test is over
    (so a server that never stops generating stops with the test)."""

    def __init__(self, model, delay: float = 0.0):
        self.count = 0
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()
        self.waiting_at_gate = threading.Event()
        self.over = threading.Event()
        self._handle = model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        if self.over.is_set():
            raise RuntimeError("the test is over")
        if not self.gate.is_set():
            self.waiting_at_gate.set()
            self.gate.wait()
        self.count += 1
        if self.delay:
            time.sleep(self.delay)

    def close(self) -> None:
        self.over.set()
        self.gate.set()
        self._handle.remove()


@contextlib.contextmanager
def counting(model, delay: float = 0.0) -> Iterator[Forwards]:
    forwards = Forwards(model, delay)
    try:
        yield forwards
    finally:
        forwards.close()


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.01)


def completion(max_tokens: int, **sampling: object) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **sampling}


def raw_post(url: str, body: dict) -> socket.socket:
    """Send a whole ``POST /v1/completions`` on a raw socket and return it, the answer unread."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def read_answer(sock: socket.socket) -> bytes:
    """One whole answer (head and body, by its Content-Length) from ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += _received(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
    while len(body) < length:
        body += _received(sock)
    return head + b"\r\n\r\n" + body


def _received(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    if not chunk:
        raise AssertionError("the server closed the connection before its answer was whole")
    return chunk


def serving(tiny_lm, tokenizer, **options: object) -> fastapi.FastAPI:
    backend = TransformersBackend(tiny_lm, tokenizer, apply_chat_template=False)
    return create_openai_app(backend, model_name="tiny", **options)


# -- abandoned requests ------------------------------------------------------------------------------------


def test_abandoned_requests_stop_and_cost_the_next_caller_at_most_a_step(tiny_lm, tokenizer):
    """Three clients ask for 1000 tokens and hang up (one generating, two waiting): the generating one stops
    after the forward in flight, the waiting ones never run, and the next 2-token request waits for no more.

    The clients hang up while the generating forward is held, so "the forward in flight" is exactly one
    however slowly this machine's threads are scheduled."""
    app = serving(tiny_lm, tokenizer, max_tokens_limit=LONG)
    queue = app.state.queue
    with counting(tiny_lm, delay=0.005) as forwards, running_app(app) as url:
        first = raw_post(url, completion(LONG))
        wait_until(lambda: forwards.count >= 3, "the first request is generating")
        others = [raw_post(url, completion(LONG)) for _ in range(2)]
        wait_until(lambda: queue.waiting == 2, "two requests wait behind it")
        forwards.gate.clear()
        assert forwards.waiting_at_gate.wait(20), "the generation never reached its next forward"
        for sock in (first, *others):
            sock.close()  # as a client's read timeout does
        hung_up = forwards.count
        wait_until(
            lambda: queue.stats["cancelled_waiting"] == 2 and queue.generating.cancelled.is_set(),
            "the server saw all three go",
        )
        forwards.gate.set()
        answer = httpx.post(f"{url}/v1/completions", json=completion(2), timeout=10)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 2
        # the abandoned generation's forward in flight, then the small request's prefill and one step
        assert forwards.count - hung_up <= 1 + 2
        assert queue.stats == {
            "completed": 1,
            "cancelled_waiting": 2,
            "cancelled_generating": 1,
            "refused": 0,
        }


def test_a_request_abandoned_while_waiting_never_runs(tiny_lm, tokenizer):
    app = serving(tiny_lm, tokenizer)
    with counting(tiny_lm) as forwards, running_app(app) as url:
        forwards.gate.clear()
        running = raw_post(url, completion(3))
        assert forwards.waiting_at_gate.wait(20), "the first request never started"
        waiting = raw_post(url, completion(LONG))
        wait_until(lambda: app.state.queue.waiting == 1, "the second request waits")
        waiting.close()
        wait_until(lambda: app.state.queue.stats["cancelled_waiting"] == 1, "the server saw it go")
        forwards.gate.set()
        assert b"200 OK" in read_answer(running)
        running.close()
        wait_until(lambda: app.state.queue.idle, "the queue empties")
        assert forwards.count == 3  # the first request's prefill and two steps: nothing for the second


# -- the bounded queue -------------------------------------------------------------------------------------


def test_past_max_waiting_the_server_answers_429_with_retry_after(tiny_lm, tokenizer):
    app = serving(tiny_lm, tokenizer, max_waiting=1)
    with counting(tiny_lm) as forwards, running_app(app) as url:
        forwards.gate.clear()
        running = raw_post(url, completion(2))
        assert forwards.waiting_at_gate.wait(20), "the first request never started"
        waiting = raw_post(url, completion(2))
        wait_until(lambda: app.state.queue.waiting == 1, "the second request waits")
        refused = httpx.post(f"{url}/v1/completions", json=completion(2), timeout=10)
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        error = refused.json()["error"]
        assert "max_waiting=1" in error["message"] and error["code"] == 429
        assert httpx.get(f"{url}/health", timeout=10).json()["queue"]["max_waiting"] == 1
        forwards.gate.set()
        for sock in (running, waiting):
            assert b"200 OK" in read_answer(sock)
            sock.close()
        assert app.state.queue.stats["refused"] == 1


def busy_then_free_app(busy: int, retry_after: str) -> tuple[fastapi.FastAPI, list[str]]:
    """A server that answers its first ``busy`` searches and completions 429 + ``Retry-After``."""
    app = fastapi.FastAPI()
    hits: list[str] = []

    def refuse_or(answer: dict) -> JSONResponse:
        hits.append("429" if len(hits) < busy else "200")
        if hits[-1] == "429":
            return JSONResponse({"error": "busy"}, status_code=429, headers={"Retry-After": retry_after})
        return JSONResponse(answer)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "noise": "engine"}

    @app.post("/retrieve")
    def retrieve() -> JSONResponse:
        return refuse_or({"result": [[{"document": {"id": "d", "contents": "T\nx"}, "score": 1.0}]]})

    @app.post("/v1/completions")
    def completions() -> JSONResponse:
        return refuse_or({"choices": [{"index": 0, "text": "a document"}]})

    return app, hits


def _search(url: str, retry: RetryPolicy) -> object:
    with HTTPSearchEngine(url, retry=retry, check_health=False) as client:
        return client.search([SearchRequest("q")], 1)[0][0].contents


def _complete(url: str, retry: RetryPolicy) -> object:
    with OpenAIBackend(url, "tiny", retry=retry, check_health=False) as client:
        return client.complete(["p"], max_new_tokens=2, temperature=0.0, top_p=1.0, seed=0)[0]


@pytest.mark.parametrize("call", [_search, _complete], ids=["search", "simulator"])
def test_clients_wait_as_long_as_retry_after_says(call, monkeypatch):
    app, hits = busy_then_free_app(busy=2, retry_after="3")
    retry = RetryPolicy(connect_timeout=1.0, read_timeout=5.0, retries=3, backoff=0.01)
    with running_app(app) as url:
        sleeps: list[float] = []
        monkeypatch.setattr("zerosim.core.http.retry.time.sleep", sleeps.append)
        assert call(url, retry) in ("T\nx", "a document")
    assert hits == ["429", "429", "200"]
    assert sleeps == [3.0, 3.0]  # the server's word, not the 0.01 s backoff


def test_retry_after_is_capped_by_an_attempts_deadline_and_counts_as_an_attempt(monkeypatch):
    app, hits = busy_then_free_app(busy=5, retry_after="3600")
    retry = RetryPolicy(connect_timeout=1.0, read_timeout=5.0, retries=2, backoff=0.01)
    with running_app(app) as url:
        sleeps: list[float] = []
        monkeypatch.setattr("zerosim.core.http.retry.time.sleep", sleeps.append)
        with pytest.raises(SearchError, match=r"after 2 attempts: HTTP 429"):
            _search(url, retry)
    assert hits == ["429", "429"] and sleeps == [6.0]


# -- sampling ----------------------------------------------------------------------------------------------


def test_a_tiny_temperature_decodes_greedily(tiny_lm, tokenizer):
    """1e-300 passes the schema (finite, >= 0); dividing the logits by it would make them inf."""
    with running_app(serving(tiny_lm, tokenizer)) as url:
        answers = [
            httpx.post(f"{url}/v1/completions", json=completion(8, temperature=t, seed=5), timeout=30)
            for t in (1e-300, 0)
        ]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    tiny, greedy = (a.json()["choices"][0]["text"] for a in answers)
    assert tiny == greedy


# -- connections -------------------------------------------------------------------------------------------

HALF_SENT = {
    "nothing": b"",
    "half the headers": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
    "half the body": b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"model": ',
}


@pytest.mark.parametrize("sent", list(HALF_SENT.values()), ids=list(HALF_SENT))
def test_a_half_sent_request_is_closed_after_the_request_timeout(tiny_lm, tokenizer, sent):
    from zerosim.core.http.connections import ConnectionTimeouts

    timeouts = ConnectionTimeouts(request=0.5, keep_alive=0.5)
    with running_app(serving(tiny_lm, tokenizer), timeouts=timeouts) as url:
        parts = urlsplit(url)
        with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
            sock.sendall(sent)
            started = time.monotonic()
            assert sock.recv(65536) == b""  # closed by the server, not by this 10 s timeout
            assert time.monotonic() - started < 8


def test_an_idle_keep_alive_connection_is_closed(tiny_lm, tokenizer):
    from zerosim.core.http.connections import ConnectionTimeouts

    timeouts = ConnectionTimeouts(request=30, keep_alive=0.5)
    with running_app(serving(tiny_lm, tokenizer), timeouts=timeouts) as url:
        parts = urlsplit(url)
        with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            started, received = time.monotonic(), b""
            while chunk := sock.recv(65536):  # the answer, then the end: closed by the server
                received += chunk
            assert b"200 OK" in received and time.monotonic() - started < 8


def test_zerosim_simulator_serve_takes_the_queue_bound_and_the_request_timeout(monkeypatch, zerosim_cli):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr("zerosim.core.runtime.apply_threads", lambda threads: 1)
    seen: dict = {}
    monkeypatch.setattr(
        "simulators.openai_server.start_simulator_server", lambda *a, **kw: seen.update(kw) or 0
    )
    zerosim_cli("simulator", "serve", "--max-waiting", "3", "--request-timeout", "2.5")
    assert seen["max_waiting"] == 3 and seen["request_timeout"] == 2.5


def test_a_burst_admits_one_generating_and_max_waiting_not_more():
    """32 requests admitted at once, before the first holds the model (a burst, not a trickle): the queue
    admits one to generate and max_waiting to wait; the rest are refused. It admitted every one of a burst
    before (its bound was checked only once the first job held its turn)."""
    import asyncio

    from simulators.generation_queue import GenerationQueue, QueueFull

    for max_waiting in (4, 0):
        queue = GenerationQueue(max_waiting=max_waiting)

        async def burst(queue=queue):
            admitted, refused = [], 0
            for _ in range(32):
                try:
                    admitted.append(queue.admit())
                except QueueFull:
                    refused += 1
            jobs = [queue.run(job, lambda: time.sleep(0.01), asyncio.Event().wait) for job in admitted]
            await asyncio.gather(*jobs)
            return len(admitted), refused

        assert asyncio.run(burst()) == (max_waiting + 1, 32 - max_waiting - 1)
        assert queue.waiting == 0 and queue.admitted == 0 and queue.stats["completed"] == max_waiting + 1


def test_a_burst_over_http_gets_429_past_the_bound(tiny_lm, tokenizer):
    app = serving(tiny_lm, tokenizer, max_waiting=4)
    forwards = Forwards(tiny_lm)
    try:
        with running_app(app) as url:
            forwards.gate.clear()  # the first generation holds the model until every request has arrived
            socks = [raw_post(url, completion(2)) for _ in range(32)]
            wait_until(lambda: app.state.queue.stats["refused"] == 27, "27 of the burst refused")
            forwards.gate.set()
            answers = [read_answer(sock) for sock in socks]
            for sock in socks:
                sock.close()
        assert sum(b"200 OK" in a for a in answers) == 5 and sum(b" 429 " in a for a in answers) == 27
    finally:
        forwards.close()

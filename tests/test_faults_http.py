"""Fault suite, HTTP side: every way a retriever or simulator server can misbehave, and every bad value a
server must refuse, as tables. Loopback servers only; seconds in all.

- clients against faulty servers: a dead port, 5xx, garbage or wrongly shaped answers, a slow server, a
  server that trickles its answer one byte at a time (per-attempt deadline): always a ``SearchError`` naming
  the URL within ``retries * (connect_timeout + read_timeout) + backoff``, never an empty observation;
- the simulator server refuses non-finite or out-of-range sampling values (400 naming the field) on both
  its endpoints, and a prompt longer than the model's context (400, before generating); the retriever
  server refuses its bad numeric fields (422 naming the field);
- curriculum noise over HTTP: a retriever behind ``zerosim serve retriever`` fills noisy slots with corpus
  negatives exactly as in-process; a server that ignores noise is an error, and an engine that cannot honour
  noise fails when it is built for a noisy curriculum.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import httpx
import pytest

from curricula.config import CurriculumConfig
from curricula.negatives import CorpusNegatives
from eval.bm25 import BM25Retriever
from eval.config import BM25Config
from simulators import OpenAIBackend, TransformersBackend
from simulators.openai_server import create_openai_app
from zerosim.core.config import ConfigError
from zerosim.core.http.client import HTTPConfig, HTTPSearchEngine
from zerosim.core.http.retry import RetryPolicy
from zerosim.core.http.server import running_app, running_server
from zerosim.core.search import Document, SearchError, SearchRequest
from zerosim.engines import SearchConfig, build_search_engine, curriculum_adds_noise

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

# small timeouts: one attempt ends by 0.3 + 0.5 = 0.8 s, a failing call by 2 x 0.8 + 0.05 s
CONNECT, READ, RETRIES, BACKOFF = 0.3, 0.5, 2, 0.05
BOUND = RETRIES * (CONNECT + READ) + BACKOFF
SLACK = 0.5  # thread scheduling on a busy 2-core machine
TIMING = RetryPolicy(connect_timeout=CONNECT, read_timeout=READ, retries=RETRIES, backoff=BACKOFF)
TRICKLE_GAP = 0.2  # seconds between two bytes of a trickling answer (less than READ: no read ever times out)
TRICKLE_CAP = 3.0  # a trickling server gives up after this, so a client without a deadline fails, not hangs


# -- a raw-socket server that misbehaves as told ----------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """What the server answers every request with."""

    status: int = 200
    body: bytes = b"{}"
    delay: float = 0.0  # seconds before the first byte
    trickle: str | None = None  # "headers": the whole answer byte by byte; "body": headers, then the body so


def _read_request(conn: socket.socket) -> str:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return ""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(
        (int(v) for k, _, v in (x.partition(":") for x in lines[1:]) if k.lower() == "content-length"), 0
    )
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    method, path, _ = lines[0].split(" ", 2)
    return f"{method} {path}"


@contextlib.contextmanager
def fault_server(fault: Fault) -> Iterator[tuple[str, list[str]]]:
    """Serve ``fault`` on a free loopback port; yields (base url, "METHOD path" of every request)."""
    hits: list[str] = []
    stop = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)

    def answer(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            hit = _read_request(conn)
            if not hit:
                return
            hits.append(hit)
            if fault.delay and stop.wait(fault.delay):
                return
            reason = {200: "OK", 404: "Not Found", 422: "Unprocessable", 500: "Error", 503: "Unavailable"}
            body = fault.body + (b" " * 100_000 if fault.trickle == "body" else b"")  # never all sent
            head = (
                f"HTTP/1.1 {fault.status} {reason.get(fault.status, 'X')}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
            if fault.trickle is None:
                conn.sendall(head + body)
                return
            if fault.trickle == "body":
                conn.sendall(head)
            data = head + body if fault.trickle == "headers" else body
            started = time.monotonic()
            for i in range(len(data)):
                if stop.wait(TRICKLE_GAP) or time.monotonic() - started > TRICKLE_CAP:
                    return  # closes the connection mid-answer
                conn.sendall(data[i : i + 1])

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", hits
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def dead_url() -> str:
    """A loopback URL nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


# -- the two HTTP clients, driven the same way -------------------------------------------------------------


def _search(url: str) -> tuple[HTTPSearchEngine, Callable[[], object]]:
    client = HTTPSearchEngine(url, check_health=False, retry=TIMING)
    return client, lambda: client.search([SearchRequest("capital of Peru"), SearchRequest("Kenya tea")], 2)


def _simulate(url: str) -> tuple[OpenAIBackend, Callable[[], object]]:
    client = OpenAIBackend(url, "sim", check_health=False, retry=TIMING)
    settings = {"max_new_tokens": 8, "temperature": 0.7, "top_p": 1.0, "seed": 1}
    return client, lambda: client.complete(["write about Peru", "write about Kenya"], **settings)


CLIENTS = {
    "search": (_search, "search server", "/retrieve"),
    "simulator": (_simulate, "simulator server", "/v1/completions"),
}

# fault, what the error says, attempts the server sees
FAULTS = [
    pytest.param(None, "cannot connect (connection refused)", 0, id="dead-port"),
    pytest.param(
        Fault(500, b'{"error": "engine crashed"}'), "HTTP 500: engine crashed", RETRIES, id="http-500"
    ),
    pytest.param(
        Fault(503, b'{"error": {"message": "overloaded"}}'), "HTTP 503: overloaded", RETRIES, id="http-503"
    ),
    pytest.param(Fault(422, b'{"error": "bad topk"}'), "(HTTP 422, not retried): bad topk", 1, id="http-422"),
    pytest.param(Fault(200, b"<html>not json</html>"), "invalid JSON", RETRIES, id="garbage-json"),
    pytest.param(
        Fault(200, b'{"result": null, "choices": null}'), "malformed answer", RETRIES, id="wrong-shape"
    ),
    pytest.param(
        Fault(200, b'{"result": [[], []], "choices": []}'), "malformed answer", RETRIES, id="empty-answer"
    ),
    pytest.param(Fault(200, b"[1, 2]"), "malformed answer", RETRIES, id="json-list"),
    pytest.param(Fault(200, delay=3.0), f"no answer within read_timeout={READ}s", RETRIES, id="slow-server"),
    pytest.param(
        Fault(200, b'{"result": []}', trickle="body"),
        f"no complete answer within {CONNECT + READ:g}s, the deadline of one attempt",
        RETRIES,
        id="trickling-body",
    ),
    pytest.param(
        Fault(200, b'{"result": []}', trickle="headers"),
        f"no complete answer within {CONNECT + READ:g}s, the deadline of one attempt",
        RETRIES,
        id="trickling-headers",
    ),
]


@pytest.mark.parametrize("kind", list(CLIENTS))
@pytest.mark.parametrize(("fault", "problem", "attempts"), FAULTS)
def test_a_faulty_server_is_an_error_naming_the_url_within_the_time_bound(kind, fault, problem, attempts):
    make, label, path = CLIENTS[kind]
    with contextlib.ExitStack() as stack:
        if fault is None:
            url, hits = dead_url(), []
        else:
            url, hits = stack.enter_context(fault_server(fault))
        client, call = make(url)
        stack.callback(client.close)
        started = time.monotonic()
        with pytest.raises(SearchError) as err:
            call()
        elapsed = time.monotonic() - started
    message = str(err.value)
    assert message.startswith(f"{label} {url}{path} "), message
    assert problem in message, message
    if "not retried" not in problem:
        assert f"did not answer after {RETRIES} attempts" in message
    assert hits == [f"POST {path}"] * attempts
    assert elapsed < BOUND + SLACK, f"{elapsed:.2f}s > {BOUND:g}s + {SLACK}s: {message}"


def test_a_trickling_health_check_is_cut_off_too():
    with fault_server(Fault(200, b'{"status": "ok"}', trickle="body")) as (url, hits):
        started = time.monotonic()
        with pytest.raises(SearchError, match=rf"{url}/health did not answer after 2 attempts: no complete"):
            HTTPSearchEngine(url, retry=TIMING)
        assert time.monotonic() - started < BOUND + SLACK
    assert hits == ["GET /health"] * RETRIES


# -- the simulator server refuses sampling values it cannot honour (400 naming the field) -------------------


@pytest.fixture(scope="module")
def simulator_url(tiny_model_dir, tokenizer):
    from zerosim.core.models import load_causal_lm

    backend = TransformersBackend(
        load_causal_lm(str(tiny_model_dir), "float32"), tokenizer, apply_chat_template=False
    )
    with running_app(create_openai_app(backend, model_name="tiny", max_tokens_limit=64)) as url:
        yield url


def _post_raw(url: str, path: str, body: str) -> httpx.Response:
    """Post ``body`` as it is: JSON with ``Infinity``/``NaN`` literals, which httpx's json= refuses to write."""
    return httpx.post(
        f"{url}{path}", content=body.encode(), headers={"content-type": "application/json"}, timeout=30
    )


# a request to each endpoint, sampling fields to add (the two endpoints share every check)
SIMULATOR_BASE = {
    "/v1/completions": '{"model": "tiny", "prompt": "hello", "max_tokens": 2, "seed": 1, %s}',
    "/v1/chat/completions": '{"model": "tiny", "messages": [{"role": "user", "content": "hello"}], '
    '"max_tokens": 2, "seed": 1, %s}',
}


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        pytest.param("temperature", "Infinity", "finite", id="temperature-inf"),
        pytest.param("temperature", "-Infinity", "finite", id="temperature-minus-inf"),
        pytest.param("temperature", "NaN", "finite", id="temperature-nan"),
        pytest.param("temperature", "1e400", "finite", id="temperature-overflow"),
        pytest.param("temperature", "-0.5", "greater than or equal to 0", id="temperature-negative"),
        pytest.param("temperature", '"hot"', "number", id="temperature-string"),
        pytest.param("top_p", "Infinity", "finite", id="top_p-inf"),
        pytest.param("top_p", "NaN", "finite", id="top_p-nan"),
        pytest.param("top_p", "0", "greater than 0", id="top_p-zero"),
        pytest.param("top_p", "1.5", "less than or equal to 1", id="top_p-above-1"),
        pytest.param("max_tokens", "0", "greater than or equal to 1", id="max_tokens-zero"),
        pytest.param("max_tokens", "1e400", "integer", id="max_tokens-inf"),
        pytest.param("max_tokens", "2.5", "integer", id="max_tokens-fraction"),
        pytest.param("max_tokens", "65", "exceeds 64", id="max_tokens-above-limit"),
        pytest.param("n", "2", "not supported", id="n-2"),
        pytest.param("seed", "1.5", "integer", id="seed-fraction"),
    ],
)
@pytest.mark.parametrize("path", list(SIMULATOR_BASE))
def test_simulator_server_refuses_bad_sampling_values_with_400(simulator_url, path, field, value, words):
    response = _post_raw(simulator_url, path, SIMULATOR_BASE[path] % f'"{field}": {value}')
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"] and words in error["message"], error


@pytest.mark.parametrize("path", list(SIMULATOR_BASE))
def test_simulator_server_answers_good_sampling_values(simulator_url, path):
    for extra in ('"temperature": 0', '"temperature": 2.5, "top_p": 1', '"temperature": 0.7, "top_p": 0.9'):
        response = _post_raw(simulator_url, path, SIMULATOR_BASE[path] % extra)
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 1


# -- the simulator server refuses a prompt longer than the model's context (400, before generating) ---------

CONTEXT = 64  # max_position_embeddings of the short-context tiny model
CHAT_HI = 31  # tokens of [{"role": "user", "content": "hi"}] in SmolLM2's template (its system turn included)


@pytest.fixture(scope="module")
def short_context(tokenizer):
    """A tiny random Llama whose context is 64 tokens, served; yields (url, generate calls)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=CONTEXT,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    backend = TransformersBackend(LlamaForCausalLM(config).eval(), tokenizer, apply_chat_template=False)
    calls: list[int] = []
    generate = backend.generator.generate
    backend.generator.generate = lambda prompts, *a, **kw: (
        calls.append(len(prompts)) or generate(prompts, *a, **kw)
    )
    with running_app(create_openai_app(backend, model_name="tiny", max_tokens_limit=CONTEXT)) as url:
        yield url, calls


def _words(n: int) -> str:
    return " the" * n  # one SmolLM2 token each (checked below)


# endpoint, request, status, what the error names
CONTEXT_CASES = [
    pytest.param("completions", {"prompt": _words(60), "max_tokens": 4}, 200, None, id="prompt-fits-exactly"),
    pytest.param(
        "completions",
        {"prompt": _words(60), "max_tokens": 5},
        400,
        ["maximum context length is 64 tokens", "65 tokens (60 in the prompt, 5 in the completion)"],
        id="prompt-plus-max_tokens-over",
    ),
    pytest.param(
        "completions",
        {"prompt": _words(90), "max_tokens": 1},
        400,
        ["maximum context length is 64 tokens", "(90 in the prompt, 1 in the completion)"],
        id="prompt-alone-over",
    ),
    pytest.param(
        "completions",
        {"prompt": [_words(10), _words(70), _words(80)], "max_tokens": 2},
        400,
        ["(70 in prompt 1, 2 in the completion)", "2 of 3 prompts are too long", "Please shorten prompt 1"],
        id="batch-with-long-prompts",
    ),
    pytest.param(
        "chat",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": CONTEXT - CHAT_HI},
        200,
        None,
        id="chat-fits-exactly",
    ),  # fmt: skip
    pytest.param(
        "chat",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": CONTEXT - CHAT_HI + 1},
        400,
        [f"({CHAT_HI} in the messages, {CONTEXT - CHAT_HI + 1} in the completion)", "lower max_tokens"],
        id="chat-plus-max_tokens-over",
    ),
    pytest.param(
        "chat",
        {"messages": [{"role": "user", "content": _words(40)}]},
        400,
        [
            "maximum context length is 64 tokens",
            "leaving none for the completion",
            "Please shorten the messages.",
        ],
        id="chat-messages-over-without-max_tokens",
    ),
    pytest.param(
        "chat",
        {"messages": [{"role": "user", "content": "hi"}]},
        200,
        None,
        id="chat-default-max_tokens-fits",
    ),
]


@pytest.mark.parametrize(("endpoint", "request_body", "status", "words"), CONTEXT_CASES)
def test_simulator_server_refuses_prompts_over_the_context_before_generating(
    short_context, tokenizer, endpoint, request_body, status, words
):
    url, calls = short_context
    assert len(tokenizer(_words(60))["input_ids"]) == 60  # the counts the table states
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    before = len(calls)
    response = httpx.post(f"{url}{path}", json={"model": "tiny", "seed": 0, **request_body}, timeout=30)
    assert response.status_code == status, response.text
    if status == 200:
        usage = response.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] <= CONTEXT
        assert len(calls) == before + 1
        return
    error = response.json()["error"]
    assert error["param"] == ("prompt" if endpoint == "completions" else "messages"), error
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error["message"]
    assert len(calls) == before  # refused before any generation


def test_simulator_client_refuses_non_finite_settings_before_sending():
    bad = ({"temperature": float("inf"), "top_p": 1.0}, {"temperature": 0.5, "top_p": float("nan")})
    with OpenAIBackend(dead_url(), "sim", check_health=False, retry=TIMING) as client:
        for settings in bad:
            with pytest.raises(ValueError, match="must be a finite number"):
                client.complete(["x"], max_new_tokens=4, seed=0, **settings)


# -- the retriever server refuses bad numeric fields (422 naming the field) ---------------------------------


class NoCorpus:
    """A retriever without its passages (no ``.docs``) that cannot write noisy documents itself."""

    honours_noise = False

    def __init__(self) -> None:
        self.retriever = BM25Retriever(CORPUS).index()

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        return self.retriever.search(requests, k)


@pytest.fixture(scope="module")
def retriever_url():
    """What ``zerosim serve retriever`` serves: a loaded index (an engine with its ``.docs``)."""
    with running_server(
        BM25Retriever(CORPUS).index(), name="tiny-bm25", max_topk=5, negatives=CorpusNegatives
    ) as url:
        yield url


class WritesNoise:
    """An engine that writes noisy documents itself, as the simulator does (no corpus)."""

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        return [
            [
                Document(f"q{i}-{s}", "Written", f"document {s}", None, noisy)
                for s, noisy in enumerate(r.noise_for(k))
            ]
            for i, r in enumerate(requests)
        ]


@pytest.fixture(scope="module")
def simulator_like_url():
    with running_server(WritesNoise(), name="simulator") as url:
        yield url


@pytest.fixture(scope="module")
def no_corpus_url():
    with running_server(NoCorpus(), name="no-corpus", negatives=CorpusNegatives) as url:
        yield url


NOISY = '"queries": ["capital of Peru"], "topk": 2, "noise": [[true, false]]'


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        pytest.param('"queries": ["a"], "topk": Infinity', "topk", "integer", id="topk-inf"),
        pytest.param('"queries": ["a"], "topk": NaN', "topk", "integer", id="topk-nan"),
        pytest.param('"queries": ["a"], "topk": 1e400', "topk", "integer", id="topk-overflow"),
        pytest.param('"queries": ["a"], "topk": 2.0', "topk", "integer", id="topk-float"),
        pytest.param('"queries": ["a"], "topk": true', "topk", "integer", id="topk-bool"),
        pytest.param(
            '"queries": ["a"], "topk": -1', "topk", "greater than or equal to 1", id="topk-negative"
        ),
        pytest.param('"queries": ["a"], "topk": 6', "topk", "at most 5", id="topk-above-max"),
        pytest.param(
            NOISY + ', "negatives": {"depth": 0}',
            "negatives.depth",
            "greater than or equal to 1",
            id="depth-zero",
        ),
        pytest.param(
            NOISY + ', "negatives": {"depth": Infinity}', "negatives.depth", "integer", id="depth-inf"
        ),
        pytest.param(
            NOISY + ', "negatives": {"depth": 5000}', "negatives.depth", "at most 1000", id="depth-above-max"
        ),
        pytest.param(
            NOISY + ', "negatives": {"mode": "nearby"}', "negatives.mode", "hard", id="mode-unknown"
        ),
        pytest.param(NOISY + ', "negatives": {"seed": 1.5}', "negatives.seed", "integer", id="seed-fraction"),
        pytest.param(NOISY + ', "negatives": "hard"', "negatives", "object", id="negatives-not-object"),
    ],
)
def test_retriever_server_refuses_bad_numeric_fields_with_422(retriever_url, body, field, words):
    response = _post_raw(retriever_url, "/retrieve", "{" + body + "}")
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert f"{field}:" in error and words in error, error


def test_random_negatives_need_the_corpus(no_corpus_url):
    assert httpx.get(f"{no_corpus_url}/health").json()["negatives"] == ["hard"]
    response = _post_raw(no_corpus_url, "/retrieve", "{" + NOISY + ', "negatives": {"mode": "random"}}')
    assert response.status_code == 422
    assert "negatives.mode: random negatives need the corpus passages" in response.json()["error"]


# -- curriculum noise over HTTP ------------------------------------------------------------------------------

NOISE_REQUESTS = [
    SearchRequest("capital of Peru", "What is the capital of Peru?", ("Lima",), (False, True, True)),
    SearchRequest("Kenya exports", "What does Kenya export?", ("tea",), (True, False, False)),
    SearchRequest("volcanic islands", None, (), None),  # no noise in the same batch
]


@pytest.mark.parametrize("mode", ["hard", "random"])
def test_noise_over_a_served_index_is_the_in_process_noise(retriever_url, mode):
    """Noisy slots come back as corpus negatives marked noisy, the very documents the in-process wrapper gives."""
    with HTTPSearchEngine(retriever_url, negatives=mode, negatives_depth=6, seed=3, retry=TIMING) as client:
        assert client.honours_noise and client.server_info["noise"] == "negatives"
        got = client.search(NOISE_REQUESTS, 3)
    in_process = CorpusNegatives(BM25Retriever(CORPUS).index(), CORPUS, mode=mode, depth=6, seed=3)
    assert got == in_process.search(NOISE_REQUESTS, 3)
    for request, docs in zip(NOISE_REQUESTS, got, strict=True):
        assert [d.noisy for d in docs] == list(request.noise_for(3))
        for doc in docs:
            if doc.noisy:  # a real passage, not one that gives the answer away
                assert doc.id in {d.id for d in CORPUS}
                assert not any(a.lower() in doc.text.lower() for a in request.answers)


def test_a_server_that_ignores_noise_is_an_error_not_a_noise_free_search():
    """A plain Search-R1 answer (no ``noisy`` marks) to a noisy request: an error naming server and fix."""
    doc = {"document": {"id": "p", "contents": "Peru\nThe capital of Peru is Lima."}, "score": 1.0}
    answer = json.dumps({"result": [[doc, doc, doc]]}).encode()
    with (
        fault_server(Fault(200, answer)) as (url, hits),
        HTTPSearchEngine(url, check_health=False, retry=TIMING) as client,
    ):
        plain = client.search([SearchRequest("capital of Peru")], 3)  # no noise asked: a plain answer is fine
        assert plain[0][0].noisy is None
        with pytest.raises(SearchError) as err:
            client.search([SearchRequest("capital of Peru", noise=(False, True, False))], 3)
    message = str(err.value)
    assert f"search server {url}/retrieve ignored the noise asked for query 0" in message
    assert "zerosim serve retriever" in message and "curriculum.p_end=0" in message
    assert hits == ["POST /retrieve"] * 2  # not retried: the same server ignores it again


def _corpus_file(tmp_path) -> str:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": d.id, "contents": d.contents}) + "\n" for d in CORPUS))
    return str(path)


def _health(body: dict) -> Fault:
    return Fault(200, json.dumps(body).encode())


# how search is configured, the server behind search.http.url (if any), what the error says (None: builds)
BUILDS = [
    pytest.param("bm25", "hard", None, None, id="bm25-hard"),
    pytest.param("bm25", "random", None, None, id="bm25-random"),
    pytest.param(
        "bm25", "none", None, "search.negatives=none leaves the bm25 retriever's noisy slots", id="bm25-none"
    ),
    pytest.param("http", "hard", "index", None, id="http-served-index"),
    pytest.param("http", "none", "index", "not with negatives=none", id="http-served-index-negatives-none"),
    pytest.param("http", "none", "simulator", None, id="http-served-simulator"),
    pytest.param(
        "http", "hard", Fault(404, b'{"detail": "Not Found"}'), "has no /health", id="http-plain-search-r1"
    ),
    pytest.param(
        "http",
        "hard",
        _health({"status": "ok", "engine": "BM25Retriever"}),
        "does not say it honours noise",
        id="http-older-zerosim",
    ),
]


@pytest.mark.filterwarnings("ignore:search server .* has no /health")  # the plain Search-R1 server
@pytest.mark.parametrize(("engine", "negatives", "server", "problem"), BUILDS)
def test_an_engine_that_cannot_honour_noise_fails_when_built_for_a_noisy_curriculum(
    engine, negatives, server, problem, retriever_url, simulator_like_url, tmp_path, monkeypatch
):
    monkeypatch.setenv("ZEROSIM_HOME", str(tmp_path / "home"))  # bm25 indexes are built there
    with contextlib.ExitStack() as stack:
        url = "http://127.0.0.1:9"
        if server == "index":
            url = retriever_url
        elif server == "simulator":
            url = simulator_like_url
        elif server is not None:
            url, _ = stack.enter_context(fault_server(server))
        cfg = SearchConfig(
            engine=engine,
            negatives=negatives,
            bm25=BM25Config(corpus=_corpus_file(tmp_path)),
            http=HTTPConfig(url=url, connect_timeout=CONNECT, read_timeout=READ, retries=1),
        )
        if problem is None:
            search = build_search_engine(cfg, noise=True)
            stack.callback(getattr(search, "close", lambda: None))
            docs = search.search([SearchRequest("capital of Peru", None, ("Lima",), (True, False, False))], 3)
            assert [d.noisy for d in docs[0]] == [True, False, False]
            return
        with pytest.raises(ConfigError) as err:
            build_search_engine(cfg, noise=True)
        message = str(err.value)
        assert f"search.engine={engine} cannot give them" in message and problem in message, message
        assert "curriculum.p_start=0 curriculum.p_end=0" in message
        # without a noisy curriculum the same engine is fine
        search = build_search_engine(cfg, noise=False)
        getattr(search, "close", lambda: None)()


@pytest.mark.parametrize(
    ("schedule", "p_start", "p_end", "noisy"),
    [
        ("exponential", 0.0, 0.5, True),
        ("exponential", 0.0, 0.0, False),
        ("linear", 0.3, 0.0, True),
        ("constant", 0.3, 0.0, False),  # constant uses p_end throughout
        ("constant", 0.0, 0.2, True),
        ("adaptive", 0.0, 0.4, True),
    ],
)
def test_which_curricula_ask_for_noise(schedule, p_start, p_end, noisy):
    assert curriculum_adds_noise(CurriculumConfig(schedule=schedule, p_start=p_start, p_end=p_end)) is noisy


def test_training_against_a_server_that_cannot_honour_noise_stops_at_start_up(tmp_path, tiny_model_dir):
    """Through ``train``: the engine is refused when it is built, before any search, run or checkpoint."""
    from zerosim.training.config import load_train_config
    from zerosim.training.recipe import train

    qa = tmp_path / "qa.jsonl"
    qa.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "question": f"Capital of {c}?", "golden_answers": [f"City{c}"]}) + "\n"
            for i, c in enumerate("ABCD")
        )
    )
    older_zerosim = _health({"status": "ok", "engine": "BM25Retriever"})  # a /health without "noise"
    with fault_server(older_zerosim) as (url, hits):
        cfg = load_train_config(
            None,
            [
                f"policy.model={tiny_model_dir}",
                "search.engine=http",
                f"search.http.url={url}",
                f"data.train={qa}",
                f"run.output_dir={tmp_path / 'out'}",
                f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                "trainer.max_steps=2",
                "trainer.per_device_train_batch_size=4",
                "trainer.num_generations=2",
                "curriculum.p_end=0.5",
            ],
        )
        with pytest.raises(ConfigError) as err:
            train(cfg)
    message = str(err.value)
    assert "search.engine=http cannot give them" in message and "does not say it honours noise" in message
    assert "zerosim serve retriever" in message and "curriculum.p_start=0 curriculum.p_end=0" in message
    assert hits == ["GET /health"]  # refused at build: no search was sent
    assert not list((tmp_path / "out").rglob("checkpoint-*"))

"""Serve any :class:`~zerosim.core.search.SearchEngine` over HTTP with the Search-R1 ``POST /retrieve`` API.

A real retriever or the LLM simulator sits behind the same endpoint, so many training nodes can share one
index (or one simulator) and every Search-R1 client keeps working. Beyond Search-R1, a request may carry the
curriculum's per-query ``questions``, ``answers`` and ``noise`` (old clients leave them out, old servers
ignore them), and a returned document may carry ``noisy``. The API is described in docs/serving.md.

Noise: an engine that writes noisy documents itself (the simulator) gets the noise pattern as it is. A
retriever over a corpus (an engine with ``.docs``, e.g. an index behind ``zerosim serve retriever``) cannot,
so the server fills its noisy slots with corpus negatives from the ``negatives`` factory it is given (the app
passes :class:`curricula.negatives.CorpusNegatives`; the request's ``negatives`` says mode, depth and seed),
exactly as the in-process retriever does. Either way every document of a request with noisy slots carries
``noisy``, and ``/health`` says which (``noise``) and in which modes (``negatives``).

Each request is one ``engine.search`` call (batch-first); calls are serialised, because an in-process model
is not safe to drive from several threads at once.
"""

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import fastapi
import httpx
import uvicorn
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr

from zerosim.core.http.connections import DEFAULT_TIMEOUTS, ConnectionTimeouts, uvicorn_options
from zerosim.core.search import Document, SearchEngine, SearchError, SearchRequest

logger = logging.getLogger(__name__)

DEFAULT_TOPK = 3  # Search-R1's default when a request leaves ``topk`` out

# ``(engine, corpus, *, mode, depth, seed) -> engine``: wraps a retriever so that its noisy slots are filled
# with corpus negatives (``corpus``: its passages, or None when it has none); e.g. CorpusNegatives
NegativesFactory = Callable[..., SearchEngine]


class NegativesRequest(BaseModel):
    """How a retriever behind the server fills noisy slots (the client's ``search.negatives`` settings)."""

    mode: Literal["hard", "random", "none"] = Field(
        default="hard", description="hard: ranks k+1..depth; random: corpus draws; none: leave noise alone."
    )
    depth: StrictInt = Field(default=30, ge=1, description="mode=hard: how deep to retrieve for negatives.")
    seed: StrictInt = Field(default=0, description="Seeds the random draws (same request -> same negatives).")


class RetrieveRequest(BaseModel):
    """Body of ``POST /retrieve``: Search-R1's three fields, then our optional per-query extensions."""

    queries: list[StrictStr] = Field(min_length=1, description="One search query per trajectory.")
    topk: StrictInt | None = Field(default=None, ge=1, description="Documents per query (server default).")
    return_scores: StrictBool = Field(default=False, description="Wrap each document as {document, score}.")
    questions: list[StrictStr | None] | None = Field(
        default=None, description="Extension: the user's question behind each query (for a simulator)."
    )
    answers: list[list[StrictStr]] | None = Field(
        default=None, description="Extension: the gold answers behind each query (for a simulator)."
    )
    noise: list[list[StrictBool] | None] | None = Field(
        default=None, description="Extension: per query, one bool per result slot (True = noisy document)."
    )
    negatives: NegativesRequest | None = Field(
        default=None, description="Extension: how a retriever fills noisy slots (server default when absent)."
    )


def _field_error(
    field: tuple[str | int, ...], message: str, kind: str = "value_error"
) -> RequestValidationError:
    return RequestValidationError([{"type": kind, "loc": ("body", *field), "msg": message}])


def _field_name(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[1:]
    return ".".join(parts) or "body"


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    """422 naming each bad field: ``{"error": "invalid request: topk: ...", "detail": [{loc, msg, type}]}``."""
    detail = [
        {
            "loc": [str(p) if not isinstance(p, int) else p for p in e.get("loc", ())],
            "msg": e.get("msg", ""),
            "type": e.get("type", ""),
        }
        for e in exc.errors()
    ]
    problems = []
    for e in detail:
        if e["type"] == "json_invalid":
            problems.append(f"body is not valid JSON ({e['msg']})")
        else:
            problems.append(f"{_field_name(e['loc'])}: {e['msg']}")
    return JSONResponse(
        status_code=422, content={"error": "invalid request: " + "; ".join(problems), "detail": detail}
    )


def _to_requests(body: RetrieveRequest, topk: int) -> list[SearchRequest]:
    """Check the extension lists against ``queries`` and build one :class:`SearchRequest` per query."""
    n = len(body.queries)
    for name in ("questions", "answers", "noise"):
        values = getattr(body, name)
        if values is not None and len(values) != n:
            raise _field_error((name,), f"has {len(values)} entries but queries has {n}; send one per query")
    if body.noise is not None:
        for i, pattern in enumerate(body.noise):
            if pattern is not None and len(pattern) != topk:
                raise _field_error(
                    ("noise", i), f"has {len(pattern)} slots but topk={topk}; send one bool per result slot"
                )
    return [
        SearchRequest(
            query=query,
            question=body.questions[i] if body.questions is not None else None,
            answers=tuple(body.answers[i]) if body.answers is not None else (),
            noise=tuple(body.noise[i]) if body.noise is not None and body.noise[i] is not None else None,
        )
        for i, query in enumerate(body.queries)
    ]


def _document_json(doc: Document) -> dict[str, Any]:
    out: dict[str, Any] = {"id": doc.id, "contents": doc.contents}
    if doc.noisy is not None:  # absent for plain retrievers, so their answers stay byte-for-byte Search-R1
        out["noisy"] = doc.noisy
    return out


def _score_json(score: float | None) -> float | None:
    # JSON has no NaN/inf; an engine without scores (the simulator) answers null.
    if score is None:
        return None
    score = float(score)
    return score if math.isfinite(score) else None


def _check_results(results: Any, n_queries: int, topk: int) -> str | None:
    """Why the engine's answer breaks the SearchEngine contract, or None when it is fine."""
    if not isinstance(results, list) or len(results) != n_queries:
        got = len(results) if isinstance(results, list) else type(results).__name__
        return f"returned {got} result lists for {n_queries} queries"
    for i, docs in enumerate(results):
        if not docs:
            return f"returned no documents for query {i}"
        if len(docs) > topk:
            return f"returned {len(docs)} documents for query {i} but topk={topk}"
    return None


def noise_handling(engine: SearchEngine) -> str:
    """``"engine"`` when ``engine`` writes noisy documents itself, ``"negatives"`` when the server must fill
    its noisy slots with corpus negatives.

    An engine's ``honours_noise`` attribute decides when it has one; otherwise an engine over a corpus
    (``.docs``: BM25, dense) gets negatives and any other engine the noise pattern as it is.
    """
    flag = getattr(engine, "honours_noise", None)
    if flag is not None:
        return "engine" if flag else "negatives"
    return "negatives" if getattr(engine, "docs", None) is not None else "engine"


def create_app(
    engine: SearchEngine,
    *,
    name: str = "zerosim",
    max_topk: int = 50,
    max_queries: int = 1024,
    default_topk: int = DEFAULT_TOPK,
    max_negatives_depth: int = 1000,
    negatives: NegativesFactory | None = None,
) -> fastapi.FastAPI:
    """A FastAPI app answering ``POST /retrieve`` (Search-R1 compatible) and ``GET /health`` from ``engine``.

    ``name`` labels the served index or simulator in ``/health``; ``max_topk`` and ``max_queries`` bound one
    request (a larger one gets a 422); ``default_topk`` is used when a request leaves ``topk`` out;
    ``max_negatives_depth`` bounds ``negatives.depth``. ``negatives`` (:data:`NegativesFactory`, e.g.
    :class:`curricula.negatives.CorpusNegatives`) fills the noisy slots of an engine that cannot write them;
    without it such an engine serves no negatives (``/health`` lists none, and a request with noisy slots
    gets a 422).
    """
    if not 1 <= default_topk <= max_topk:
        raise ValueError(f"default_topk={default_topk} must be between 1 and max_topk={max_topk}")
    if max_queries < 1:
        raise ValueError(f"max_queries={max_queries} must be at least 1")
    if max_negatives_depth < 1:
        raise ValueError(f"max_negatives_depth={max_negatives_depth} must be at least 1")
    engine_name = type(engine).__name__
    noise = noise_handling(engine)
    corpus = getattr(engine, "docs", None) if noise == "negatives" else None
    # random negatives need passages to draw from; hard ones only the retriever's deeper ranks
    negative_modes = (
        (["hard", "random"] if corpus else ["hard"]) if noise == "negatives" and negatives is not None else []
    )
    lock = threading.Lock()
    app = fastapi.FastAPI(title=f"zerosim search server ({name})", version="1")

    @app.exception_handler(RequestValidationError)
    async def _on_invalid_request(request: fastapi.Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(exc)

    @app.get("/health")
    def health() -> dict[str, Any]:
        docs = getattr(engine, "docs", None)
        return {
            "status": "ok",
            "engine": engine_name,
            "name": name,
            "documents": len(docs) if docs is not None and hasattr(docs, "__len__") else None,
            "max_topk": max_topk,
            "max_queries": max_queries,
            "default_topk": default_topk,
            "noise": noise,
            "negatives": negative_modes,
        }

    def answering_engine(body: RetrieveRequest, requests: list[SearchRequest], topk: int) -> SearchEngine:
        """``engine``, or ``engine`` behind corpus negatives when it cannot write the noisy slots asked for."""
        if noise != "negatives" or not any(any(r.noise_for(topk)) for r in requests):
            return engine
        asked = body.negatives or NegativesRequest()
        if asked.mode == "none":
            return engine
        if negatives is None:
            raise _field_error(
                ("negatives", "mode"),
                f"{asked.mode} negatives: this server fills no noisy slots of {engine_name} (started without a "
                "negatives factory); start it with create_app(..., negatives=CorpusNegatives), as `zerosim "
                "serve retriever` does, or send negatives.mode=none",
            )
        if asked.mode not in negative_modes:
            raise _field_error(
                ("negatives", "mode"),
                f"{asked.mode} negatives need the corpus passages and {engine_name} has none; use hard",
            )
        if asked.depth > max_negatives_depth:
            raise _field_error(
                ("negatives", "depth"),
                f"must be at most {max_negatives_depth} on this server (got {asked.depth})",
            )
        return negatives(engine, corpus, mode=asked.mode, depth=asked.depth, seed=asked.seed)

    @app.post("/retrieve")
    def retrieve(body: RetrieveRequest) -> JSONResponse:
        topk = body.topk if body.topk is not None else default_topk
        if topk > max_topk:
            raise _field_error(("topk",), f"must be at most {max_topk} on this server (got {topk})")
        if len(body.queries) > max_queries:
            raise _field_error(
                ("queries",),
                f"has {len(body.queries)} queries; this server takes at most {max_queries} per request",
            )
        requests = _to_requests(body, topk)
        answering = answering_engine(body, requests, topk)
        started = time.perf_counter()
        try:
            with lock:
                results = answering.search(requests, topk)
        except SearchError as exc:
            logger.warning("%s could not answer %d queries: %s", engine_name, len(requests), exc)
            return JSONResponse(status_code=503, content={"error": f"{engine_name} could not answer: {exc}"})
        except Exception as exc:  # an engine bug: log the trace here, send only the message
            logger.exception("%s failed on %d queries", engine_name, len(requests))
            return JSONResponse(
                status_code=500, content={"error": f"{engine_name} failed: {type(exc).__name__}: {exc}"}
            )
        problem = _check_results(results, len(requests), topk)
        if problem is not None:
            logger.error("%s %s", engine_name, problem)
            return JSONResponse(status_code=500, content={"error": f"{engine_name} {problem}"})
        logger.debug("%d queries x topk=%d in %.3fs", len(requests), topk, time.perf_counter() - started)
        if body.return_scores:
            result = [
                [{"document": _document_json(d), "score": _score_json(d.score)} for d in docs]
                for docs in results
            ]
        else:
            result = [[_document_json(d) for d in docs] for docs in results]
        return JSONResponse(content={"result": result})

    return app


def serve(
    engine: SearchEngine,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    timeouts: ConnectionTimeouts = DEFAULT_TIMEOUTS,
    **app_options: Any,
) -> None:
    """Serve ``engine`` until interrupted. Binds loopback unless ``host`` says otherwise (``0.0.0.0``: all).

    ``timeouts`` close idle and half-sent connections. ``app_options`` go to :func:`create_app` (``name``,
    ``max_topk``, ``max_queries``, ``default_topk``, ``max_negatives_depth``, ``negatives``).
    """
    uvicorn.run(
        create_app(engine, **app_options),
        host=host,
        port=port,
        log_level=log_level,
        **uvicorn_options(timeouts),
    )


@contextlib.contextmanager
def running_app(
    app: fastapi.FastAPI,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    log_level: str = "warning",
    startup_timeout: float = 10.0,
    health_path: str = "/health",
    label: str = "server",
    timeouts: ConnectionTimeouts = DEFAULT_TIMEOUTS,
) -> Iterator[str]:
    """Serve ``app`` from a background thread for the ``with`` block; yields the base URL.

    ``port=0`` picks a free port. Waits until ``health_path`` answers, and stops the server on exit. ``label``
    names the server in errors and logs; ``timeouts`` close idle and half-sent connections. For tests and
    benchmarks; use :func:`serve` for a long-running server.
    """
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="off",
        timeout_graceful_shutdown=2,
        **uvicorn_options(timeouts),
    )
    server = uvicorn.Server(config)
    crashed: list[BaseException] = []

    def run() -> None:
        try:
            server.run()
        except BaseException as exc:  # uvicorn exits with SystemExit when it cannot bind
            crashed.append(exc)

    thread = threading.Thread(target=run, name=f"zerosim-{label.replace(' ', '-')}-{port}", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if not thread.is_alive():
                reason = f": {crashed[0]!r}" if crashed else ""
                raise RuntimeError(f"{label} on {host}:{port} failed to start{reason}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label} on {host}:{port} did not start within {startup_timeout}s")
            time.sleep(0.01)
        bound_port = server.servers[0].sockets[0].getsockname()[1]
        url_host = f"[{host}]" if ":" in host else host
        base_url = f"http://{url_host}:{bound_port}"
        response = httpx.get(f"{base_url}{health_path}", timeout=max(deadline - time.monotonic(), 0.5))
        response.raise_for_status()
        yield base_url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        if thread.is_alive():
            logger.warning("%s thread did not stop within 10 s", label)


@contextlib.contextmanager
def running_server(
    engine: SearchEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    log_level: str = "warning",
    startup_timeout: float = 10.0,
    **app_options: Any,
) -> Iterator[str]:
    """Serve ``engine`` from a background thread for the ``with`` block; yields the base URL.

    ``port=0`` picks a free port. Waits until ``/health`` answers, and stops the server on exit.
    For tests and benchmarks; use :func:`serve` for a long-running server.
    """
    app = create_app(engine, **app_options)
    with running_app(
        app, host, port, log_level=log_level, startup_timeout=startup_timeout, label="search server"
    ) as url:
        yield url

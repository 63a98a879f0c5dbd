"""A :class:`~zerosim.core.search.SearchEngine` that asks a search server over HTTP (Search-R1 ``/retrieve`` API).

Works against :mod:`zerosim.core.http.server` (any engine, the simulator included) and against a plain Search-R1
retrieval server. One POST per ``search`` call carries every query. Failures are retried a bounded number of
times with exponential backoff and then raised as :class:`SearchError`; an answer is never replaced by an
empty list. Each attempt ends by its deadline (``connect_timeout + read_timeout``), so one search takes at
most ``retries * (connect_timeout + read_timeout)`` plus the backoff sleeps.

Curriculum noise: a request's noise pattern travels in the ``noise`` extension, with ``negatives`` (mode,
depth, seed) saying how a retriever behind the server fills the noisy slots with corpus negatives. A server
that honours noise says so in ``/health`` (``"noise"``) and marks every document of a noisy request with
``noisy``; an answer without those marks (a plain Search-R1 server, an older zerosim server) is an error,
never a silently noise-free search.
"""

from __future__ import annotations

import hashlib
import logging
import math
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from zerosim.core.config import ranged
from zerosim.core.http.retry import Retryable, RetryingClient, RetryPolicy
from zerosim.core.search import Document, SearchError, SearchRequest

logger = logging.getLogger(__name__)


class Negatives(StrEnum):
    """``search.negatives``: how a real retriever (or one behind the server) fills noisy slots."""

    hard = "hard"
    random = "random"
    none = "none"


@dataclass
class HTTPConfig:
    # a server speaking the Search-R1 /retrieve API (zerosim serve retriever)
    url: str = "http://127.0.0.1:8000"
    # seconds to connect before a retry
    connect_timeout: float = ranged(2.0, ">0", "seconds")
    # seconds to wait for an answer before a retry
    read_timeout: float = ranged(60.0, ">0", "seconds")
    # attempts before the search fails with an error naming the URL
    retries: int = ranged(3, ">=1", "attempts per request, the first one included")
    # connections each training process keeps open (a server sees processes x this)
    max_connections: int = ranged(2, ">=1")
    # the server is a web search proxy: an empty result list is an answer (the policy reads "no results", counted as search/http/empty), not a malformed one
    empty_is_answer: bool = False


DEFAULT_RETRY = RetryPolicy(read_timeout=30.0)  # HTTPSearchEngine's when none is given


class HTTPSearchEngine:
    """Search through a ``POST /retrieve`` server; implements :class:`zerosim.core.search.SearchEngine`.

    Args:
        url: the server's base URL (``http://host:8000``) or its retrieve URL (``http://host:8000/retrieve``).
        retry: timeouts, attempts and backoff (:class:`~zerosim.core.http.retry.RetryPolicy`; ``read_timeout``
            30 s by default, a simulator behind the server may need more). ``retries`` counts the attempts of
            one search: connection errors, timeouts, 5xx answers, invalid JSON and malformed answers are
            retried; a 4xx answer (a bad request) is not.
        check_health: ask ``GET /health`` at construction. A connection failure there raises
            :class:`SearchError`; a 404 (a plain Search-R1 server has no ``/health``) only warns.
        send_training_fields: send each request's ``question``, ``answers`` and ``noise`` along (the server's
            extension fields, for a simulator behind it; a Search-R1 server ignores them).
        max_connections: connections this process keeps open to the server. Every training rank holds its
            own engine, so a shared server sees at most ``ranks x max_connections``.
        negatives: how a retriever behind the server fills noisy slots (``search.negatives``): ``hard``
            (ranks ``k+1 .. negatives_depth``), ``random`` (corpus draws) or ``none`` (not at all: only an
            engine that writes noisy documents itself, a simulator, honours noise then).
        negatives_depth: ``negatives=hard``: how deep the server retrieves for the noisy slots.
        seed: seeds the server's random negatives (the same request gets the same negatives).
        empty_is_answer: an empty result list is the server's answer (a web search proxy found nothing),
            counted in ``stats["empty"]``; otherwise it is malformed and retried, then an error.
    """

    metrics_name = "http"  # stats logged as search/http/<counter>

    def __init__(
        self,
        url: str,
        *,
        retry: RetryPolicy = DEFAULT_RETRY,
        check_health: bool = True,
        send_training_fields: bool = True,
        max_connections: int = 2,
        negatives: str = "hard",
        negatives_depth: int = 30,
        seed: int = 0,
        empty_is_answer: bool = False,
    ):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"search server url {url!r} must look like http://HOST:PORT[/retrieve]")
        if negatives not in tuple(Negatives):
            raise ValueError(f"negatives={negatives!r} is not one of {', '.join(Negatives)}")
        if negatives_depth < 1:
            raise ValueError(f"negatives_depth={negatives_depth} must be at least 1")
        base = url.rstrip("/")
        if base.endswith("/retrieve"):
            base = base[: -len("/retrieve")]
        self.base_url = base
        self.retrieve_url = f"{base}/retrieve"
        self.health_url = f"{base}/health"
        self.retry = retry
        self.send_training_fields = send_training_fields
        self.negatives = negatives
        self.negatives_depth = negatives_depth
        self.seed = seed
        self.empty_is_answer = empty_is_answer
        self.stats: Counter[str] = Counter()
        self._http = RetryingClient("search server", retry, max_connections=max_connections, log=logger)
        self.server_info: dict[str, Any] | None = None  # the /health answer, when the server has one
        if check_health:
            try:
                self.server_info = self._check_health()
            except BaseException:
                self.close()
                raise

    # -- public API ---------------------------------------------------------------------------------

    @property
    def honours_noise(self) -> bool:
        """Whether noisy slots asked for come back noisy (what ``/health`` said the server does)."""
        return self.noise_problem() is None

    def noise_problem(self) -> str | None:
        """Why this client and server cannot honour curriculum noise, or ``None`` when they can."""
        if not self.send_training_fields:
            return "send_training_fields=False: the noise pattern is not sent"
        info = self.server_info
        if info is None:
            return (
                f"search server {self.base_url} has no /health (a plain Search-R1 server?) or was not asked"
                " (check_health=False), so nothing says it honours noise"
            )
        noise = info.get("noise")
        if noise == "engine":  # the engine writes noisy documents itself (a simulator)
            return None
        if noise == "negatives":
            modes = info.get("negatives") or []
            if self.negatives in modes:
                return None
            return (
                f"search server {self.base_url} fills noisy slots with corpus negatives "
                f"({', '.join(modes) or 'no mode'}), not with negatives={self.negatives}"
            )
        return (
            f"search server {self.base_url} does not say it honours noise (its /health has no 'noise': "
            "a zerosim server older than this client?)"
        )

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        """One POST carrying every query; ``k`` documents (at most) per request, in order."""
        if k < 1:
            raise ValueError(f"k={k} must be at least 1")
        if not requests:
            return []
        payload = self._payload(requests, k)
        # queries whose noisy slots the server must honour (and mark): checked in every answer
        noisy = [self.send_training_fields and any(r.noise_for(k)) for r in requests]
        return self._http.with_retries(self.retrieve_url, lambda: self._retrieve_once(payload, noisy, k))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HTTPSearchEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        retry = self.retry
        return f"HTTPSearchEngine({self.retrieve_url!r}, retries={retry.retries}, read_timeout={retry.read_timeout})"

    # -- one attempt ----------------------------------------------------------------------------------

    def _payload(self, requests: Sequence[SearchRequest], k: int) -> dict[str, Any]:
        payload: dict[str, Any] = {"queries": [r.query for r in requests], "topk": k, "return_scores": True}
        if self.send_training_fields:
            # only when a request has them, so a plain retrieval call stays a plain Search-R1 call
            if any(r.question is not None for r in requests):
                payload["questions"] = [r.question for r in requests]
            if any(r.answers for r in requests):
                payload["answers"] = [list(r.answers) for r in requests]
            if any(r.noise is not None for r in requests):
                payload["noise"] = [list(r.noise_for(k)) if r.noise is not None else None for r in requests]
                payload["negatives"] = {
                    "mode": self.negatives,
                    "depth": self.negatives_depth,
                    "seed": self.seed,
                }
        return payload

    def _retrieve_once(self, payload: dict[str, Any], noisy: list[bool], k: int) -> list[list[Document]]:
        response = self._http.send("POST", self.retrieve_url, json=payload)
        self._http.raise_for_status(response, self.retrieve_url)
        data = self._http.json(response)
        results = _parse_result(data, len(noisy), k, empty_is_answer=self.empty_is_answer)
        self.stats["empty"] += sum(not docs for docs in results)
        for qi, (asked, docs) in enumerate(zip(noisy, results, strict=True)):
            if asked and any(d.noisy is None for d in docs):
                # not retried: the same server ignores the same request again
                raise SearchError(
                    f"search server {self.retrieve_url} ignored the noise asked for query {qi}: its documents "
                    "carry no 'noisy' mark (a plain Search-R1 server, or a zerosim server older than this "
                    "client). Serve the index with this version's `zerosim serve retriever` (it fills noisy "
                    "slots with corpus negatives), or train without noise "
                    "(curriculum.p_start=0 curriculum.p_end=0)"
                )
        return results

    def _check_health(self) -> dict[str, Any] | None:
        def attempt() -> dict[str, Any] | None:
            response = self._http.send("GET", self.health_url)
            if response.status_code == 404:
                warnings.warn(
                    f"search server {self.base_url} has no /health (a plain Search-R1 server?); "
                    "continuing without a health check",
                    stacklevel=5,  # the caller of HTTPSearchEngine(...)
                )
                return None
            self._http.raise_for_status(response, self.health_url)
            data = self._http.json(response)
            if not isinstance(data, dict) or data.get("status") != "ok":
                raise Retryable(f"/health answered {str(data)[:200]!r}, not status ok")
            return data

        return self._http.with_retries(self.health_url, attempt)


# -- parsing an answer (pure functions) -----------------------------------------------------------------


def _parse_result(
    data: Any, n_queries: int, k: int, *, empty_is_answer: bool = False
) -> list[list[Document]]:
    """``{"result": [[entry, ...] per query]}`` → documents; a malformed answer raises :class:`Retryable` (an
    empty list for a query too, unless ``empty_is_answer``: a web proxy's "no results").

    An entry is ``{"document": {...}, "score": x}`` (``return_scores``) or the document itself.
    """
    if not isinstance(data, dict) or "result" not in data:
        raise Retryable(f"malformed answer: no 'result' key in {str(data)[:200]!r}")
    result = data["result"]
    if not isinstance(result, list) or len(result) != n_queries:
        got = len(result) if isinstance(result, list) else type(result).__name__
        raise Retryable(f"malformed answer: {got} result lists for {n_queries} queries")
    out = []
    for qi, entries in enumerate(result):
        if not isinstance(entries, list) or (not entries and not empty_is_answer):
            raise Retryable(
                f"malformed answer: no documents for query {qi} (an empty result is not an answer)"
            )
        if len(entries) > k:
            raise Retryable(f"malformed answer: {len(entries)} documents for query {qi} but topk={k}")
        out.append([_parse_entry(entry, qi, rank) for rank, entry in enumerate(entries)])
    return out


def _parse_entry(entry: Any, qi: int, rank: int) -> Document:
    where = f"query {qi}, document {rank}"
    if not isinstance(entry, dict):
        raise Retryable(f"malformed answer: {where} is {type(entry).__name__}, not an object")
    doc, score = (
        (entry["document"], entry.get("score")) if "document" in entry else (entry, entry.get("score"))
    )
    if not isinstance(doc, dict):
        raise Retryable(f"malformed answer: {where} has a non-object 'document'")
    contents = doc.get("contents")
    if not isinstance(contents, str):
        raise Retryable(f"malformed answer: {where} has no 'contents' string")
    if score is not None and (isinstance(score, bool) or not isinstance(score, int | float)):
        raise Retryable(f"malformed answer: {where} has score {score!r}, not a number")
    noisy = doc.get("noisy")
    if noisy is not None and not isinstance(noisy, bool):
        raise Retryable(f"malformed answer: {where} has noisy={noisy!r}, not a bool or null")
    doc_id = doc.get("id")
    if doc_id is None:
        # Search-R1's BM25 server sends no id; a content hash keeps "same document" meaningful
        doc_id = "sha1-" + hashlib.sha1(contents.encode("utf-8"), usedforsecurity=False).hexdigest()[:16]
    score = float(score) if score is not None and math.isfinite(score) else None
    document = Document.from_contents(str(doc_id), contents, score)
    return replace(document, noisy=noisy) if noisy is not None else document

"""``search.engine=web``: a web search API as the engine — the baseline ZeroSearch measured its simulator against.

Each provider is one small adapter in :data:`PROVIDERS` (how a query becomes a request, how an answer becomes
ranked hits, which answers mean "the quota is used up", its list price): Serper (Google), SerpAPI (Google and
Bing), Brave and Tavily. Every provider's hits become the same :class:`~zerosim.core.search.Document` (title,
snippet as text, the URL as id, in rank order), at most ``k``.

What the web adds over a local retriever, and how it is bounded:

- **The key** comes from an environment variable (``search.web.api_key_env``) into a
  :class:`~zerosim.core.secrets.Secret`; it goes into one header or parameter of each request and nowhere else.
  Every error message built from a server's answer passes :func:`~zerosim.core.secrets.redact`.
- **Faults are named**: a rejected key (401/403) stops the run naming the provider and the variable
  (:class:`WebAuthError`); a used-up quota (402, and each provider's own codes) stops naming the quota
  (:class:`WebQuotaError`), or hands every later search to ``search.web.fallback`` (counted); a 429 is retried
  after its ``Retry-After`` (at most ``search.web.max_retry_after``); timeouts, 5xx and malformed bodies are
  retried a bounded number of times and then fail in one line naming the provider.
- **An empty result is an answer**: "no results" (the policy reads it, :data:`~zerosim.core.search.NO_RESULTS`),
  counted as ``search/web/empty``; never an error, never a silent hole.
- **Cost**: every query goes through :class:`~zerosim.core.search_cache.CachedSearchEngine` (memory and an sqlite
  file shared across runs, keyed by provider, endpoint, query and depth; empty answers kept too), so a replay
  makes zero requests; requests are paced (``requests_per_second``) and bounded in flight
  (``max_concurrency``); :meth:`WebSearchEngine.ledger` counts requests, cache hits and their estimated cost.
- **The curriculum**: noisy slots take results of the same query ranked below ``k`` (``search.negatives=hard``:
  ask for ``negatives_depth``, up to the provider's most per request) or results other queries returned
  (``random``), each falling back on the other, never a result holding a gold answer.
"""

from __future__ import annotations

import hashlib
import html
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from zerosim.core.http.retry import Retryable, RetryingClient, RetryPolicy, error_message, retry_after
from zerosim.core.metrics import answer_in_text
from zerosim.core.search import Document, SearchEngine, SearchError, SearchRequest
from zerosim.core.search_cache import CachedSearchEngine
from zerosim.core.secrets import Secret, redact

logger = logging.getLogger(__name__)

# the month the list prices below were taken as; a price set in search.web.price_per_1k replaces them
PRICE_DATE = "2026-12"
DEFAULT_RETRY = RetryPolicy(connect_timeout=5.0, read_timeout=20.0, backoff=1.0)  # search.web's defaults
POOL_SIZE = 20000  # results of earlier queries kept for random negatives (oldest dropped first)


class WebAuthError(SearchError):
    """The provider rejected the API key: not retried, the run stops."""


class WebQuotaError(SearchError):
    """The provider says the account's quota or credit is used up: the run stops, or falls back."""


class Malformed(ValueError):
    """A 2xx body a provider adapter cannot read."""


@dataclass(frozen=True)
class Hit:
    """One web result, as every provider's answer becomes."""

    title: str
    snippet: str
    url: str


@dataclass(frozen=True)
class Provider:
    """One web search API: what it is called, where it answers, how a query is asked and an answer read.

    ``request(query, n, key)`` gives the ``httpx`` request's keyword arguments (``params``/``json`` and
    ``headers``); ``parse(body)`` gives the ranked hits (``[]``: the API found nothing) or raises
    :class:`Malformed`; ``quota(status, message)`` tells a used-up quota from other refusals.
    """

    name: str
    label: str
    endpoint: str
    method: str
    key_env: str
    max_results: int  # most results one request returns
    price_per_1k: float  # US dollars per 1,000 requests, entry paid tier (PRICE_DATE)
    request: Callable[[str, int, str], dict[str, Any]]
    parse: Callable[[Any], list[Hit]]
    quota: Callable[[int, str], bool]
    auth: Callable[[int, str], bool] = lambda status, message: status in (401, 403)


_TAG = re.compile(r"<[^>]+>")


def _text(value: Any) -> str:
    """A provider's string field as plain text (Brave marks matches with ``<strong>``; entities unescaped)."""
    return " ".join(html.unescape(_TAG.sub("", value)).split()) if isinstance(value, str) else ""


def _hits(entries: Any, where: str, title: str, snippet: str, url: str) -> list[Hit]:
    if not isinstance(entries, list):
        raise Malformed(f"'{where}' is {type(entries).__name__}, not a list")
    hits = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get(url), str) or not entry[url]:
            raise Malformed(f"{where}[{i}] has no '{url}' string")
        hits.append(Hit(title=_text(entry.get(title)), snippet=_text(entry.get(snippet)), url=entry[url]))
    return hits


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise Malformed(f"the body is {type(body).__name__}, not a JSON object")
    return body


# -- the providers (request and answer shapes from each one's public API reference) ---------------------------


def _serper_parse(body: Any) -> list[Hit]:
    body = _object(body)
    if "organic" not in body:
        if "searchParameters" in body:  # an answer that found no web page
            return []
        raise Malformed("no 'organic' results and no 'searchParameters'")
    return _hits(body["organic"], "organic", "title", "snippet", "link")


def _serpapi_request(engine: str) -> Callable[[str, int, str], dict[str, Any]]:
    count = "num" if engine == "google" else "count"
    return lambda q, n, key: {
        "params": {"engine": engine, "q": q, count: n, "api_key": key, "output": "json"}
    }


_NO_RESULTS = re.compile(r"hasn't returned any results|no results", re.IGNORECASE)


def _serpapi_parse(body: Any) -> list[Hit]:
    body = _object(body)
    if "organic_results" in body:
        return _hits(body["organic_results"], "organic_results", "title", "snippet", "link")
    info = body.get("search_information")
    state = info.get("organic_results_state") if isinstance(info, dict) else None
    if state == "Fully empty" or _NO_RESULTS.search(str(body.get("error") or "")):
        return []  # SerpAPI: a search that found nothing is a success with an "error" saying so
    if body.get("error"):
        raise Malformed(f"an error without results: {str(body['error'])[:200]}")
    raise Malformed("no 'organic_results'")


def _brave_parse(body: Any) -> list[Hit]:
    body = _object(body)
    web = body.get("web")
    if web is None:
        if body.get("type") == "search":  # an answer without a web section: nothing found
            return []
        raise Malformed("no 'web' section and not a search answer")
    if not isinstance(web, dict):
        raise Malformed(f"'web' is {type(web).__name__}, not an object")
    return _hits(web.get("results", []), "web.results", "title", "description", "url")


def _tavily_parse(body: Any) -> list[Hit]:
    body = _object(body)
    if "results" not in body:
        raise Malformed("no 'results'")
    return _hits(body["results"], "results", "title", "content", "url")


def _says(message: str, *words: str) -> bool:
    low = message.lower()
    return any(w in low for w in words)


PROVIDERS: dict[str, Provider] = {
    "serper": Provider(
        name="serper",
        label="Serper (Google)",
        endpoint="https://google.serper.dev/search",
        method="POST",
        key_env="SERPER_API_KEY",
        max_results=100,
        price_per_1k=1.00,
        request=lambda q, n, key: {"json": {"q": q, "num": n}, "headers": {"X-API-KEY": key}},
        parse=_serper_parse,
        quota=lambda status, message: status == 402 or (status in (400, 403) and _says(message, "credit")),
    ),
    "serpapi_google": Provider(
        name="serpapi_google",
        label="SerpAPI (Google)",
        endpoint="https://serpapi.com/search.json",
        method="GET",
        key_env="SERPAPI_API_KEY",
        max_results=100,
        price_per_1k=15.00,
        request=_serpapi_request("google"),
        parse=_serpapi_parse,
        quota=lambda status, message: status == 402 or (status == 429 and _says(message, "run out", "plan")),
    ),
    "serpapi_bing": Provider(
        name="serpapi_bing",
        label="SerpAPI (Bing)",
        endpoint="https://serpapi.com/search.json",
        method="GET",
        key_env="SERPAPI_API_KEY",
        max_results=50,
        price_per_1k=15.00,
        request=_serpapi_request("bing"),
        parse=_serpapi_parse,
        quota=lambda status, message: status == 402 or (status == 429 and _says(message, "run out", "plan")),
    ),
    "brave": Provider(
        name="brave",
        label="Brave Search",
        endpoint="https://api.search.brave.com/res/v1/web/search",
        method="GET",
        key_env="BRAVE_API_KEY",
        max_results=20,
        price_per_1k=5.00,
        request=lambda q, n, key: {
            "params": {"q": q, "count": n},
            "headers": {"X-Subscription-Token": key, "Accept": "application/json"},
        },
        parse=_brave_parse,
        quota=lambda status, message: status == 402 or (status == 429 and _says(message, "quota")),
        auth=lambda status, message: (
            status in (401, 403) or (status == 422 and _says(message, "subscription_token", "token"))
        ),
    ),
    "tavily": Provider(
        name="tavily",
        label="Tavily",
        endpoint="https://api.tavily.com/search",
        method="POST",
        key_env="TAVILY_API_KEY",
        max_results=20,
        price_per_1k=8.00,
        request=lambda q, n, key: {
            "json": {"query": q, "max_results": n, "search_depth": "basic"},
            "headers": {"Authorization": f"Bearer {key}"},
        },
        parse=_tavily_parse,
        quota=lambda status, message: status in (402, 432, 433),
    ),
}


def document(hit: Hit) -> Document:
    """A web hit as the project's document: the URL names it (a content hash of it as the id), the snippet is
    its text."""
    digest = hashlib.sha1(hit.url.encode("utf-8"), usedforsecurity=False).hexdigest()[:16]
    return Document(id=f"web-{digest}", title=hit.title or hit.url, text=hit.snippet)


class _Pace:
    """At most ``rate`` request starts per second across this process's threads (``None``: unbounded)."""

    def __init__(self, rate: float | None):
        self.interval = 0.0 if rate is None else 1.0 / rate
        self._next = 0.0
        self._lock = threading.Lock()

    def wait(self) -> None:
        if not self.interval:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + self.interval
        if start > now:
            time.sleep(start - now)


class _Fetch:
    """The provider's ranked documents for plain queries (a :class:`SearchEngine` over ``request.query`` alone):
    what the cache wraps. One request per query, ``max_concurrency`` in flight, paced."""

    def __init__(self, web: WebSearchEngine):
        self.web = web

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        queries = [r.query for r in requests]
        if len(queries) == 1:
            return [self.web._one(queries[0], k)]
        with ThreadPoolExecutor(max_workers=min(self.web.max_concurrency, len(queries))) as pool:
            return list(pool.map(lambda q: self.web._one(q, k), queries))


class WebSearchEngine:
    """A web search API behind the :class:`~zerosim.core.search.SearchEngine` protocol (see the module).

    Args:
        provider: the adapter (:data:`PROVIDERS`).
        key: the API key (:func:`~zerosim.core.secrets.secret_from_env`).
        endpoint: the API's URL (a proxy, a local replay server); the provider's own when ``None``.
        retry: timeouts, attempts and backoff; ``max_retry_after``: the longest ``Retry-After`` waited.
        max_concurrency / requests_per_second: in flight at once, and request starts per second.
        price_per_1k: US dollars per 1,000 requests for :meth:`ledger` (the provider's list price when ``None``).
        negatives / negatives_depth / seed: how noisy slots are filled (``hard``, ``random``, ``none``).
        cache_size / cache_path: the result cache (memory entries; the sqlite file, ``None``: memory only).
        fallback: builds the retriever that answers every search once the quota is used up (``None``: stop).
    """

    metrics_name = "web"  # counters logged as search/web/<counter>
    empty_is_answer = True  # "no results" is an answer the policy reads (zerosim.core.search.answers_empty)

    def __init__(
        self,
        provider: Provider,
        key: Secret,
        *,
        endpoint: str | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        max_retry_after: float = 20.0,
        max_concurrency: int = 4,
        requests_per_second: float | None = 5.0,
        price_per_1k: float | None = None,
        negatives: str = "hard",
        negatives_depth: int = 30,
        seed: int = 0,
        cache_size: int = 100000,
        cache_path: str | Path | None = None,
        fallback: Callable[[], SearchEngine] | None = None,
        key_setting: str = "search.web.api_key_env",
    ):
        if negatives not in ("hard", "random", "none"):
            raise ValueError(f"negatives={negatives!r} is not one of hard, random, none")
        self.provider = provider
        self._key = key
        self.key_setting = key_setting
        self.endpoint = endpoint or provider.endpoint
        self.retry = retry
        self.max_retry_after = max_retry_after
        self.max_concurrency = max_concurrency
        self.price_per_1k = provider.price_per_1k if price_per_1k is None else price_per_1k
        self.price_source = PRICE_DATE if price_per_1k is None else "search.web.price_per_1k"
        self.negatives = negatives
        self.negatives_depth = negatives_depth
        self.seed = seed
        self._pace = _Pace(requests_per_second)
        self._counts: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        self._pool: list[tuple[str, Document]] = []  # (query, document) of earlier answers
        self._fallback_builder = fallback
        self._fallback: SearchEngine | None = None
        self._http = RetryingClient(f"web search ({provider.label})", retry, max_connections=max_concurrency)
        self._cache = CachedSearchEngine(
            _Fetch(self),
            max_entries=cache_size,
            sqlite_path=cache_path,
            key_extra={"web": provider.name, "endpoint": self.endpoint},
            keep_empty=True,
            setting="search.web.cache_path",
        )

    # -- the SearchEngine protocol ---------------------------------------------------------------------------

    @property
    def honours_noise(self) -> bool:
        """Noisy slots come back as other web results marked noisy (``zerosim.engines.noise_problem``)."""
        return self.negatives != "none"

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        if k < 1:
            raise ValueError(f"k={k} must be at least 1")
        if not requests:
            return []
        if self._fallback is not None:
            return self._fall_back(requests, k)
        patterns = [r.noise_for(k) for r in requests]
        noisy = self.honours_noise and any(any(p) for p in patterns)
        depth = min(max(k, self.negatives_depth), self.provider.max_results) if noisy else k
        try:
            ranked = self._cache.search([SearchRequest(query=r.query) for r in requests], depth)
        except WebQuotaError as exc:
            if self._fallback_builder is None:
                raise
            logger.warning("%s; search.web.fallback answers every later search", exc)
            self._fallback = self._fallback_builder()
            return self._fall_back(requests, k)
        out = []
        for request, pattern, docs in zip(requests, patterns, ranked, strict=True):
            if not docs:
                self._count("empty")
                out.append([])
            elif noisy and any(pattern):
                out.append(self._with_negatives(request, pattern, docs, k))
            else:
                out.append(list(docs[:k]))
        self._remember(requests, ranked)
        return out

    @property
    def stats(self) -> dict[str, float]:
        """Running counters (``search/web/<counter>``): requests sent and answered, cache hits, empty answers,
        searches the fallback answered, and the estimated cost in US dollars."""
        with self._count_lock:
            counts = dict(self._counts)
        requests = counts.get("requests", 0)
        return {
            "requests": requests,
            "cache_hits": self._cache.stats["hits"],
            "empty": counts.get("empty", 0),
            "fallback": counts.get("fallback", 0),
            "cost_usd": requests * self.price_per_1k / 1000,
        }

    def ledger(self) -> dict[str, Any]:
        """What the web cost so far: the counters of :attr:`stats`, the provider and the price they assume."""
        return {
            "provider": self.provider.label,
            **self.stats,
            "price_per_1k": self.price_per_1k,
            "price_source": self.price_source,
        }

    def close(self) -> None:
        self._cache.close()  # closes its sqlite file (the fetcher under it has nothing to close)
        self._http.close()
        if self._fallback is not None and callable(getattr(self._fallback, "close", None)):
            self._fallback.close()

    def __repr__(self) -> str:
        return f"WebSearchEngine({self.provider.label}, {self.endpoint!r}, key={self._key!r})"

    # -- one query --------------------------------------------------------------------------------------------

    def _one(self, query: str, n: int) -> list[Document]:
        """One request for ``query``'s top ``n``, retried as the policy says; errors redacted."""
        provider = self.provider

        def attempt() -> list[Document]:
            self._pace.wait()
            response = self._http.send(
                provider.method, self.endpoint, **provider.request(query, n, self._key.reveal())
            )
            status = response.status_code
            if status >= 300:
                self._refuse(response)
            body = self._http.json(response)
            try:
                hits = provider.parse(body)
            except Malformed as exc:
                raise Retryable(f"{provider.label} answered a body it cannot read: {exc}") from None
            self._count("requests")
            return [document(h) for h in hits[:n]]

        try:
            return self._http.with_retries(self.endpoint, attempt)
        except SearchError as exc:
            raise type(exc)(redact(str(exc))) from None

    def _refuse(self, response) -> None:
        """A non-2xx answer as the error it means (see the module)."""
        provider, status = self.provider, response.status_code
        message = redact(error_message(response))
        env = f"${self._key.name} ({self.key_setting})"
        if provider.quota(status, message):
            raise WebQuotaError(
                f"{provider.label}: the account's quota is used up (HTTP {status}: {message}). Top up or "
                "raise the plan, or set search.web.fallback=bm25|dense|hybrid|http to let a local retriever "
                "answer the rest of the run (counted as search/web/fallback)"
            )
        if provider.auth(status, message):
            raise WebAuthError(
                f"{provider.label} rejected the API key in {env} (HTTP {status}: {message}): export a valid "
                f"key in {self._key.name}, or name the variable holding one with {self.key_setting}"
            )
        if status == 429:
            wait = retry_after(response.headers.get("Retry-After"))
            if wait is not None and wait > self.max_retry_after:
                raise SearchError(
                    f"{provider.label} asks to wait {wait:g}s before the next request (HTTP 429, Retry-After), "
                    f"more than search.web.max_retry_after={self.max_retry_after:g}s: lower "
                    "search.web.requests_per_second or search.web.max_concurrency, or raise max_retry_after"
                )
            raise Retryable(f"HTTP 429 (rate limited): {message}", retry_after=wait)
        if status >= 500:
            raise Retryable(f"HTTP {status}: {message}")
        raise SearchError(f"{provider.label} refused the request (HTTP {status}, not retried): {message}")

    # -- the curriculum's noisy slots -------------------------------------------------------------------------

    def _with_negatives(
        self, request: SearchRequest, pattern: tuple[bool, ...], docs: list[Document], k: int
    ) -> list[Document]:
        """The useful slots from the top of ``docs``, the noisy ones from its ranks below ``k`` (hard) or from
        other queries' results (random), each mode falling back on the other; a gold answer never."""

        def helps(d: Document) -> bool:
            return bool(request.answers) and answer_in_text(d.contents, request.answers)

        own = {d.id for d in docs}
        deep = [d for d in docs[k:] if not helps(d)]
        with self._count_lock:
            others = [d for q, d in self._pool if q != request.query and d.id not in own and not helps(d)]
        key = f"{self.seed}\x00{request.query}\x00{request.question or ''}".encode()
        rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
        others = [others[i] for i in rng.permutation(len(others))]
        candidates, seen = (deep + others if self.negatives == "hard" else others + deep), set()
        negatives = []
        for d in candidates:
            if d.id not in seen:
                seen.add(d.id)
                negatives.append(d)
        n_noisy = sum(pattern)
        if len(negatives) < n_noisy:
            raise SearchError(
                f"web search found {len(negatives)} of {n_noisy} negatives for query {request.query!r} "
                f"(none may hold a gold answer): raise search.negatives_depth (now {self.negatives_depth}, "
                f"{self.provider.label} gives at most {self.provider.max_results})"
            )
        useful, noisy = iter(docs[: k - n_noisy]), iter(negatives)
        out = []
        for slot in pattern:
            doc = next(noisy) if slot else next(useful, None)
            if doc is not None:
                out.append(replace(doc, noisy=slot))
        return out

    def _remember(self, requests: Sequence[SearchRequest], ranked: list[list[Document]]) -> None:
        with self._count_lock:
            known = {d.id for _, d in self._pool}
            for request, docs in zip(requests, ranked, strict=True):
                for d in docs:
                    if d.id not in known:
                        known.add(d.id)
                        self._pool.append((request.query, d))
            del self._pool[: max(0, len(self._pool) - POOL_SIZE)]

    # -- the fallback -----------------------------------------------------------------------------------------

    def _fall_back(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        self._count("fallback", len(requests))
        return self._fallback.search(requests, k)

    def _count(self, name: str, n: int = 1) -> None:
        with self._count_lock:
            self._counts[name] += n


def describe_ledger(ledger: dict[str, Any]) -> str:
    """One line for a ledger (:meth:`WebSearchEngine.ledger`): what the web was asked and what it cost."""
    source = ledger["price_source"]
    price = f"list price of {source}" if source == PRICE_DATE else source
    fallback = f", {ledger['fallback']} answered by the fallback" if ledger["fallback"] else ""
    return (
        f"web search: {ledger['provider']}, {ledger['requests']} requests, {ledger['cache_hits']} cache hits, "
        f"{ledger['empty']} empty{fallback}; est. ${ledger['cost_usd']:.4f} "
        f"(${ledger['price_per_1k']:.2f} per 1,000 requests, {price})"
    )

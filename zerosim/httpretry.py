"""Bounded-retry HTTP plumbing shared by the HTTP clients (:mod:`zerosim.http_search`, ``simulators.backends``).

A :class:`RetryingClient` owns one ``httpx.Client``. An attempt raises :class:`Retryable` when another attempt
may fix what went wrong (connection errors, timeouts, 5xx answers, invalid JSON, malformed answers); a 4xx
answer raises :class:`~zerosim.search.SearchError` at once. :meth:`RetryingClient.with_retries` runs an attempt
up to ``retries`` times with capped exponential backoff, then raises :class:`~zerosim.search.SearchError`
naming the server (its ``label``), the URL, the attempts and the last problem.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

from zerosim.search import SearchError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Retryable(Exception):
    """One attempt failed in a way another attempt may fix (the message says how)."""


def check_settings(
    connect_timeout: float, read_timeout: float, retries: int, backoff: float, max_backoff: float
) -> None:
    """Refuse settings :class:`RetryingClient` cannot work with (``ValueError`` naming them)."""
    if retries < 1:
        raise ValueError(f"retries={retries} must be at least 1 (it counts attempts in all)")
    if connect_timeout <= 0 or read_timeout <= 0:
        raise ValueError(
            f"timeouts must be positive (connect_timeout={connect_timeout}, read_timeout={read_timeout})"
        )
    if backoff < 0 or max_backoff < 0:
        raise ValueError(f"backoff={backoff} and max_backoff={max_backoff} must not be negative")


class RetryingClient:
    """An ``httpx.Client`` plus the retry loop and the error messages of one kind of server.

    Args:
        label: what the server is, as error messages name it (``"search server"``, ``"simulator server"``).
        connect_timeout: seconds to wait for a TCP connection (also the write timeout: sending a request
            body is quick).
        read_timeout: seconds to wait for the answer once the request is sent; also how long a request may
            wait for a free connection when ``limits`` are reached (that is waiting for another answer).
        retries: attempts in all (1 = no retry).
        backoff: seconds slept before the second attempt; doubled before each later one.
        max_backoff: upper bound on one sleep.
        on_retry: called once before each retry (after a failed attempt, before the sleep).
        limits: connection limits for the ``httpx.Client`` (its defaults when ``None``).
        log: the logger failed attempts are reported to (this module's when ``None``).
    """

    def __init__(
        self,
        label: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        retries: int,
        backoff: float,
        max_backoff: float,
        on_retry: Callable[[], None] | None = None,
        limits: httpx.Limits | None = None,
        log: logging.Logger | None = None,
    ):
        check_settings(connect_timeout, read_timeout, retries, backoff, max_backoff)
        self.label = label
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.on_retry = on_retry
        self.log = log or logger
        timeout = httpx.Timeout(
            connect=connect_timeout, read=read_timeout, write=connect_timeout, pool=read_timeout
        )
        options = {"limits": limits} if limits is not None else {}  # else httpx's default limits
        self.client = httpx.Client(timeout=timeout, **options)

    def send(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """One request; a transport failure (connect, timeout, reset, ...) raises :class:`Retryable`."""
        try:
            return self.client.request(method, url, **kwargs)
        except httpx.ConnectTimeout as exc:
            raise Retryable(f"connect timed out after connect_timeout={self.connect_timeout}s") from exc
        except httpx.ReadTimeout as exc:
            raise Retryable(f"no answer within read_timeout={self.read_timeout}s (timed out)") from exc
        except httpx.TimeoutException as exc:
            raise Retryable(f"timed out ({type(exc).__name__})") from exc
        except httpx.ConnectError as exc:
            raise Retryable(f"cannot connect ({reason(exc)})") from exc
        except httpx.TransportError as exc:  # connection reset, protocol error, ...
            raise Retryable(f"{type(exc).__name__}: {reason(exc)}") from exc

    def raise_for_status(self, response: httpx.Response, url: str) -> None:
        """A 4xx answer raises :class:`SearchError` (not retried), a 5xx one :class:`Retryable`."""
        status = response.status_code
        if status < 300:
            return
        message = error_message(response)
        if 400 <= status < 500:
            raise SearchError(
                f"{self.label} {url} rejected the request (HTTP {status}, not retried): {message}"
            )
        raise Retryable(f"HTTP {status}: {message}")

    @staticmethod
    def json(response: httpx.Response) -> Any:
        """The answer's JSON; a body that is not JSON raises :class:`Retryable`."""
        try:
            return response.json()
        except ValueError as exc:
            raise Retryable(f"invalid JSON answer ({exc}): {response.text[:200]!r}") from exc

    def with_retries(self, url: str, attempt: Callable[[], T]) -> T:
        """Run ``attempt`` up to ``self.retries`` times, sleeping ``backoff * 2**i`` (capped) in between."""
        problem = ""
        for i in range(self.retries):
            if i:
                if self.on_retry is not None:
                    self.on_retry()
                time.sleep(min(self.max_backoff, self.backoff * 2 ** (i - 1)))
            try:
                return attempt()
            except Retryable as exc:
                problem = str(exc)
                self.log.warning("%s %s, attempt %d/%d: %s", self.label, url, i + 1, self.retries, problem)
        plural = "attempt" if self.retries == 1 else "attempts"
        raise SearchError(f"{self.label} {url} did not answer after {self.retries} {plural}: {problem}")

    def close(self) -> None:
        self.client.close()


def error_message(response: httpx.Response) -> str:
    """What an error answer says: OpenAI-style ``{"error": {"message": ...}}``, else its ``error`` (zerosim),
    ``detail`` (FastAPI) or ``message`` field, else the start of the body."""
    try:
        data = response.json()
    except ValueError:
        return response.text[:200] or response.reason_phrase
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:500]
        for key in ("error", "detail", "message"):
            if data.get(key):
                return str(data[key])[:500]
    return str(data)[:200]


def reason(exc: Exception) -> str:
    """A transport error in a few words (``connection refused`` for the common case)."""
    text = str(exc)
    if "Connection refused" in text or "Errno 111" in text:
        return "connection refused"
    return text or type(exc).__name__

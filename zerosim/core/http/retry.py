"""Bounded-retry HTTP plumbing shared by the HTTP clients (:mod:`zerosim.core.http.client`, ``simulators.backends``).

A :class:`RetryingClient` owns one ``httpx.Client`` and runs by a :class:`RetryPolicy` (timeouts, attempts and
backoff, which every client here takes as one object and a config section gives through :meth:`RetryPolicy.of`).
An attempt raises :class:`Retryable` when another attempt may fix what went wrong (connection errors,
timeouts, 5xx answers, 429 "too many requests", invalid JSON, malformed answers); any other 4xx answer raises
:class:`~zerosim.core.search.SearchError` at once. :meth:`RetryingClient.with_retries` runs an attempt up to
``retries`` times with capped exponential backoff, then raises :class:`~zerosim.core.search.SearchError` naming
the server (its ``label``), the URL, the attempts and the last problem. A 429 or 503 answer's
``Retry-After`` replaces the backoff before the next attempt (a busy simulator server says when its queue
will have room), up to one attempt's deadline.

Each attempt has a wall-clock deadline of ``connect_timeout + read_timeout``. httpx's own timeouts bound
each socket operation, so a server trickling one byte at a time would never trip them; here every socket
operation of an attempt (connect, send, each read, TLS handshake) is given at most the time left before
the deadline, through an httpcore network backend wrapped around the default one. One call therefore takes
at most ``retries * (connect_timeout + read_timeout)`` plus the backoff sleeps.
"""

from __future__ import annotations

import contextvars
import datetime
import email.utils
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpcore
import httpx

from zerosim.core.search import SearchError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Retryable(Exception):
    """One attempt failed in a way another attempt may fix (the message says how); ``retry_after``: the
    seconds the server asked to be left alone (its ``Retry-After``), or None."""

    def __init__(self, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


# -- the per-attempt deadline ---------------------------------------------------------------------------


class _Attempt:
    """The deadline of the attempt running in this thread (monotonic clock), and whether it expired."""

    __slots__ = ("deadline", "expired")

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.expired = False


_ATTEMPT: contextvars.ContextVar[_Attempt | None] = contextvars.ContextVar(
    "zerosim_http_attempt", default=None
)


def _within_deadline(
    operation: Callable[[float | None], T], timeout: float | None, expired: type[Exception]
) -> T:
    """Run ``operation(timeout)`` with ``timeout`` cut to the time left before this attempt's deadline."""
    attempt = _ATTEMPT.get()
    if attempt is None:  # a request outside RetryingClient.send: httpx's timeouts only
        return operation(timeout)
    left = attempt.deadline - time.monotonic()
    if left <= 0:
        attempt.expired = True
        raise expired("the attempt's deadline has passed")
    if timeout is not None and timeout < left:
        return operation(timeout)
    try:
        return operation(left)
    except httpcore.TimeoutException:
        attempt.expired = True  # the deadline, not the per-operation timeout, cut it off
        raise


class _DeadlineStream(httpcore.NetworkStream):
    """A network stream whose every operation ends by the current attempt's deadline."""

    def __init__(self, stream: httpcore.NetworkStream):
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return _within_deadline(lambda t: self._stream.read(max_bytes, t), timeout, httpcore.ReadTimeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        _within_deadline(lambda t: self._stream.write(buffer, t), timeout, httpcore.WriteTimeout)

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context, server_hostname: str | None = None, timeout: float | None = None):
        stream = _within_deadline(
            lambda t: self._stream.start_tls(ssl_context, server_hostname, t),
            timeout,
            httpcore.ConnectTimeout,
        )
        return _DeadlineStream(stream)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's network backend, its streams wrapped in :class:`_DeadlineStream`."""

    def __init__(self, backend: httpcore.NetworkBackend):
        self._backend = backend

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        stream = _within_deadline(
            lambda t: self._backend.connect_tcp(host, port, t, local_address, socket_options),
            timeout,
            httpcore.ConnectTimeout,
        )
        return _DeadlineStream(stream)

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        stream = _within_deadline(
            lambda t: self._backend.connect_unix_socket(path, t, socket_options),
            timeout,
            httpcore.ConnectTimeout,
        )
        return _DeadlineStream(stream)

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


def _deadline_transport(limits: httpx.Limits | None) -> httpx.HTTPTransport:
    """httpx's default transport with :class:`_DeadlineBackend` under its connection pool.

    httpx has no public hook for the network backend, so this reaches into the transport's pool; if a
    future httpx/httpcore lays it out differently this fails loudly here rather than losing the deadline.
    """
    transport = httpx.HTTPTransport(limits=limits) if limits is not None else httpx.HTTPTransport()
    pool = getattr(transport, "_pool", None)
    backend = getattr(pool, "_network_backend", None)
    if not isinstance(pool, httpcore.ConnectionPool) or not isinstance(backend, httpcore.NetworkBackend):
        raise RuntimeError(
            f"httpx {httpx.__version__} / httpcore {httpcore.__version__}: cannot install the per-attempt "
            "deadline (the transport has no httpcore connection pool with a network backend); "
            "install the httpx and httpcore versions pyproject.toml names"
        )
    pool._network_backend = _DeadlineBackend(backend)
    return transport


@dataclass(frozen=True)
class RetryPolicy:
    """How long a client waits for a server and how often it tries: what :class:`RetryingClient` runs by.

    Args:
        connect_timeout: seconds to wait for a TCP connection (also the write timeout: sending a request
            body is quick).
        read_timeout: seconds to wait for the answer once the request is sent. An attempt as a whole —
            waiting for a free connection, connecting, sending, reading the whole answer — ends by its
            deadline, :attr:`attempt_timeout` (``connect_timeout + read_timeout``) after it started, however
            the server paces its bytes.
        retries: attempts in all (1 = no retry).
        backoff: seconds slept before the second attempt; doubled before each later one. An answer with
            ``Retry-After`` (429, 503) is waited for that long instead, at most :attr:`attempt_timeout`.
        max_backoff: upper bound on one backoff sleep.

    Settings no client can work with raise ``ValueError`` naming them, at construction.
    """

    connect_timeout: float = 2.0
    read_timeout: float = 60.0
    retries: int = 3
    backoff: float = 0.5
    max_backoff: float = 8.0

    def __post_init__(self) -> None:
        if self.retries < 1:
            raise ValueError(f"retries={self.retries} must be at least 1 (it counts attempts in all)")
        if self.connect_timeout <= 0 or self.read_timeout <= 0:
            raise ValueError(
                f"timeouts must be positive (connect_timeout={self.connect_timeout}, "
                f"read_timeout={self.read_timeout})"
            )
        if self.backoff < 0 or self.max_backoff < 0:
            raise ValueError(
                f"backoff={self.backoff} and max_backoff={self.max_backoff} must not be negative"
            )

    @classmethod
    def of(cls, settings: Any) -> RetryPolicy:
        """The policy a config section's ``connect_timeout``, ``read_timeout``, ``retries`` and ``backoff`` keys
        give (``search.http``, ``search.simulator``, ``reward.judge``); a section without ``backoff``
        (``search.http``) gets the default."""
        return cls(
            connect_timeout=settings.connect_timeout,
            read_timeout=settings.read_timeout,
            retries=settings.retries,
            backoff=getattr(settings, "backoff", cls.backoff),
        )

    @property
    def attempt_timeout(self) -> float:
        """The wall-clock deadline of one attempt: ``connect_timeout + read_timeout``."""
        return self.connect_timeout + self.read_timeout


class RetryingClient:
    """An ``httpx.Client`` plus the retry loop and the error messages of one kind of server.

    Args:
        label: what the server is, as error messages name it (``"search server"``, ``"simulator server"``).
        retry: the timeouts, attempts and backoff sleeps (:class:`RetryPolicy`).
        on_retry: called once before each retry (after a failed attempt, before the sleep).
        max_connections: most connections the ``httpx.Client`` opens (and keeps alive); httpx's default
            limits when ``None``. Waiting for a free one counts toward an attempt's deadline.
        log: the logger failed attempts are reported to (this module's when ``None``).
    """

    def __init__(
        self,
        label: str,
        retry: RetryPolicy,
        *,
        on_retry: Callable[[], None] | None = None,
        max_connections: int | None = None,
        log: logging.Logger | None = None,
    ):
        self.label = label
        self.retry = retry
        self.on_retry = on_retry
        self.log = log or logger
        timeout = httpx.Timeout(
            connect=retry.connect_timeout,
            read=retry.read_timeout,
            write=retry.connect_timeout,
            pool=retry.attempt_timeout,
        )
        limits = (
            None
            if max_connections is None
            else httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        )
        # an explicit transport: HTTP(S)_PROXY variables are not used (the servers are on the job's network)
        self.client = httpx.Client(timeout=timeout, transport=_deadline_transport(limits))

    def send(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """One request, whole answer read, by its deadline (``connect_timeout + read_timeout`` from now).

        A transport failure (connect, timeout, deadline, reset, ...) raises :class:`Retryable`.
        """
        retry = self.retry
        attempt = _Attempt(time.monotonic() + retry.attempt_timeout)
        token = _ATTEMPT.set(attempt)
        try:
            return self.client.request(method, url, **kwargs)
        except httpx.TimeoutException as exc:
            if attempt.expired:
                raise Retryable(
                    f"no complete answer within {retry.attempt_timeout:g}s, the deadline of one attempt "
                    f"(connect_timeout={retry.connect_timeout}s + read_timeout={retry.read_timeout}s)"
                ) from exc
            raise self._timeout(exc) from exc
        except httpx.ConnectError as exc:
            raise Retryable(f"cannot connect ({reason(exc)})") from exc
        except httpx.TransportError as exc:  # connection reset, protocol error, ...
            raise Retryable(f"{type(exc).__name__}: {reason(exc)}") from exc
        finally:
            _ATTEMPT.reset(token)

    def _timeout(self, exc: httpx.TimeoutException) -> Retryable:
        if isinstance(exc, httpx.ConnectTimeout):
            return Retryable(f"connect timed out after connect_timeout={self.retry.connect_timeout}s")
        if isinstance(exc, httpx.ReadTimeout):
            return Retryable(f"no answer within read_timeout={self.retry.read_timeout}s (timed out)")
        return Retryable(f"timed out ({type(exc).__name__})")

    def raise_for_status(self, response: httpx.Response, url: str) -> None:
        """A 4xx answer raises :class:`SearchError` (not retried); a 5xx or 429 one :class:`Retryable`,
        carrying the answer's ``Retry-After``."""
        status = response.status_code
        if status < 300:
            return
        message = error_message(response)
        if 400 <= status < 500 and status != 429:
            raise SearchError(
                f"{self.label} {url} rejected the request (HTTP {status}, not retried): {message}"
            )
        wait = retry_after(response.headers.get("Retry-After"))
        asked = f" (Retry-After: {wait:g}s)" if wait is not None else ""
        raise Retryable(f"HTTP {status}{asked}: {message}", retry_after=wait)

    @staticmethod
    def json(response: httpx.Response) -> Any:
        """The answer's JSON; a body that is not JSON raises :class:`Retryable`."""
        try:
            return response.json()
        except ValueError as exc:
            raise Retryable(f"invalid JSON answer ({exc}): {response.text[:200]!r}") from exc

    def with_retries(self, url: str, attempt: Callable[[], T]) -> T:
        """Run ``attempt`` up to ``retries`` times, sleeping ``backoff * 2**i`` (capped) in between, or as
        long as the last answer's ``Retry-After`` asked (at most one attempt's deadline)."""
        retry = self.retry
        problem = ""
        asked: float | None = None
        for i in range(retry.retries):
            if i:
                if self.on_retry is not None:
                    self.on_retry()
                backoff = min(retry.max_backoff, retry.backoff * 2 ** (i - 1))
                time.sleep(backoff if asked is None else max(backoff, min(asked, retry.attempt_timeout)))
            try:
                return attempt()
            except Retryable as exc:
                problem, asked = str(exc), exc.retry_after
                self.log.warning("%s %s, attempt %d/%d: %s", self.label, url, i + 1, retry.retries, problem)
        plural = "attempt" if retry.retries == 1 else "attempts"
        raise SearchError(f"{self.label} {url} did not answer after {retry.retries} {plural}: {problem}")

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


def retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` header's wait in seconds (a number, or an HTTP date), or None when absent or unreadable."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            return None
        seconds = (when - datetime.datetime.now(datetime.UTC)).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else None


def reason(exc: Exception) -> str:
    """A transport error in a few words (``connection refused`` for the common case)."""
    text = str(exc)
    if "Connection refused" in text or "Errno 111" in text:
        return "connection refused"
    return text or type(exc).__name__

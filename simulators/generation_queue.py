"""How the in-process simulator server shares its one model among requests: one generation at a time, in
arrival order, a bounded number waiting, and no work for a client that has gone.

A request becomes a :class:`Job` when :meth:`GenerationQueue.admit` takes it, or is refused with
:class:`QueueFull` (the server's 429, with ``Retry-After``) when ``max_waiting`` jobs already wait.
:meth:`GenerationQueue.run` waits for the job's turn, runs its generation in a worker thread, and watches
the client meanwhile: when the client goes (its read timeout, a retry), a waiting job leaves the queue and
never runs, and a generating one stops before its next model forward. The check sits in a forward pre-hook
on the model's input embeddings (:meth:`GenerationQueue.watch`), which every forward of a causal LM calls
(the prefill, then one per decode step), whichever loop decodes (zerosim's or ``generate``). So a client
that hangs up costs whoever waits behind it at most the forward already running.

Everything but the hook runs on the server's event loop, so the queue's counts need no lock.
"""

from __future__ import annotations

import asyncio
import collections
import math
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_MAX_WAITING = 64
MAX_RETRY_AFTER = 60  # seconds: the most a refused client is told to wait


class Cancelled(Exception):
    """The job's client went away: its generation was not started, or stopped between two forwards."""


class QueueFull(Exception):
    """``max_waiting`` jobs already wait; ``retry_after``: seconds until the queue has likely drained."""

    def __init__(self, waiting: int, max_waiting: int, retry_after: int):
        super().__init__(
            f"{waiting} requests already wait for the model (max_waiting={max_waiting}); "
            f"retry after {retry_after}s"
        )
        self.retry_after = retry_after


@dataclass(eq=False)
class Job:
    """One request's generation: whether its client went away, and the forwards it has run."""

    cancelled: threading.Event = field(default_factory=threading.Event)
    started: bool = False  # its turn came and its generation began
    forwards: int = 0  # model forwards run for it (the prefill, then one per decode step)
    queued: bool = True  # counted in the queue's waiting jobs
    admitted: bool = True  # counted in the queue's admitted jobs (waiting or generating)


class GenerationQueue:
    """Runs one generation at a time, first come first served, with at most ``max_waiting`` waiting.

    ``stats`` counts the jobs ``completed``, ``cancelled_waiting`` (gone before their turn: never run),
    ``cancelled_generating`` (stopped between two forwards) and ``refused`` (the queue was full).
    """

    def __init__(self, max_waiting: int = DEFAULT_MAX_WAITING):
        if max_waiting < 0:
            raise ValueError(f"max_waiting={max_waiting} must be at least 0")
        self.max_waiting = max_waiting
        self.waiting = 0  # admitted, their turn not come
        self.admitted = 0  # admitted and not finished: the waiting and the one generating
        self.stats = {"completed": 0, "cancelled_waiting": 0, "cancelled_generating": 0, "refused": 0}
        self._turn = asyncio.Lock()  # FIFO: a release wakes the longest waiter
        self._generating: Job | None = None
        self._in_thread = threading.local()  # the job whose generation runs in this thread
        self._seconds: collections.deque[float] = collections.deque(maxlen=16)  # recent generations

    @property
    def generating(self) -> Job | None:
        """The job whose generation runs now, if any."""
        return self._generating

    @property
    def idle(self) -> bool:
        """Nothing generating and nothing waiting."""
        return self._generating is None and self.waiting == 0

    def watch(self, model: Any) -> Any:
        """Check the generating job before every forward of ``model``; returns the hook's handle."""
        return model.get_input_embeddings().register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: Any, args: Any) -> None:
        job = getattr(self._in_thread, "job", None)
        if job is None:  # a forward outside a job (a caller using the model directly)
            return
        if job.cancelled.is_set():
            raise Cancelled
        job.forwards += 1

    def admit(self) -> Job:
        """A new waiting job, or :class:`QueueFull` when the queue holds its bound: one generating and
        ``max_waiting`` waiting. Counted at admission, not when a job takes its turn, so a burst that arrives
        before the first job holds the model is bounded too."""
        if self.admitted >= self.max_waiting + 1:
            self.stats["refused"] += 1
            raise QueueFull(max(self.waiting, self.admitted - 1), self.max_waiting, self.retry_after())
        self.admitted += 1
        self.waiting += 1
        return Job()

    def _dequeued(self, job: Job) -> None:
        if job.queued:
            job.queued = False
            self.waiting -= 1

    def _finished(self, job: Job) -> None:
        if job.admitted:
            job.admitted = False
            self.admitted -= 1

    def retry_after(self) -> int:
        """Seconds until the jobs now queued have likely run (recent generations' mean), 1 to 60."""
        mean = sum(self._seconds) / len(self._seconds) if self._seconds else 1.0
        return max(1, min(MAX_RETRY_AFTER, math.ceil(mean * (self.waiting + 1))))

    async def run(self, job: Job, work: Callable[[], T], gone: Callable[[], Awaitable[Any]]) -> T:
        """Wait for ``job``'s turn, then run ``work()`` in a worker thread and return what it returns.

        ``gone()`` finishes when the client has gone; then this raises :class:`Cancelled`: at once for a
        job still waiting (it never runs), after the forward in flight for a generating one (the next job
        starts only once the model is free).
        """
        serving = asyncio.ensure_future(self._serve(job, work))
        watching = asyncio.ensure_future(gone())
        try:
            await asyncio.wait({serving, watching}, return_when=asyncio.FIRST_COMPLETED)
            if not serving.done():
                self._cancel(job, serving)
            return await serving
        except asyncio.CancelledError:
            if job.cancelled.is_set() and not job.started:
                raise Cancelled from None  # we cancelled it while it waited
            self._cancel(job, serving)  # the server is shutting down: stop this job too
            raise
        finally:
            watching.cancel()
            if serving.done():  # also a job cancelled before its coroutine ran: it leaves the counts here
                self._dequeued(job)
                self._finished(job)

    def _cancel(self, job: Job, serving: asyncio.Future) -> None:
        job.cancelled.set()
        if not job.started:
            serving.cancel()  # leaves the lock's waiters: the turn passes to the next job

    async def _serve(self, job: Job, work: Callable[[], T]) -> T:
        try:
            await self._turn.acquire()
        except asyncio.CancelledError:
            self._dequeued(job)
            self._finished(job)
            self.stats["cancelled_waiting"] += 1
            raise
        self._dequeued(job)
        job.started = True
        self._generating = job
        started = time.monotonic()
        try:  # never cancelled once started (run's _cancel): the turn is held until the thread lets go
            result = await asyncio.to_thread(self._generate, job, work)
        except Cancelled:
            self.stats["cancelled_generating"] += 1
            raise
        finally:
            self._generating = None
            self._finished(job)
            self._turn.release()
        self._seconds.append(time.monotonic() - started)
        self.stats["completed"] += 1
        return result

    def _generate(self, job: Job, work: Callable[[], T]) -> T:
        self._in_thread.job = job
        try:
            return work()
        finally:
            self._in_thread.job = None

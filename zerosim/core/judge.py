"""An LLM judge over an OpenAI-compatible server: does a predicted answer match any gold answer? (yes / no)

``reward.metric: judge`` (or a ``judge`` key in ``reward.weights``) scores each trajectory's final answer by
asking a served model (``vllm serve MODEL``, ``zerosim simulator serve``, any OpenAI-compatible endpoint)
the :data:`PROMPT` question. The first word of its answer decides: ``yes`` scores 1, ``no`` scores 0;
anything else is retried like a malformed answer and, after ``retries`` attempts, raises
:class:`JudgeError` naming the URL (never a silent 0). A score is cached per (question, answer, gold
answers) — in training the gold answers are one per question (``zerosim.training.recipe.build_dataset``), so this is
per (question, answer) — and each batch asks the server once per unique uncached pair.

Transport: :class:`~zerosim.core.http.retry.RetryingClient` (bounded timeouts, retries, per-attempt deadline). One
call takes at most ``retries * (connect_timeout + read_timeout)`` plus the backoff sleeps per request.

Start-up: :meth:`LLMJudge.check` asks ``GET /v1/models`` (the server is up and serves the model) and then
one :data:`PROBE` question on the very endpoint ``api`` names, so a server without it (an older
``zerosim simulator serve`` has no ``/v1/chat/completions``) is refused before the first rollout, not
after it.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from zerosim.core.config import ranged
from zerosim.core.http.retry import Retryable, RetryingClient, RetryPolicy, error_message
from zerosim.core.search import SearchError


class JudgeAPI(StrEnum):
    """``reward.judge.api``: the OpenAI endpoint the judge is asked through."""

    chat = "chat"  # POST /v1/chat/completions, one question per request (the server applies its template)
    completions = "completions"  # POST /v1/completions, every question of a batch in one request


@dataclass
class JudgeConfig:
    # OpenAI-compatible server the judge is asked on, http://HOST:PORT (vllm serve, zerosim simulator serve)
    url: str | None = None
    # model name asked of the server (vLLM's --served-model-name)
    model: str = "judge"
    # chat = /v1/chat/completions (instruct models); completions = /v1/completions, one request per batch
    api: JudgeAPI = JudgeAPI.chat
    # seconds to connect before a retry
    connect_timeout: float = ranged(2.0, ">0", "seconds")
    # seconds to wait for an answer before a retry
    read_timeout: float = ranged(60.0, ">0", "seconds")
    # attempts per request before the reward fails with an error naming the URL
    retries: int = ranged(3, ">=1", "attempts per request, the first one included")
    # seconds slept before the second attempt; doubled before each later one
    backoff: float = ranged(0.5, ">=0", "seconds")
    # requests in flight at once (api=chat sends one question per request)
    max_concurrency: int = ranged(8, ">=1")


class JudgeError(RuntimeError):
    """The judge server did not give a usable verdict (the message names the URL and the last problem)."""


PROMPT = """You are grading a question-answering system. Decide whether the predicted answer matches \
any of the gold answers: it matches when it names the same thing, even in other words, as an abbreviation \
or with extra detail that does not change it; it does not match when it is wrong, vaguer or names something \
else.

Question: {question}
Gold answers: {golds}
Predicted answer: {answer}

Does the predicted answer match any gold answer? Reply with one word: yes or no.
Reply:"""

ENDPOINTS = {JudgeAPI.chat: "/v1/chat/completions", JudgeAPI.completions: "/v1/completions"}
DEFAULT_RETRY = RetryPolicy()  # LLMJudge's when none is given (read_timeout 60 s)
MAX_TOKENS = 4  # "yes" / "no" and a little room (a leading space, punctuation)
_FIRST_WORD = re.compile(r"\W*([a-z]+)")  # after any quotes, brackets, bullets, markdown, spaces


def judge_prompt(question: str, answer: str, golds: Sequence[str]) -> str:
    """The text the judge is asked for one (question, predicted answer, gold answers)."""
    return PROMPT.format(question=question, answer=answer, golds=" | ".join(golds))


# the start-up check's question: a real one, asked on the endpoint the judge will use (its verdict unread)
PROBE = judge_prompt("What is the capital of France?", "Paris", ["Paris"])


def parse_verdict(text: str) -> float | None:
    """1.0 for an answer whose first word is ``yes``, 0.0 for ``no``, None for anything else.

    The one reading of a yes/no judge's answer (this reward judge's, and the document labeller's of
    ``zerosim simulator collect``). Case does not matter, nor what comes before the first word (``**Yes**``,
    ``- no``, ``"yes"``); the first word is its letters a-z (``Yes.``, ``no,`` count; ``yesterday``, ``nope``
    do not).
    """
    word = _FIRST_WORD.match(text.lower())
    if word is None:
        return None
    return {"yes": 1.0, "no": 0.0}.get(word.group(1))


class LLMJudge:
    """Scores answers with a served model, caching each verdict; :attr:`stats` counts the work done.

    ``stats``: ``requests`` (HTTP attempts sent), ``judged`` (pairs the server decided), ``cache_hits``
    (pairs answered from the cache), ``seconds`` (wall-clock time spent asking). :meth:`take_stats` returns
    them and starts new counts (one reward call = one training step's numbers).
    """

    def __init__(
        self,
        url: str,
        model: str = "judge",
        *,
        api: JudgeAPI | str = JudgeAPI.chat,
        retry: RetryPolicy = DEFAULT_RETRY,
        max_concurrency: int = 8,
    ):
        parts = urlsplit(url or "")
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"judge url {url!r} must look like http://HOST:PORT (reward.judge.url)")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} must be at least 1")
        base = url.rstrip("/")
        self.base_url = base[: -len("/v1")] if base.endswith("/v1") else base
        self.api = JudgeAPI(api)
        self.endpoint = self.base_url + ENDPOINTS[self.api]
        self.model = model
        self.max_concurrency = max_concurrency
        self.cache: dict[tuple[str, str, tuple[str, ...]], float] = {}
        self.stats = self._zero()
        self._lock = threading.Lock()
        self._http = RetryingClient("judge server", retry, max_connections=max_concurrency)

    @classmethod
    def from_config(cls, cfg: JudgeConfig) -> LLMJudge:
        return cls(
            cfg.url or "",
            cfg.model,
            api=cfg.api,
            retry=RetryPolicy.of(cfg),
            max_concurrency=cfg.max_concurrency,
        )

    # -- scoring ------------------------------------------------------------------------------------

    def score(
        self, questions: Sequence[str], answers: Sequence[str | None], golds: Sequence[Sequence[str]]
    ) -> list[float]:
        """One verdict per row (1 = matches a gold answer); a missing answer (``None``) scores 0 unasked."""
        started = time.perf_counter()
        keys = [
            None if a is None else (q, a, tuple(g)) for q, a, g in zip(questions, answers, golds, strict=True)
        ]
        asked = list(dict.fromkeys(k for k in keys if k is not None and k not in self.cache))
        hits = sum(1 for k in keys if k is not None and k in self.cache)
        try:
            if asked:
                verdicts = self._ask([judge_prompt(q, a, g) for q, a, g in asked])
                self.cache.update(zip(asked, verdicts, strict=True))
        finally:
            with self._lock:
                self.stats["judged"] += len(asked)
                self.stats["cache_hits"] += hits
                self.stats["seconds"] += time.perf_counter() - started
        return [0.0 if k is None else self.cache[k] for k in keys]

    def check(self) -> None:
        """Ask ``GET /v1/models`` (with the retries) that the server is up and serves :attr:`model`, then one
        :data:`PROBE` question on :attr:`endpoint` that it answers there in OpenAI's shape, so a wrong URL,
        model or ``api`` fails at start-up rather than after the first rollout. The probe's verdict is not
        read (a model may still answer garbage: that is :meth:`score`'s error) nor counted in :attr:`stats`."""
        url = f"{self.base_url}/v1/models"

        def attempt() -> Any:
            response = self._http.send("GET", url)
            self._http.raise_for_status(response, url)
            return self._http.json(response)

        try:
            data = self._http.with_retries(url, attempt)
        except SearchError as exc:
            raise JudgeError(f"{exc}. Check reward.judge.url (start the server first)") from None
        models = data.get("data", []) if isinstance(data, dict) else []
        served = [m.get("id") for m in models if isinstance(m, dict)]
        if served and self.model not in served:
            raise JudgeError(
                f"judge server {self.base_url} serves {', '.join(map(str, served))}, not "
                f"reward.judge.model={self.model!r}: set reward.judge.model to one of those"
            )
        self._probe()

    def _probe(self) -> None:
        """One :data:`PROBE` question on :attr:`endpoint`: a server without that endpoint is a one-line error
        naming the URL, the api and the fix."""
        url = self.endpoint

        def attempt() -> list[str]:
            response = self._http.send("POST", url, json=self._body([PROBE]))
            if response.status_code in (404, 405):  # no such route (the model was found in /v1/models)
                other = next(a for a in JudgeAPI if a != self.api)
                raise JudgeError(
                    f"judge server {self.base_url} does not answer POST {ENDPOINTS[self.api]} (HTTP "
                    f"{response.status_code}: {error_message(response)}), the endpoint "
                    f"reward.judge.api={self.api} asks: set "
                    f"reward.judge.api={other} (POST {ENDPOINTS[other]}) if it serves that, or serve the "
                    f"judge with vllm serve or zerosim simulator serve (both answer either)"
                )
            self._http.raise_for_status(response, url)
            return self._texts(self._http.json(response), 1)

        try:
            self._http.with_retries(url, attempt)
        except SearchError as exc:
            raise JudgeError(
                f"{exc}. Check that reward.judge.url serves reward.judge.model={self.model!r} over "
                f"reward.judge.api={self.api}"
            ) from None

    def take_stats(self) -> dict[str, float]:
        """The counts since the last call, as ``judge/<name>`` metrics; the counts start again at 0."""
        with self._lock:
            stats, self.stats = self.stats, self._zero()
        return {f"judge/{name}": float(value) for name, value in stats.items()}

    def close(self) -> None:
        self._http.close()

    def __repr__(self) -> str:
        return f"LLMJudge({self.endpoint!r}, model={self.model!r}, retries={self._http.retry.retries})"

    # -- asking the server ----------------------------------------------------------------------------

    @staticmethod
    def _zero() -> dict[str, float]:
        return {"requests": 0, "judged": 0, "cache_hits": 0, "seconds": 0.0}

    def _ask(self, prompts: list[str]) -> list[float]:
        """The verdicts for ``prompts``: one request for all (completions) or one each (chat)."""
        try:
            if self.api == JudgeAPI.completions:
                return self._with_retries(prompts, self._post)
            with ThreadPoolExecutor(min(self.max_concurrency, len(prompts))) as pool:
                return list(pool.map(lambda p: self._with_retries([p], self._post)[0], prompts))
        except SearchError as exc:  # RetryingClient's final error: it names the server, URL and problem
            raise JudgeError(
                f"{exc}. Check that reward.judge.url serves reward.judge.model={self.model!r} over "
                f"reward.judge.api={self.api}, and that the model answers yes or no"
            ) from None

    def _with_retries(self, prompts: list[str], send_once) -> list[float]:
        """Ask until every prompt has a yes/no verdict; each retry asks only the ones still undecided."""
        verdicts: dict[int, float] = {}

        def attempt() -> list[float]:
            pending = [i for i in range(len(prompts)) if i not in verdicts]
            texts = send_once([prompts[i] for i in pending])
            bad = []
            for i, text in zip(pending, texts, strict=True):
                verdict = parse_verdict(text)
                if verdict is None:
                    bad.append(text)
                else:
                    verdicts[i] = verdict
            if bad:
                raise Retryable(
                    f"{len(bad)} of {len(pending)} answers are neither yes nor no, e.g. {bad[0][:120]!r}"
                )
            return [verdicts[i] for i in range(len(prompts))]

        return self._http.with_retries(self.endpoint, attempt)

    def _body(self, prompts: list[str]) -> dict[str, Any]:
        """The request for ``prompts``: all in one completions request, or one chat message (chat)."""
        settings = {"model": self.model, "max_tokens": MAX_TOKENS, "temperature": 0.0, "seed": 0}
        if self.api == JudgeAPI.completions:
            return {**settings, "prompt": prompts}
        (prompt,) = prompts
        return {**settings, "messages": [{"role": "user", "content": prompt}]}

    def _texts(self, data: Any, n: int) -> list[str]:
        """The ``n`` answer texts of an OpenAI answer of :attr:`api`'s shape, in prompt order."""
        if self.api == JudgeAPI.completions:
            return _choices(data, n, lambda c: c.get("text"))
        return _choices(data, n, lambda c: (c.get("message") or {}).get("content"))

    def _post(self, prompts: list[str]) -> list[str]:
        with self._lock:
            self.stats["requests"] += 1
        response = self._http.send("POST", self.endpoint, json=self._body(prompts))
        self._http.raise_for_status(response, self.endpoint)
        return self._texts(self._http.json(response), len(prompts))


def _choices(data: Any, n: int, text_of) -> list[str]:
    """The texts of an OpenAI answer's ``choices``, in prompt order; a malformed answer is retryable."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        raise Retryable(f"malformed answer: expected {n} choices in {str(data)[:200]!r}")
    texts: list[str | None] = [None] * n
    for position, choice in enumerate(choices):
        index = choice.get("index", position) if isinstance(choice, dict) else None
        text = text_of(choice) if isinstance(choice, dict) else None
        if not isinstance(index, int) or not 0 <= index < n or not isinstance(text, str):
            raise Retryable(f"malformed answer: choice {position} is {str(choice)[:200]!r}")
        texts[index] = text
    if any(t is None for t in texts):
        raise Retryable("malformed answer: two choices with the same index")
    return [t for t in texts if t is not None]

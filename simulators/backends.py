"""Text backends for the LLM simulator: prompts in, completions out, in one batched call.

A :class:`TextBackend` turns simulator prompts (the text of one user message each) into completions. Two
implementations:

- :class:`TransformersBackend` — an in-process transformers model. Wraps each prompt in the tokenizer's
  chat template, left-pads, and runs ONE batched ``generate`` for all prompts of a call, seeded without
  touching the caller's global RNG.
- :class:`OpenAIBackend` — an OpenAI-compatible ``POST /v1/completions`` server (``vllm serve`` or
  :mod:`simulators.openai_server`). The client applies the chat template itself (``/v1/completions``
  takes raw text, and only it accepts a list of prompts in one request), then sends every prompt of a call
  in one request, or in at most ``max_concurrency`` concurrent ones. Bounded retries with backoff, then a
  :class:`~zerosim.core.search.SearchError` naming the URL, the attempts and the last problem; each attempt ends
  by its deadline (``connect_timeout + read_timeout``), however slowly the server sends.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

import torch

from zerosim.core.generation import HFGenerator
from zerosim.core.http.retry import Retryable, RetryingClient, RetryPolicy
from zerosim.core.models import encode_chat_prompt, format_chat_prompt
from zerosim.core.sampling import Sampling
from zerosim.core.search import SearchError

logger = logging.getLogger(__name__)


@runtime_checkable
class TextBackend(Protocol):
    """Completes simulator prompts; one call carries every prompt of a search call."""

    def complete(
        self, prompts: Sequence[str], *, max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> list[str]:
        """One completion per prompt, in order. ``prompts`` are user-message texts (no chat template yet)."""
        ...

    def describe(self) -> dict[str, str]:
        """What about this backend changes its output (kind, model, chat template): part of cache keys."""
        ...


@dataclass(frozen=True)
class Completion:
    """One generated text plus what an OpenAI-style answer reports about it."""

    text: str
    finish_reason: str  # "stop" (EOS) | "length" (max_new_tokens reached)
    prompt_tokens: int
    completion_tokens: int


def _fingerprint(text: str | None) -> str:
    return "none" if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


# -- in-process ---------------------------------------------------------------------------------------


class TransformersBackend:
    """An in-process transformers causal LM: one left-padded, batched ``generate`` per call.

    Args:
        model, tokenizer: a loaded causal LM and its tokenizer (``zerosim.core.models.load_causal_lm`` /
            ``load_tokenizer``).
        apply_chat_template: wrap each prompt as a user message in the chat template (the simulator's case).
            ``False`` takes prompts as raw text (the OpenAI server's case: its clients send formatted text).
        model_id: the name recorded in :meth:`describe` (cache keys); defaults to the model's
            ``name_or_path``.
        batch_invariant: decode each prompt exactly as if it were alone in its call
            (``zerosim.core.decode.decode_invariant``): bit-exact documents whatever the batch (a trained
            simulator's 16 requests in float32: 17.9 s against 15.8 s without, docs/simulator.md). Off, a
            batched call can differ from one call per prompt only by float rounding that depends on the batch
            (greedy float32: the same text for all 16 requests of ``benchmarks/simulator.py``; bfloat16: 5
            of 16).
    """

    kind = "transformers"

    def __init__(
        self,
        model,
        tokenizer,
        *,
        apply_chat_template: bool = True,
        model_id: str | None = None,
        batch_invariant: bool = False,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.apply_chat_template = apply_chat_template
        self.model_id = model_id or str(getattr(model.config, "name_or_path", "") or type(model).__name__)
        self.batch_invariant = batch_invariant
        # documents need text only
        self.generator = HFGenerator(model, tokenizer, logprobs=False, batch_invariant=batch_invariant)
        self._lock = threading.Lock()  # one generate at a time: the model and the generator are shared

    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: str = "auto", **kwargs: Any) -> TransformersBackend:
        from zerosim.core.models import load_causal_lm, load_tokenizer

        kwargs.setdefault("model_id", name_or_path)
        return cls(load_causal_lm(name_or_path, dtype), load_tokenizer(name_or_path), **kwargs)

    def describe(self) -> dict[str, str]:
        template = getattr(self.tokenizer, "chat_template", None) if self.apply_chat_template else None
        described = {"backend": self.kind, "model": self.model_id, "chat_template": _fingerprint(template)}
        if self.batch_invariant:
            described["batch_invariant"] = "true"
        return described

    def encode(self, prompt: str) -> list[int]:
        if self.apply_chat_template:
            return encode_chat_prompt(self.tokenizer, prompt)
        # as vLLM's /v1/completions does: the tokenizer's own special tokens (if any) are added
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def generate(
        self, prompts: Sequence[str], *, max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> list[Completion]:
        """Completions with token counts and finish reasons (what the OpenAI server reports)."""
        if not prompts:
            return []
        encoded = [self.encode(p) for p in prompts]
        with self._lock, torch.random.fork_rng(devices=_rng_devices()):
            # a private RNG stream: same prompts + same seed -> same text, and the caller's RNG is untouched
            torch.manual_seed(seed % 2**63)
            self.generator.sampling = Sampling(temperature=temperature, top_p=top_p)
            outputs = self.generator.generate(encoded, max_new_tokens)
        if len(outputs) != len(prompts):
            raise SearchError(f"generate returned {len(outputs)} outputs for {len(prompts)} prompts")
        return [
            Completion(
                text=self.tokenizer.decode(out.token_ids, skip_special_tokens=True),
                finish_reason="length" if out.finish == "length" else "stop",
                prompt_tokens=len(ids),
                completion_tokens=len(out.token_ids),
            )
            for ids, out in zip(encoded, outputs, strict=True)
        ]

    def complete(
        self, prompts: Sequence[str], *, max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> list[str]:
        generated = self.generate(
            prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
        )
        return [c.text for c in generated]


def _rng_devices() -> list[int]:
    # fork the CUDA RNG too when generation runs there; on CPU only the CPU generator matters
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


# -- over HTTP ----------------------------------------------------------------------------------------


DEFAULT_RETRY = RetryPolicy(read_timeout=120.0)  # OpenAIBackend's when none is given


class OpenAIBackend:
    """An OpenAI-compatible completions server (``vllm serve``, ``zerosim simulator serve``).

    Each :meth:`complete` call sends every prompt in ONE ``POST /v1/completions`` (``prompt`` as a list),
    or splits them into at most ``max_concurrency`` requests sent concurrently. Choices are matched to
    prompts by their ``index``.

    Args:
        base_url: the server's base URL, ``http://HOST:PORT`` (a trailing ``/v1`` is accepted).
        model: the model name the server serves (vLLM's ``--served-model-name``, or a LoRA adapter's name).
        tokenizer: a tokenizer object, or a name/path to load one from, whose chat template wraps each prompt
            before it is sent (``/v1/completions`` takes raw text). ``None`` sends prompts unformatted.
        retry: timeouts, attempts and backoff (:class:`~zerosim.core.http.retry.RetryPolicy`; ``read_timeout``
            120 s by default: a batch of long completions takes a while). ``retries`` counts the attempts of
            one request: connection errors, timeouts, 5xx answers, invalid JSON and malformed answers (wrong
            number of choices, ...) are retried; a 4xx answer (a bad request, an unknown model) is not.
        max_concurrency: most requests in flight for one call (1 = all prompts in a single request).
        check_health: ask ``GET /health`` (falling back to ``GET /v1/models``) at construction, with the same
            retries; a server that never answers raises :class:`SearchError` right away.
    """

    kind = "openai"

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        tokenizer: Any = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        max_concurrency: int = 1,
        check_health: bool = True,
    ):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"simulator server url {base_url!r} must look like http://HOST:PORT")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} must be at least 1")
        if not model:
            raise ValueError("model must name the model the server serves (its --served-model-name)")
        base = base_url.rstrip("/")
        if base.endswith("/v1"):
            base = base[: -len("/v1")]
        self.base_url = base
        self.completions_url = f"{base}/v1/completions"
        self.model = model
        if isinstance(tokenizer, str):
            from zerosim.core.models import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.retry = retry
        self.max_concurrency = max_concurrency
        self.stats = {"requests": 0, "retries": 0}  # HTTP requests sent (attempts), and retries among them
        self._stats_lock = threading.Lock()  # concurrent requests update the counters
        self._http = RetryingClient(
            "simulator server",
            retry,
            on_retry=lambda: self._count("retries"),
            max_connections=max_concurrency,
            log=logger,
        )
        self._pool = ThreadPoolExecutor(max_concurrency) if max_concurrency > 1 else None
        self.server_info: Any = None  # what /health (or /v1/models) answered
        if check_health:
            try:
                self.server_info = self.check_health()
            except BaseException:
                self.close()
                raise

    # -- public API ---------------------------------------------------------------------------------

    def describe(self) -> dict[str, str]:
        template = getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None
        return {"backend": self.kind, "model": self.model, "chat_template": _fingerprint(template)}

    def complete(
        self, prompts: Sequence[str], *, max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> list[str]:
        if not prompts:
            return []
        for name, value in (("temperature", temperature), ("top_p", top_p)):
            if not math.isfinite(value):  # JSON cannot carry it, and no server may sample with it
                raise ValueError(f"{name}={value} must be a finite number")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
        texts = (
            [format_chat_prompt(self.tokenizer, p) for p in prompts]
            if self.tokenizer is not None
            else list(prompts)
        )
        size = math.ceil(len(texts) / self.max_concurrency)
        chunks = [texts[i : i + size] for i in range(0, len(texts), size)]
        settings = {"max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}

        def send(chunk: list[str]) -> list[str]:
            return self._http.with_retries(self.completions_url, lambda: self._complete_once(chunk, settings))

        if self._pool is None or len(chunks) == 1:
            answers = [send(chunk) for chunk in chunks]
        else:
            answers = list(self._pool.map(send, chunks))
        return [text for answer in answers for text in answer]

    def check_health(self) -> Any:
        """``GET /health`` (vLLM, our server); a server without it (404) is asked ``GET /v1/models``."""

        def attempt() -> Any:
            response = self._http.send("GET", f"{self.base_url}/health")
            if response.status_code == 404:
                response = self._http.send("GET", f"{self.base_url}/v1/models")
                self._http.raise_for_status(response, f"{self.base_url}/v1/models")
                return self._http.json(response)
            self._http.raise_for_status(response, f"{self.base_url}/health")
            try:
                return response.json()
            except ValueError:
                return response.text  # vLLM's /health answers 200 with an empty body

        return self._http.with_retries(f"{self.base_url}/health", attempt)

    def close(self) -> None:
        self._http.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def __enter__(self) -> OpenAIBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"OpenAIBackend({self.base_url!r}, model={self.model!r}, retries={self.retry.retries}, "
            f"max_concurrency={self.max_concurrency})"
        )

    # -- one attempt ----------------------------------------------------------------------------------

    def _count(self, name: str) -> None:
        with self._stats_lock:
            self.stats[name] += 1

    def _complete_once(self, prompts: list[str], settings: dict[str, Any]) -> list[str]:
        payload = {"model": self.model, "prompt": prompts, "n": 1, **settings}
        self._count("requests")
        response = self._http.send("POST", self.completions_url, json=payload)
        self._http.raise_for_status(response, self.completions_url)
        return parse_choices(self._http.json(response), len(prompts))


# -- parsing an answer (pure functions) -----------------------------------------------------------------


def parse_choices(data: Any, n_prompts: int) -> list[str]:
    """The texts of a ``/v1/completions`` answer, in prompt order (by each choice's ``index``).

    Anything but exactly one text choice per prompt raises a retryable error.
    """
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        raise Retryable(f"malformed answer: no 'choices' list in {str(data)[:200]!r}")
    choices = data["choices"]
    if len(choices) != n_prompts:
        raise Retryable(f"malformed answer: {len(choices)} choices for {n_prompts} prompts")
    texts: list[str | None] = [None] * n_prompts
    for position, choice in enumerate(choices):
        if not isinstance(choice, dict):
            raise Retryable(f"malformed answer: choice {position} is {type(choice).__name__}, not an object")
        index, text = choice.get("index", position), choice.get("text")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n_prompts:
            raise Retryable(
                f"malformed answer: choice {position} has index {index!r} for {n_prompts} prompts"
            )
        if texts[index] is not None:
            raise Retryable(f"malformed answer: two choices with index {index}")
        if not isinstance(text, str):
            raise Retryable(f"malformed answer: choice {index} has no 'text' string")
        texts[index] = text
    return [t for t in texts if t is not None]

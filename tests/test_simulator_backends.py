"""Simulator text backends: the OpenAI-compatible client against fake and real (in-process) servers."""

from __future__ import annotations

import asyncio
import re
import socket
import time

import fastapi
import httpx
import pytest
from fastapi.responses import JSONResponse, PlainTextResponse

from simulators import LLMSimulator, OpenAIBackend, TransformersBackend
from simulators.openai_server import (
    create_openai_app,
    parse_lora,
    running_openai_server,
    start_simulator_server,
    vllm_command,
)
from zerosim.core.http.retry import RetryPolicy
from zerosim.core.http.server import running_app
from zerosim.core.search import SearchError, SearchRequest

SETTINGS = {"max_new_tokens": 8, "temperature": 0.7, "top_p": 1.0, "seed": 11}  # top_p 1: no vocab sort


# -- a fake OpenAI-compatible server whose behaviour each test sets ---------------------------------------


class FakeServer:
    def __init__(self) -> None:
        self.mode = "ok"
        self.bodies: list[dict] = []
        self.app = fastapi.FastAPI()
        self.app.get("/health")(lambda: {"status": "ok"})
        self.app.post("/v1/completions")(self.completions)

    async def completions(self, request: fastapi.Request):
        body = await request.json()
        self.bodies.append(body)
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        choices = [{"index": i, "text": _answer(p), "finish_reason": "stop"} for i, p in enumerate(prompts)]
        if self.mode == "500":
            return JSONResponse(status_code=500, content={"error": {"message": "engine crashed"}})
        if self.mode == "400":
            return JSONResponse(status_code=400, content={"error": {"message": "bad max_tokens"}})
        if self.mode == "badjson":
            return PlainTextResponse("<html>not json", status_code=200)
        if self.mode == "wrongcount":
            choices = choices[:-1]
        if self.mode == "slow":
            await asyncio.sleep(0.6)
        if self.mode == "shuffled":
            choices = choices[::-1]
        return {"object": "text_completion", "model": body["model"], "choices": choices}


def _answer(prompt: str) -> str:
    """Documents that say which mode's prompt asked for them: 'Doc i: NOISY ...' or 'Doc i: USEFUL ...'."""
    k = int(re.search(r"write (\d+) short", prompt).group(1)) if "write" in prompt else 1
    mode = "NOISY" if "must not contain" in prompt else "USEFUL"
    return "\n".join(f"Doc {i}: {mode} document {i} for {prompt[-12:]!r}" for i in range(1, k + 1))


@pytest.fixture(scope="module")
def fake():
    server = FakeServer()
    with running_app(server.app) as url:
        server.url = url
        yield server


@pytest.fixture
def fake_server(fake):
    fake.mode = "ok"
    fake.bodies.clear()
    return fake


def backend(url: str, retries: int = 3, **kwargs) -> OpenAIBackend:
    retry = RetryPolicy(connect_timeout=0.5, read_timeout=0.3, retries=retries, backoff=0.01)
    return OpenAIBackend(url, "fake", retry=retry, **kwargs)


def test_all_prompts_of_a_call_go_in_one_request(fake_server):
    with backend(fake_server.url) as client:
        texts = client.complete(["write 1 short a", "write 2 short b", "c"], **SETTINGS)
    assert len(texts) == 3 and texts[1].count("Doc") == 2
    (body,) = fake_server.bodies
    assert body["prompt"] == ["write 1 short a", "write 2 short b", "c"] and body["n"] == 1
    assert (body["max_tokens"], body["seed"], body["model"]) == (8, 11, "fake")


def test_max_concurrency_splits_and_keeps_order(fake_server):
    prompts = [f"prompt number {i}" for i in range(5)]
    with backend(fake_server.url, max_concurrency=2) as client:
        texts = client.complete(prompts, **SETTINGS)
    assert len(fake_server.bodies) == 2
    assert sorted(len(b["prompt"]) for b in fake_server.bodies) == [2, 3]
    assert texts == [_answer(p) for p in prompts]


def test_choices_are_matched_by_index(fake_server):
    fake_server.mode = "shuffled"
    with backend(fake_server.url) as client:
        assert client.complete(["first", "second"], **SETTINGS) == [_answer("first"), _answer("second")]


@pytest.mark.parametrize(
    ("mode", "problem"),
    [
        ("500", "HTTP 500: engine crashed"),
        ("badjson", "invalid JSON"),
        ("wrongcount", "1 choices for 2 prompts"),
        ("slow", "timed out"),
    ],
)
def test_http_faults_raise_after_the_configured_retries(fake_server, mode, problem):
    fake_server.mode = mode
    with backend(fake_server.url, retries=2) as client:
        started = time.monotonic()
        with pytest.raises(SearchError) as info:
            client.complete(["a", "b"], **SETTINGS)
        elapsed = time.monotonic() - started
    message = str(info.value)
    assert f"{fake_server.url}/v1/completions" in message and "after 2 attempts" in message
    assert problem in message
    assert len(fake_server.bodies) == 2  # exactly the configured attempts, no more
    assert elapsed < 2 * 0.3 + 0.01 + 1.5


def test_a_rejected_request_is_not_retried(fake_server):
    fake_server.mode = "400"
    with backend(fake_server.url) as client, pytest.raises(SearchError, match="HTTP 400.*bad max_tokens"):
        client.complete(["a"], **SETTINGS)
    assert len(fake_server.bodies) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nothing_listening_fails_the_health_check_and_the_call():
    url = f"http://127.0.0.1:{_free_port()}"
    started = time.monotonic()
    with pytest.raises(SearchError, match=rf"{url}/health did not answer after 2 attempts: cannot connect"):
        backend(url, retries=2)
    with (
        backend(url, retries=2, check_health=False) as client,
        pytest.raises(SearchError, match=rf"{url}/v1/completions did not answer after 2 attempts"),
    ):
        client.complete(["a"], **SETTINGS)
    assert time.monotonic() - started < 3


def test_health_falls_back_to_the_models_list():
    app = fastapi.FastAPI()
    app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "m"}]})
    with running_app(app, health_path="/v1/models") as url, backend(url) as client:
        assert client.server_info["data"][0]["id"] == "m"


def test_bad_settings_are_refused_up_front():
    with pytest.raises(ValueError, match="retries=0"):
        OpenAIBackend("http://127.0.0.1:1", "m", retry=RetryPolicy(retries=0), check_health=False)
    with pytest.raises(ValueError, match="HOST:PORT"):
        OpenAIBackend("127.0.0.1:1", "m", check_health=False)


def test_mixed_noise_is_honoured_doc_by_doc_over_http(fake_server):
    sim = LLMSimulator(backend(fake_server.url), seed=1)
    reqs = [
        SearchRequest("capital of Peru", "What is the capital of Peru?", ("Lima",), (False, True, False)),
        SearchRequest("code of Japan", "Internet code of Japan?", (".jp",), (True, True, True)),
        SearchRequest("flag of Chad", None, (), None),
    ]
    results = sim.search(reqs, 3)
    assert (
        len(fake_server.bodies) == 1 and len(fake_server.bodies[0]["prompt"]) == 4
    )  # one request, 4 prompts
    for req, docs in zip(reqs, results, strict=True):
        assert len(docs) == 3
        for slot, doc in enumerate(docs):
            assert doc.noisy == req.noise_for(3)[slot]
            assert doc.text.startswith("NOISY" if doc.noisy else "USEFUL")
    assert sim.stats["documents_filled"] == 0 and sim.stats["reasks"] == 0


# -- the in-process OpenAI-compatible server, with the tiny model ----------------------------------------


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir, tokenizer):
    from zerosim.core.models import load_causal_lm

    return load_causal_lm(str(tiny_model_dir), "float32")


@pytest.fixture(scope="module")
def tiny_server(tiny_lm, tokenizer):
    with running_openai_server(
        TransformersBackend(tiny_lm, tokenizer, apply_chat_template=False), model_name="tiny"
    ) as url:
        yield url


def test_in_process_server_round_trip_matches_the_in_process_backend(tiny_server, tiny_lm, tokenizer):
    prompts = ["Write 2 documents about Lima.", "Write 1 document about Chad."]
    local = TransformersBackend(tiny_lm, tokenizer).complete(prompts, **SETTINGS)
    with OpenAIBackend(tiny_server, "tiny", tokenizer=tokenizer) as client:
        remote = client.complete(prompts, **SETTINGS)
    # the client applies the chat template, the server tokenizes raw text: the same tokens, the same seed
    assert remote == local


def test_simulator_over_the_in_process_server(tiny_server, tokenizer):
    sim = LLMSimulator.from_openai(tiny_server, "tiny", tokenizer=tokenizer, max_new_tokens=12, seed=5)
    reqs = [
        SearchRequest("capital of Peru", "What is the capital of Peru?", ("Lima",), (False, True, False)),
        SearchRequest("code of Japan", "Internet code of Japan?", (".jp",), (True, True, True)),
    ]
    first = sim.search(reqs, 3)
    for req, docs in zip(reqs, first, strict=True):
        assert docs and all(d.text for d in docs)
        for doc in docs:
            slot = 0 if doc.id.endswith("-empty") else int(doc.id.rsplit("-", 1)[1])
            assert doc.noisy == req.noise[slot]
    assert sim.search(reqs, 3) == first  # deterministic under the seed
    assert sim.cache_key_extra()["backend"] == "openai"
    sim.backend.close()


def test_in_process_server_api(tiny_server):
    models = httpx.get(f"{tiny_server}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "seed": 1}
    answer = httpx.post(f"{tiny_server}/v1/completions", json=body, timeout=30).json()
    assert answer["object"] == "text_completion" and answer["choices"][0]["index"] == 0
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    usage = answer["usage"]
    assert (
        usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        and usage["completion_tokens"] <= 3
    )
    unknown = httpx.post(f"{tiny_server}/v1/completions", json={**body, "model": "gpt-9"})
    assert unknown.status_code == 404 and "gpt-9" in unknown.json()["error"]["message"]
    for bad in ({"n": 2}, {"max_tokens": 0}, {"prompt": [1, 2]}, {"stream": True}, {"prompt": []}):
        response = httpx.post(f"{tiny_server}/v1/completions", json={**body, **bad})
        assert response.status_code == 400, bad
        assert response.json()["error"]["message"]
    with (
        OpenAIBackend(tiny_server, "gpt-9", retry=RetryPolicy(retries=3, backoff=0.01)) as client,
        pytest.raises(SearchError, match="HTTP 404, not retried"),
    ):
        client.complete(["x"], **SETTINGS)


def test_in_process_server_serves_lora_adapters(tiny_model_dir, tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model

    from simulators.openai_server import load_lora
    from zerosim.core.models import load_causal_lm

    adapter_dir = tmp_path / "lora"
    config = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(load_causal_lm(str(tiny_model_dir), "float32"), config).save_pretrained(adapter_dir)
    served = TransformersBackend(
        load_causal_lm(str(tiny_model_dir), "float32"), tokenizer, apply_chat_template=False
    )
    load_lora(served, parse_lora([f"sft={adapter_dir}"]))
    with running_app(create_openai_app(served, model_name="base", adapters=["sft"])) as url:
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["base", "sft"]
        settings = {**SETTINGS, "temperature": 0.0}
        with OpenAIBackend(url, "base") as base, OpenAIBackend(url, "sft") as tuned:
            assert base.complete(["hello there"], **settings) != tuned.complete(["hello there"], **settings)


def test_transformers_backend_leaves_the_global_rng_alone(tiny_lm, tokenizer):
    import torch

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    TransformersBackend(tiny_lm, tokenizer).complete(["hi"], **SETTINGS)
    assert torch.equal(torch.rand(3), expected)


# -- starting a server --------------------------------------------------------------------------------


def test_vllm_command_and_lora_parsing():
    lora = parse_lora(["sft=/ckpt/a", "judge=/ckpt/b"])
    assert lora == {"sft": "/ckpt/a", "judge": "/ckpt/b"}
    command = vllm_command(
        "/models/sim", port=9000, served_model_name="sim", lora=lora, extra_args=["--max-model-len", "4096"]
    )
    assert command[1:4] == ["serve", "/models/sim", "--host"] and "127.0.0.1" in command
    assert command[command.index("--served-model-name") + 1] == "sim"
    assert command[command.index("--lora-modules") + 1 :][:2] == ["sft=/ckpt/a", "judge=/ckpt/b"]
    assert "--enable-lora" in command and command[-2:] == ["--max-model-len", "4096"]
    assert "--enable-lora" not in vllm_command("/models/sim")
    for bad in (["nopath"], ["=x"], ["a=1", "a=2"]):
        with pytest.raises(ValueError):
            parse_lora(bad)


def test_vllm_command_runs_the_vllm_beside_this_interpreter(tmp_path, monkeypatch):
    """A virtual environment's interpreter run without activating it (``/venv/bin/zerosim ...``, ``/venv/bin/python
    -m zerosim.cli ...``) has no ``vllm`` on PATH: the command is that environment's ``vllm`` script, not a bare
    ``vllm`` (FileNotFoundError) nor another environment's found on PATH."""
    import sys

    venv, elsewhere = tmp_path / "venv" / "bin", tmp_path / "other" / "bin"
    for bin_dir in (venv, elsewhere):
        bin_dir.mkdir(parents=True)
        (bin_dir / "vllm").write_text("#!/bin/sh\n")
        (bin_dir / "vllm").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    monkeypatch.setenv("PATH", str(elsewhere))
    assert vllm_command("/models/sim")[0] == str(venv / "vllm")
    (venv / "vllm").unlink()  # no vLLM beside the interpreter: whichever PATH finds
    assert vllm_command("/models/sim")[0] == str(elsewhere / "vllm")


def test_start_simulator_server_picks_vllm_or_in_process(tiny_model_dir, monkeypatch):
    import simulators.openai_server as server

    ran = []
    monkeypatch.setattr(server.subprocess, "run", lambda cmd, check: ran.append(cmd) or subprocess_result(3))
    assert start_simulator_server(str(tiny_model_dir), ["sft=/a"], port=9001, use_vllm=True) == 3
    assert ran[0][1:3] == ["serve", str(tiny_model_dir)] and "sft=/a" in ran[0]
    served = []
    monkeypatch.setattr(server, "serve_openai", lambda *a, **kw: served.append((a, kw)))
    monkeypatch.setattr(server, "vllm_available", lambda: False)  # as on a machine without vLLM or a GPU
    assert start_simulator_server(str(tiny_model_dir), port=9002, served_model_name="sim") == 0
    assert served[0][0][1:] == ("127.0.0.1", 9002) and served[0][1]["served_model_name"] == "sim"


def subprocess_result(code: int):
    class Result:
        returncode = code

    return Result()

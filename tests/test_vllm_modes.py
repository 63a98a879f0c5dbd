"""``trainer.generation``'s vLLM modes, refused before any weight loads where they cannot run (issue 38 item 3):
no CUDA device (TRL syncs the policy's weights into vLLM over one), and for ``vllm_server`` a
``trainer.vllm_server_url`` that does not answer its health route — in the dry run and at ``train``'s start,
in seconds, instead of TRL's ``NotImplementedError`` or its 240 s wait after the models have loaded."""

from __future__ import annotations

import importlib.machinery
import socket
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from zerosim.core.config import ConfigError
from zerosim.training import recipe
from zerosim.training.config import load_train_config
from zerosim.training.dry_run import plan
from zerosim.training.recipe import require_vllm

MODES = ["vllm_colocate", "vllm_server"]


@pytest.fixture
def vllm_installed(monkeypatch):
    """A ``vllm`` module importlib finds (the real one is not installed on this CPU machine)."""
    fake = types.ModuleType("vllm")
    fake.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    monkeypatch.setitem(sys.modules, "vllm", fake)


@pytest.fixture
def no_weights(monkeypatch):
    """Every weight loader fails the test: a refusal must come first."""
    from zerosim.core import models

    def loaded(*a, **k):
        pytest.fail("a model loaded")

    for module in (models, recipe):
        monkeypatch.setattr(module, "load_causal_lm", loaded)
        monkeypatch.setattr(module, "load_tokenizer", loaded)


def train_config(tmp_path, mode: str, url: str = "http://127.0.0.1:8000"):
    return load_train_config(
        None,
        [
            f"trainer.generation={mode}",
            f"trainer.vllm_server_url={url}",
            f"run.output_dir={tmp_path / 'out'}",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        ],
    )


def dead_url() -> str:
    """A local port nothing listens on (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("mode", MODES)
def test_vllm_modes_are_refused_without_cuda_by_the_dry_run_and_by_train(
    mode, tmp_path, monkeypatch, vllm_installed, no_weights, zerosim_cli
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = train_config(tmp_path, mode)
    needs_cuda = rf"trainer.generation={mode} needs a CUDA GPU.*weight sync.*trainer.generation=hf on CPU"
    with pytest.raises(ConfigError, match=needs_cuda):
        plan(cfg)
    with pytest.raises(ConfigError, match=needs_cuda):
        require_vllm(cfg)
    with pytest.raises(ConfigError, match=needs_cuda):
        recipe.train(cfg)
    result = zerosim_cli("train", f"trainer.generation={mode}", "--dry-run", code=2)
    assert f"trainer.generation={mode} needs a CUDA GPU" in result.stderr
    assert "--dry-run --gpu-memory GB" in result.stderr  # how to plan it for its GPU machine from here
    assert not (tmp_path / "out").exists()
    # a plan for another machine's card leaves that machine's CUDA and vLLM unchecked; a server is asked all
    # the same (a dead one passed the plan and stopped the run: tests/test_faults_config.py, issue 50)
    if mode == "vllm_colocate":
        rows = dict(plan(train_config(tmp_path, mode, dead_url()), gpu_memory=80))
        assert rows["generation"].startswith(f"{mode} (for a CUDA GPU of 80 GB elsewhere: not checked here)")
    else:
        with pytest.raises(ConfigError, match=r"trainer.vllm_server_url .*/health.*--gpu-memory plans"):
            plan(train_config(tmp_path, mode, dead_url()), gpu_memory=80)


def test_a_dead_vllm_server_is_refused_in_seconds_naming_the_key(
    tmp_path, monkeypatch, vllm_installed, no_weights
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    url = dead_url()
    cfg = train_config(tmp_path, "vllm_server", url)
    started = time.perf_counter()
    for check in (plan, require_vllm, recipe.train):
        with pytest.raises(ConfigError, match=rf"trainer.vllm_server_url {url}.*/health.*trl vllm-serve"):
            check(cfg)
    assert time.perf_counter() - started < 10

    # a server that takes the connection and never answers: refused after the probe's timeout
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.perf_counter()
        with pytest.raises(ConfigError, match=r"trainer.vllm_server_url .*no answer within 0.5 s"):
            require_vllm(train_config(tmp_path, "vllm_server", url), timeout=0.5)
        assert time.perf_counter() - started < 5


@pytest.fixture
def health_server():
    """A stub of ``trl vllm-serve``: 200 on GET /health (the route TRL's ``VLLMClient.check_server`` asks),
    404 elsewhere; yields its URL and the paths asked."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


def test_a_live_vllm_server_passes_the_dry_run_and_the_start_check(
    tmp_path, monkeypatch, vllm_installed, health_server
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80e9),
    )
    url, asked = health_server
    cfg = train_config(tmp_path, "vllm_server", url + "/")
    require_vllm(cfg)
    rows = dict(plan(cfg))
    assert url in rows["generation"] and "answers" in rows["generation"]
    assert asked == ["/health", "/health"]
    # a server that answers, but not as TRL's does, is refused too
    with pytest.raises(ConfigError, match=r"trainer.vllm_server_url .*HTTP 404"):
        require_vllm(train_config(tmp_path, "vllm_server", url + "/nothing-here"))


def test_a_plan_for_another_card_asks_the_server_and_passes_a_live_one(tmp_path, monkeypatch, health_server):
    """Under --gpu-memory with no CUDA here (and no vLLM), a vllm_server that answers passes: the row says so."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    url, asked = health_server
    rows = dict(plan(train_config(tmp_path, "vllm_server", url), gpu_memory=80))
    assert rows["generation"] == (
        f"vllm_server (for a CUDA GPU of 80 GB elsewhere: CUDA and vLLM not checked here), server {url} answers"
    )
    assert asked == ["/health"]

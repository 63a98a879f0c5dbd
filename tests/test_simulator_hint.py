"""The gate on the simulator's answer hint: a training query that says little of its question is written for
from the query alone, so that the query matters to what the policy gets back."""

from __future__ import annotations

import pytest
from helpers.scripted import ScriptedBackend

from simulators import LLMSimulator
from simulators.config import SimulatorConfig
from simulators.llm import build_simulator
from simulators.relevance import content_words, question_coverage
from zerosim.core.config import ConfigError, load_config
from zerosim.core.search import SearchRequest
from zerosim.training.config import TrainConfig

QUESTION = "What is the internet country code of the country whose capital is Abu Dhabi?"
ANSWER = ".ae"


def test_coverage_counts_the_question_s_stemmed_content_words_the_query_holds():
    # stopwords and question words do not count; stems do ("countries" is "country")
    assert content_words(QUESTION) == {"internet", "countri", "code", "capit", "abu", "dhabi"}
    assert question_coverage("what", QUESTION) == 0.0
    assert question_coverage("What is it?", QUESTION) == 0.0
    assert question_coverage(QUESTION, QUESTION) == 1.0
    assert question_coverage("internet code of Abu Dhabi", QUESTION) == pytest.approx(4 / 6)
    assert question_coverage("countries with capitals", QUESTION) == pytest.approx(2 / 6)
    assert question_coverage("anything", "What is it?") == 1.0  # nothing to cover


def _prompts(sim: LLMSimulator, backend: ScriptedBackend, queries: list[str]) -> list[str]:
    requests = [SearchRequest(q, QUESTION, (ANSWER,), (False, True)) for q in queries]
    sim.search(requests, 2)
    return backend.calls[0]


def test_a_query_below_the_coverage_gets_no_question_and_no_answers():
    backend = ScriptedBackend()
    sim = LLMSimulator(backend, hint_min_coverage=0.5, on_short="fill", on_leak="keep")
    useful_good, noisy_good, useful_what, noisy_what = _prompts(
        sim, backend, ["internet country code Abu Dhabi", "what"]
    )
    for prompt in (useful_good, noisy_good):
        assert ANSWER in prompt and QUESTION in prompt
    for prompt in (useful_what, noisy_what):
        assert ANSWER not in prompt and "Abu Dhabi" not in prompt
    # written for the query alone: the prompt evaluation sends for the same query
    plain = LLMSimulator(ScriptedBackend(), pass_answers=False)
    assert useful_what == plain._prompt(SearchRequest("what"), False, 1, hinted=False)
    assert sim.stats["answers_withheld"] == 1
    assert sim.cache_key_extra()["hint_min_coverage"] == 0.5


def test_without_the_gate_every_training_query_is_shown_the_answers():
    backend = ScriptedBackend()
    sim = LLMSimulator(backend, on_short="fill", on_leak="keep")
    prompts = _prompts(sim, backend, ["internet country code Abu Dhabi", "what"])
    assert all(ANSWER in p and QUESTION in p for p in prompts)
    assert "answers_withheld" not in sim.stats
    # caches written before the setting existed stay valid
    assert "hint_min_coverage" not in sim.cache_key_extra()


def test_the_setting_reaches_the_simulator_and_is_range_checked(tiny_model_dir):
    cfg = SimulatorConfig(model=str(tiny_model_dir), hint_min_coverage=0.4)
    assert build_simulator(cfg).hint_min_coverage == 0.4
    with pytest.raises(ValueError, match="hint_min_coverage"):
        LLMSimulator(ScriptedBackend(), hint_min_coverage=1.5)
    with pytest.raises(ConfigError, match="hint_min_coverage"):
        load_config(None, ["search.simulator.hint_min_coverage=1.5"], schema=TrainConfig)

import pytest

from simulators import LLMSimulator, SimulatorPrompts, split_documents
from simulators.llm import EMPTY_RESULT_TEXT
from zerosim.search import SearchRequest


def test_split_documents_markers_lines_and_limits():
    assert split_documents("Sure!\nDoc 1: a b\nDoc 2: c\nDoc 3: d\nDoc 4: e", 3) == ["a b", "c", "d"]
    assert split_documents("**Doc 1:** x\n**Doc 2:** y", 5) == ["x", "y"]
    assert split_documents("one line\n\n- two\n3. three", 3) == ["one line", "two", "three"]
    assert split_documents("   \n\n", 3) == []


def test_prompts_render_modes_and_withhold_answers():
    p = SimulatorPrompts()
    useful = p.render(
        query="capital of Peru", k=2, words=20, noisy=False, question="Capital of Peru?", answers=["Lima"]
    )
    noisy = p.render(
        query="capital of Peru", k=2, words=20, noisy=True, question="Capital of Peru?", answers=["Lima"]
    )
    assert "Lima" in useful and "Lima" in noisy and useful != noisy and "must not contain" in noisy
    blind = p.render(query="capital of Peru", k=2, words=20, noisy=False, question=None, answers=())
    assert "Lima" not in blind


@pytest.fixture(scope="module")
def tiny_sim(tiny_model_dir):
    return LLMSimulator.from_pretrained(str(tiny_model_dir), max_new_tokens=24, seed=3)


def test_mixed_noise_is_honoured_slot_by_slot(tiny_sim):
    reqs = [
        SearchRequest("capital of Peru", "What is the capital of Peru?", ("Lima",), (False, True, False)),
        SearchRequest("code of Japan", "Internet code of Japan?", (".jp",), (True, True, True)),
    ]
    results = tiny_sim.search(reqs, 3)
    assert len(results) == 2
    for req, docs in zip(reqs, results, strict=True):
        assert 1 <= len(docs) <= 3
        for doc in docs:
            if doc.text == EMPTY_RESULT_TEXT:
                continue
            slot = int(doc.id.rsplit("-", 1)[1])
            assert doc.noisy == req.noise[slot]
    # one prompt per (request, mode): 2 for the mixed request, 1 for the all-noisy one
    assert len(tiny_sim._jobs(reqs, 3)) == 3


def test_simulator_is_deterministic_under_a_seed(tiny_sim):
    reqs = [SearchRequest("population of Chile", "Population of Chile?", ("19 million",), (False, False))]
    assert tiny_sim.search(reqs, 2) == tiny_sim.search(reqs, 2)


def test_unparseable_output_becomes_explicit_failure_document(tiny_sim, monkeypatch):
    from zerosim.generation import Generation

    monkeypatch.setattr(
        tiny_sim.generator, "generate", lambda prompts, n: [Generation([], [], "eos") for _ in prompts]
    )
    before = tiny_sim.stats["empty_results"]
    (docs,) = tiny_sim.search([SearchRequest("q", noise=(True, True))], 2)
    assert [d.text for d in docs] == [EMPTY_RESULT_TEXT] and docs[0].noisy is True
    assert tiny_sim.stats["empty_results"] == before + 1

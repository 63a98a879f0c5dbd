import pytest
from helpers.scripted import ScriptedBackend
from hypothesis import given, settings
from hypothesis import strategies as st

from simulators import LLMSimulator, SimulatorPrompts, split_documents
from simulators.llm import EMPTY_RESULT_TEXT
from zerosim.core.search import SearchRequest


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
    assert len(tiny_sim._jobs(reqs, 3, [False] * len(reqs))) == 3


def test_simulator_is_deterministic_under_a_seed(tiny_sim):
    reqs = [SearchRequest("population of Chile", "Population of Chile?", ("19 million",), (False, False))]
    assert tiny_sim.search(reqs, 2) == tiny_sim.search(reqs, 2)


def test_unparseable_output_becomes_explicit_failure_document(tiny_sim, monkeypatch):
    from zerosim.core.generation import Generation

    monkeypatch.setattr(
        tiny_sim.generator, "generate", lambda prompts, n: [Generation([], [], "eos") for _ in prompts]
    )
    before = tiny_sim.stats["empty_results"]
    (docs,) = tiny_sim.search([SearchRequest("q", noise=(True, True))], 2)
    assert [d.text for d in docs] == [EMPTY_RESULT_TEXT] and docs[0].noisy is True
    assert tiny_sim.stats["empty_results"] == before + 1


# -- split_documents: properties --------------------------------------------------------------------------

# one document's text: no line breaks (a document is one line), not blank, and not opening with markdown
# emphasis (which a parser may rightly read as part of a "**Doc 1:**" marker)
_line = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), min_size=1, max_size=60).filter(
    lambda t: t.strip() and not t.lstrip().startswith("*")
)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400), st.integers(min_value=0, max_value=8))
def test_split_documents_never_crashes_and_respects_k(text, k):
    docs = split_documents(text, k)
    assert len(docs) <= k
    assert all(d and d == d.strip() and "\n" not in d for d in docs)


@settings(max_examples=300, deadline=None)
@given(st.lists(_line, min_size=1, max_size=6), st.integers(min_value=1, max_value=8))
def test_split_documents_round_trips_doc_markers(texts, k):
    rendered = "\n".join(f"Doc {i}: {t}" for i, t in enumerate(texts, start=1))
    assert split_documents(rendered, k) == [" ".join(t.split()) for t in texts][:k]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(_line, min_size=1, max_size=6),
    st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp", "Nd")), max_size=40),
)
def test_split_documents_drops_a_preamble_before_the_markers(texts, preamble):
    rendered = preamble + "\n" + "\n".join(f"Doc {i}: {t}" for i, t in enumerate(texts, start=1))
    assert split_documents(rendered, len(texts)) == [" ".join(t.split()) for t in texts]


# -- short output: re-ask or fill (a scripted backend) ----------------------------------------------------


def test_reask_asks_once_for_the_missing_slots_only():
    from simulators.llm import MISSING_DOC_TEXT

    backend = ScriptedBackend(
        ["Doc 1: useful one", "Doc 1: noisy one\nDoc 2: noisy two", "nothing useful here"],
        ["Doc 1: useful two", ""],
    )
    sim = LLMSimulator(backend, on_short="reask")
    reqs = [SearchRequest("q1", "Q1?", ("a",), (False, True, False, True)), SearchRequest("q2")]
    mixed, plain = sim.search(reqs, 4)
    assert len(backend.calls) == 2  # one call, one re-ask
    reask = backend.calls[1]
    assert len(reask) == 2 and "write 1 short" in reask[0] and "write 3 short" in reask[1]
    assert [d.text for d in mixed] == ["useful one", "noisy one", "useful two", "noisy two"]
    assert [d.noisy for d in mixed] == [False, True, False, True]
    assert [d.text for d in plain] == ["nothing useful here", *[MISSING_DOC_TEXT] * 3]
    assert len({d.id for d in plain}) == 4  # one id per slot, even for the same filler text
    assert sim.stats["reasks"] == 1 and sim.stats["documents_reasked"] == 4
    assert sim.stats["documents_recovered"] == 1 and sim.stats["documents_filled"] == 3
    assert sim.stats["documents_requested"] == 8 and sim.stats["documents_parsed"] == 5


def test_fill_mode_fills_missing_slots_with_failure_documents_and_counts_them():
    from simulators.llm import EMPTY_RESULT_TEXT, MISSING_DOC_TEXT

    backend = ScriptedBackend(["Doc 1: only one", "Doc 1: noisy"], [""])
    sim = LLMSimulator(backend, on_short="fill")
    reqs = [SearchRequest("q1", noise=(False, False, True)), SearchRequest("q2", noise=(True, False, False))]
    with_gap, nothing = sim.search(reqs, 3)
    assert len(backend.calls) == 1  # no re-ask
    assert [d.text for d in with_gap] == ["only one", MISSING_DOC_TEXT, "noisy"]
    assert [d.noisy for d in with_gap] == [False, False, True]
    assert [d.text for d in nothing] == [EMPTY_RESULT_TEXT] and nothing[0].noisy is True
    (empty,) = sim.search([SearchRequest("q3", noise=(True, True))], 2)
    assert [d.text for d in empty] == [EMPTY_RESULT_TEXT] and empty[0].noisy is True
    assert sim.stats["documents_filled"] == 1 + 3 + 2 and sim.stats["empty_results"] == 2
    assert not LLMSimulator.is_cacheable(with_gap) and LLMSimulator.is_cacheable(with_gap[:1])


def test_reask_that_still_fails_fills_and_never_returns_empty():
    from simulators.llm import EMPTY_RESULT_TEXT

    sim = LLMSimulator(ScriptedBackend(["", "   "], ["\n\n", ""]), on_short="reask")
    results = sim.search([SearchRequest("q1", noise=(False, True)), SearchRequest("q2")], 2)
    assert [[d.text for d in docs] for docs in results] == [[EMPTY_RESULT_TEXT], [EMPTY_RESULT_TEXT]]
    assert sim.stats["reasks"] == 1 and sim.stats["empty_results"] == 2 and sim.stats["documents_filled"] == 4


# -- noisy documents that give the answer away ---------------------------------------------------------------


def test_leaking_noisy_slots_are_reasked_with_the_short_ones_then_relabelled():
    backend = ScriptedBackend(
        # request 1: useful slot 0 fine; noisy slots 1, 2: the second names the answer (Algiers)
        # request 2: useful slot 2 fine; noisy slot 0 leaks, slot 1 missing
        [
            "Doc 1: Algiers is the capital.",
            "Doc 1: Oran is a port.\nDoc 2: The capital is Algiers.",
            "Doc 1: Algiers hosts the parliament.",
            "Doc 1: Algiers, the capital.",
        ],
        # the re-ask: request 1's leaking slot now clean; request 2's two slots: one still leaks
        ["Doc 1: Constantine has bridges.", "Doc 1: algiers, again.\nDoc 2: Tlemcen has mosques."],
    )
    sim = LLMSimulator(backend, on_short="reask", on_leak="reask")
    q = ("What is the capital of Algeria?", ("Algiers",))
    reqs = [
        SearchRequest("capital", *q, (False, True, True)),
        SearchRequest("capital", *q, (True, True, False)),
    ]
    first, second = sim.search(reqs, 3)
    assert len(backend.calls) == 2
    assert "write 1 short" in backend.calls[1][0] and "write 2 short" in backend.calls[1][1]
    assert [d.text for d in first] == [
        "Algiers is the capital.",
        "Oran is a port.",
        "Constantine has bridges.",
    ]
    assert [d.noisy for d in first] == [False, True, True]
    # request 2: the re-asked slot that still leaks is relabelled (noisy=False), the missing one was written
    assert [d.text for d in second[:2]] == ["algiers, again.", "Tlemcen has mosques."]
    assert [d.noisy for d in second] == [False, True, False]
    assert sim.stats["noisy_leaks"] == 2 and sim.stats["noisy_leaks_fixed"] == 1
    assert sim.stats["noisy_relabelled"] == 1


def test_a_short_slot_that_leaks_after_the_reask_is_relabelled_not_counted_as_a_fix():
    backend = ScriptedBackend(["Doc 1: Oran."], ["Doc 1: Algiers."])
    sim = LLMSimulator(backend, on_short="reask", on_leak="reask")
    (docs,) = sim.search([SearchRequest("capital", "Capital?", ("Algiers",), (True, True))], 2)
    assert [d.text for d in docs] == ["Oran.", "Algiers."] and [d.noisy for d in docs] == [True, False]
    assert sim.stats["noisy_leaks"] == 0 and sim.stats["noisy_leaks_fixed"] == 0
    assert sim.stats["noisy_relabelled"] == 1


def test_a_leak_that_survives_the_reask_is_marked_useful():
    backend = ScriptedBackend(["Doc 1: Algiers.\nDoc 2: Oran."], ["Doc 1: Still Algiers."])
    sim = LLMSimulator(backend, on_leak="reask")
    (docs,) = sim.search([SearchRequest("capital", "Capital?", ("Algiers",), (True, True))], 2)
    assert [d.text for d in docs] == ["Still Algiers.", "Oran."]
    assert [d.noisy for d in docs] == [False, True]  # the realised noise is what the policy really saw
    assert sim.stats["noisy_leaks"] == 1 and sim.stats["noisy_leaks_fixed"] == 0
    assert sim.stats["noisy_relabelled"] == 1


@pytest.mark.parametrize("on_leak, noisy", [("relabel", [False, True]), ("keep", [True, True])])
def test_relabel_and_keep_make_no_extra_call(on_leak, noisy):
    backend = ScriptedBackend(["Doc 1: Algiers.\nDoc 2: Oran."])
    sim = LLMSimulator(backend, on_leak=on_leak)
    (docs,) = sim.search([SearchRequest("capital", "Capital?", ("Algiers",), (True, True))], 2)
    assert len(backend.calls) == 1 and [d.noisy for d in docs] == noisy
    assert sim.stats["noisy_relabelled"] == (1 if on_leak == "relabel" else 0)


def test_without_answers_nothing_is_checked():
    backend = ScriptedBackend(["Doc 1: Algiers.\nDoc 2: Oran."])
    sim = LLMSimulator(backend, on_leak="reask")
    (docs,) = sim.search([SearchRequest("capital", noise=(True, True))], 2)
    assert len(backend.calls) == 1 and [d.noisy for d in docs] == [True, True]


def test_engine_counters_reach_the_rollout_metrics():
    from simulators import CachedSearchEngine
    from zerosim.agent.rollout import engine_counters

    sim = LLMSimulator(ScriptedBackend(["Doc 1: Algiers.\nDoc 2: Oran."]), on_leak="relabel")
    cached = CachedSearchEngine(sim, key_extra=sim.cache_key_extra())
    req = SearchRequest("capital", "Capital?", ("Algiers",), (True, True))
    cached.search([req], 2)
    cached.search([req], 2)
    counters = engine_counters(cached)
    assert counters["search/cache/hits"] == 1 and counters["search/cache/misses"] == 1
    assert counters["search/simulator/noisy_relabelled"] == 1
    assert counters["search/simulator/requests"] == 1


def test_bad_backend_answers_and_settings_are_errors():
    from zerosim.core.search import SearchError

    class Short(ScriptedBackend):
        def complete(self, prompts, **kw):
            return []

    with pytest.raises(SearchError, match="returned 0 texts for 1 prompts"):
        LLMSimulator(Short()).search([SearchRequest("q")], 1)
    with pytest.raises(ValueError, match="on_short='retry'"):
        LLMSimulator(ScriptedBackend(), on_short="retry")
    with pytest.raises(ValueError, match="on_leak='drop' is not one of reask, relabel, keep"):
        LLMSimulator(ScriptedBackend(), on_leak="drop")
    assert LLMSimulator(ScriptedBackend()).search([], 3) == []


def test_cache_key_extra_names_what_changes_the_output():
    base = LLMSimulator(ScriptedBackend(), seed=1).cache_key_extra()
    assert base["backend"] == "scripted" and base["seed"] == 1
    assert LLMSimulator(ScriptedBackend(), seed=2).cache_key_extra() != base
    other = SimulatorPrompts(useful="Results for {query}: {k} x {words}{context}")
    assert (
        LLMSimulator(ScriptedBackend(), seed=1, prompts=other).cache_key_extra()["templates"]
        != base["templates"]
    )


# -- template files ----------------------------------------------------------------------------------------


def test_templates_from_yaml_and_json_files(tmp_path):
    import json

    from simulators import load_prompts

    yaml_file = tmp_path / "t.yaml"
    yaml_file.write_text("useful: 'Search results for {query} ({k} of them, {words} words){context}'\n")
    prompts = load_prompts(yaml_file)
    assert prompts.useful.startswith("Search results for") and prompts.noisy == SimulatorPrompts().noisy
    json_file = tmp_path / "t.json"
    json_file.write_text(json.dumps({"noisy_context": " Avoid {answers}."}))
    assert load_prompts(json_file).noisy_context == " Avoid {answers}."
    backend = ScriptedBackend()
    LLMSimulator(backend, prompts=str(yaml_file)).search([SearchRequest("tea")], 1)
    assert backend.calls[0][0].startswith("Search results for tea (1 of them, 30 words)")


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ("usefull: 'x {query}'\n", r"unknown keys \['usefull'\]; valid keys: useful, noisy"),
        ("useful: 3\n", "useful must be a string"),
        ("useful: 'x {query} {colour}'\n", "useful is not a valid template"),
        ("noisy: 'no query here'\n", "noisy never uses {query}"),
        ("- a\n- b\n", "must hold a mapping"),
        ("useful: [unclosed\n", "cannot be parsed"),
    ],
)
def test_bad_template_files_are_clear_errors(tmp_path, content, error):
    from simulators import load_prompts

    path = tmp_path / "t.yaml"
    path.write_text(content)
    with pytest.raises(ValueError, match=error):
        load_prompts(path)


class EchoBackend:
    """Answers each prompt from its own text alone (its query line), whatever else is in the call."""

    def complete(self, prompts, *, max_new_tokens, temperature, top_p, seed):
        return [
            "\n".join(f"Doc {i}: about {p.split('Query: ')[1].splitlines()[0]} {i}" for i in (1, 2))
            for p in prompts
        ]

    def describe(self):
        return {"backend": "echo", "model": "none"}


def test_document_ids_name_the_document_not_its_place_in_the_call():
    """A request alone and the same request second in a batch get the same documents, ids included; two
    different documents written at the same place in two calls do not share an id (step rewards count a
    seen id as a repeat)."""
    sim = LLMSimulator(EchoBackend())
    first, second = SearchRequest("capital of peru"), SearchRequest("longest river")
    batched = sim.search([first, second], 2)
    alone = sim.search([second], 2)
    assert batched[1] == alone[0]
    assert not {d.id for d in batched[0]} & {d.id for d in alone[0]}

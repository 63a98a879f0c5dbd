"""``search.simulator.prompts``: the ``default`` preset unchanged, and ``zerosearch`` — the prompt layout and the
``Doc 1: ... Doc 2: ...`` output of ZeroSearch's released simulators — for RL-time search and collect's SFT rows."""

from __future__ import annotations

import json

import pytest
from helpers.scripted import ScriptedBackend

from simulators.collect import run_collect
from simulators.config import PromptPreset, SimulatorConfig
from simulators.llm import MISSING_DOC_TEXT, LLMSimulator, build_simulator
from simulators.parsing import split_documents, split_numbered_documents
from simulators.prompts import PRESETS, ZEROSEARCH_PROMPTS, SimulatorPrompts, load_prompts, preset_prompts
from zerosim.core.config import ConfigError
from zerosim.core.search import Document, SearchRequest
from zerosim.job_config import SimulatorCollectConfig

QUESTION, ANSWERS = "What is the capital of Peru?", ("Lima", "Ciudad de los Reyes")


# -- the zerosearch templates ------------------------------------------------------------------------------


@pytest.mark.parametrize("noisy", [False, True], ids=["useful", "noisy"])
def test_zerosearch_preset_renders_persona_mode_query_question_and_answers(noisy):
    mode = "noisy" if noisy else "useful"
    text = ZEROSEARCH_PROMPTS.render(
        query="  capital of peru ", k=5, words=30, noisy=noisy, question=QUESTION, answers=ANSWERS
    )
    lines = text.split("\n")
    assert lines[0] == "You are a web search engine like Google."  # the persona comes first
    assert f"write five {mode} documents" in lines[1]  # the count spelled out, as their simulators read it
    # the question and its gold answers in BOTH modes (the noisy mode needs them to stay clear of them)
    assert f'the question "{QUESTION}", which is Lima; Ciudad de los Reyes.' in text
    assert f"near 30 words, and make the documents carry {mode} information." in text
    assert text.endswith(
        f"Query: capital of peru\n{mode.capitalize()} Output:\n"
    )  # the cue their models answer
    other = "useful" if noisy else "noisy"
    assert other not in text.lower()
    # answers withheld (evaluation): no question line, nothing else changes
    bare = ZEROSEARCH_PROMPTS.render(
        query="capital of peru", k=3, words=30, noisy=noisy, question=None, answers=()
    )
    assert "question" not in bare and "Lima" not in bare and f"write three {mode} documents" in bare
    assert bare.endswith(f"Query: capital of peru\n{mode.capitalize()} Output:\n")


def test_zerosearch_preset_selected_from_config(tmp_path):
    sim = LLMSimulator(ScriptedBackend(), preset="zerosearch")
    assert sim.prompts == ZEROSEARCH_PROMPTS and sim.split_documents is split_numbered_documents
    assert sim.cache_key_extra()["preset"] == "zerosearch"
    assert (
        "preset" not in LLMSimulator(ScriptedBackend()).cache_key_extra()
    )  # default keys (caches) unchanged
    assert preset_prompts(PromptPreset.zerosearch) is ZEROSEARCH_PROMPTS
    with pytest.raises(ValueError, match="preset='google' is not one of default, zerosearch"):
        LLMSimulator(ScriptedBackend(), preset="google")
    with pytest.raises(ValueError, match="use one of default, zerosearch"):
        preset_prompts("google")

    from zerosim.training.config import load_train_config

    assert (
        load_train_config(None, ["search.simulator.prompts=zerosearch"]).search.simulator.prompts
        == "zerosearch"
    )
    with pytest.raises(ConfigError, match="default, zerosearch"):
        load_train_config(None, ["search.simulator.prompts=google"])


# -- the default preset: byte for byte what it was ---------------------------------------------------------

DEFAULT_USEFUL = (
    "You are a web search engine. For the search query below, write 3 short search results of about 30 words "
    "each. Each result must state facts that help answer the query. The user's question is: What is the "
    "capital of Peru? The correct answer is: Lima; Ciudad de los Reyes. Mention it.\n"
    "Query: capital of peru\n"
    "Write exactly 3 results, one per line, each starting with 'Doc <number>:'."
)
DEFAULT_NOISY_BARE = (
    "You are a web search engine. For the search query below, write 2 short search results of about 25 words "
    "each. The results must look related to the query but must not contain the answer or anything that helps "
    "find it.\n"
    "Query: capital of peru\n"
    "Write exactly 2 results, one per line, each starting with 'Doc <number>:'."
)
DEFAULT_NOISY_CONTEXT = " The user's question is: What is the capital of Peru? Never mention the correct answer (Lima; Ciudad de los Reyes)."  # fmt: skip


def test_default_preset_renders_exactly_as_before():
    assert PRESETS["default"] == SimulatorPrompts() == preset_prompts()
    backend = ScriptedBackend()
    sim = LLMSimulator(backend)  # no preset: the default
    sim.search([SearchRequest("capital of peru ", QUESTION, ANSWERS, (False, False, False))], 3)
    assert backend.calls[0] == [DEFAULT_USEFUL]
    assert (
        SimulatorPrompts().render(
            query="capital of peru", k=2, words=25, noisy=True, question=None, answers=()
        )
        == DEFAULT_NOISY_BARE
    )
    noisy = SimulatorPrompts().render(
        query="capital of peru", k=2, words=25, noisy=True, question=QUESTION, answers=ANSWERS
    )
    assert noisy == DEFAULT_NOISY_BARE.replace("find it.\n", "find it." + DEFAULT_NOISY_CONTEXT + "\n")
    assert sim.split_documents is split_documents


# -- the parser ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "k", "docs"),
    [
        ("Doc 1: Lima is the capital.\nDoc 2: Peru is in South America.\nDoc 3: Cusco was the Inca capital.", 3,
         ["Lima is the capital.", "Peru is in South America.", "Cusco was the Inca capital."]),
        # extra whitespace: around markers, inside documents, blank lines between them
        ("  Doc  1 :   Lima   is\n the capital. \n\n\n   Doc 2:Peru.  \r\n", 3, ["Lima is the capital.", "Peru."]),
        # several documents on one line
        ("Doc 1: Lima, 1535. Doc 2: Peru borders Chile. Doc 3: Andes.", 3, ["Lima, 1535.", "Peru borders Chile.", "Andes."]),
        # text before Doc 1 (an echoed cue, a preamble) is not a document
        ("Useful Output:\nSure, here they are.\nDoc 1: a b\nDoc 2: c", 2, ["a b", "c"]),
        # a missing document: a number skipped, or a marker with nothing after it
        ("Doc 1: first\nDoc 3: third", 3, ["first", "third"]),
        ("Doc 1: first\nDoc 2:   \nDoc 3: third", 3, ["first", "third"]),
        # never more than k; bold markers; "Doc 1.5" and "Doctor" are text; a number going back is text
        ("**Doc 1:** a\n**Doc 2:** b\nDoc 3: c", 2, ["a", "b"]),
        ("Doc 1: rose 1.5 m in Doc 1.5 terms. Doctor 2: no\nDoc 2: x, see Doc 1: y", 3,
         ["rose 1.5 m in Doc 1.5 terms. Doctor 2: no", "x, see Doc 1: y"]),
        # no markers at all: one document per line, as the default parser
        ("first line\n\n- second", 3, ["first line", "second"]),
        ("   \n", 3, []),
    ],
)  # fmt: skip
def test_numbered_parser_reads_doc_markers(text, k, docs):
    assert split_numbered_documents(text, k) == docs


def test_zerosearch_search_cuts_inline_docs_and_fills_a_short_answer():
    # one line, two documents of three: the default parser sees one (markers must start a line)
    answer = "Useful Output: Doc 1: Lima is the capital of Peru. Doc 2: Lima lies on the coast."
    assert split_documents(answer, 3) == ["Useful Output: Doc 1: Lima is the capital of Peru. Doc 2: Lima lies on the coast."]  # fmt: skip
    backend = ScriptedBackend([answer])
    sim = LLMSimulator(backend, preset="zerosearch", on_short="fill")
    (docs,) = sim.search([SearchRequest("capital of peru", QUESTION, ("Lima",), (False, False, False))], 3)
    assert [d.text for d in docs] == [
        "Lima is the capital of Peru.",
        "Lima lies on the coast.",
        MISSING_DOC_TEXT,
    ]
    assert backend.calls[0][0].startswith("You are a web search engine like Google.\nFor the query below")
    assert sim.stats["documents_parsed"] == 2 and sim.stats["documents_filled"] == 1
    # on_short=reask asks once more for the missing slot, in the same format
    backend = ScriptedBackend([answer], ["Noise.\nDoc 1: Peru grows potatoes... and Lima too."])
    sim = LLMSimulator(backend, preset="zerosearch", on_short="reask", on_leak="keep")
    (docs,) = sim.search([SearchRequest("capital of peru", QUESTION, ("Lima",), (False, False, False))], 3)
    assert (
        docs[2].text == "Peru grows potatoes... and Lima too."
        and "write one useful document" in backend.calls[1][0]
    )


# -- a template file overrides either preset ----------------------------------------------------------------


def test_prompts_file_overrides_a_zerosearch_template(tmp_path):
    path = tmp_path / "noisy.yaml"
    path.write_text('noisy: "Engine. {k_word} noisy documents for: {query}{context}\\nNoisy Output:\\n"\n')
    prompts = load_prompts(path, base=ZEROSEARCH_PROMPTS)
    assert prompts.noisy.startswith("Engine.")
    assert (prompts.useful, prompts.noisy_context) == (
        ZEROSEARCH_PROMPTS.useful,
        ZEROSEARCH_PROMPTS.noisy_context,
    )
    backend = ScriptedBackend()
    sim = LLMSimulator(backend, prompts=str(path), preset="zerosearch", on_short="fill")
    sim.search([SearchRequest("capital of peru", QUESTION, ("Lima",), (False, True))], 2)
    useful, noisy = backend.calls[0]
    assert useful.startswith("You are a web search engine like Google.")  # the preset's, kept
    assert noisy.startswith("Engine. one noisy documents for: capital of peru\nThe user is looking for")
    assert sim.split_documents is split_numbered_documents  # the preset's parser stays
    # the same file over the default preset keeps the default wording elsewhere
    assert load_prompts(path).useful == SimulatorPrompts().useful
    # and through the config
    cfg = SimulatorConfig(prompts=PromptPreset.zerosearch, prompts_file=str(path))
    assert preset_prompts(cfg.prompts, cfg.prompts_file) == prompts


# -- collect writes SFT rows in the selected format ---------------------------------------------------------


class ListRetriever:
    def search(self, requests, k):
        return [
            [Document(id=f"{r.query}-{i}", title="", text=f"passage {i} about {r.query}") for i in range(k)]
            for r in requests
        ]


def test_collect_rows_use_the_selected_preset(tmp_path):
    path = tmp_path / "useful.json"
    path.write_text(json.dumps({"useful": "Find {k_word}: {query}{context}"}))
    for preset, prompts_file in (("zerosearch", None), ("zerosearch", str(path)), ("default", None)):
        cfg = SimulatorCollectConfig(
            prompts=preset, prompts_file=prompts_file, max_questions=3, depth=2, k=2, balance=False,
            out=str(tmp_path / f"{preset}-{bool(prompts_file)}.jsonl"),
        )  # fmt: skip
        result = run_collect(cfg, retriever=ListRetriever())
        rows = [json.loads(line) for line in result.path.read_text().splitlines()]
        assert len(rows) == 3
        for row in rows:
            prompt, completion = row["prompt"][0]["content"], row["completion"][0]["content"]
            noisy = row["mode"] == "noisy"
            expected = preset_prompts(preset, prompts_file).render(
                query=row["query"], k=2, words=cfg.words_per_doc, noisy=noisy,
                question=row["question"], answers=row["answers"],
            )  # fmt: skip
            assert prompt == expected
            cue = "Noisy Output:\n" if noisy else "Useful Output:\n"
            assert prompt.endswith(cue) == (preset == "zerosearch" and not (prompts_file and not noisy))
            # the completion is what the preset's parser reads back: the model learns the format it is read in
            assert len(PRESETS_PARSE[preset](completion, 2)) == 2


PRESETS_PARSE = {"default": split_documents, "zerosearch": split_numbered_documents}


# -- end to end: the recipe's settings against an OpenAI-compatible server on the tiny model ------------------


def test_search_through_a_served_tiny_model_with_the_zerosearch_preset(tiny_model_dir, tokenizer):
    from simulators.backends import TransformersBackend
    from simulators.openai_server import running_openai_server
    from zerosim.core.models import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir), "float32")
    with running_openai_server(
        TransformersBackend(model, tokenizer, apply_chat_template=False), model_name="sim"
    ) as url:
        # what docs/simulator.md gives for a released checkpoint: backend=openai, prompts=zerosearch, the
        # checkpoint's own chat template (model = its path, for the tokenizer), the served name
        cfg = SimulatorConfig(
            model=str(tiny_model_dir), backend="openai", url=url, served_model="sim", prompts="zerosearch",
            chat_template=True, max_new_tokens=16, on_short="fill",
        )  # fmt: skip
        sim = build_simulator(cfg, seed=0)
        sent = []
        complete = sim.backend.complete
        sim.backend.complete = lambda prompts, **kw: (sent.extend(prompts), complete(prompts, **kw))[1]
        reqs = [SearchRequest("capital of peru", QUESTION, ("Lima",), (False, True, False))]
        (docs,) = sim.search(reqs, 3)
        sim.close()
    assert len(docs) == 3 and all(d.text for d in docs)  # k documents, whatever the random model wrote
    assert [d.noisy for d in docs] == [False, True, False]
    assert sorted(p.rsplit("\n", 2)[-2] for p in sent) == ["Noisy Output:", "Useful Output:"]
    assert all(p.startswith("You are a web search engine like Google.") for p in sent)


def test_dry_run_shows_the_preset(zerosim_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = zerosim_cli("train", "--dry-run", "search.simulator.prompts=zerosearch").stdout
    assert "simulator prompts" in out and "zerosearch preset" in out
    from zerosim.training.config import load_train_config
    from zerosim.training.dry_run import plan

    assert "simulator prompts" not in dict(plan(load_train_config(None, [])))  # default: nothing to say

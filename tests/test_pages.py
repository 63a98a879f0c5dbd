"""The read_page tool: corpus pages (a factbook section, a wiki article), pages the simulator writes by the
curriculum's own draw, results numbered across a trajectory, a page of no result as an invalid turn, engines with
no pages refused, and warm-start demonstrations that search, read and answer."""

from __future__ import annotations

import json

import pytest

from tests.test_tools import Scripted, call
from zerosim.agent.rollout import Protocol, RolloutConfig, SearchRollout, build_prompt
from zerosim.core.pages import CorpusPages, PageRequest, page_reader
from zerosim.core.search import Document, SearchError

QUESTION = "What is the capital of Peru?"


def article(title: str, n: int, prefix: str = "p") -> list[Document]:
    return [Document(f"{prefix}-{i}", title, f"{title} sentence {i} " + "word " * 20) for i in range(n)]


def test_a_corpus_page_is_its_document_around_the_result_within_the_budget():
    docs = [*article("Peru", 6), *article("Chile", 3, "c")]
    pages = CorpusPages(docs)
    [page] = pages.read_pages([PageRequest(document=docs[3])], max_words=80)  # 23 words a passage: 3 fit
    assert page.title == "Peru" and page.noisy is None
    assert [line.split()[2] for line in page.text.splitlines()] == ["2", "3", "4"]  # in corpus order
    [whole] = pages.read_pages([PageRequest(document=docs[7])], max_words=10_000)
    assert whole.text.count("Chile sentence") == 3 and "Peru" not in whole.text
    [one] = pages.read_pages([PageRequest(document=docs[0])], max_words=1)  # the result itself, at least
    assert one.text == docs[0].text
    with pytest.raises(SearchError, match="not a passage of the search corpus"):
        pages.read_pages([PageRequest(document=Document("sim-x-0", "Peru", "written"))], 50)


def test_the_embedded_factbook_pages_are_country_sections():
    from zerosim.core.data.embedded import ensure_factbook
    from zerosim.engines import SearchConfig, page_grouping

    assert page_grouping(SearchConfig(engine="bm25")) == "id"
    assert page_grouping(SearchConfig(engine="bm25", page_by="title")) == "title"
    rows = [json.loads(line) for line in ensure_factbook(progress=False).corpus.open()]
    docs = [Document.from_contents(r["id"], r["contents"]) for r in rows if r["id"].startswith("pe-")]
    chunked = next(
        d for d in docs if d.title.count(" - ") == 2
    )  # a long field's chunk: titled with its field
    [page] = CorpusPages(docs, by="id").read_pages([PageRequest(document=chunked)], max_words=100_000)
    section = chunked.id.rsplit("-", 1)[0]
    assert page.title == " - ".join(chunked.title.split(" - ")[:2])
    assert page.text.count("\n") + 1 == sum(d.id.rsplit("-", 1)[0] == section for d in docs) > 1


class CorpusEngine:
    """A retriever over ``docs`` that returns the passages in order (what page_reader sees: ``.docs``)."""

    def __init__(self, docs):
        self.docs, self.queries = docs, []

    def search(self, requests, k):
        self.queries += [r.query for r in requests]
        return [self.docs[:k] for _ in requests]


def page_rollout(tokenizer, engine, **cfg):
    config = RolloutConfig(
        protocol=Protocol.tools, tools=["search", "read_page"], max_turns=4, max_new_tokens=64,
        max_completion_tokens=2000, max_page_tokens=120, **cfg,
    )  # fmt: skip
    examples = {build_prompt(QUESTION): (QUESTION, ("Lima",))}
    return SearchRollout(tokenizer, engine, config=config, k=2, examples=examples), build_prompt(QUESTION)


def test_a_page_opens_a_result_numbered_across_the_trajectory_and_its_reply_is_masked(tokenizer):
    docs = [*article("Peru", 4), *article("Chile", 2, "c")]
    loop, prompt = page_rollout(tokenizer, CorpusEngine(docs))
    turns = [
        call(query="Peru"),
        call(query="Peru capital"),
        call("read_page", doc=4),
        "<answer> Lima </answer>",
    ]
    [traj], _ = loop.run(Scripted(tokenizer, turns, loop.tool_tokens.eos_id), [prompt], step=0)
    assert traj.valid_format and traj.answer == "Lima" and traj.pages == 1 and traj.searches == 2
    replies = tokenizer.decode([t for t, m in zip(traj.completion_ids, traj.env_mask, strict=True) if m == 0])
    assert "Doc 3 (Title: Peru)" in replies and "Doc 4 (Title: Peru)" in replies  # the second search: 3, 4
    assert "Page (Title: Peru)" in replies and "Peru sentence 1" in replies  # Doc 4 is p-1: its page
    sampled = [t for t, m in zip(traj.completion_ids, traj.env_mask, strict=True) if m == 1]
    assert "Page (Title" not in tokenizer.decode(sampled)
    assert traj.events[-1] == {"page": 4, "title": "Peru", "noisy": None}
    metrics = loop.metrics([traj], 0, {})
    assert metrics["tools/pages_per_traj"] == 1.0 and metrics["tools/invalid/no_such_result"] == 0.0


@pytest.mark.parametrize(
    ("turns", "shown"),
    [
        ([call("read_page", doc=1), "<answer> Lima </answer>"], "search first"),  # nothing searched yet
        (
            [call(query="Peru") + call("read_page", doc=1), "<answer> Lima </answer>"],
            "search first",
        ),  # same turn
        ([call(query="Peru"), call("read_page", doc=3), "<answer> Lima </answer>"], "Doc 1 to Doc 2"),
    ],
)
def test_a_page_of_no_earlier_result_is_an_invalid_turn(tokenizer, turns, shown):
    loop, prompt = page_rollout(tokenizer, CorpusEngine(article("Peru", 3)))
    [traj], _ = loop.run(Scripted(tokenizer, turns, loop.tool_tokens.eos_id), [prompt], step=0)
    assert traj.invalid_calls == {"no_such_result": 1} and not traj.valid_format and traj.pages == 0
    replies = tokenizer.decode([t for t, m in zip(traj.completion_ids, traj.env_mask, strict=True) if m == 0])
    assert "Error: there is no Doc" in replies and shown in replies


class PageBackend:
    """A simulator backend that writes what it was asked for (the prompt's mode) and records the prompts."""

    def __init__(self):
        self.prompts = []

    def complete(self, prompts, *, max_new_tokens, temperature, top_p, seed):
        self.prompts += prompts
        return ["Peru has mountains." if "must not contain the answer" in p else "Lima is the capital."
                for p in prompts]  # fmt: skip

    def describe(self):
        return {"backend": "pages"}


def test_the_simulator_writes_pages_by_their_own_curriculum_draw(tokenizer):
    from curricula.noise import CurriculumNoise, page_noise
    from curricula.schedules import ConstantSchedule
    from simulators.llm import LLMSimulator

    backend = PageBackend()
    simulator = LLMSimulator(backend, words_per_doc=20)
    noise = CurriculumNoise(ConstantSchedule(0.5), seed=3, k=2)
    draws = [page_noise(seed=3, step=2, trajectory=t, call=0, p=0.5) for t in range(40)]
    assert 5 < sum(draws) < 35 and draws == [noise.page(2, t, 0) for t in range(40)]
    assert [noise.page(2, 0, c) for c in range(3)] == [page_noise(seed=3, step=2, trajectory=0, call=c, p=0.5)
                                                       for c in range(3)]  # fmt: skip
    doc = Document("sim-1-0", "capital of Peru", "written")
    pages = simulator.read_pages(
        [
            PageRequest(doc, QUESTION, ("Lima",), noisy=False),
            PageRequest(doc, QUESTION, ("Lima",), noisy=True),
        ],
        max_words=120,
    )
    assert [p.noisy for p in pages] == [False, True] and pages[0].text == "Lima is the capital."
    assert "capital of Peru" in backend.prompts[0] and "120" in backend.prompts[0]
    assert "Lima" in backend.prompts[0]  # the training-time page sees the answers, as a search would
    assert simulator.stats["pages"] == 2

    # through the rollout: the trajectory's n-th page takes draw n of its stream
    class Drawn:
        def __call__(self, step, trajectory, search):
            return (False, False)

        def page(self, step, trajectory, call):
            return call == 1

    class SimEngine(CorpusEngine):
        def read_pages(self, requests, max_words):
            return simulator.read_pages(requests, max_words)

    loop, prompt = page_rollout(tokenizer, SimEngine([doc, doc]))
    loop.noise = Drawn()
    turns = [
        call(query="Peru"),
        call("read_page", doc=1),
        call("read_page", doc=2),
        "<answer> Lima </answer>",
    ]
    [traj], _ = loop.run(Scripted(tokenizer, turns, loop.tool_tokens.eos_id), [prompt], step=1)
    assert [e["noisy"] for e in traj.events if "page" in e] == [False, True] and traj.noisy_pages == 1


def test_engines_without_pages_are_refused_and_evaluation_withholds_the_answers():
    from eval.harness import WithheldAnswers
    from zerosim.core.config import ConfigError
    from zerosim.training.config import load_train_config

    seen = []

    class Recorder(CorpusEngine):
        def read_pages(self, requests, max_words):
            seen.extend(requests)
            return [page_reader(CorpusEngine(self.docs)).read_pages(requests, max_words)[0] for _ in requests]

    docs = article("Peru", 2)
    withheld = page_reader(WithheldAnswers(Recorder(docs)))
    withheld.read_pages([PageRequest(docs[0], QUESTION, ("Lima",))], 50)
    assert seen[0].question is None and seen[0].answers == ()
    assert page_reader(object()) is None
    with pytest.raises(ConfigError, match="has no pages to open"):
        load_train_config(None, ["rollout.protocol=tools", "rollout.tools=[search,read_page]",
                                 "search.engine=http", "search.http.url=http://127.0.0.1:9"])  # fmt: skip


def test_warm_start_demonstrations_search_read_and_answer(tokenizer):
    from zerosim.core.data.qa import QAExample
    from zerosim.training.warmstart import IGNORE_INDEX, build_examples

    # the snippet (passage 0) lacks the answer; passage 2 of its page holds it
    docs = [Document(f"p-{i}", "Peru", t) for i, t in enumerate(["Peru is in South America.", "It has coasts.",
                                                                  "Its capital is Lima."])]  # fmt: skip
    engine = CorpusEngine(docs)
    engine.search = lambda requests, k: [docs[:1] for _ in requests]
    config = RolloutConfig(protocol=Protocol.tools, tools=["search", "read_page"], max_turns=3)
    rows = build_examples(
        [QAExample("q", QUESTION, ("Lima",))], engine, tokenizer, k=1, max_obs_tokens=64, grounded=True,
        rollout=config, pages=page_reader(engine),
    )  # fmt: skip
    [row] = rows
    learnt = tokenizer.decode(
        [t for t, lab in zip(row["input_ids"], row["labels"], strict=True) if lab != IGNORE_INDEX]
    )
    masked = tokenizer.decode(
        [t for t, lab in zip(row["input_ids"], row["labels"], strict=True) if lab == IGNORE_INDEX]
    )
    assert '"name": "read_page", "arguments": {"doc": 1}' in learnt and "<answer> Lima </answer>" in learnt
    assert "Page (Title: Peru)" in masked and "Its capital is Lima." in masked and "Page (Title" not in learnt
    # under search alone the same question has nothing to read from: no demonstration
    alone = RolloutConfig(protocol=Protocol.tools, tools=["search"], max_turns=3)
    assert build_examples([QAExample("q", QUESTION, ("Lima",))], engine, tokenizer, k=1, max_obs_tokens=64,
                          grounded=True, rollout=alone) == []  # fmt: skip

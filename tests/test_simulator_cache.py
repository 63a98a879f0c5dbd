"""CachedSearchEngine: keys, hits and misses, LRU, sqlite persistence."""

from __future__ import annotations

import dataclasses
import sqlite3

import pytest

from simulators import CachedSearchEngine, LLMSimulator
from simulators.cache import cache_key, documents_from_json, documents_to_json
from simulators.llm import MISSING_DOC_TEXT
from zerosim.core.search import Document, SearchEngine, SearchRequest


class CountingEngine:
    """Answers each request with k documents naming the query and the engine call that wrote them."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def search(self, requests, k):
        self.calls.append([r.query for r in requests])
        n = len(self.calls)
        return [
            [
                Document(f"{r.query}-{i}", r.query, f"call {n}: {r.query} #{i}", 1.0 / (i + 1))
                for i in range(k)
            ]
            for r in requests
        ]


REQ = SearchRequest("capital of Peru", "What is the capital of Peru?", ("Lima",), (False, True))


@pytest.mark.parametrize(
    "changed",
    [
        dataclasses.replace(REQ, query="capital of Chile"),
        dataclasses.replace(REQ, question="Which city is the capital of Peru?"),
        dataclasses.replace(REQ, question=None),
        dataclasses.replace(REQ, answers=("Lima", "Ciudad de los Reyes")),
        dataclasses.replace(REQ, answers=()),
        dataclasses.replace(REQ, noise=(True, False)),
        dataclasses.replace(REQ, noise=(True, True)),
    ],
)
def test_keys_differ_when_the_request_differs(changed):
    assert cache_key(changed, 2, {"m": 1}) != cache_key(REQ, 2, {"m": 1})


def test_keys_differ_with_k_and_key_extra_and_agree_otherwise():
    extra = {"model": "sim", "seed": 1, "templates": "abc", "backend": "openai"}
    key = cache_key(REQ, 2, extra)
    assert key == cache_key(dataclasses.replace(REQ), 2, dict(extra))
    assert cache_key(dataclasses.replace(REQ, noise=(False, False, True)), 3, extra) != cache_key(
        dataclasses.replace(REQ, noise=(False, False)), 2, extra
    )
    for name, value in [("model", "sim2"), ("seed", 2), ("templates", "abd"), ("backend", "transformers")]:
        assert cache_key(REQ, 2, {**extra, name: value}) != key, name
    # no curriculum noise means all-useful: the same documents, the same key
    plain = SearchRequest("q")
    assert cache_key(plain, 2, {}) == cache_key(dataclasses.replace(plain, noise=(False, False)), 2, {})


def test_hits_skip_the_engine_and_misses_go_in_one_call():
    engine = CountingEngine()
    cache = CachedSearchEngine(engine)
    assert isinstance(cache, SearchEngine)
    first = cache.search([SearchRequest("a"), SearchRequest("b")], 2)
    again = cache.search([SearchRequest("b"), SearchRequest("c"), SearchRequest("a"), SearchRequest("d")], 2)
    assert engine.calls == [["a", "b"], ["c", "d"]]  # only the misses, in one call
    assert again[0] == first[1] and again[2] == first[0] and again[1][0].text == "call 2: c #0"
    assert (cache.stats["hits"], cache.stats["misses"]) == (2, 4)
    cache.search([SearchRequest("a")], 3)  # another k is another result
    assert engine.calls[-1] == ["a"]


def test_a_request_repeated_within_a_call_is_sent_once():
    engine = CountingEngine()
    cache = CachedSearchEngine(engine)
    results = cache.search([SearchRequest("x"), SearchRequest("x"), SearchRequest("y")], 1)
    assert engine.calls == [["x", "y"]] and results[0] == results[1]
    assert (cache.stats["hits"], cache.stats["misses"]) == (1, 2)


def test_memory_is_a_bounded_lru():
    engine = CountingEngine()
    cache = CachedSearchEngine(engine, max_entries=2)
    for query in ["a", "b", "a", "c"]:  # "b" is the least recently used when "c" arrives
        cache.search([SearchRequest(query)], 1)
    assert len(cache) == 2
    cache.search([SearchRequest("a")], 1)
    cache.search([SearchRequest("b")], 1)
    assert engine.calls == [["a"], ["b"], ["c"], ["b"]]


def test_sqlite_persists_across_instances(tmp_path):
    path = tmp_path / "cache" / "sim.sqlite"
    with CachedSearchEngine(CountingEngine(), sqlite_path=path, key_extra={"model": "m"}) as cache:
        written = cache.search([REQ, SearchRequest("b")], 2)
    engine = CountingEngine()
    with CachedSearchEngine(engine, sqlite_path=path, key_extra={"model": "m"}) as cache:
        assert cache.search([SearchRequest("b"), REQ], 2) == written[::-1]
        assert engine.calls == [] and cache.stats["disk_hits"] == 2 and cache.stats["hits"] == 2
    with CachedSearchEngine(engine, sqlite_path=path, key_extra={"model": "other"}) as cache:
        cache.search([REQ], 2)
        assert engine.calls == [[REQ.query]]  # another model: nothing matches
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("SELECT COUNT(*) FROM results").fetchone()[0] == 3
    db.close()


def test_documents_round_trip_through_json():
    docs = [Document("1", "Pérou", "Lima — capitale", None, True), Document("2", "", "x", 0.5, None)]
    assert documents_from_json(documents_to_json(docs)) == docs


class ScriptedBackend:
    def __init__(self, text: str):
        self.text, self.calls = text, 0

    def complete(self, prompts, **settings):
        self.calls += 1
        return [self.text] * len(prompts)

    def describe(self):
        return {"backend": "scripted", "model": "m"}


def test_simulator_results_are_cached_under_its_own_key_extra():
    backend = ScriptedBackend("Doc 1: one\nDoc 2: two")
    cache = CachedSearchEngine(LLMSimulator(backend, seed=4))
    assert cache.key_extra["seed"] == 4 and cache.key_extra["backend"] == "scripted"
    first = cache.search([REQ], 2)
    assert cache.search([REQ], 2) == first
    assert backend.calls == 1  # the useful and the noisy prompt in one call; the repeat is a hit
    assert [d.noisy for d in first[0]] == [False, True]


def test_results_with_failure_documents_are_not_kept():
    backend = ScriptedBackend("Doc 1: only one")
    cache = CachedSearchEngine(LLMSimulator(backend, on_short="fill"))
    (docs,) = cache.search([SearchRequest("q")], 2)
    assert docs[1].text == MISSING_DOC_TEXT
    cache.search([SearchRequest("q")], 2)
    assert backend.calls == 2 and cache.stats["misses"] == 2 and len(cache) == 0


@pytest.mark.parametrize(
    "content",
    [b"not a database\n" * 200, b"SQLite format 3\x00" + b"\xff" * 5000],
    ids=["text", "damaged-header"],
)
def test_a_damaged_cache_file_is_one_line_naming_it_and_the_fix(tmp_path, content):
    """A cache_path file that is no database (or a damaged one) is refused naming the file and the fix, not
    with sqlite3.DatabaseError; the file is left as it was."""
    from zerosim.cli import error_line
    from zerosim.core.config import ConfigError

    path = tmp_path / "cache.sqlite"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        CachedSearchEngine(CountingEngine(), sqlite_path=path)
    line = error_line(err.value)
    assert str(path) in line and "search.simulator.cache_path" in line and "move it aside" in line, line
    assert "run with --debug" not in line, line  # zerosim's own message: one line, no traceback
    assert path.read_bytes() == content


@pytest.mark.parametrize(
    "blob",
    ['[{"id": "x", "bogus": 1}]', '[{"id": "x", "title": "t"', '{"id": "x"}', "[1]", "null"],
    ids=["wrong-keys", "not-json", "not-a-list", "not-objects", "null"],
)
def test_a_damaged_cache_row_is_a_miss_named_once_then_replaced(tmp_path, caplog, blob):
    """A row whose stored documents cannot be read (valid JSON of the wrong shape included) is not served: it
    counts as a miss, is named in one warning (file and the fix), and the engine's fresh answer replaces it."""
    path = tmp_path / "cache.sqlite"
    with CachedSearchEngine(CountingEngine(), sqlite_path=path) as cache:
        cache.search([REQ, SearchRequest("b")], 2)
    db = sqlite3.connect(path)
    db.execute("UPDATE results SET documents = ? WHERE key = ?", (blob, cache.key(REQ, 2)))
    db.commit()
    db.close()
    engine = CountingEngine()
    with caplog.at_level("WARNING"), CachedSearchEngine(engine, sqlite_path=path) as cache:
        (fresh, kept) = cache.search([REQ, SearchRequest("b")], 2)
    assert engine.calls == [[REQ.query]] and fresh[0].text == f"call 1: {REQ.query} #0" and kept
    assert (cache.stats["damaged"], cache.stats["misses"], cache.stats["disk_hits"]) == (1, 1, 1)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert str(path) in warning and "1 row" in warning and "delete" in warning, warning
    with CachedSearchEngine(CountingEngine(), sqlite_path=path) as cache:  # the row was replaced
        assert cache.search([REQ], 2) == [fresh] and cache.stats["disk_hits"] == 1

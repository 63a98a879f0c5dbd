import pytest

from zerosim.core.fsutil import atomic_directory


def test_success_replaces_target(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with atomic_directory(target) as tmp:
        (tmp / "new.txt").write_text("new")
        assert not (target / "new.txt").exists()  # nothing visible until done
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_failure_leaves_target_and_no_temp(tmp_path, exc):
    target = tmp_path / "out"
    with pytest.raises(type(exc)), atomic_directory(target) as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise exc
    assert list(tmp_path.iterdir()) == []


def test_two_processes_starting_on_a_fresh_cache_build_the_index_once(tmp_path, monkeypatch):
    """The ranks of one `accelerate launch` (or a simulator server beside training) ask for the same cached
    BM25 index at the same moment: one builds it, the other waits and loads it — neither fails on the other's
    rename (the CI failure of test_multiprocess: `OSError: Directory not empty`)."""
    import json
    import threading
    import time

    import eval.index
    from zerosim.core.search import SearchRequest
    from zerosim.engines import real_retriever

    monkeypatch.setenv("ZEROSIM_HOME", str(tmp_path / "home"))
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"id": f"d{i}", "contents": f"Title {i}\npassage number {i} about keyword{i}"} for i in range(30)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))

    builds = []
    real_build = eval.index.build_index

    def slow_build(*args, **kwargs):
        builds.append(threading.get_ident())
        time.sleep(0.5)  # wide enough that the second caller arrives while the first still builds
        return real_build(*args, **kwargs)

    monkeypatch.setattr(eval.index, "build_index", slow_build)
    results, errors = [], []

    def ask():
        try:
            results.append(real_retriever("bm25", str(corpus), None))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert len(builds) == 1
    top = [r.search([SearchRequest(query="keyword7")], 2)[0][0].id for r in results]
    assert top == ["d7", "d7"]
    leftovers = [p.name for p in (tmp_path / "home" / "indexes").iterdir() if p.name.startswith(".tmp")]
    assert leftovers == []

"""Fault suite, indexes: damaged, mismatched or badly built indexes fail at load or build with an error that
names the index folder, what does not match and the rebuild command; folders get the user's permissions.

Each case builds on a 6-passage corpus (BM25, and dense with a tiny random 32-d encoder), copies the built
index and damages the copy, so the whole file runs in seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from eval.config import BM25Config, DenseConfig
from eval.index import IndexMismatchError, build_index, load_index, read_manifest, save_index
from zerosim.core.data.qa import DataError
from zerosim.core.search import SearchRequest
from zerosim.engines import SearchConfig, build_search_engine

PASSAGES = [
    ("p0", "Peru\nThe capital of Peru is Lima, on the Pacific coast."),
    ("p1", "Chile\nThe capital of Chile is Santiago, below the Andes."),
    ("p2", "Kenya\nNairobi is the capital of Kenya and its largest city."),
    ("p3", "Norway\nOslo, the capital of Norway, lies at the head of a fjord."),
    ("p4", "Japan\nTokyo is the capital of Japan and a vast metropolis."),
    ("p5", "Egypt\nCairo, the capital of Egypt, sits on the Nile."),
]


def _write_corpus(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps({"id": i, "contents": c}) + "\n" for i, c in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_encoder):
    """The corpus, another corpus (the first 4 passages), and a BM25 and a dense index of the first."""
    root = tmp_path_factory.mktemp("faults-index")
    corpus = _write_corpus(root / "corpus.jsonl", PASSAGES)
    other = _write_corpus(root / "other.jsonl", PASSAGES[:4])
    bm25 = build_index(corpus, "bm25", root / "bm25", progress=False)
    dense = build_index(corpus, "dense", root / "dense", encoder=tiny_encoder, progress=False)
    return SimpleNamespace(corpus=corpus, other=other, bm25=bm25, dense=dense, encoder=tiny_encoder)


# -- damage done to a copy of a built index -------------------------------------------------------------


def _lines(index: Path) -> list[str]:
    return (index / "docs.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)


def truncate_rows(index: Path, ctx) -> None:
    (index / "docs.jsonl").write_text("".join(_lines(index)[:3]), encoding="utf-8")


def truncate_mid_line(index: Path, ctx) -> None:
    data = (index / "docs.jsonl").read_bytes()
    (index / "docs.jsonl").write_bytes(data[: len(data) - 20])


def edit_one_line(index: Path, ctx) -> None:  # same length, same count: only the hash can tell
    lines = _lines(index)
    lines[2] = lines[2].replace("Nairobi", "Mombasa")
    (index / "docs.jsonl").write_text("".join(lines), encoding="utf-8")


def add_a_line(index: Path, ctx) -> None:
    lines = _lines(index)
    (index / "docs.jsonl").write_text("".join(lines + lines[-1:]), encoding="utf-8")


def delete_docs(index: Path, ctx) -> None:
    (index / "docs.jsonl").unlink()


def _edit_manifest(index: Path, edit: Callable[[dict], None]) -> None:
    manifest = json.loads((index / "manifest.json").read_text())
    edit(manifest)
    (index / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


def change_stemmer(index: Path, ctx) -> None:
    _edit_manifest(index, lambda m: m["bm25"].update(stemmer="french"))


def change_query_prefix(index: Path, ctx) -> None:
    _edit_manifest(index, lambda m: m["dense"].update(query_prefix="query: "))


def drop_checksum(index: Path, ctx) -> None:
    _edit_manifest(index, lambda m: m.pop("checksum"))


def newer_format(index: Path, ctx) -> None:
    _edit_manifest(index, lambda m: m.update(format=99))


def garble_manifest(index: Path, ctx) -> None:
    (index / "manifest.json").write_text('{"kind": "bm25", "format": 2, ')


def bm25s_of_fewer_passages(index: Path, ctx) -> None:
    from eval.bm25 import BM25Retriever
    from zerosim.core.data.qa import load_corpus

    shutil.rmtree(index / "bm25s")
    BM25Retriever(load_corpus(ctx.other)).index().write_files(index)


def garble_bm25s_vocab(index: Path, ctx) -> None:
    (index / "bm25s" / "vocab.index.json").write_text('{"capit": 0, "lima": ')


def cut_bm25s_array(index: Path, ctx) -> None:  # a copy or download that stopped part way
    data = (index / "bm25s" / "data.csc.index.npy").read_bytes()
    (index / "bm25s" / "data.csc.index.npy").write_bytes(data[: len(data) - 12])


def without_digests(damage: Callable) -> Callable:
    """``damage`` done to an index built before the manifest recorded file digests (checksum recomputed)."""

    def damage_older_index(index: Path, ctx) -> None:
        from eval.index import manifest_checksum

        _edit_manifest(index, lambda m: (m.pop("files"), m.update(checksum=manifest_checksum(m))))
        damage(index, ctx)

    return damage_older_index


def faiss_of_fewer_vectors(index: Path, ctx) -> None:
    import faiss

    vectors = np.fromfile(index / "embeddings.f32", dtype=np.float32).reshape(len(PASSAGES), 32)
    fewer = faiss.IndexFlatIP(32)
    fewer.add(vectors[:5])
    faiss.write_index(fewer, str(index / "faiss.index"))


def faiss_of_another_type(index: Path, ctx) -> None:
    import faiss

    vectors = np.fromfile(index / "embeddings.f32", dtype=np.float32).reshape(len(PASSAGES), 32)
    hnsw = faiss.IndexHNSWFlat(32, 4, faiss.METRIC_INNER_PRODUCT)
    hnsw.add(vectors)
    faiss.write_index(hnsw, str(index / "faiss.index"))


def truncate_embeddings(index: Path, ctx) -> None:
    data = (index / "embeddings.f32").read_bytes()
    (index / "embeddings.f32").write_bytes(data[: 4 * 32 * 5])


def delete_faiss(index: Path, ctx) -> None:
    (index / "faiss.index").unlink()


@dataclass(frozen=True)
class Damage:
    id: str
    kind: str  # which built index is copied and damaged
    damage: Callable
    expect: tuple[str, ...]  # fragments of the error message, besides the folder and the rebuild command


DAMAGES = [
    Damage(
        "docs-truncated-rows", "bm25", truncate_rows, ("damaged", "docs.jsonl holds 3 passages", "records 6")
    ),
    Damage("docs-truncated-mid-line", "bm25", truncate_mid_line, ("damaged", "docs.jsonl holds 5 passages")),
    Damage("docs-line-edited", "bm25", edit_one_line, ("docs.jsonl was edited after the build", "sha256")),
    Damage("docs-line-added", "dense", add_a_line, ("docs.jsonl holds 7 passages", "records 6")),
    Damage("docs-missing", "bm25", delete_docs, ("docs.jsonl is missing",)),
    Damage("manifest-stemmer-changed", "bm25", change_stemmer, ("manifest.json was changed", '"french"')),
    Damage("manifest-prefix-changed", "dense", change_query_prefix, ("manifest.json was changed", "query: ")),
    Damage("manifest-checksum-dropped", "bm25", drop_checksum, ("manifest.json was changed", "none")),
    Damage("manifest-newer-format", "bm25", newer_format, ("format 99", "upgrade zerosim")),
    Damage("manifest-not-json", "bm25", garble_manifest, ("manifest.json is not valid JSON",)),
    Damage("bm25s-count-differs", "bm25", bm25s_of_fewer_passages, ("bm25s/ holds 4 entries", "6 passages")),
    Damage("bm25s-vocab-not-json", "bm25", garble_bm25s_vocab, ("bm25s/vocab.index.json is not valid JSON",)),
    Damage(
        "bm25s-vocab-not-json-no-digests",
        "bm25",
        without_digests(garble_bm25s_vocab),
        ("bm25s/vocab.index.json is not valid JSON",),
    ),
    Damage("bm25s-array-cut-short", "bm25", cut_bm25s_array, ("bm25s/data.csc.index.npy is cut short",)),
    Damage(
        "bm25s-array-cut-short-no-digests",
        "bm25",
        without_digests(cut_bm25s_array),
        ("bm25s/data.csc.index.npy is cut short",),
    ),
    Damage("dense-vector-count-differs", "dense", faiss_of_fewer_vectors, ("faiss.index holds 5 entries",)),
    Damage("dense-faiss-type-differs", "dense", faiss_of_another_type, ("IndexHNSWFlat", "32-d flat index")),
    Damage("dense-embeddings-truncated", "dense", truncate_embeddings, ("embeddings.f32 holds 640 bytes",)),
    Damage("dense-faiss-missing", "dense", delete_faiss, ("faiss.index is missing",)),
]


@pytest.mark.parametrize("case", DAMAGES, ids=[d.id for d in DAMAGES])
def test_damaged_index_is_refused_at_load(case, built, tmp_path):
    index = shutil.copytree(getattr(built, case.kind), tmp_path / "index")
    case.damage(index, built)
    with pytest.raises(IndexMismatchError) as err:
        load_index(index)
    message = str(err.value)
    assert f"index {index}" in message and "zerosim index build" in message, message
    assert f"--kind {case.kind} --out {index}" in message, message
    for fragment in case.expect:
        assert fragment in message, (fragment, message)


def test_damage_after_a_verified_load_is_still_caught(built, tmp_path):
    index = shutil.copytree(built.bm25, tmp_path / "index")
    assert load_index(index).search([SearchRequest("capital of Kenya")], 1)[0][0].id == "p2"
    assert load_index(index).search([SearchRequest("capital of Kenya")], 1)[0][0].id == "p2"  # cached verdict
    truncate_rows(index, built)
    with pytest.raises(IndexMismatchError, match="docs.jsonl holds 3 passages"):
        load_index(index)


def test_verification_hashes_docs_once_per_file_version(built, tmp_path, monkeypatch):
    import eval.index as index_module

    index = shutil.copytree(built.bm25, tmp_path / "index")
    opened = []
    real_open = open

    def counting_open(path, mode="r", *args, **kwargs):
        if str(path).endswith("docs.jsonl") and "b" in mode:
            opened.append(path)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(index_module, "open", counting_open, raising=False)
    load_index(index)
    load_index(index)
    assert len(opened) == 1


def test_format_1_index_still_loads(built, tmp_path):
    """Indexes built before the checksum (format 1) load; their passages are still verified."""
    index = shutil.copytree(built.bm25, tmp_path / "index")
    _edit_manifest(index, lambda m: (m.pop("checksum"), m.update(format=1)))
    assert load_index(index).search([SearchRequest("capital of Japan")], 1)[0][0].id == "p4"
    truncate_rows(index, built)
    with pytest.raises(IndexMismatchError, match="docs.jsonl holds 3 passages"):
        load_index(index)


def test_new_manifest_records_format_2_and_a_checksum(built):
    from eval.index import manifest_checksum

    manifest = read_manifest(built.bm25)
    assert manifest["format"] == 2 and manifest["checksum"] == manifest_checksum(manifest)


# -- builds that must be refused ------------------------------------------------------------------------

BUILD_FAULTS = [
    pytest.param(
        [("a", "A\none"), ("b", "B\ntwo"), ("a", "A again\nthree")],
        DataError,
        ("line 3: passage id 'a' repeats the id of line 1", "must be unique"),
        id="duplicate-id",
    ),
    pytest.param(
        [("7", "A\none"), (7, "B\ntwo"), ("x", "C\nthree"), ("x", "D\nfour")],
        DataError,
        ("line 2: passage id '7' repeats the id of line 1", "1 more repeated id"),
        id="duplicate-ids-int-and-str",
    ),
    # already clear before this suite: kept so they stay clear
    pytest.param([("a", "A\none"), ("b", "")], DataError, ("line 2", "'contents'"), id="empty-contents"),
    pytest.param([], ValueError, ("holds no passages",), id="empty-corpus"),
]


@pytest.mark.parametrize(("rows", "error", "expect"), BUILD_FAULTS)
def test_bad_corpus_is_refused_at_build(rows, error, expect, tmp_path):
    corpus = _write_corpus(tmp_path / "corpus.jsonl", rows)
    with pytest.raises(error) as err:
        build_index(corpus, "bm25", tmp_path / "index", progress=False)
    message = str(err.value)
    assert str(corpus) in message or "no passages" in message, message
    for fragment in expect:
        assert fragment in message, (fragment, message)
    assert not (tmp_path / "index").exists()


def test_duplicate_ids_refused_when_saving_a_retriever(tmp_path):
    from eval.bm25 import BM25Retriever
    from zerosim.core.search import Document

    docs = [Document.from_contents("a", "A\none"), Document.from_contents("a", "B\ntwo")]
    with pytest.raises(DataError, match="passage 2: id 'a' repeats the id of passage 1"):
        save_index(BM25Retriever(docs).index(), tmp_path / "index")


def test_malformed_corpus_row_names_file_and_line(tmp_path):  # already worked: kept so it stays so
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "a", "contents": "A\\none"}\n{"id": "b", "contents": \n')
    with pytest.raises(DataError, match=r"corpus.jsonl line 2: invalid JSON"):
        build_index(corpus, "bm25", tmp_path / "index", progress=False)


def test_missing_corpus_and_missing_index_are_named(tmp_path):  # already worked: kept so it stays so
    from zerosim.engines import resolve_corpus

    with pytest.raises(DataError, match="nowhere.jsonl: no such file"):
        build_index(tmp_path / "nowhere.jsonl", "bm25", tmp_path / "index", progress=False)
    with pytest.raises(FileNotFoundError, match="corpus file .*nowhere.jsonl does not exist"):
        resolve_corpus(str(tmp_path / "nowhere.jsonl"))
    with pytest.raises(
        FileNotFoundError, match="no-index does not exist; build one with: zerosim index build"
    ):
        load_index(tmp_path / "no-index")


# -- imports that must be refused: before the encoder loads, nothing written ----------------------------

# (id, passages of the corpus given with the faiss file, words the error must hold)
IMPORT_FAULTS = [
    # an index of 0 vectors over an empty corpus counted 0 == 0 and was written as an index of nothing
    pytest.param([], ("holds no vectors", "an empty faiss IndexFlatIP", "zerosim index build"), id="empty-faiss-empty-corpus"),
    pytest.param(PASSAGES, ("holds no vectors",), id="empty-faiss-full-corpus"),
]  # fmt: skip


@pytest.mark.parametrize(("passages", "expect"), IMPORT_FAULTS)
def test_bad_faiss_import_is_refused_before_the_encoder_loads(passages, expect, tmp_path, monkeypatch):
    import faiss
    from typer.testing import CliRunner

    import eval.dense
    from zerosim.cli import app

    def no_encoder(*args, **kwargs):
        raise AssertionError("the encoder was loaded for an import that cannot be served")

    monkeypatch.setattr(eval.dense, "load_encoder", no_encoder)
    corpus = _write_corpus(tmp_path / "corpus.jsonl", passages)
    faiss.write_index(faiss.IndexFlatIP(32), str(tmp_path / "e5_Flat.index"))
    result = CliRunner().invoke(
        app,
        ["index", "import", "--faiss", str(tmp_path / "e5_Flat.index"), "--corpus", str(corpus),
         "--encoder", "minilm", "--out", str(tmp_path / "index")],
    )  # fmt: skip
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "Traceback" not in result.output, result.output
    assert str(tmp_path / "e5_Flat.index") in lines[0], lines[0]
    for fragment in expect:
        assert fragment in lines[0], (fragment, lines[0])
    assert not (tmp_path / "index").exists()


# -- configured engines: the corpus, kind and partner of an index_dir are checked ------------------------


def _bm25_cfg(corpus, index_dir, **kw) -> SearchConfig:
    return SearchConfig(engine="bm25", bm25=BM25Config(corpus=str(corpus), index_dir=str(index_dir)), **kw)


def test_index_dir_with_another_corpus_is_refused(built):
    with pytest.raises(IndexMismatchError) as err:
        build_search_engine(_bm25_cfg(built.other, built.bm25))
    message = str(err.value)
    assert f"index {built.bm25} does not match: corpus differs" in message
    assert "6 passages" in message and f"{built.other} has 4 passages" in message
    assert f"zerosim index build --corpus {built.other} --kind bm25 --out {built.bm25}" in message


def test_index_dir_with_its_own_corpus_or_the_default_loads(built):
    query = [SearchRequest("capital of Egypt")]
    for corpus in (built.corpus, "factbook"):  # the embedded default names no corpus: the index's own is used
        engine = build_search_engine(_bm25_cfg(corpus, built.bm25, negatives="none"))
        assert engine.search(query, 1)[0][0].id == "p5"


def test_index_dir_of_the_other_kind_is_refused(built):
    with pytest.raises(IndexMismatchError, match=f"index {built.dense} is a dense index, not a bm25 one"):
        build_search_engine(_bm25_cfg("factbook", built.dense))


def test_hybrid_over_two_corpora_is_refused(built, tmp_path):
    other_dense = build_index(built.other, "dense", tmp_path / "dense", encoder=built.encoder, progress=False)
    cfg = SearchConfig(
        engine="hybrid",
        bm25=BM25Config(index_dir=str(built.bm25)),
        dense=DenseConfig(index_dir=str(other_dense), encoder=built.encoder),
    )
    with pytest.raises(ValueError, match="hybrid retrieval over two different corpora") as err:
        build_search_engine(cfg)
    assert f"index {built.bm25}): 6 passages" in str(err.value) and "4 passages" in str(err.value)
    same = SearchConfig(
        engine="hybrid",
        negatives="none",
        bm25=BM25Config(index_dir=str(built.bm25)),
        dense=DenseConfig(index_dir=str(built.dense), encoder=built.encoder),
    )
    assert len(build_search_engine(same).search([SearchRequest("capital of Peru")], 2)[0]) == 2


# -- permissions: what we create is as readable as the umask allows, not private -------------------------


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_created_folders_and_files_follow_the_umask(umask_027, built, tmp_path):
    from zerosim.core.distributed import shared_atomic_directory
    from zerosim.core.fsutil import atomic_directory, atomic_write_text

    with atomic_directory(tmp_path / "plain") as tmp:
        (tmp / "f.txt").write_text("x")
    with shared_atomic_directory(tmp_path / "checkpoint-1", SimpleNamespace(num_processes=1)) as tmp:
        (tmp / "f.txt").write_text("x")
    atomic_write_text(tmp_path / "run.json", "{}")
    index = build_index(built.corpus, "bm25", tmp_path / "index", progress=False)
    assert _mode(tmp_path / "plain") == 0o750
    assert _mode(tmp_path / "checkpoint-1") == 0o750
    assert _mode(tmp_path / "run.json") == 0o640
    assert _mode(index) == 0o750 and _mode(index / "manifest.json") == 0o640
    assert _mode(index / "bm25s") == 0o750
    os.umask(0o022)
    atomic_write_text(tmp_path / "run.json", "{}")  # replaced: the new file's mode, not the old one's
    with atomic_directory(tmp_path / "plain"):
        pass
    assert _mode(tmp_path / "run.json") == 0o644 and _mode(tmp_path / "plain") == 0o755

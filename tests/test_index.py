"""On-disk indexes: manifest, mismatch errors, interrupted builds, chunked memmap indexing.

Dense indexes here use a tiny random 32-d sentence-transformers encoder built locally (fast); retrieval
quality with the real MiniLM is tested in test_dense.py.
"""

import json

import numpy as np
import pytest

from eval.bm25 import BM25Retriever
from eval.dense import DenseRetriever, load_encoder
from eval.index import IndexMismatchError, build_index, load_index, read_manifest
from zerosim.core.data.embedded import ensure_factbook
from zerosim.core.data.qa import load_corpus
from zerosim.core.search import SearchRequest

QUERIES = [
    SearchRequest("capital of Afghanistan"),
    SearchRequest("internet country code"),
    SearchRequest("the"),
]


def _write_corpus(path, docs):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"id": d.id, "contents": d.contents}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two small corpora cut from the factbook: the first 60 passages, and the 40 after them."""
    docs = load_corpus(ensure_factbook(progress=False).corpus)
    root = tmp_path_factory.mktemp("corpora")
    return _write_corpus(root / "small.jsonl", docs[:60]), _write_corpus(root / "other.jsonl", docs[60:100])


@pytest.fixture(scope="module")
def dense_index(tmp_path_factory, corpora, tiny_encoder):
    out = tmp_path_factory.mktemp("built") / "dense"
    return build_index(
        corpora[0], "dense", out, encoder=tiny_encoder, batch_size=16, chunk_size=25, progress=False
    )


@pytest.fixture(scope="module")
def bm25_index(tmp_path_factory, corpora):
    return build_index(corpora[0], "bm25", tmp_path_factory.mktemp("built") / "bm25", progress=False)


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_dense_index_round_trip_and_manifest(dense_index, corpora, tiny_encoder):
    manifest = read_manifest(dense_index)
    assert manifest["kind"] == "dense" and manifest["corpus"]["passages"] == 60
    assert manifest["dense"]["encoder"] == tiny_encoder and manifest["dense"]["dimension"] == 32
    assert manifest["dense"]["faiss_type"] == "flat" and manifest["dense"]["faiss_options"] == {}
    assert manifest["dense"]["query_prefix"] == manifest["dense"]["passage_prefix"] == ""
    assert {p.name for p in dense_index.iterdir()} == {
        "manifest.json",
        "docs.jsonl",
        "faiss.index",
        "embeddings.f32",
    }
    loaded = load_index(dense_index, corpus=corpora[0], encoder=tiny_encoder)
    assert isinstance(loaded, DenseRetriever)
    fresh = DenseRetriever(load_corpus(corpora[0]), encoder=tiny_encoder).index()
    assert [[d.id for d in r] for r in loaded.search(QUERIES, 4)] == [
        [d.id for d in r] for r in fresh.search(QUERIES, 4)
    ]


def test_bm25_index_round_trip(bm25_index, corpora):
    manifest = read_manifest(bm25_index)
    assert manifest["kind"] == "bm25" and manifest["bm25"] == {"stopwords": "en", "stemmer": "english"}
    loaded = load_index(bm25_index, corpus=corpora[0], encoder="ignored-for-bm25")
    fresh = BM25Retriever(load_corpus(corpora[0])).index()
    assert loaded.search(QUERIES, 5) == fresh.search(QUERIES, 5)
    assert load_index(bm25_index, kind="bm25").search(QUERIES, 5) == fresh.search(QUERIES, 5)


def test_manifest_is_deterministic(bm25_index, corpora, tmp_path):
    again = build_index(corpora[0], "bm25", tmp_path / "again", progress=False)
    assert (again / "manifest.json").read_bytes() == (bm25_index / "manifest.json").read_bytes()


def test_other_corpus_raises_mismatch_with_rebuild_command(dense_index, bm25_index, corpora):
    for index_dir, kind in ((bm25_index, "bm25"), (dense_index, "dense")):
        with pytest.raises(IndexMismatchError) as err:
            load_index(index_dir, corpus=corpora[1])
        message = str(err.value)
        assert "corpus differs" in message and "60 passages" in message and "40 passages" in message
        assert f"zerosim index build --corpus {corpora[1]} --kind {kind} --out {index_dir}" in message


def test_other_encoder_dimension_raises_mismatch(dense_index):
    with pytest.raises(IndexMismatchError) as err:
        load_index(dense_index, encoder="minilm")
    message = str(err.value)
    assert "encoder differs" in message and "dimension differs: expected 32, found 384" in message
    assert "--kind dense" in message and "--encoder" in message
    assert issubclass(IndexMismatchError, ValueError)


def test_changed_encoder_dimension_raises_mismatch(dense_index, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(dense_index, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["dense"]["dimension"] = 768  # as if the encoder folder had been swapped for a bigger model
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IndexMismatchError, match="embedding dimension differs: index holds 768-d"):
        load_index(copy)


def test_missing_manifest_names_the_directory(tmp_path):
    (tmp_path / "not-an-index").mkdir()
    with pytest.raises(FileNotFoundError, match="not-an-index has no manifest.json"):
        load_index(tmp_path / "not-an-index")
    with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
        load_index(tmp_path / "nowhere")


@pytest.mark.parametrize("error", [RuntimeError("encoder crashed"), KeyboardInterrupt()])
def test_interrupted_build_leaves_nothing(corpora, tiny_encoder, tmp_path, monkeypatch, error):
    model = load_encoder(tiny_encoder)
    real_encode, calls = model.encode, []

    def encode_then_die(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # midway: after two batches are in the memmap
            raise error
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(model, "encode", encode_then_die)
    out = tmp_path / "index"
    with pytest.raises(type(error)):
        build_index(
            corpora[0], "dense", out, encoder=tiny_encoder, batch_size=8, chunk_size=16, progress=False
        )
    assert len(calls) == 3
    assert not out.exists() and _leftovers(tmp_path) == []


def test_failed_rebuild_keeps_the_old_index(corpora, tiny_encoder, tmp_path, monkeypatch):
    out = build_index(corpora[0], "bm25", tmp_path / "index", progress=False)
    monkeypatch.setattr(
        load_encoder(tiny_encoder), "encode", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt)
    )
    with pytest.raises(KeyboardInterrupt):
        build_index(corpora[0], "dense", out, encoder=tiny_encoder, progress=False)
    assert read_manifest(out)["kind"] == "bm25" and _leftovers(tmp_path) == []


def test_refuses_to_replace_a_folder_that_is_not_an_index(corpora, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="is not an index"):
        build_index(corpora[0], "bm25", tmp_path / "notes", progress=False)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_chunked_memmap_indexing_matches_one_shot(corpora, tiny_encoder, tmp_path):
    docs = load_corpus(corpora[0])
    chunked = build_index(
        corpora[0], "dense", tmp_path / "a", encoder=tiny_encoder, batch_size=4, chunk_size=7, progress=False
    )
    whole = build_index(
        corpora[0],
        "dense",
        tmp_path / "b",
        encoder=tiny_encoder,
        batch_size=64,
        chunk_size=10_000,
        progress=False,
    )
    memmap = np.fromfile(chunked / "embeddings.f32", dtype=np.float32).reshape(len(docs), 32)
    one_shot = load_encoder(tiny_encoder).encode([d.contents for d in docs], normalize_embeddings=True)
    np.testing.assert_allclose(memmap, one_shot, atol=1e-5)
    np.testing.assert_allclose(
        memmap, np.fromfile(whole / "embeddings.f32", dtype=np.float32).reshape(len(docs), 32), atol=1e-5
    )
    a, b = load_index(chunked).search(QUERIES, 5), load_index(whole).search(QUERIES, 5)
    assert [[d.id for d in r] for r in a] == [[d.id for d in r] for r in b]
    np.testing.assert_allclose(
        [[d.score for d in r] for r in a], [[d.score for d in r] for r in b], atol=1e-5
    )


def test_a_tampered_bm25_array_of_the_same_shape_is_refused_at_load(bm25_index, tmp_path):
    """Scores permuted in place (same dtype, shape and size) change every ranking: the digest of each index
    file, recorded at build, refuses the load naming the file and the rebuild."""
    import shutil

    copy = tmp_path / "bm25"
    shutil.copytree(bm25_index, copy)
    scores = copy / "bm25s" / "data.csc.index.npy"
    data = np.load(scores)
    np.save(scores, np.random.default_rng(0).permutation(data))
    assert np.load(scores).shape == data.shape
    with pytest.raises(
        IndexMismatchError, match=r"bm25s/data.csc.index.npy was changed after the build.*zerosim index build"
    ):
        load_index(copy)
    assert "bm25s/data.csc.index.npy" in read_manifest(bm25_index)["files"]
    load_index(bm25_index)  # the untouched one loads

"""`zerosim index import`: a faiss index built elsewhere (Search-R1's e5_Flat.index over wiki-18.jsonl is the
model case) served by search.engine=dense without encoding its corpus again.

The foreign files are written here as Search-R1 wrote its own: a corpus of ``{"id", "contents": "\\"Title\\"\\ntext"}``
rows (json.dumps defaults, so non-ASCII escaped) and a faiss IndexFlatIP of the normalised embeddings of
those raw ``contents`` strings, by the tiny random 32-d encoder of conftest (``tiny_encoder``).
"""

import json
import os
from pathlib import Path

import faiss
import numpy as np
import pytest

from eval.dense import load_encoder, read_faiss_index
from eval.index import IndexMismatchError, load_index, read_manifest
from zerosim.core.search import SearchRequest
from zerosim.engines import build_search_engine
from zerosim.training.config import load_train_config

CITIES = ["Zürich", "Lima", "Oslo", "Quito", "Hanoi", "Accra", "Dakar", "Riga", "Sofia", "Tunis"]


def _search_r1_corpus(path: Path, n: int = len(CITIES)) -> list[str]:
    """Write ``n`` passages in wiki-18.jsonl's form; return their raw ``contents``."""
    contents = [
        f'"{city}"\n{city} is a city; its river and its {i} bridges are known in country {chr(65 + i)}.'
        for i, city in enumerate((CITIES * 2)[:n])
    ]
    path.write_text("".join(json.dumps({"id": str(i), "contents": c}) + "\n" for i, c in enumerate(contents)))
    return contents


def _faiss_file(path: Path, vectors: np.ndarray, metric: str = "ip") -> Path:
    index = faiss.IndexFlatIP(vectors.shape[1]) if metric == "ip" else faiss.IndexFlatL2(vectors.shape[1])
    index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    faiss.write_index(index, str(path))
    return path


def _encode(encoder, texts, pooling=None) -> np.ndarray:
    return load_encoder(encoder, pooling=pooling).encode(
        texts, normalize_embeddings=True, convert_to_numpy=True
    )


@pytest.fixture
def search_r1(tmp_path, tiny_encoder):
    """wiki-18.jsonl and e5_Flat.index stand-ins (10 passages, 32-d inner product) in ``tmp_path/src``."""
    src = tmp_path / "src"
    src.mkdir()
    contents = _search_r1_corpus(src / "wiki-18.jsonl")
    _faiss_file(src / "e5_Flat.index", _encode(tiny_encoder, contents))
    return src / "e5_Flat.index", src / "wiki-18.jsonl", contents


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_imported_search_r1_index_is_served_by_the_dense_engine(
    search_r1, tiny_encoder, tmp_path, zerosim_cli
):
    faiss_file, corpus, contents = search_r1
    out = tmp_path / "wiki18-e5"
    result = zerosim_cli(
        "index", "import", "--faiss", faiss_file, "--corpus", corpus, "--encoder", tiny_encoder, "--out", out
    )
    assert result.stdout.strip() == str(out)
    manifest = read_manifest(out)
    assert manifest["kind"] == "dense" and manifest["corpus"]["passages"] == len(contents)
    assert manifest["dense"]["dimension"] == 32 and manifest["dense"]["metric"] == "inner_product"
    assert manifest["imported"]["faiss"] == str(faiss_file)
    # linked, not copied: the folder's files are the user's (hard links on one filesystem)
    assert manifest["imported"]["faiss_link"] == manifest["imported"]["corpus_link"] == "hardlink"
    assert os.path.samefile(out / "faiss.index", faiss_file) and os.path.samefile(out / "docs.jsonl", corpus)

    # search.dense.encoder unset: the index's own encoder, read from its manifest
    cfg = load_train_config(overrides=["search.engine=dense", f"search.dense.index_dir={out}"])
    assert cfg.search.dense.encoder is None
    engine = build_search_engine(cfg.search)
    for row in (0, 4, 9):  # the query that is passage i's own text finds passage i: vector i is row i
        (hits,) = engine.search([SearchRequest(contents[row])], k=3)
        assert hits[0].id == str(row) and hits[0].score == pytest.approx(1.0, abs=1e-4)
        assert hits[0].title == CITIES[row]  # title unquoted, non-ASCII decoded (Zürich)

    # the dry run reads the manifest: what the index is, and the encoder it needs, checked before any load
    keys = ["train", "--dry-run", "search.engine=dense", f"search.dense.index_dir={out}"]
    for encoder in ([], [f"search.dense.encoder={tiny_encoder}"]):  # unset (the index's), or the same named
        table = zerosim_cli(*keys, *encoder).stdout
        flat = "".join(ch for ch in table if not ch.isspace() and ch != "│")  # the wrapped cells, read on
        assert f"{len(contents)}passages" in flat and f"importedfrom{faiss_file}".replace(" ", "") in flat, (
            table
        )
    refused = zerosim_cli(*keys, "search.dense.encoder=minilm", code=2)  # another encoder named
    assert f"set search.dense.encoder={tiny_encoder}" in " ".join(refused.stderr.split())


def test_count_mismatch_names_both_numbers_and_writes_nothing(search_r1, tiny_encoder, tmp_path, zerosim_cli):
    faiss_file, _, contents = search_r1
    longer = tmp_path / "src" / "longer.jsonl"
    _search_r1_corpus(longer, len(contents) + 2)
    out = tmp_path / "idx"
    result = zerosim_cli(
        "index",
        "import",
        "--faiss",
        faiss_file,
        "--corpus",
        longer,
        "--encoder",
        tiny_encoder,
        "--out",
        out,
        code=2,
    )
    err = " ".join(result.stderr.split())
    assert "holds 10 vectors" in err and "holds 12 passages" in err, err
    assert str(faiss_file) in err and str(longer) in err and "--corpus" in err
    assert not out.exists() and _leftovers(tmp_path) == []


def test_dimension_mismatch_names_both_numbers_and_writes_nothing(
    search_r1, tiny_encoder, tmp_path, zerosim_cli
):
    _, corpus, contents = search_r1
    other = _faiss_file(
        tmp_path / "src" / "other.index", np.random.default_rng(0).standard_normal((len(contents), 16))
    )
    out = tmp_path / "idx"
    result = zerosim_cli(
        "index",
        "import",
        "--faiss",
        other,
        "--corpus",
        corpus,
        "--encoder",
        tiny_encoder,
        "--out",
        out,
        code=2,
    )
    err = " ".join(result.stderr.split())
    assert "16-d vectors" in err and "32-d embeddings" in err and "--encoder" in err, err
    assert not out.exists() and _leftovers(tmp_path) == []


def test_l2_metric_is_recorded_and_searched_nearest_first(tmp_path, tiny_encoder, zerosim_cli):
    contents = _search_r1_corpus(tmp_path / "corpus.jsonl")
    _faiss_file(tmp_path / "l2.index", _encode(tiny_encoder, contents), metric="l2")
    out = tmp_path / "idx"
    zerosim_cli(
        "index",
        "import",
        "--faiss",
        tmp_path / "l2.index",
        "--corpus",
        tmp_path / "corpus.jsonl",
        "--encoder",
        tiny_encoder,
        "--out",
        out,
    )
    engine = load_index(out, encoder=tiny_encoder)
    assert engine.manifest["dense"]["metric"] == engine.metric == "l2"
    (hits,) = engine.search([SearchRequest(contents[3])], k=4)
    assert hits[0].id == "3" and hits[0].score == pytest.approx(0.0, abs=1e-4)  # minus the squared distance
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)  # higher = better


def test_bare_transformers_encoder_with_cls_pooling(tmp_path, tiny_encoder, zerosim_cli, caplog):
    bare = str(
        Path(tiny_encoder).parent / "bert"
    )  # the tiny BERT saved by transformers, no sentence-transformers files
    contents = _search_r1_corpus(tmp_path / "corpus.jsonl")
    _faiss_file(tmp_path / "cls.index", _encode(bare, contents, pooling="cls"))
    args = ["index", "import", "--faiss", tmp_path / "cls.index", "--corpus", tmp_path / "corpus.jsonl"]
    zerosim_cli(*args, "--encoder", bare, "--pooling", "cls", "--out", tmp_path / "idx")
    engine = load_index(tmp_path / "idx")
    assert engine.manifest["dense"]["pooling"] == "cls"
    (hits,) = engine.search([SearchRequest(contents[7])], k=1)
    assert hits[0].id == "7" and hits[0].score == pytest.approx(1.0, abs=1e-4)
    # the same index imported with the wrong pooling: the stored vectors are not the encoder's (warned)
    with caplog.at_level("WARNING", logger="eval.index_import"):
        zerosim_cli(*args, "--encoder", bare, "--pooling", "mean", "--out", tmp_path / "wrong")
    assert "does not reproduce the stored vectors" in caplog.text and "--pooling" in caplog.text


def test_moved_original_is_named_at_load(search_r1, tiny_encoder, tmp_path, monkeypatch):
    """Across filesystems the files are symlinked; a moved original is named at load, not a crash later."""
    from eval.index_import import import_index

    faiss_file, corpus, _ = search_r1
    monkeypatch.setattr(
        os, "link", lambda *a: (_ for _ in ()).throw(OSError(18, "Invalid cross-device link"))
    )
    out = import_index(faiss_file, corpus, tiny_encoder, tmp_path / "idx")
    assert (out / "faiss.index").is_symlink() and read_manifest(out)["imported"]["faiss_link"] == "symlink"
    faiss_file.rename(faiss_file.with_suffix(".moved"))
    with pytest.raises(
        IndexMismatchError, match="faiss.index links to .*e5_Flat.index, which no longer exists"
    ):
        load_index(out)


def test_flat_index_is_memory_mapped(tmp_path):
    """Loading a flat index maps its file instead of reading the vectors into process memory
    (docs/retrieval.md): the file shows in this process's memory maps, and a plain read does not map it."""
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        pytest.skip("no /proc/self/maps")
    mapped_path = _faiss_file(tmp_path / "mapped.index", np.random.default_rng(0).standard_normal((1000, 16)))
    read_path = _faiss_file(tmp_path / "read.index", np.random.default_rng(1).standard_normal((1000, 16)))
    mapped = read_faiss_index(mapped_path)
    full = faiss.read_index(str(read_path))
    assert mapped.ntotal == full.ntotal == 1000
    regions = maps.read_text()
    assert str(mapped_path) in regions and str(read_path) not in regions
    query = np.random.default_rng(2).standard_normal((1, 16)).astype("float32")
    assert mapped.search(query, 3)[1].shape == (1, 3)  # the mapped vectors are searchable

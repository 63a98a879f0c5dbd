"""On-disk retrieval indexes: build once, load many times, refuse to load against the wrong corpus or encoder.

An index directory is self-contained::

    manifest.json   what was built from what (below); deterministic: same inputs, same bytes
    docs.jsonl      the passages, FlashRAG form {"id", "contents"}; row i is index entry i
    bm25s/          kind bm25: the bm25s index
    faiss.index     kind dense: the faiss index
    embeddings.f32  kind dense: the passage embeddings, float32 (passages x dimension), row-major

``manifest.json`` holds ``format``, ``kind``, ``zerosim_version``, ``corpus`` (``sha256`` and ``passages``
of the passages as written to docs.jsonl, and ``source``, the corpus path it was built from) and either
``bm25`` (stopwords, stemmer) or ``dense`` (encoder, dimension, prefixes, faiss type and options).

Every write goes to a temporary folder beside the target and is renamed into place at the end, so a build
that dies (exception, Ctrl-C) leaves neither a half index nor the temporary folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shlex
from collections.abc import Iterator, Sequence
from pathlib import Path

from zerosim.fsutil import atomic_directory
from zerosim.search import Document, SearchEngine

MANIFEST = "manifest.json"
DOCS = "docs.jsonl"
EMBEDDINGS = "embeddings.f32"
MANIFEST_FORMAT = 1
KINDS = ("bm25", "dense")


class IndexMismatchError(ValueError):
    """An index does not fit what it is loaded with (other corpus, encoder or dimension); the message says
    what differs, expected vs found, and the command that rebuilds it."""


def rebuild_command(
    corpus: str | Path,
    kind: str,
    out: str | Path,
    *,
    encoder: str | None = None,
    faiss_type: str | None = None,
) -> str:
    """The ``zerosim index build`` command line that builds this index."""
    args = ["zerosim", "index", "build", "--corpus", str(corpus), "--kind", kind, "--out", str(out)]
    if kind == "dense":
        args += ["--encoder", encoder or "minilm", "--faiss-type", faiss_type or "flat"]
    return shlex.join(args)


def _doc_line(doc: Document) -> bytes:
    return (json.dumps({"id": doc.id, "contents": doc.contents}, ensure_ascii=False) + "\n").encode("utf-8")


def corpus_fingerprint(docs: Sequence[Document]) -> dict:
    """``{"sha256", "passages"}`` of passages as docs.jsonl stores them (so a .jsonl and a .parquet holding
    the same passages match)."""
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(_doc_line(doc))
    return {"sha256": digest.hexdigest(), "passages": len(docs)}


def write_docs(path: Path, docs: Sequence[Document]) -> dict:
    """Write docs.jsonl and return its :func:`corpus_fingerprint`."""
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for doc in docs:
            line = _doc_line(doc)
            digest.update(line)
            f.write(line)
    return {"sha256": digest.hexdigest(), "passages": len(docs)}


def _is_replaceable(out: Path) -> bool:
    """Only an empty folder or a former index may be replaced: a typo in ``--out`` must not wipe a folder."""
    if not out.exists():
        return True
    if not out.is_dir():
        return False
    return not any(out.iterdir()) or (out / MANIFEST).is_file()


@contextlib.contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; on success it replaces ``out``, on any failure (Ctrl-C
    included) it is removed and ``out`` is left as it was."""
    out = Path(out)
    if not _is_replaceable(out):
        raise FileExistsError(
            f"{out} exists and is not an index (no {MANIFEST}); pick another --out or remove it"
        )
    with atomic_directory(out) as tmp:
        yield tmp


def _write_index(tmp: Path, retriever, docs: Sequence[Document], source: str | None) -> None:
    fingerprint = write_docs(tmp / DOCS, docs)
    retriever.write_files(tmp)
    from zerosim import __version__

    manifest = {
        "format": MANIFEST_FORMAT,
        "zerosim_version": __version__,
        "corpus": {**fingerprint, "source": source},
        **retriever.manifest_fields(),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_index(retriever, out: str | Path) -> Path:
    """Write an already indexed :class:`~eval.bm25.BM25Retriever` or :class:`~eval.dense.DenseRetriever`
    (and its passages) to ``out``, with a manifest (``corpus.source`` is null: no corpus file is known)."""
    out = Path(out)
    with staged_dir(out) as tmp:
        _write_index(tmp, retriever, retriever.docs, source=None)
    return out


def build_index(
    corpus: str | Path,
    kind: str,
    out: str | Path,
    *,
    encoder: str = "minilm",
    faiss_type: str = "flat",
    faiss_options: dict[str, int] | None = None,
    query_prefix: str | None = None,
    passage_prefix: str | None = None,
    batch_size: int = 64,
    chunk_size: int = 16384,
    device: str | None = None,
    progress: bool = True,
) -> Path:
    """Build a ``bm25`` or ``dense`` index of a FlashRAG corpus file (.jsonl/.parquet) into ``out``; return it.

    Dense options (ignored for bm25): ``encoder`` (``minilm``, a sentence-transformers folder or hub id),
    ``faiss_type`` (flat | hnsw | ivfpq) and ``faiss_options`` (see ``eval.dense.FAISS_DEFAULTS``), prefixes
    (default: what the encoder expects), ``batch_size`` passages per encoder call, ``chunk_size`` passages
    per memmap write / faiss add, ``device`` for the encoder. An existing index at ``out`` is replaced only
    once the new one is complete.
    """
    from zerosim.data.qa import load_corpus

    if kind not in KINDS:
        raise ValueError(f"unknown index kind {kind!r}; valid: {', '.join(KINDS)}")
    corpus, out = Path(corpus), Path(out)
    docs = load_corpus(corpus)
    if not docs:
        raise ValueError(f"{corpus} holds no passages")
    with staged_dir(out) as tmp:
        if kind == "bm25":
            from eval.bm25 import BM25Retriever

            retriever = BM25Retriever(docs).index(show_progress=progress)
        else:
            from eval.dense import DenseRetriever

            retriever = DenseRetriever(
                docs,
                encoder=encoder,
                faiss_type=faiss_type,
                faiss_options=faiss_options,
                query_prefix=query_prefix,
                passage_prefix=passage_prefix,
                batch_size=batch_size,
                device=device,
            )
            retriever.index(embeddings_path=tmp / EMBEDDINGS, chunk_size=chunk_size, progress=progress)
        _write_index(tmp, retriever, docs, source=str(corpus.resolve()))
    return out


def read_manifest(index_dir: str | Path) -> dict:
    """The parsed ``manifest.json`` of an index directory (a clear error when there is none)."""
    index_dir = Path(index_dir)
    path = index_dir / MANIFEST
    if not path.is_file():
        what = (
            "does not exist" if not index_dir.exists() else f"has no {MANIFEST}, so it is not a zerosim index"
        )
        raise FileNotFoundError(
            f"index directory {index_dir} {what}; build one with: "
            f"{rebuild_command('CORPUS.jsonl', 'bm25', index_dir)} (or --kind dense)"
        )
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("kind") not in KINDS:
        raise ValueError(f"{path}: unknown index kind {manifest.get('kind')!r}; valid: {', '.join(KINDS)}")
    return manifest


def _mismatch(index_dir: Path, manifest: dict, what: str, corpus: str | Path | None) -> IndexMismatchError:
    dense = manifest.get("dense") or {}
    source = corpus or manifest["corpus"].get("source") or "CORPUS.jsonl"
    command = rebuild_command(
        source, manifest["kind"], index_dir, encoder=dense.get("encoder"), faiss_type=dense.get("faiss_type")
    )
    return IndexMismatchError(f"index {index_dir} does not match: {what}. Rebuild it with: {command}")


def load_index(
    index_dir: str | Path,
    *,
    corpus: str | Path | None = None,
    encoder: str | None = None,
    device: str | None = None,
) -> SearchEngine:
    """Load the index at ``index_dir`` as a ready :class:`SearchEngine` (BM25 or dense, from its manifest).

    With ``corpus`` (a corpus file), its passages must be the ones indexed (same sha256 and count); with
    ``encoder`` (dense only; ignored for bm25), it must be the encoder the index was built with. The
    encoder's embedding dimension must always equal the manifest's. Any difference raises
    :class:`IndexMismatchError` naming it and the rebuild command.
    """
    from zerosim.data.qa import load_corpus

    index_dir = Path(index_dir)
    manifest = read_manifest(index_dir)
    if corpus is not None:
        expected, found = manifest["corpus"], corpus_fingerprint(load_corpus(corpus))
        if (expected["sha256"], expected["passages"]) != (found["sha256"], found["passages"]):
            what = (
                f"corpus differs: index built from {expected['passages']} passages (sha256 {expected['sha256'][:12]}), "
                f"{corpus} has {found['passages']} passages (sha256 {found['sha256'][:12]})"
            )
            raise _mismatch(index_dir, manifest, what, corpus)
    docs = load_corpus(index_dir / DOCS)
    if manifest["kind"] == "bm25":
        from eval.bm25 import BM25Retriever

        return BM25Retriever.from_files(index_dir, docs, manifest)

    from eval.dense import embedding_dimension, load_encoder, resolve_encoder

    built = manifest["dense"]
    if encoder is not None and resolve_encoder(encoder)[0] != built["encoder"]:
        dim = embedding_dimension(load_encoder(encoder, device))
        what = (
            f"encoder differs: index built with {built['encoder']} ({built['dimension']}-d embeddings), "
            f"asked for {resolve_encoder(encoder)[0]} ({dim}-d)"
        )
        if dim != built["dimension"]:
            what += f"; embedding dimension differs: expected {built['dimension']}, found {dim}"
        raise _mismatch(index_dir, manifest, what, corpus)
    dim = embedding_dimension(load_encoder(built["encoder"], device))
    if dim != built["dimension"]:
        what = (
            f"embedding dimension differs: index holds {built['dimension']}-d embeddings, "
            f"encoder {built['encoder']} now gives {dim}-d"
        )
        raise _mismatch(index_dir, manifest, what, corpus)
    from eval.dense import DenseRetriever

    return DenseRetriever.from_files(index_dir, docs, manifest, device=device)

"""On-disk retrieval indexes: build once, load many times, refuse to load against the wrong corpus or encoder.

An index directory is self-contained::

    manifest.json   what was built from what (below); deterministic: same inputs, same bytes
    docs.jsonl      the passages, FlashRAG form {"id", "contents"}; row i is index entry i
    bm25s/          kind bm25: the bm25s index
    faiss.index     kind dense: the faiss index
    embeddings.f32  kind dense: the passage embeddings, float32 (passages x dimension), row-major

``manifest.json`` holds ``format``, ``kind``, ``zerosim_version``, ``corpus`` (``sha256`` and ``passages``
of the passages as written to docs.jsonl, and ``source``, the corpus path it was built from), either
``bm25`` (stopwords, stemmer) or ``dense`` (encoder, dimension, prefixes, faiss type and options), and
``checksum``, the sha256 of every other field (format 2). An index made by ``zerosim index import``
(eval.index_import) also records ``imported`` (the faiss file and corpus it wraps, linked rather than copied)
and ``corpus.file_sha256``, the sha256 of docs.jsonl's bytes when they are the user's corpus file as is.

Loading verifies the index before it answers a query: docs.jsonl must hold the manifest's passages
(count and sha256; hashed once per file version and process), the manifest must match its checksum, and the
stored bm25s / faiss data must hold as many entries as docs.jsonl (and, dense, the manifest's dimension and
faiss type). A difference raises :class:`IndexMismatchError` naming the folder, what differs and the
rebuild command. A build refuses a corpus whose passage ids repeat.

Every write goes to a temporary folder beside the target and is renamed into place at the end, so a build
that dies (exception, Ctrl-C) leaves neither a half index nor the temporary folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

from eval.index_errors import (
    DOCS,
    IndexMismatchError,
    damaged_index_error,
    rebuild_command,
    rebuild_index_command,
    recorded_source,
)
from zerosim.core.engine_names import EngineName
from zerosim.core.fsutil import atomic_directory
from zerosim.core.search import Document, SearchEngine

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
EMBEDDINGS = "embeddings.f32"
MANIFEST_FORMAT = 2  # 2: adds "checksum"; format 1 indexes still load (their passages are verified)
KINDS = tuple(e.value for e in EngineName if e.index_kind)  # ("bm25", "dense"): an index of its own kind
_HASH_BLOCK = 1 << 20


def _doc_line(doc: Document) -> bytes:
    return (json.dumps({"id": doc.id, "contents": doc.contents}, ensure_ascii=False) + "\n").encode("utf-8")


def corpus_fingerprint(docs: Sequence[Document]) -> dict:
    """``{"sha256", "passages"}`` of passages as docs.jsonl stores them (so a .jsonl and a .parquet holding
    the same passages match)."""
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(_doc_line(doc))
    return {"sha256": digest.hexdigest(), "passages": len(docs)}


def manifest_checksum(manifest: dict) -> str:
    """sha256 of the manifest's fields other than ``checksum`` (canonical JSON: sorted keys, no spaces)."""
    fields = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_unique_ids(docs: Sequence[Document], corpus: str | Path | None = None) -> None:
    """Raise :class:`~zerosim.core.data.qa.DataError` when two passages share an id, naming the id and both rows
    (file lines when ``corpus`` is the file ``docs`` were read from). Results are matched by id (hybrid
    fusion, negatives, gold recall), so a repeated id would silently merge two passages."""
    from zerosim.core.data.qa import DataError

    seen: dict[str, int] = {}
    repeats = []
    for i, doc in enumerate(docs):
        if doc.id in seen:
            repeats.append((seen[doc.id], i, doc.id))
        else:
            seen[doc.id] = i
    if not repeats:
        return
    first, second, doc_id = repeats[0]
    if corpus is not None:
        from zerosim.core.data.qa import _rows  # the same "file line N" labels the corpus reader gives

        wheres = [where for where, _ in _rows(Path(corpus))]
        here, there = wheres[second], wheres[first].rsplit(" ", 2)[-2:]
        where = f"{here}: passage id {doc_id!r} repeats the id of {' '.join(there)}"
    else:
        where = f"passage {second + 1}: id {doc_id!r} repeats the id of passage {first + 1}"
    more = f" ({len(repeats) - 1} more repeated id(s) after it)" if len(repeats) > 1 else ""
    raise DataError(
        f"{where}{more}; passage ids must be unique (results are matched by id): give each passage its "
        "own id or drop the duplicate, then build again"
    )


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
        "files": index_file_digests(tmp),  # the stored index itself: checked at every load
    }
    manifest["checksum"] = manifest_checksum(manifest)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_index(retriever, out: str | Path) -> Path:
    """Write an already indexed :class:`~eval.bm25.BM25Retriever` or :class:`~eval.dense.DenseRetriever`
    (and its passages) to ``out``, with a manifest (``corpus.source`` is null: no corpus file is known)."""
    out = Path(out)
    check_unique_ids(retriever.docs)
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
    from zerosim.core.data.qa import load_corpus

    if kind not in KINDS:
        raise ValueError(f"unknown index kind {kind!r}; valid: {', '.join(KINDS)}")
    corpus, out = Path(corpus), Path(out)
    from zerosim.core.fsutil import folder_lock

    with folder_lock(out, "zerosim index build"):  # one build into --out at a time
        docs = load_corpus(corpus)
        if not docs:
            raise ValueError(f"{corpus} holds no passages")
        check_unique_ids(docs, corpus)
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
    """The parsed ``manifest.json`` of an index directory (a clear error when there is none, when it is not
    JSON, or when its format or kind is unknown)."""
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
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IndexMismatchError(
            f"index {index_dir} is damaged: {MANIFEST} is not valid JSON ({e}). Rebuild it with: "
            f"{rebuild_command('CORPUS.jsonl', 'bm25', index_dir)} (or --kind dense)"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("kind") not in KINDS:
        kind = manifest.get("kind") if isinstance(manifest, dict) else None
        raise ValueError(
            f"{path}: unknown index kind {kind!r}; valid: {', '.join(KINDS)}. Rebuild it with: "
            f"{rebuild_command('CORPUS.jsonl', 'bm25', index_dir)} (or --kind dense)"
        )
    fmt = manifest.get("format")
    if not isinstance(fmt, int) or not 1 <= fmt <= MANIFEST_FORMAT:
        raise IndexMismatchError(
            f"index {index_dir}: {MANIFEST} has format {fmt!r}, this zerosim reads formats 1 to "
            f"{MANIFEST_FORMAT}; upgrade zerosim, or rebuild it with: "
            f"{rebuild_command(recorded_source(manifest, None), manifest['kind'], index_dir)}"
        )
    if not isinstance(manifest.get("corpus"), dict) or not isinstance(manifest.get(manifest["kind"]), dict):
        raise damaged_index_error(
            index_dir, manifest, f"{MANIFEST} lacks its 'corpus' or {manifest['kind']!r} section"
        )
    return manifest


def _mismatch(index_dir: Path, manifest: dict, what: str, corpus: str | Path | None) -> IndexMismatchError:
    return IndexMismatchError(
        f"index {index_dir} does not match: {what}. Rebuild it with: {rebuild_index_command(index_dir, manifest, corpus)}"
    )


# (path, size, mtime_ns, inode, device) -> result, so that a file is hashed or parsed once per version
_DOCS_DIGESTS: dict[tuple, tuple[str, int]] = {}
_CORPUS_FINGERPRINTS: dict[tuple, dict] = {}


def _file_key(path: Path) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def docs_digest(path: str | Path) -> tuple[str, int]:
    """``(sha256, lines)`` of a docs.jsonl as stored: the file's bytes hashed in blocks (no parsing), so it
    equals the manifest's ``corpus`` fingerprint exactly when the file is as built. Cached per file
    version (size, mtime, inode) for the process."""
    path = Path(path)
    key = _file_key(path)
    if key not in _DOCS_DIGESTS:
        digest, lines = hashlib.sha256(), 0
        with open(path, "rb") as f:
            while block := f.read(_HASH_BLOCK):
                digest.update(block)
                lines += block.count(b"\n")
        _DOCS_DIGESTS[key] = (digest.hexdigest(), lines)
    return _DOCS_DIGESTS[key]


def file_sha256(path: Path) -> str:
    """sha256 of a file as stored, cached per file version (size, mtime, inode) for the process."""
    key = _file_key(path)
    if key not in _FILE_DIGESTS:
        with open(path, "rb") as f:
            _FILE_DIGESTS[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _FILE_DIGESTS[key]


_FILE_DIGESTS: dict[tuple, str] = {}


def index_file_digests(folder: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of an index's own data (bm25s arrays, faiss files, embeddings): everything
    but the passages (fingerprinted apart) and the manifest."""
    return {
        path.relative_to(folder).as_posix(): file_sha256(path)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name not in (DOCS, MANIFEST)
    }


def corpus_file_fingerprint(corpus: str | Path) -> dict:
    """:func:`corpus_fingerprint` of a corpus file's passages (parsed once per file version and process)."""
    from zerosim.core.data.qa import load_corpus

    path = Path(corpus)
    key = _file_key(path) if path.is_file() else None
    if key is None or key not in _CORPUS_FINGERPRINTS:
        found = corpus_fingerprint(load_corpus(path))
        if key is None:
            return found
        _CORPUS_FINGERPRINTS[key] = found
    return _CORPUS_FINGERPRINTS[key]


def verify_index(index_dir: str | Path, manifest: dict | None = None) -> dict:
    """Check that the files of ``index_dir`` are the ones its manifest describes; return the manifest.

    docs.jsonl must hold the manifest's passage count and sha256 (a truncated, extended or edited file is
    refused before any query can reach a row that is not there), the manifest must match its ``checksum``
    (format 2; an edited stemmer or encoder would otherwise tokenise or encode queries unlike the index),
    and the kind's data must be present (``bm25s/`` or ``faiss.index``; embeddings.f32, when kept, must
    hold passages x dimension float32). Counts inside the bm25s / faiss data are checked when they load.
    """
    index_dir = Path(index_dir)
    manifest = read_manifest(index_dir) if manifest is None else manifest
    recorded = manifest["corpus"]
    docs = index_dir / DOCS
    if not docs.is_file():
        raise damaged_index_error(index_dir, manifest, f"{DOCS} is missing")
    _check_imported_files(index_dir, manifest)
    sha, lines = docs_digest(docs)
    if lines != recorded.get("passages"):
        raise damaged_index_error(
            index_dir,
            manifest,
            f"{DOCS} holds {lines} passages, the manifest records {recorded.get('passages')} "
            "(truncated or extended after the build)",
        )
    expected_sha = recorded.get("file_sha256", recorded.get("sha256"))  # an imported corpus: its own bytes
    if sha != expected_sha:
        raise damaged_index_error(
            index_dir,
            manifest,
            f"{DOCS} was edited after the build: its sha256 is {sha[:12]}, the manifest records "
            f"{str(expected_sha)[:12]}",
        )
    if manifest["format"] >= 2:
        checksum = manifest.get("checksum")
        if checksum != manifest_checksum(manifest):
            section = {k: v for k, v in manifest.items() if k in KINDS}
            raise damaged_index_error(
                index_dir,
                manifest,
                f"{MANIFEST} was changed after the build (its fields no longer match the checksum recorded "
                f"then, {'none' if checksum is None else str(checksum)[:12]}); its settings now read "
                f"{json.dumps(section, sort_keys=True)}: queries would be tokenised or encoded unlike the "
                "stored index",
            )
    data = index_dir / ("bm25s" if manifest["kind"] == "bm25" else "faiss.index")
    if not data.exists():
        raise damaged_index_error(index_dir, manifest, f"{data.name} is missing")
    embeddings = index_dir / EMBEDDINGS
    if manifest["kind"] == "dense" and embeddings.is_file():
        expected = lines * int(manifest["dense"].get("dimension", 0)) * 4
        if embeddings.stat().st_size != expected:
            raise damaged_index_error(
                index_dir,
                manifest,
                f"{EMBEDDINGS} holds {embeddings.stat().st_size} bytes, expected {expected} "
                f"({lines} passages x {manifest['dense'].get('dimension')} float32)",
            )
    return manifest


def check_file_digests(index_dir: Path, manifest: dict) -> None:
    """Every stored index file hashes to the sha256 its manifest's ``files`` recorded at the build (an index
    built before digests has none). Run after the loaders' own checks, which name the more specific damage
    (counts, sizes, faiss type) where there is one; this catches what they cannot see (same shape, other
    values)."""
    for name, digest in (manifest.get("files") or {}).items():  # an index built before digests: none
        path = index_dir / name
        if not path.is_file():
            raise damaged_index_error(index_dir, manifest, f"{name} is missing")
        found = file_sha256(path)
        if found != digest:
            raise damaged_index_error(
                index_dir,
                manifest,
                f"{name} was changed after the build (sha256 {found[:12]}, the manifest records "
                f"{str(digest)[:12]}): its rankings are not the ones built",
            )


def _check_imported_files(index_dir: Path, manifest: dict) -> None:
    """An imported index's linked files must still be there (a symlink's target may have gone) and
    faiss.index must have the size recorded at import (a replaced file; hashing many GB is left out)."""
    imported = manifest.get("imported")
    if not isinstance(imported, dict):
        return
    for name, source in ((DOCS, imported.get("corpus")), ("faiss.index", imported.get("faiss"))):
        path = index_dir / name
        if path.is_symlink() and not path.exists():
            raise damaged_index_error(
                index_dir, manifest, f"{name} links to {source}, which no longer exists (moved or deleted)"
            )
    faiss_file = index_dir / "faiss.index"
    size = imported.get("faiss_bytes")
    if faiss_file.exists() and size is not None and faiss_file.stat().st_size != size:
        raise damaged_index_error(
            index_dir,
            manifest,
            f"faiss.index holds {faiss_file.stat().st_size} bytes, the import recorded {size} "
            f"({imported.get('faiss')} was replaced after the import)",
        )


def load_index(
    index_dir: str | Path,
    *,
    corpus: str | Path | None = None,
    encoder: str | None = None,
    device: str | None = None,
    kind: str | None = None,
) -> SearchEngine:
    """Load the index at ``index_dir`` as a ready :class:`SearchEngine` (BM25 or dense, from its manifest).

    The index is first verified (:func:`verify_index`): its passages, manifest and stored data must be as
    built. With ``corpus`` (a corpus file), its passages must be the ones indexed (same sha256 and count);
    with ``encoder`` (dense only; ignored for bm25), it must be the encoder the index was built with. The
    encoder's embedding dimension must always equal the manifest's. Any difference raises
    :class:`IndexMismatchError` naming it and the rebuild command; so does a ``kind`` (bm25 | dense) other
    than the index's. The engine keeps the manifest (``engine.manifest``) and its folder
    (``engine.index_dir``).
    """
    from zerosim.core.data.qa import load_corpus

    index_dir = Path(index_dir)
    manifest = read_manifest(index_dir)
    if kind is not None and kind != manifest["kind"]:
        raise IndexMismatchError(
            f"index {index_dir} is a {manifest['kind']} index, not a {kind} one: point the {kind} settings at "
            f"a {kind} index, or build one with: {rebuild_command(recorded_source(manifest, corpus), kind, index_dir.parent / f'{index_dir.name}-{kind}')}"
        )
    if corpus is not None:
        expected, found = manifest["corpus"], corpus_file_fingerprint(corpus)
        if (expected["sha256"], expected["passages"]) != (found["sha256"], found["passages"]):
            what = (
                f"corpus differs: index built from {expected['passages']} passages (sha256 {expected['sha256'][:12]}), "
                f"{corpus} has {found['passages']} passages (sha256 {found['sha256'][:12]})"
            )
            raise _mismatch(index_dir, manifest, what, corpus)
    if manifest["kind"] == "dense":
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
            what += f". To search this index, ask for its encoder (search.dense.encoder={built['encoder']})"
            raise _mismatch(index_dir, manifest, what, corpus)
        dim = embedding_dimension(load_encoder(built["encoder"], device, built.get("pooling")))
        if dim != built["dimension"]:
            what = (
                f"embedding dimension differs: index holds {built['dimension']}-d embeddings, "
                f"encoder {built['encoder']} now gives {dim}-d"
            )
            raise _mismatch(index_dir, manifest, what, corpus)
    verify_index(index_dir, manifest)
    docs = load_corpus(index_dir / DOCS)
    if manifest["kind"] == "bm25":
        from eval.bm25 import BM25Retriever

        engine = BM25Retriever.from_files(index_dir, docs, manifest)
    else:
        from eval.dense import DenseRetriever

        engine = DenseRetriever.from_files(index_dir, docs, manifest, device=device)
    check_file_digests(index_dir, manifest)  # before a query reaches it
    engine.manifest, engine.index_dir = manifest, index_dir
    logger.info(
        "index %s: %s, %d passages from %s%s",
        index_dir,
        manifest["kind"],
        len(docs),
        manifest["corpus"].get("source") or "an in-memory corpus",
        "" if corpus is None else f" (checked against {corpus})",
    )
    return engine

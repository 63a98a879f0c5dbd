"""Build the search engine named by ``search.engine`` — the one key that swaps simulator and retrievers."""

from __future__ import annotations

from zerosim.config import EMBEDDED_DATA, SearchConfig
from zerosim.search import SearchEngine


def resolve_corpus(source: str):
    """A corpus path from config: ``factbook`` → the embedded corpus (built on first use), else the path."""
    from pathlib import Path

    if source == EMBEDDED_DATA:
        from zerosim.data.embedded import ensure_factbook

        return ensure_factbook().corpus
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(
            f"corpus file {path} does not exist; pass a FlashRAG corpus jsonl ({{id, contents}} per line) "
            f"or '{EMBEDDED_DATA}' for the embedded corpus"
        )
    return path


def real_retriever(kind: str, corpus: str, index_dir: str | None, **options) -> SearchEngine:
    """A BM25 or dense retriever from an index directory.

    With ``index_dir`` set, that index is loaded (its manifest checked against the encoder). Without it,
    the index is built once into ``$ZEROSIM_HOME/indexes`` (keyed by corpus path and options) and reused;
    its manifest is checked against the corpus, so an edited corpus triggers a clear mismatch error.
    """
    import hashlib
    import json
    from pathlib import Path

    from eval.index import build_index, load_index
    from zerosim.models import zerosim_home

    encoder = options.get("encoder")
    if index_dir is not None:
        return load_index(Path(index_dir), encoder=encoder)
    corpus_path = Path(resolve_corpus(corpus)).resolve()
    key = json.dumps({"corpus": str(corpus_path), "kind": kind, **options}, sort_keys=True)
    target = zerosim_home() / "indexes" / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if not (target / "manifest.json").is_file():
        build_index(corpus_path, kind, target, **options)
    return load_index(target, corpus=corpus_path, encoder=encoder)


def _dense(cfg: SearchConfig) -> SearchEngine:
    d = cfg.dense
    return real_retriever(
        "dense",
        d.corpus,
        d.index_dir,
        encoder=d.encoder,
        faiss_type=d.faiss_type,
        query_prefix=d.query_prefix,
        passage_prefix=d.passage_prefix,
    )


def with_negatives(retriever: SearchEngine, docs, cfg: SearchConfig, seed: int) -> SearchEngine:
    """``retriever`` honouring curriculum noise with corpus negatives (``search.negatives``), or as it is."""
    if cfg.negatives == "none":
        return retriever
    from curricula.negatives import CorpusNegatives

    return CorpusNegatives(retriever, docs, mode=cfg.negatives, depth=cfg.negatives_depth, seed=seed)


def build_search_engine(cfg: SearchConfig, *, seed: int = 0, dtype: str = "auto") -> SearchEngine:
    """The configured :class:`SearchEngine`, ready to answer."""
    if cfg.engine == "simulator":
        from simulators import CachedSearchEngine, LLMSimulator

        sim = cfg.simulator
        options = dict(
            words_per_doc=sim.words_per_doc,
            max_new_tokens=sim.max_new_tokens,
            temperature=sim.temperature,
            top_p=sim.top_p,
            pass_answers=sim.pass_answers,
            prompts=sim.prompts_file,
            on_short=sim.on_short,
            on_leak=sim.on_leak,
            seed=seed,
        )
        if sim.backend == "openai":
            engine = LLMSimulator.from_openai(
                sim.url,
                sim.served_model or sim.model,
                tokenizer=sim.model if sim.chat_template else None,
                connect_timeout=sim.connect_timeout,
                read_timeout=sim.read_timeout,
                retries=sim.retries,
                backoff=sim.backoff,
                max_concurrency=sim.max_concurrency,
                **options,
            )
        else:
            engine = LLMSimulator.from_pretrained(sim.model, dtype=dtype, **options)
        if sim.cache:
            engine = CachedSearchEngine(engine, max_entries=sim.cache_size, sqlite_path=sim.cache_path)
        return engine
    if cfg.engine == "bm25":
        sparse = real_retriever("bm25", cfg.bm25.corpus, cfg.bm25.index_dir)
        return with_negatives(sparse, sparse.docs, cfg, seed)
    if cfg.engine == "dense":
        dense = _dense(cfg)
        return with_negatives(dense, dense.docs, cfg, seed)
    if cfg.engine == "hybrid":
        from eval.hybrid import HybridRetriever

        sparse = real_retriever("bm25", cfg.bm25.corpus, cfg.bm25.index_dir)
        hybrid = HybridRetriever(sparse, _dense(cfg), rrf_k=cfg.hybrid.rrf_k, depth=cfg.hybrid.depth)
        return with_negatives(hybrid, sparse.docs, cfg, seed)
    if cfg.engine == "http":
        from zerosim.http_search import HTTPSearchEngine

        h = cfg.http
        return HTTPSearchEngine(
            h.url,
            connect_timeout=h.connect_timeout,
            read_timeout=h.read_timeout,
            retries=h.retries,
            max_connections=h.max_connections,
        )
    raise ValueError(f"unknown search.engine {cfg.engine!r}; valid: simulator, bm25, dense, hybrid, http")

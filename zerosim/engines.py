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


def build_search_engine(cfg: SearchConfig, *, seed: int = 0, dtype: str = "auto") -> SearchEngine:
    """The configured :class:`SearchEngine`, ready to answer."""
    if cfg.engine == "simulator":
        from simulators import LLMSimulator

        sim = cfg.simulator
        return LLMSimulator.from_pretrained(
            sim.model,
            dtype=dtype,
            words_per_doc=sim.words_per_doc,
            max_new_tokens=sim.max_new_tokens,
            temperature=sim.temperature,
            top_p=sim.top_p,
            pass_answers=sim.pass_answers,
            seed=seed,
        )
    if cfg.engine == "bm25":
        from pathlib import Path

        from eval.bm25 import BM25Retriever
        from zerosim.data.qa import load_corpus

        index_dir = Path(cfg.bm25.index_dir) if cfg.bm25.index_dir else None
        if index_dir is not None and (index_dir / "meta.json").is_file():
            return BM25Retriever.load(index_dir)
        retriever = BM25Retriever(load_corpus(resolve_corpus(cfg.bm25.corpus))).index()
        if index_dir is not None:
            retriever.save(index_dir)
        return retriever
    if cfg.engine == "http":
        from zerosim.http_search import HTTPSearchEngine

        h = cfg.http
        return HTTPSearchEngine(
            h.url, connect_timeout=h.connect_timeout, read_timeout=h.read_timeout, retries=h.retries
        )
    raise ValueError(f"unknown search.engine {cfg.engine!r}; valid: simulator, bm25, dense, hybrid, http")

"""Build the search engine named by ``search.engine`` — the one key that swaps simulator and retrievers."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from curricula.config import CurriculumConfig, MixedConfig
from eval.config import BM25Config, DenseConfig, HybridConfig, RerankConfig
from simulators.config import SimulatorConfig
from simulators.llm import build_simulator
from zerosim.core.config import EMBEDDED_DATA, ConfigError, ranged
from zerosim.core.http.client import HTTPConfig, Negatives
from zerosim.core.search import SearchEngine


class EngineName(StrEnum):
    """``search.engine``: what answers the policy's searches."""

    simulator = "simulator"
    bm25 = "bm25"
    dense = "dense"
    hybrid = "hybrid"
    http = "http"
    mixed = "mixed"

    @property
    def real(self) -> bool:
        """A retriever over a corpus (bm25, dense, hybrid, http): what evaluation searches with."""
        return self in (EngineName.bm25, EngineName.dense, EngineName.hybrid, EngineName.http)

    @property
    def simulated(self) -> bool:
        """The simulator writes (some of) the documents: simulator, mixed."""
        return self in (EngineName.simulator, EngineName.mixed)


@dataclass
class SearchConfig:
    # simulator | bm25 | dense | hybrid | http | mixed (simulator or search.mixed.real per search) — what answers the policy's <search>
    engine: EngineName = EngineName.simulator
    # documents per search
    k: int = ranged(3, ">=1")
    # curriculum noise over bm25/dense/hybrid: hard (ranks k+1..depth) / random (corpus) / none (ignore noise)
    negatives: Negatives = Negatives.hard
    # negatives=hard: retrieve this deep for the noisy slots
    negatives_depth: int = ranged(30, ">=1")
    simulator: SimulatorConfig = field(default_factory=SimulatorConfig)
    bm25: BM25Config = field(default_factory=BM25Config)
    dense: DenseConfig = field(default_factory=DenseConfig)
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    http: HTTPConfig = field(default_factory=HTTPConfig)
    mixed: MixedConfig = field(default_factory=MixedConfig)
    # a cross-encoder over the real retriever (bm25, dense, hybrid, http; mixed's real part)
    rerank: RerankConfig = field(default_factory=RerankConfig)

    def validate(self, prefix: str) -> None:
        """A reranker needs a real retriever under it: the simulator writes its documents, it ranks none."""
        if self.engine == EngineName.simulator and self.rerank.model is not None:
            raise ConfigError(rerank_refusal(prefix))


def rerank_refusal(prefix: str = "search.") -> str:
    """Why ``{prefix}rerank.model`` cannot go with ``{prefix}engine=simulator``, and the fix."""
    return (
        f"{prefix}rerank.model reranks a real retriever's candidates, but {prefix}engine=simulator has none "
        f"(the simulator writes its documents). Fix: set {prefix}rerank.model=null, or {prefix}engine="
        "bm25|dense|hybrid|http (or mixed: its real part is reranked)"
    )


def curriculum_adds_noise(curriculum: CurriculumConfig) -> bool:
    """Whether ``curriculum`` can ask for noisy documents at some step (p > 0)."""
    if curriculum.schedule == "constant":  # p_end throughout
        return curriculum.p_end > 0
    return max(curriculum.p_start, curriculum.p_end) > 0


def real_part(cfg: SearchConfig) -> SearchConfig:
    """``cfg`` for the real retriever of ``search.engine=mixed`` (``search.mixed.real``, its own settings)."""
    import dataclasses

    return dataclasses.replace(cfg, engine=cfg.mixed.real)


def noise_problem(engine: SearchEngine, cfg: SearchConfig) -> str | None:
    """Why ``engine`` (built from ``cfg``) would drop the curriculum's noise, or ``None`` when it honours it."""
    if cfg.engine == "mixed":  # the simulator part writes noisy documents itself; the real part decides
        problem = noise_problem(engine.real, real_part(cfg))
        return None if problem is None else f"its real part (search.mixed.real={cfg.mixed.real}): {problem}"
    if cfg.engine == "simulator":
        return None  # it writes noisy documents itself
    if cfg.engine == "http":
        return unwrap_rerank(engine).noise_problem()
    if getattr(engine, "honours_noise", False):
        return None
    return f"search.negatives={cfg.negatives} leaves the {cfg.engine} retriever's noisy slots unfilled"


def check_noise_config(cfg: SearchConfig, curriculum: CurriculumConfig) -> None:
    """What :func:`check_noise` can tell from the config alone (``--dry-run``, before any engine is built):
    a noisy curriculum over a real retriever with ``search.negatives=none``."""
    # (over http, negatives=none leaves the slots to the engine behind the server: its /health decides)
    kind = cfg.mixed.real if cfg.engine == "mixed" else cfg.engine  # mixed: its real part must fill them
    if curriculum_adds_noise(curriculum) and kind in ("bm25", "dense", "hybrid") and cfg.negatives == "none":
        _refuse(cfg, f"search.negatives=none leaves the {kind} retriever's noisy slots unfilled")


def check_noise(engine: SearchEngine, cfg: SearchConfig) -> None:
    """Refuse (``ConfigError``) an engine that cannot honour the noise a curriculum will ask for."""
    problem = noise_problem(engine, cfg)
    if problem is not None:
        _refuse(cfg, problem)


def _refuse(cfg: SearchConfig, problem: str) -> None:
    if (cfg.mixed.real if cfg.engine == "mixed" else cfg.engine) == "http":
        fix = (
            "serve the index with this version's `zerosim serve retriever` (it fills noisy slots with corpus "
            "negatives; set search.negatives=hard|random)"
        )
    else:
        fix = "set search.negatives=hard or random"
    raise ConfigError(
        f"the curriculum asks for noisy documents but search.engine={cfg.engine} cannot give them: {problem}. "
        f"Fix: {fix}, or train without noise (curriculum.p_start=0 curriculum.p_end=0)"
    )


def resolve_corpus(source: str):
    """A corpus path from config: ``factbook`` → the embedded corpus (built on first use), else the path."""
    from pathlib import Path

    if source == EMBEDDED_DATA:
        from zerosim.core.data.embedded import ensure_factbook

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

    With ``index_dir`` set, that index is loaded (verified, its kind and manifest checked against the
    encoder) and ``corpus``, unless left at the embedded default, must hold the passages it indexes.
    Without it, the index is built once into ``$ZEROSIM_HOME/indexes`` (keyed by corpus path and options)
    and reused; its manifest is checked against the corpus, so an edited corpus triggers a clear mismatch
    error.
    """
    import hashlib
    import json
    from pathlib import Path

    from eval.index import build_index, load_index
    from zerosim.core.fsutil import build_once
    from zerosim.core.models import zerosim_home

    encoder = options.get("encoder")
    if index_dir is not None:
        # a corpus the user named must be the indexed one; the embedded default names none: the index's own
        # passages are used (load_index logs where they came from)
        given = None if corpus == EMBEDDED_DATA else resolve_corpus(corpus)
        return load_index(Path(index_dir), corpus=given, encoder=encoder, kind=kind)
    corpus_path = Path(resolve_corpus(corpus)).resolve()
    key = json.dumps({"corpus": str(corpus_path), "kind": kind, **options}, sort_keys=True)
    target = zerosim_home() / "indexes" / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    build_once(
        target,
        done=(target / "manifest.json").is_file,
        build=lambda: build_index(corpus_path, kind, target, **options),
    )
    return load_index(target, corpus=corpus_path, encoder=encoder)


def _dense(cfg: SearchConfig) -> SearchEngine:
    from eval.dense import EMBEDDED_ENCODER

    d = cfg.dense
    return real_retriever(
        "dense",
        d.corpus,
        d.index_dir,
        # unset: a given index's own encoder (its manifest), else the embedded one for the index built here
        encoder=d.encoder if d.encoder is not None or d.index_dir is not None else EMBEDDED_ENCODER,
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


def build_search_engine(
    cfg: SearchConfig,
    *,
    seed: int = 0,
    dtype: str = "auto",
    noise: bool = False,
    total_steps: int | None = None,
) -> SearchEngine:
    """The configured :class:`SearchEngine`, ready to answer.

    ``noise=True`` (the run's curriculum can ask for noisy documents, :func:`curriculum_adds_noise`) refuses
    an engine that would silently answer them with plain documents: ``ConfigError`` naming the fix.
    ``total_steps`` (the run's ``trainer.max_steps``) is the length of ``search.engine=mixed``'s real-share
    schedule unless ``search.mixed.total_steps`` sets it.
    """
    if cfg.engine == "simulator" and cfg.rerank.model is not None:
        raise ConfigError(rerank_refusal())
    if cfg.engine == "mixed":
        engine = _mixed(cfg, seed=seed, dtype=dtype, total_steps=total_steps)
    else:
        engine = _build(cfg, seed=seed, dtype=dtype)
    if noise:
        try:
            check_noise(engine, cfg)
        except BaseException:
            close = getattr(engine, "close", None)
            if close is not None:
                close()
            raise
    return engine


def _mixed(cfg: SearchConfig, *, seed: int, dtype: str, total_steps: int | None) -> SearchEngine:
    """The simulator (as for ``engine=simulator``) and ``search.mixed.real`` (as for that engine, with
    corpus negatives), routed per search (:class:`curricula.MixedSearchEngine`)."""
    import dataclasses

    from curricula.mixed import MixedSearchEngine, share_schedule

    m = cfg.mixed
    share = share_schedule(m.real_share, m.real_share_end, m.schedule, m.total_steps or total_steps or 1)
    real = _build(real_part(cfg), seed=seed, dtype=dtype)
    try:
        simulator = _build(dataclasses.replace(cfg, engine="simulator"), seed=seed, dtype=dtype)
    except BaseException:
        close = getattr(real, "close", None)
        if close is not None:
            close()
        raise
    return MixedSearchEngine(simulator, real, share=share, seed=seed)


def rerank_source(model: str, key: str = "search.rerank.model") -> str:
    """Where the cross-encoder ``model`` comes from: ``"local folder"`` or ``"Hugging Face id"``; a path-like
    name that does not exist, or a folder without ``config.json``, raises :class:`ConfigError` naming ``key``."""
    from pathlib import Path

    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"{key}: {path} has no config.json; point it at a cross-encoder folder (sentence-transformers "
                "or transformers save_pretrained output) or a Hugging Face id"
            )
        return "local folder"
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model:
        raise ConfigError(
            f"{key}: {model} does not exist; pass a cross-encoder folder or a Hugging Face id (e.g. "
            f"cross-encoder/ms-marco-MiniLM-L-6-v2), or {key}=null for no reranking"
        )
    return "Hugging Face id"


def reranked(retriever: SearchEngine, cfg: SearchConfig, *, engine_fills_noise: bool = False) -> SearchEngine:
    """``retriever`` under ``search.rerank``'s cross-encoder (:class:`eval.rerank.CrossEncoderReranker`), or
    as it is when ``search.rerank.model`` is unset."""
    if cfg.rerank.model is None:
        return retriever
    from eval.rerank import CrossEncoderReranker

    r = cfg.rerank
    rerank_source(r.model)  # a missing folder: a ConfigError naming the key, before sentence-transformers
    return CrossEncoderReranker(
        retriever, r.model, depth=r.depth, batch_size=r.batch_size, engine_fills_noise=engine_fills_noise
    )


def unwrap_rerank(engine: SearchEngine) -> SearchEngine:
    """The engine under a :func:`reranked` one (itself when it is not reranked)."""
    from eval.rerank import CrossEncoderReranker

    return engine.engine if isinstance(engine, CrossEncoderReranker) else engine


def _build(cfg: SearchConfig, *, seed: int, dtype: str) -> SearchEngine:
    # the reranker sits under the corpus negatives: useful slots take the reranked top, hard negatives the
    # reranked ranks k+1..; over http the server fills the noisy slots and the useful ones are reranked
    if cfg.engine == "simulator":
        return build_simulator(cfg.simulator, seed=seed, dtype=dtype)
    if cfg.engine == "bm25":
        sparse = real_retriever("bm25", cfg.bm25.corpus, cfg.bm25.index_dir)
        return with_negatives(reranked(sparse, cfg), sparse.docs, cfg, seed)
    if cfg.engine == "dense":
        dense = _dense(cfg)
        return with_negatives(reranked(dense, cfg), dense.docs, cfg, seed)
    if cfg.engine == "hybrid":
        from eval.hybrid import HybridRetriever

        sparse = real_retriever("bm25", cfg.bm25.corpus, cfg.bm25.index_dir)
        hybrid = HybridRetriever(sparse, _dense(cfg), rrf_k=cfg.hybrid.rrf_k, depth=cfg.hybrid.depth)
        return with_negatives(reranked(hybrid, cfg), sparse.docs, cfg, seed)
    if cfg.engine == "http":
        return reranked(_http(cfg, seed), cfg, engine_fills_noise=True)
    raise ValueError(
        f"unknown search.engine {cfg.engine!r}; valid: simulator, bm25, dense, hybrid, http, mixed"
    )


def _http(cfg: SearchConfig, seed: int) -> SearchEngine:
    from zerosim.core.http.client import HTTPSearchEngine

    h = cfg.http
    return HTTPSearchEngine(
        h.url,
        connect_timeout=h.connect_timeout,
        read_timeout=h.read_timeout,
        retries=h.retries,
        max_connections=h.max_connections,
        negatives=cfg.negatives,
        negatives_depth=cfg.negatives_depth,
        seed=seed,
    )

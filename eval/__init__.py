"""Real retrievers (BM25, dense, hybrid, reranker), their indexes, and the evaluation harness.

Components layer: independent of the other components (simulators, eval, curricula). May import ``zerosim.agent``,
``zerosim.core`` and third-party libraries; imported by the apps (``zerosim.engines`` and above).
"""

from eval.bm25 import BM25Retriever

__all__ = ["BM25Retriever"]

from eval.dense import DenseRetriever  # noqa: E402
from eval.hybrid import HybridRetriever  # noqa: E402
from eval.index import IndexMismatchError, build_index, load_index  # noqa: E402
from eval.rerank import CrossEncoderReranker  # noqa: E402

__all__ += [
    "CrossEncoderReranker",
    "DenseRetriever",
    "HybridRetriever",
    "IndexMismatchError",
    "build_index",
    "load_index",
]

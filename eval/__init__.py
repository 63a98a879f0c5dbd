"""Real retrievers and evaluation."""

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

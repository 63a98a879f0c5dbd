"""Real retrievers and evaluation."""

from eval.bm25 import BM25Retriever

__all__ = ["BM25Retriever"]

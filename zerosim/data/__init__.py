"""Datasets: the CIA World Factbook corpus and QA builder, and the FlashRAG QA / corpus loaders."""

from zerosim.data.factbook import FactbookPaths, build_factbook
from zerosim.data.qa import DataError, QAExample, load_corpus, load_qa, parse_qa_row

__all__ = [
    "DataError",
    "FactbookPaths",
    "QAExample",
    "build_factbook",
    "load_corpus",
    "load_qa",
    "parse_qa_row",
]

"""Datasets (foundation layer): the CIA World Factbook corpus and QA builder, the FlashRAG QA / corpus loaders,
JSON lines. May import ``zerosim.core`` and third-party libraries."""

from zerosim.core.data.factbook import FactbookPaths, build_factbook
from zerosim.core.data.jsonl import DataError, read_jsonl, write_jsonl
from zerosim.core.data.qa import QAExample, load_corpus, load_qa, parse_qa_row

__all__ = [
    "DataError",
    "FactbookPaths",
    "QAExample",
    "build_factbook",
    "load_corpus",
    "load_qa",
    "parse_qa_row",
    "read_jsonl",
    "write_jsonl",
]

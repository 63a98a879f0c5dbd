"""BM25 over a passage corpus with bm25s (English stopwords, Snowball stemming via PyStemmer)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from eval.index_errors import check_stored_count, damaged_index_error
from zerosim.core.search import Document, SearchError, SearchRequest


class BM25Retriever:
    """Sparse lexical retrieval; implements :class:`zerosim.core.search.SearchEngine`.

    Curriculum noise in requests is not applied here (documents come back with ``noisy=None``).
    """

    def __init__(self, docs: Sequence[Document], *, stopwords: str = "en", stemmer_language: str = "english"):
        import bm25s
        import Stemmer

        if not docs:
            raise ValueError("BM25Retriever needs a non-empty corpus")
        self.docs = list(docs)
        self.stopwords = stopwords
        self.stemmer_language = stemmer_language
        self._stemmer = Stemmer.Stemmer(stemmer_language)
        self._bm25s = bm25s
        self.retriever: bm25s.BM25 | None = None

    def index(self, show_progress: bool = False) -> BM25Retriever:
        tokens = self._bm25s.tokenize(
            [d.contents for d in self.docs],
            stopwords=self.stopwords,
            stemmer=self._stemmer,
            show_progress=show_progress,
        )
        self.retriever = self._bm25s.BM25()
        self.retriever.index(tokens, show_progress=show_progress)
        return self

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        if self.retriever is None:
            raise SearchError("BM25Retriever.search called before index() or load_index()")
        if not requests:
            return []
        k_eff = min(k, len(self.docs))
        queries = [r.query for r in requests]
        tokens = self._bm25s.tokenize(
            queries, stopwords=self.stopwords, stemmer=self._stemmer, show_progress=False, return_ids=False
        )
        # Only index-vocabulary tokens can be scored. A query with none (all stopwords or unseen words)
        # matches nothing: it gets the first k passages with score 0, as an all-zero BM25 ranking would.
        vocab = self.retriever.vocab_dict
        known = [[t for t in toks if t in vocab] for toks in tokens]
        scorable = [i for i, toks in enumerate(known) if toks]
        indices = [list(range(k_eff))] * len(queries)
        scores = [[0.0] * k_eff] * len(queries)
        if scorable:
            found, found_scores = self.retriever.retrieve(
                [known[i] for i in scorable], k=k_eff, show_progress=False, n_threads=1
            )
            for row, i in enumerate(scorable):
                indices[i], scores[i] = found[row], found_scores[row]
        results: list[list[Document]] = []
        for row_idx, row_scores in zip(indices, scores, strict=True):
            docs = [self.docs[int(i)] for i in row_idx]
            results.append(
                [
                    Document(id=d.id, title=d.title, text=d.text, score=float(s))
                    for d, s in zip(docs, row_scores, strict=True)
                ]
            )
        return results

    # -- persistence: eval.index.save_index / load_index write and read the directory and its manifest ----

    def manifest_fields(self) -> dict:
        return {"kind": "bm25", "bm25": {"stopwords": self.stopwords, "stemmer": self.stemmer_language}}

    def write_files(self, index_dir: Path) -> None:
        if self.retriever is None:
            raise ValueError("nothing to save: call index() first")
        self.retriever.save(str(index_dir / "bm25s"))

    @classmethod
    def from_files(cls, index_dir: Path, docs: Sequence[Document], manifest: dict) -> BM25Retriever:
        import bm25s

        self = cls(
            docs, stopwords=manifest["bm25"]["stopwords"], stemmer_language=manifest["bm25"]["stemmer"]
        )
        try:
            self.retriever = bm25s.BM25.load(str(index_dir / "bm25s"))
        except (ValueError, EOFError, OSError) as e:  # orjson's JSONDecodeError is a ValueError
            raise damaged_index_error(index_dir, manifest, unreadable_file(index_dir / "bm25s", e)) from None
        stored = self.retriever.scores.get("num_docs")
        check_stored_count(index_dir, manifest, "bm25s/", len(docs) if stored is None else stored, len(docs))
        return self


def unreadable_file(folder: Path, error: Exception) -> str:
    """Which file of a stored bm25s ``folder`` could not be read, and how: bm25s's own error (``error``)
    names neither the file nor the damage. Run only once a load has failed, so the files are re-read then."""
    if isinstance(error, FileNotFoundError) and error.filename:
        return f"bm25s/{Path(error.filename).name} is missing"
    for path in sorted(folder.glob("*.json")):
        try:
            json.loads(path.read_bytes())
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            return f"bm25s/{path.name} is not valid JSON ({e})"
    for path in sorted(folder.glob("*.npy")):
        if (short := _npy_shortfall(path)) is not None:
            return f"bm25s/{path.name} is cut short: {short}"
    return f"bm25s/ cannot be read ({type(error).__name__}: {error})"


def _npy_shortfall(path: Path) -> str | None:
    """How an .npy file falls short of the array its header describes (None: it holds all of it)."""
    import numpy as np

    size = path.stat().st_size
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read_header(f)
        except (ValueError, EOFError) as e:
            return f"its {size} bytes do not hold a whole numpy header ({e})"
        needed = f.tell() + int(np.prod(shape)) * dtype.itemsize
    if size < needed:
        return f"it holds {size} bytes, its header describes {needed} ({dtype} x {shape})"
    return None

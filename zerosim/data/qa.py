"""Load FlashRAG QA datasets and passage corpora, checking every row.

QA rows are ``{"id", "question", "golden_answers", "metadata"}`` (FlashRAG's format); corpus rows are
``{"id", "contents": "Title\\ntext"}``. Files may be ``.jsonl`` or ``.parquet``; a QA source that is not a
local path is read from the Hugging Face hub with ``datasets.load_dataset``. A bad row raises
:class:`DataError` naming the file, the 1-based line (or row) and the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerosim.data.jsonl import DataError, at_line, iter_jsonl
from zerosim.search import Document

FILE_SUFFIXES = (".jsonl", ".parquet")


@dataclass(frozen=True)
class QAExample:
    """One question with its accepted answers; ``metadata`` is free-form (FlashRAG's ``metadata``)."""

    id: str
    question: str
    golden_answers: tuple[str, ...]
    metadata: dict = field(default_factory=dict, hash=False, compare=False)


def _type_name(value: Any) -> str:
    return type(value).__name__


def _got(row: dict, name: str) -> str:
    """What a bad field holds, for error messages: ``missing``, ``empty str``, ``int`` ..."""
    if name not in row:
        return "missing"
    value = row[name]
    empty = isinstance(value, str | list | tuple) and not (value.strip() if isinstance(value, str) else value)
    return f"empty {_type_name(value)}" if empty else _type_name(value)


def _rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for each row of a ``.jsonl`` or ``.parquet`` file; ``where`` reads ``"f.jsonl line 7"``."""
    if not path.is_file():
        raise DataError(f"{path}: no such file; check the path (a FlashRAG .jsonl or .parquet file)")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # lazy: only parquet users pay the import

        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise DataError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
        for i, row in enumerate(table.to_pylist(), start=1):
            yield f"{path} row {i}", row
        return
    for i, row in iter_jsonl(path):
        yield at_line(path, i), row


def _object(where: str, row: Any) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where}: each row must be a JSON object (got {_type_name(row)})")
    return row


def _id(where: str, row: dict) -> str:
    value = row.get("id")
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        raise DataError(
            f"{where}: field 'id' must be a non-empty string or an integer (got {_got(row, 'id')})"
        )
    return str(value)


def _text(where: str, row: dict, name: str) -> str:
    value = row.get(name)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: field {name!r} must be a non-empty string (got {_got(row, name)})")
    return value


def _answers(where: str, row: dict) -> tuple[str, ...]:
    value = row.get("golden_answers")
    if isinstance(value, str):  # some datasets store a single answer as a plain string
        value = [value]
    if not isinstance(value, list | tuple) or not value:
        got = _got(row, "golden_answers")
    elif bad := [a for a in value if not isinstance(a, str)]:
        got = f"an item of type {_type_name(bad[0])}"
    else:
        return tuple(value)
    raise DataError(f"{where}: field 'golden_answers' must be a non-empty list of strings (got {got})")


def parse_qa_row(where: str, row: Any) -> QAExample:
    """Check one FlashRAG QA row and build a :class:`QAExample`; ``where`` prefixes any error message."""
    row = _object(where, row)
    metadata = row.get("metadata")
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict):
        raise DataError(f"{where}: field 'metadata' must be an object (got {_type_name(metadata)})")
    return QAExample(
        id=_id(where, row),
        question=_text(where, row, "question"),
        golden_answers=_answers(where, row),
        metadata=metadata,
    )


def local_path(source: str | Path, split: str | None) -> Path | None:
    """The file ``source`` names, if it names a local one: a file, or ``<dir>/<split>.jsonl|.parquet``.

    Returns ``None`` for what looks like a hub id (``"org/name"`` that is not on disk, no file suffix).
    ``~`` is expanded.
    """
    path = Path(source).expanduser()
    if path.is_dir():
        if split is None:
            raise DataError(f"{path} is a folder: pass split= to pick {path}/<split>.jsonl")
        for suffix in FILE_SUFFIXES:
            if (path / f"{split}{suffix}").is_file():
                return path / f"{split}{suffix}"
        raise DataError(f"{path}: no {split}.jsonl or {split}.parquet in this folder")
    if isinstance(source, Path) or path.exists() or path.suffix in (*FILE_SUFFIXES, ".json"):
        return path
    if str(source).startswith(("/", ".", "~")):  # a path, never a hub id: reported missing as a file
        return path
    return None


def _hub_rows(source: str, split: str | None) -> Iterator[tuple[str, Any]]:
    import datasets  # lazy: heavy, and only hub users need it

    data = datasets.load_dataset(source, split=split)
    if isinstance(data, datasets.DatasetDict):
        raise DataError(f"{source}: pass split= (one of {sorted(data)})")
    for i, row in enumerate(data, start=1):
        yield f"{source} [{split}] row {i}", row


def load_qa(source: str | Path, split: str | None = None, limit: int | None = None) -> list[QAExample]:
    """Read FlashRAG QA rows from a ``.jsonl``/``.parquet`` file, a folder holding ``<split>.jsonl``, or a
    Hugging Face dataset id (``datasets.load_dataset(source, split=split)``; needs hub access).

    ``split`` picks the file in a folder and the hub split; it is ignored for a file path. ``limit`` keeps
    the first ``limit`` rows. A bad row raises :class:`DataError` naming file, line and field.
    """
    path = local_path(source, split)
    rows = _rows(path) if path is not None else _hub_rows(str(source), split)
    examples = []
    for where, row in rows:
        if limit is not None and len(examples) >= limit:
            break
        examples.append(parse_qa_row(where, row))
    return examples


def load_corpus(path: str | Path) -> list[Document]:
    """Read a FlashRAG corpus (``{"id", "contents": "Title\\ntext"}`` per row; ``.jsonl`` or ``.parquet``)."""
    docs = []
    for where, row in _rows(Path(path)):
        row = _object(where, row)
        docs.append(Document.from_contents(_id(where, row), _text(where, row, "contents")))
    return docs

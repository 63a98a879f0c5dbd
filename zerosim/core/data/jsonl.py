"""JSON lines, read and written one way everywhere: datasets, collected SFT rows, evaluation scores, samples.

Reading checks every line and raises :class:`DataError` naming the file, the 1-based line and the fix (a
missing file, a byte that is not UTF-8, a line that is not JSON, a row that is not an object). Blank lines
are skipped (they still count for line numbers) and a UTF-8 byte-order mark is tolerated. Writing is
atomic (:func:`zerosim.core.fsutil.atomic_open`): a crash never leaves a half-written file under the final
name. Rows are written as UTF-8 text (``ensure_ascii=False``), one object per line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from zerosim.core.fsutil import atomic_open


class DataError(ValueError):
    """A dataset file is missing or holds a row that does not fit the expected format."""


def at_line(path: str | Path, line: int) -> str:
    """How errors name a row: ``"data/train.jsonl line 7"``."""
    return f"{path} line {line}"


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` for each non-blank line of ``path``, every line checked as it is read."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file; check the path")
    with open(path, "rb") as f:  # bytes: a non-UTF-8 byte is reported with its line, not mid-iteration
        for i, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if i == 1 else "utf-8")  # tolerate a BOM
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{at_line(path, i)}: not UTF-8 text (byte 0x{raw[e.start]:02x}, byte {e.start + 1} of the "
                    "line); save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))  # so a column is the line's, not one past its end
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{at_line(path, i)}: invalid JSON ({e.msg} at column {e.colno}); each line must be one "
                    "complete JSON object"
                ) from None
            if not isinstance(row, dict):
                raise DataError(
                    f"{at_line(path, i)}: each row must be a JSON object (got {type(row).__name__})"
                )
            yield i, row


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every row of ``path`` (:func:`iter_jsonl`), as a list."""
    return [row for _, row in iter_jsonl(path)]


def jsonl_line(row: Mapping[str, Any], *, sort_keys: bool = False) -> str:
    """One row as a line of JSON (UTF-8 text, not ``\\u`` escapes), newline included."""
    return json.dumps(row, ensure_ascii=False, sort_keys=sort_keys) + "\n"


def jsonl_text(rows: Iterable[Mapping[str, Any]], *, sort_keys: bool = False) -> str:
    """``rows`` as JSON-lines text (what :func:`write_jsonl` writes; for MLflow text artifacts)."""
    return "".join(jsonl_line(row, sort_keys=sort_keys) for row in rows)


def write_jsonl(path: str | Path, rows: Iterable[Mapping[str, Any]], *, sort_keys: bool = False) -> Path:
    """Write ``rows`` to ``path`` atomically, one JSON object per line; return ``path``.

    ``rows`` may be any iterable (it is streamed); if a row fails to serialise, the file is not replaced.
    """
    with atomic_open(path) as f:
        for row in rows:
            f.write(jsonl_line(row, sort_keys=sort_keys))
    return Path(path)

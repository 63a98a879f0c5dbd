"""The embedded factbook data set, built once into the cache and reused."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from zerosim.core.config import EMBEDDED_DATA
from zerosim.core.data.splits import (  # noqa: F401 (SPLITS, DEV_PERCENT: public here too)
    BUILT_SPLITS,
    DERIVED_SPLITS,
    DEV_PERCENT,
    SPLITS,
    in_fact_dev,
)
from zerosim.core.fsutil import build_once
from zerosim.core.models import zerosim_home

if TYPE_CHECKING:
    from zerosim.core.data.factbook import FactbookFiles

FACTBOOK_VERSION = "v3"  # bump when the builder's output changes, so caches rebuild


def factbook_dir() -> Path:
    return zerosim_home() / "data" / f"factbook-{FACTBOOK_VERSION}"


def ensure_factbook(progress: bool = True) -> FactbookFiles:
    """Paths of the embedded corpus and QA splits, building them on first use."""
    from zerosim.core.data.factbook import FactbookFiles, build_factbook

    out = factbook_dir()
    paths = {name.replace("-", "_"): out / f"{name}.jsonl" for name in ("corpus", *BUILT_SPLITS)}
    build_once(
        out,
        done=lambda: all(p.is_file() for p in paths.values()),
        build=lambda: build_factbook(out, progress=progress),
    )
    return FactbookFiles(**paths)


def load_questions(source: str, split: str = "train", limit: int | None = None):
    """QA examples from config: ``factbook`` → the embedded split, else a file or HF dataset id."""
    from zerosim.core.data.qa import DataError, load_qa

    if source == EMBEDDED_DATA:
        if split not in SPLITS:  # checked before the first use builds the factbook
            raise DataError(
                f"the embedded factbook has splits {', '.join(SPLITS)}; got split {split!r}: use one of them"
            )
        if split in DERIVED_SPLITS:
            parent, dev = DERIVED_SPLITS[split]
            rows = load_qa(getattr(ensure_factbook(), parent.replace("-", "_")))
            rows = [row for row in rows if in_fact_dev(row.id) == dev]
            return rows[:limit] if limit is not None else rows
        return load_qa(getattr(ensure_factbook(), split.replace("-", "_")), limit=limit)
    return load_qa(source, split=split, limit=limit)

"""What a retrieval index that does not fit raises, and the command that rebuilds it.

The retrievers (eval.bm25, eval.dense) check their stored data with these when they read it; eval.index,
which builds, verifies and loads index directories, raises the same errors. Kept apart from eval.index so
that the retrievers need not import it (eval.index imports them).
"""

from __future__ import annotations

import shlex
from pathlib import Path

DOCS = "docs.jsonl"


class IndexMismatchError(ValueError):
    """An index does not fit what it is loaded with (other corpus, encoder or dimension), or its files no
    longer fit its manifest (docs.jsonl or manifest.json changed after the build, stored vectors missing);
    the message names the folder, what differs, expected vs found, and the command that rebuilds it."""


def rebuild_command(
    corpus: str | Path,
    kind: str,
    out: str | Path,
    *,
    encoder: str | None = None,
    faiss_type: str | None = None,
) -> str:
    """The ``zerosim index build`` command line that builds this index."""
    args = ["zerosim", "index", "build", "--corpus", str(corpus), "--kind", kind, "--out", str(out)]
    if kind == "dense":
        args += ["--encoder", encoder or "minilm", "--faiss-type", faiss_type or "flat"]
    return shlex.join(args)


def recorded_source(manifest: dict, corpus: str | Path | None) -> str:
    """The corpus to name in a rebuild command: ``corpus`` when given, else the one the manifest records."""
    recorded = manifest.get("corpus") if isinstance(manifest.get("corpus"), dict) else {}
    return str(corpus or recorded.get("source") or "CORPUS.jsonl")


def import_command(
    faiss_file: str | Path,
    corpus: str | Path,
    encoder: str,
    out: str | Path,
    *,
    pooling: str | None = None,
    query_prefix: str | None = None,
    passage_prefix: str | None = None,
) -> str:
    """The ``zerosim index import`` command line that wraps ``faiss_file`` and ``corpus`` into ``out``."""
    args = ["zerosim", "index", "import", "--faiss", str(faiss_file), "--corpus", str(corpus)]
    args += ["--encoder", encoder]
    for flag, value in (
        ("--pooling", pooling),
        ("--query-prefix", query_prefix),
        ("--passage-prefix", passage_prefix),
    ):
        if value is not None:
            args += [flag, value]
    return shlex.join([*args, "--out", str(out)])


def rebuild_index_command(index_dir: Path, manifest: dict, corpus: str | Path | None) -> str:
    """:func:`rebuild_command` for the index at ``index_dir`` as its manifest describes it (the
    :func:`import_command` for an imported one)."""
    dense = manifest.get("dense") if isinstance(manifest.get("dense"), dict) else {}
    imported = manifest.get("imported")
    if isinstance(imported, dict) and imported.get("faiss"):
        return import_command(
            imported["faiss"],
            corpus or imported.get("corpus") or "CORPUS.jsonl",
            dense.get("encoder") or "ENCODER",
            index_dir,
            pooling=dense.get("pooling"),
            query_prefix=dense.get("query_prefix"),
            passage_prefix=dense.get("passage_prefix"),
        )
    return rebuild_command(
        recorded_source(manifest, corpus),
        manifest["kind"],
        index_dir,
        encoder=dense.get("encoder"),
        faiss_type=dense.get("faiss_type"),
    )


def damaged_index_error(index_dir: Path, manifest: dict, what: str) -> IndexMismatchError:
    """The error for an index whose files no longer fit its manifest (changed or lost after the build)."""
    return IndexMismatchError(
        f"index {index_dir} is damaged: {what}. Rebuild it with: {rebuild_index_command(index_dir, manifest, None)}"
    )


def check_stored_count(index_dir: Path, manifest: dict, what: str, count: int, passages: int) -> None:
    """Raise the damaged-index error when the stored bm25s / faiss data holds ``count`` entries for
    ``passages`` passages (row i of docs.jsonl is entry i: a difference sends queries to missing rows)."""
    if count != passages:
        raise damaged_index_error(
            index_dir, manifest, f"{what} holds {count} entries but {DOCS} {passages} passages"
        )

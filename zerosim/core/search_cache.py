"""A result cache in front of any :class:`~zerosim.core.search.SearchEngine`: in-memory LRU plus optional sqlite.

The key of a request is a sha256 over everything that changes the engine's answer: the query, question,
gold answers, noise pattern and ``k``, plus ``key_extra`` — what the engine itself depends on (for the
simulator: model, backend, templates, seed, sampling settings; :meth:`LLMSimulator.cache_key_extra`). Only
the misses of a call reach the wrapped engine, in one batched call.

It sits in the foundation because more than one component keeps one: the simulator (``simulators.llm``:
``search.simulator.cache_path``) and web search (``eval.web``: ``search.web.cache_path``, where a replay must
make no paid request).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sqlite3
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from zerosim.core.config import ConfigError
from zerosim.core.search import Document, SearchEngine, SearchRequest

logger = logging.getLogger(__name__)

KEY_VERSION = 1  # bump when the key or the stored format changes: old entries then simply miss
_SQLITE_BATCH = 500  # keys per SELECT ... IN (...), below sqlite's bound on host parameters


def cache_key(request: SearchRequest, k: int, key_extra: dict[str, Any]) -> str:
    """Hex sha256 over the request, ``k`` and ``key_extra`` (a JSON-serialisable dict)."""
    material = {
        "v": KEY_VERSION,
        "query": request.query,
        "question": request.question,
        "answers": list(request.answers),
        "noise": list(request.noise_for(k)),  # None and all-useful give the same documents
        "k": k,
        "extra": key_extra,
    }
    blob = json.dumps(material, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def documents_to_json(docs: Sequence[Document]) -> str:
    return json.dumps(
        [{"id": d.id, "title": d.title, "text": d.text, "score": d.score, "noisy": d.noisy} for d in docs],
        ensure_ascii=False,
    )


def documents_from_json(blob: str) -> list[Document]:
    """The documents :func:`documents_to_json` wrote; ValueError when ``blob`` is not JSON or not a list of
    objects with Document's fields (a damaged row)."""
    entries = json.loads(blob)
    if not isinstance(entries, list):
        raise ValueError(f"a JSON {type(entries).__name__}, not a list of documents")
    try:
        return [Document(**entry) for entry in entries]
    except TypeError as exc:  # an entry that is no object, or lacks or adds fields
        raise ValueError(f"not a list of documents ({exc})") from None


class CachedSearchEngine:
    """Answers repeated requests from a cache; implements :class:`zerosim.core.search.SearchEngine`.

    Args:
        engine: the engine whose answers are cached.
        max_entries: most results kept in memory (least recently used dropped first).
        sqlite_path: also keep every result in this sqlite file (WAL mode), shared across runs and processes;
            ``None`` = memory only. The file is not size-bounded: delete it to start over.
        key_extra: what besides the request changes the engine's answer. ``None`` takes the engine's own
            ``cache_key_extra()`` when it has one, else its class name. Change it (a new model, template or
            seed) and old entries no longer match.
        cacheable: decides whether a result is stored; ``None`` takes the engine's ``is_cacheable`` when it
            has one (the simulator refuses results holding failure documents), else stores everything.
        keep_empty: store empty results too (web search: "no results" is the engine's answer, and asking
            again would be paid for); by default an empty list is never stored.
        setting: the config key of ``sqlite_path``, as the error for an unusable cache file names it.

    ``stats`` counts ``hits`` (memory or disk), ``disk_hits``, ``misses`` (requests sent to the engine) and
    ``damaged`` (stored rows that could not be read, each served as a miss).
    A request repeated within one call is sent once and counts as a hit the second time.
    """

    metrics_name = "cache"  # ``stats`` are logged as ``search/cache/<counter>``

    def __init__(
        self,
        engine: SearchEngine,
        *,
        max_entries: int = 10000,
        sqlite_path: str | Path | None = None,
        key_extra: dict[str, Any] | None = None,
        cacheable: Callable[[Sequence[Document]], bool] | None = None,
        keep_empty: bool = False,
        setting: str = "search.simulator.cache_path",
    ):
        if max_entries < 0:
            raise ValueError(f"max_entries={max_entries} must not be negative (0 = no memory cache)")
        self.engine = engine
        self.max_entries = max_entries
        if key_extra is None:
            own = getattr(engine, "cache_key_extra", None)
            key_extra = own() if callable(own) else {"engine": type(engine).__name__}
        self.key_extra = dict(key_extra)
        self.cacheable = cacheable or getattr(engine, "is_cacheable", None) or (lambda docs: True)
        self.keep_empty = keep_empty
        self.setting = setting
        self._warned_damaged = False
        self.stats: Counter[str] = Counter()
        self._memory: OrderedDict[str, list[Document]] = OrderedDict()
        self._lock = threading.Lock()
        self.sqlite_path = Path(sqlite_path) if sqlite_path is not None else None
        self._db: sqlite3.Connection | None = None
        if self.sqlite_path is not None:
            self.sqlite_path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._db = sqlite3.connect(self.sqlite_path, check_same_thread=False, timeout=30.0)
                self._db.execute("PRAGMA journal_mode=WAL")  # reads the header: a damaged file fails here
                self._db.execute(
                    "CREATE TABLE IF NOT EXISTS results (key TEXT PRIMARY KEY, documents TEXT NOT NULL)"
                )
                self._db.commit()
            except sqlite3.DatabaseError as exc:
                raise self._unusable(exc) from None

    def key(self, request: SearchRequest, k: int) -> str:
        return cache_key(request, k, self.key_extra)

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        if not requests:
            return []
        keys = [self.key(r, k) for r in requests]
        with self._lock, self._damage_named():
            known = self._lookup(set(keys))
        # each missing key once, in first-seen order: one batched call to the engine
        todo: dict[str, SearchRequest] = {}
        for key, request in zip(keys, requests, strict=True):
            if key not in known and key not in todo:
                todo[key] = request
        self.stats["misses"] += len(todo)
        self.stats["hits"] += len(requests) - len(todo)
        if todo:
            answers = self.engine.search(list(todo.values()), k)
            if len(answers) != len(todo):
                raise ValueError(
                    f"{type(self.engine).__name__} returned {len(answers)} results for {len(todo)} requests"
                )
            fresh = dict(zip(todo, answers, strict=True))
            with self._lock, self._damage_named():
                self._store(
                    (key, docs)
                    for key, docs in fresh.items()
                    if (docs or self.keep_empty) and self.cacheable(docs)
                )
            known.update(fresh)
        return [list(known[key]) for key in keys]

    def clear(self) -> None:
        """Forget everything (memory and disk)."""
        with self._lock:
            self._memory.clear()
            if self._db is not None:
                self._db.execute("DELETE FROM results")
                self._db.commit()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()

    def __len__(self) -> int:
        return len(self._memory)

    def __enter__(self) -> CachedSearchEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CachedSearchEngine({self.engine!r}, max_entries={self.max_entries}, sqlite_path={self.sqlite_path})"

    @contextlib.contextmanager
    def _damage_named(self) -> Iterator[None]:
        """A cache file found damaged past its header (a page sqlite cannot read): the one line, not sqlite's
        traceback. A busy or locked file is another process's turn, and stays sqlite's error."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError):
                raise
            raise self._unusable(exc) from None

    def _unusable(self, exc: sqlite3.DatabaseError) -> ConfigError:
        """The one line for a cache file sqlite cannot use: which file, and the fix."""
        if self._db is not None:
            self._db.close()
            self._db = None
        path = self.sqlite_path
        if path is not None and path.is_dir():
            what = "is a folder"
        elif isinstance(exc, sqlite3.OperationalError):
            what = f"cannot be opened or written ({exc})"
        else:
            what = f"is not an sqlite database, or a damaged one ({exc})"
        return ConfigError(
            f"search cache {path} ({self.setting}) {what}: delete it or move it aside and the "
            "cache starts empty (it only holds answers the engine gives again), or point "
            f"{self.setting} at another file"
        )

    # -- storage (caller holds the lock) ------------------------------------------------------------

    def _lookup(self, keys: set[str]) -> dict[str, list[Document]]:
        found, damaged = {}, []
        for key in keys:
            if key in self._memory:
                self._memory.move_to_end(key)
                found[key] = self._memory[key]
        rest = sorted(keys - found.keys())
        if self._db is not None and rest:
            for start in range(0, len(rest), _SQLITE_BATCH):
                batch = rest[start : start + _SQLITE_BATCH]
                marks = ",".join("?" * len(batch))
                rows = self._db.execute(f"SELECT key, documents FROM results WHERE key IN ({marks})", batch)
                for key, blob in rows:
                    try:
                        docs = documents_from_json(blob)
                    except (ValueError, TypeError) as exc:  # TypeError: a row that holds no text at all
                        # A miss, not a refusal: the cache only holds answers the engine gives again, and the
                        # fresh answer overwrites the row (INSERT OR REPLACE). Refusing would stop a run over
                        # one lost answer; deleting the file would lose every good row (paid web results too).
                        damaged.append(exc)
                        continue
                    found[key] = docs
                    self.stats["disk_hits"] += 1
                    self._remember(key, docs)
        if damaged:
            self._note_damaged(damaged)
        return found

    def _note_damaged(self, damaged: list[Exception]) -> None:
        """Count rows that could not be read; warn once per instance (the count goes on in ``stats``)."""
        self.stats["damaged"] += len(damaged)
        if self._warned_damaged:
            return
        self._warned_damaged = True
        logger.warning(
            "search cache %s (%s): %d row(s) cannot be read (%s); each is treated as a miss and replaced by "
            "the engine's answer. If rows keep failing (counted in search/cache/damaged), delete the file or "
            "point %s at another one: the cache starts empty (it only holds answers the engine gives again)",
            self.sqlite_path,
            self.setting,
            len(damaged),
            damaged[0],
            self.setting,
        )

    def _store(self, entries: Iterable[tuple[str, list[Document]]]) -> None:
        entries = list(entries)
        for key, docs in entries:
            self._remember(key, docs)
        if self._db is not None and entries:
            self._db.executemany(
                "INSERT OR REPLACE INTO results (key, documents) VALUES (?, ?)",
                [(key, documents_to_json(docs)) for key, docs in entries],
            )
            self._db.commit()

    def _remember(self, key: str, docs: list[Document]) -> None:
        if self.max_entries == 0:
            return
        self._memory[key] = docs
        self._memory.move_to_end(key)
        while len(self._memory) > self.max_entries:
            self._memory.popitem(last=False)

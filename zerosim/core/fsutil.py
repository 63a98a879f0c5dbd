"""Filesystem helpers: nothing half-written is ever left where a reader would find it.

What they create gets the user's normal permissions (folders ``0o777 & ~umask``, files ``0o666 & ~umask``,
as ``mkdir`` and ``open`` give), not the private ``0o700`` / ``0o600`` of ``tempfile.mkdtemp`` / ``mkstemp``:
an index or checkpoint folder is meant to be read by whoever may read its parent.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from filelock import FileLock, Timeout

logger = logging.getLogger(__name__)

_ATTEMPTS = 100


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file's content; None when it is missing or not JSON (a record being written, a damaged one)."""
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def make_temp_dir(parent: Path, prefix: str) -> Path:
    """A new, uniquely named folder in ``parent``, created with mode ``0o777`` less the umask (unlike
    ``tempfile.mkdtemp``, which makes it private)."""
    for _ in range(_ATTEMPTS):
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir(mode=0o777)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no unused temporary name {prefix}* in {parent} after {_ATTEMPTS} tries")


def _make_temp_file(parent: Path, prefix: str) -> tuple[int, Path]:
    """``(fd, path)`` of a new file in ``parent`` opened for writing, mode ``0o666`` less the umask."""
    for _ in range(_ATTEMPTS):
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        return fd, path
    raise FileExistsError(f"no unused temporary name {prefix}* in {parent} after {_ATTEMPTS} tries")


# what a full disk (or quota) looks like: errno, or the words of a library that lost it (torch's writer)
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NO_SPACE_WORDS = ("No space left on device", "Disk quota exceeded", "file write failed")
# the other faults of a write that the writer cannot fix by retrying: what each means, and the way out
WRITE_FAULTS = {
    errno.EROFS: ("is on a read-only file system", "write elsewhere (or remount it read-write)"),
    errno.EFBIG: (
        "met a file-size limit",
        "raise the limit (`ulimit -f`, a quota) or write to a file system that takes larger files",
    ),
    errno.EACCES: ("may not be written by this user", "fix its permissions or write elsewhere"),
    errno.EPERM: ("may not be written by this user", "fix its permissions or write elsewhere"),
}


class WriteFaultError(OSError):
    """A write failed for a reason of its disk or file system (full, read-only, a size limit, permissions):
    one line naming where, what the errno means and the way out."""

    def __init__(self, code: int, message: str):
        super().__init__(code, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class DiskFullError(WriteFaultError):
    """A write failed because its disk (or quota) is full: one line naming where, how much is free, the fix."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)


def no_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says the disk or the quota is full."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
            return True
        if any(words in str(exc) for words in NO_SPACE_WORDS):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def write_fault(exc: BaseException) -> OSError | None:
    """The ``OSError`` of :data:`WRITE_FAULTS` that ``exc`` is, or was raised from; None otherwise."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, OSError) and exc.errno in WRITE_FAULTS:
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _free(path: Path) -> str:
    here = Path(path).absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    try:
        return f"{shutil.disk_usage(here).free / 2**20:,.0f} MiB free"
    except OSError:
        return "free space unknown"


@contextlib.contextmanager
def named_write_fault(path: str | Path, what: str, then: str) -> Iterator[None]:
    """Turn a write fault met inside the block into one line: a full disk or quota (an ``OSError``
    ENOSPC/EDQUOT, or a library's words for it) into :class:`DiskFullError` — ``<what>: the disk holding
    <path> is full (N MiB free); free space there or write elsewhere, <then>`` — and a read-only file system,
    a file-size limit or a permission (:data:`WRITE_FAULTS`) into :class:`WriteFaultError`, naming the file
    the fault names, the errno and its way out. ``then``: what to do once the fault is fixed."""
    try:
        yield
    except WriteFaultError:
        raise
    except Exception as exc:
        if no_space(exc):
            raise DiskFullError(
                f"{what}: the disk holding {path} is full ({_free(Path(path))}); free space there or write "
                f"elsewhere, {then}"
            ) from exc
        fault = write_fault(exc)
        if fault is None:
            raise
        meaning, way = WRITE_FAULTS[fault.errno]
        where = fault.filename or path
        raise WriteFaultError(
            fault.errno,
            f"{what}: {where} {meaning} ({errno.errorcode[fault.errno]}: {os.strerror(fault.errno)}); {way}, {then}",
        ) from exc


@contextlib.contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``target``; on success it replaces ``target``.

    On any exception (KeyboardInterrupt included) the temporary directory is removed and ``target`` is
    left as it was. The directory has the user's normal permissions (``0o777 & ~umask``).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(target.parent, f".tmp-{target.name}-")
    then = "then run again (nothing was left half-written)"
    try:
        with named_write_fault(target, f"writing {target.name}", then):
            yield tmp
        old = None
        if target.exists():  # move the old one aside first: the target is missing only between two renames
            old = make_temp_dir(target.parent, f".old-{target.name}-")
            target.rename(old / target.name)
        tmp.rename(target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def build_once(target: str | Path, done: Callable[[], bool], build: Callable[[], object]) -> None:
    """Build the cache entry ``target`` unless ``done()``, once across processes.

    Two processes that start on a fresh cache at the same moment (the ranks of one ``accelerate launch``, a
    simulator server beside training) would otherwise both build it, and the second rename can fail on the
    first's finished folder. The builder holds a lock file beside ``target``; a waiter re-checks ``done()``
    after the lock is released and uses what the other process built.
    """
    target = Path(target)
    if done():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(target.parent / f".{target.name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("another process is building %s; waiting for it", target)
        lock.acquire()
    try:
        if not done():
            build()
    finally:
        lock.release()


@contextlib.contextmanager
def atomic_open(path: str | Path) -> Iterator[TextIO]:
    """A UTF-8 text file to write, open on a temporary file beside ``path``; when the block ends it is
    renamed over ``path`` (mode ``0o666 & ~umask``, as ``open`` would create it). On any exception
    (KeyboardInterrupt included) the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _make_temp_file(path.parent, f".tmp-{path.name}-")
    try:
        with open(fd, "w", encoding="utf-8", newline="\n") as f:
            yield f
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path`` (:func:`atomic_open`)."""
    with atomic_open(path) as f:
        f.write(text)
    return Path(path)


def check_output_folder(path: str | Path, key: str) -> None:
    """Refuse an output folder that cannot be made: ``path``, or a folder above it, is an existing file. Checked
    before anything loads (``mkdir`` would fail only once the models are up)."""
    from zerosim.core.config import ConfigError

    path = Path(path).expanduser()
    for here in (path, *path.parents):
        if here.exists():
            if here.is_dir():
                return
            within = "" if here == path else f" (the job writes under {path})"
            raise ConfigError(
                f"{key}: {here} is an existing file, not a folder{within}; point {key} at a folder (it is "
                "created when missing) or move the file"
            )


_FOLDER_LOCKS: dict[str, FileLock] = {}  # one FileLock per folder in this process (re-entrant)


@contextlib.contextmanager
def folder_lock(folder: str | Path, job: str) -> Iterator[None]:
    """One writer per output folder: while ``job`` (``"zerosim train"``, ...) writes ``folder``, another
    process asking for it is refused at once, naming the process that holds it. The lock lives beside the folder
    (``.<name>.writer.lock``, with ``.<name>.writer.json``: pid, host, job; both removed when released), so the
    folder itself holds only what the job writes and may be replaced whole (an index build). Re-entrant within
    a process."""
    import json
    import socket

    from zerosim.core.config import ConfigError

    folder = Path(folder).expanduser().absolute()
    folder.parent.mkdir(parents=True, exist_ok=True)
    path = folder.parent / f".{folder.name}.writer.lock"  # not build_once's .<name>.lock: a build holds both
    owner_file = folder.parent / f".{folder.name}.writer.json"
    lock = _FOLDER_LOCKS.setdefault(str(path), FileLock(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            owner = json.loads(owner_file.read_text())
        except (OSError, ValueError):
            owner = {}
        who = f"{owner.get('job', 'another zerosim job')}, pid {owner.get('pid', '?')} on {owner.get('host', '?')}"
        raise ConfigError(
            f"{folder} is being written by another process ({who}); wait for it to end, or write this one "
            "to another folder (another run.name / output_dir / --out)"
        ) from None
    try:
        if lock.lock_counter == 1:
            atomic_write_text(
                owner_file, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "job": job})
            )
        yield
    finally:
        lock.release()
        if not lock.is_locked:  # the last holder in this process: leave no trace beside the folder
            owner_file.unlink(missing_ok=True)
            path.unlink(missing_ok=True)

"""A stage's results files: which of them travel, the walk that finds them (regular files only), their
digests when the stage finishes, and the check of those files against the record when the stage is reused.

Results that travel between people are input like any other: a link in an export (``notes.txt ->
/some/secret``, a link to ``/``) would bring what it points at into the experiment, and into the next export.
So every walk over a stage's folder takes regular files only and refuses, naming it, a link (to a file or a
folder), a device, pipe or socket, and a path that resolves outside the folder.

A finished stage's record holds ``files``: the sha256 of each results file it wrote (not its model, whose
digest is ``model``, nor its record). When the stage is reused, each is checked: a truncated or hand-edited
``questions.jsonl`` would otherwise shrink an arm (or change its scores) while its record says otherwise. A
record from before these digests is checked by count where its outputs give one (an eval's questions, a
collection's rows).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from zerosim.core.config import ConfigError
from zerosim.experiment.kinds import ROOT, STAGE_FILE, Kind, Stage
from zerosim.experiment.provenance import CHECKPOINT_PREFIX, MODEL_DIRS, WEIGHT_SUFFIXES, file_sha256
from zerosim.experiment.runlogs import ATTEMPT_FILE

REPORT_FILES = (
    "report.json",
    "report.md",
    "report.png",
)  # the report stage's files, in the experiment's folder
NOT_RESULTS = (STAGE_FILE, ATTEMPT_FILE)  # a stage folder's bookkeeping: its record, its time so far


def _model_or_hidden(part: str) -> bool:
    # incomplete-checkpoint-N: a save that died midway, moved aside by a fresh run (zerosim.training.checkpoint)
    return part in MODEL_DIRS or part.startswith((CHECKPOINT_PREFIX, ".", f"incomplete-{CHECKPOINT_PREFIX}"))


def portable(rel: Path, *, is_dir: bool = False) -> bool:
    """Whether a path of a stage's folder (relative to it) travels: not a model (``final/``, ``best/``,
    ``critic/``, ``checkpoint-*/``, weight files), nor hidden (a file, or a folder such as what a killed
    checkpoint deletion left: ``.deleting-checkpoint-*/``)."""
    if any(_model_or_hidden(p) for p in rel.parts[: None if is_dir else -1]):
        return False
    return is_dir or not (rel.name.endswith(WEIGHT_SUFFIXES) or rel.name.startswith("."))


def regular_files(folder: Path, keep: Callable[[Path, bool], bool] | None = None) -> list[Path]:
    """Every regular file under ``folder`` (sorted), never following a link; ``keep(relative path, is_dir)``
    leaves out (and does not descend into) what it refuses. Raises naming the first link, device, pipe or
    socket met, or a file that resolves outside ``folder``."""
    top = folder.resolve()
    if folder.is_symlink():
        raise ConfigError(f"{folder} is a link (to {os.readlink(folder)}): only regular files are copied")
    found, todo = [], [folder]
    while todo:
        with os.scandir(todo.pop()) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                path = Path(entry.path)
                mode = entry.stat(follow_symlinks=False).st_mode
                if keep is not None and not keep(path.relative_to(folder), stat.S_ISDIR(mode)):
                    continue
                if stat.S_ISLNK(mode):
                    raise ConfigError(
                        f"{path} is a link (to {os.readlink(path)}): only regular files are copied, so what "
                        "it points at never comes along; replace it by the file itself, or delete it"
                    )
                if stat.S_ISDIR(mode):
                    todo.append(path)
                elif not stat.S_ISREG(mode):
                    raise ConfigError(
                        f"{path} is not a regular file (a device, pipe or socket): only regular files are "
                        "copied; delete it"
                    )
                elif not path.resolve().is_relative_to(top):
                    raise ConfigError(f"{path} resolves outside {folder}: only files inside it are copied")
                else:
                    found.append(path)
    return sorted(found)


def _results(stage: Stage, root: Path) -> tuple[Path, list[Path]]:
    """Where a stage's results files are, and which: the report's in the experiment's folder; any other
    stage's, the portable files of its folder less its bookkeeping."""
    if stage.kind == Kind.report:
        return root, [root / name for name in REPORT_FILES if (root / name).is_file()]
    folder = stage.dir(root)
    if not folder.is_dir():
        return folder, []

    def keep(rel: Path, is_dir: bool) -> bool:
        return portable(rel, is_dir=is_dir) and (is_dir or rel.as_posix() not in NOT_RESULTS)

    return folder, regular_files(folder, keep)


def written_files(stage: Stage, root: Path) -> dict[str, str]:
    """``{path relative to the stage's folder: sha256}`` of the results files a stage wrote: its record's
    ``files``, taken when it finishes."""
    base, files = _results(stage, root)
    return {p.relative_to(base).as_posix(): file_sha256(p) for p in files}


def in_stage(path: Any, name: str, folder: Path) -> Path | None:
    """A path a record names (``<root>/stages/<name>/...`` as exported, or under ``folder``) as a path under
    ``folder`` (where the record is read); None for a path outside the stage's folder."""
    if not isinstance(path, str):
        return None
    for prefix in (f"{ROOT}/stages/{name}/", f"{folder}/", f"{folder.resolve()}/"):
        if path.startswith(prefix):
            return folder / path[len(prefix) :]
    return None


def _lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def _counted(stage: Stage, record: Mapping[str, Any], folder: Path) -> tuple[Path, int] | None:
    """The results file a record gives a count of, and that count: an eval's questions (``rows``' n), a
    collection's rows."""
    outputs = record.get("outputs") or {}
    if stage.kind == Kind.eval and isinstance(outputs.get("rows"), list):
        n = sum(r.get("n", 0) for r in outputs["rows"] if isinstance(r, dict))
        return (path, n) if (path := in_stage(outputs.get("questions"), stage.name, folder)) else None
    if stage.kind == Kind.collect and isinstance(outputs.get("rows"), int):
        return (
            (path, outputs["rows"]) if (path := in_stage(outputs.get("path"), stage.name, folder)) else None
        )
    return None


def files_problem(
    stage: Stage, record: Mapping[str, Any], folder: Path, root: Path | None = None
) -> str | None:
    """What is wrong with a finished stage's results files against its record, in words naming the file;
    None when they are what it wrote. ``folder``: where the stage's files are (its folder here, or in an
    export); ``root``: the experiment's folder, where the report's files are (None: not checked)."""
    base = root if stage.kind == Kind.report else folder
    if base is None:
        return None
    recorded = record.get("files")
    if stage.kind == Kind.report and not isinstance(recorded, dict):  # a record from before digests
        recorded = dict.fromkeys(REPORT_FILES)
    if isinstance(recorded, dict):
        for name, digest in sorted(recorded.items()):
            if stage.kind != Kind.report and not portable(Path(name)):
                continue  # listed by a record from before the rule that leaves it out (a best/ tokenizer)
            path = base / name
            if not path.is_file():
                return f"{path} is missing"
            if digest is not None and file_sha256(path) != digest:
                return (
                    f"{path} has sha256 {file_sha256(path)[:8]}…, but the stage wrote {str(digest)[:8]}…: it was "
                    "edited or cut short since"
                )
    counted = _counted(stage, record, folder)
    if counted is not None:
        path, n = counted
        if not path.is_file():
            return f"{path} is missing"
        if (found := _lines(path)) != n:
            return f"{path} has {found} lines, but its record ({STAGE_FILE}) counts {n}: it was cut short or edited"
    return None

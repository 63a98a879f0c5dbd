"""Results that travel: ``zerosim experiment ... --export DIR`` writes the finished stages' results, ``--import
DIR`` brings them into another output directory, where they are reused as if they had run there.

What travels is what the report and the stages downstream read — each finished stage's record
(``stage.json``), its per-question scores and answers, tables and collected data, its MLflow run ids (in the
record) and its runs' metrics and sample trajectories (``mlflow/metrics.csv``, ``mlflow/samples/``; a stage
that failed or stopped travels as these only: :mod:`zerosim.experiment.runlogs`) — and no model unless asked
(below): model folders (``final``, ``best``, ``critic``, ``checkpoint-*``), hidden files and folders and weight
files stay behind. Paths under the experiment's folder are written as ``<root>`` and read back as the folder
imported into, so arms run on different machines (one arm per GPU node, or one CPU machine after another)
merge into one report.

With ``--with-models`` each stage's model folder (``outputs.path``: the warm start's, the simulator's, each
arm's ``final``) travels too, so a continuation elsewhere reads the very weights instead of making them again
(on another CPU kind or with other code, a re-run gives other weights: :mod:`zerosim.experiment.provenance`).
An import checks each model against the digest its record holds, and refuses the whole import, naming the
model, when one differs: nothing is copied.

A reused stage whose model is absent (it ran elsewhere) is not run again while every stage that reads it is
reused too; a stage that still has to read it runs it again (:func:`zerosim.experiment.run.statuses`).

Both sides copy regular files only and check everything before copying anything
(:mod:`zerosim.experiment.stagefiles`): a link, device or pipe is refused, naming it; ``export.json`` lists
each file with its size and an import copies no other; each results file is checked against the digest (or
count) its record holds; an export into the experiment's own folder is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from zerosim.core.config import ConfigError
from zerosim.core.fsutil import atomic_write_text, named_write_fault
from zerosim.experiment.keys import recorded_key
from zerosim.experiment.kinds import (  # noqa: F401 (ROOT: public here too)
    ROOT,
    STAGE_FILE,
    Kind,
    Stage,
    outputs_outside,
    read_stage,
    relative_to_root,
)
from zerosim.experiment.provenance import MODEL_KINDS, as_recorded, short, written_digest
from zerosim.experiment.runlogs import export_logs, stage_runs
from zerosim.experiment.stagefiles import REPORT_FILES, files_problem, portable, regular_files

MANIFEST = "export.json"
# an export written before manifests listed their files: the most an import of it may copy
UNLISTED_LIMIT = 1 << 30
# the most an export's export.json or stage.json may hold: both list files (a few KB to MB); a bigger one is no
# manifest, and an import must not read a file from elsewhere of any size into memory
MAX_JSON_BYTES = 64 << 20


def _model_folder(stage: Stage, record: dict, stage_dir: Path) -> Path | None:
    """Where a finished stage's model is, relative to its folder (``stage_dir``: where its record is read);
    None for a stage that writes no model, or one kept outside its folder."""
    path = (record.get("outputs") or {}).get("path")
    if stage.kind not in MODEL_KINDS or not isinstance(path, str):
        return None
    prefix = f"{ROOT}/stages/{stage.name}/"
    if path.startswith(prefix):  # a record as exported: <root> unread
        return Path(path[len(prefix) :])
    try:
        return Path(path).resolve().relative_to(stage_dir.resolve())
    except ValueError:
        return None


def _outside_experiment(stages: Sequence[Stage], root: Path, out: Path) -> None:
    """Refuse an export folder inside the experiment's (``--export <root>/stages`` replaced each stage's
    folder by its portable copy, deleting the trained models), or one whose stage folders would be it."""
    experiment, target = root.resolve(), out.resolve()
    clash = target == experiment or experiment in target.parents
    clash = clash or any(
        experiment == target / s.name or target / s.name in experiment.parents for s in stages
    )
    if clash:
        raise ConfigError(
            f"--export {out}: inside the experiment's folder {root} (or holding it): the export would replace "
            "the stage folders it copies; give a folder outside it (e.g. results/<name>)"
        )


def _files_to_export(stage: Stage, record: dict, src: Path, with_models: bool) -> tuple[list[Path], bool]:
    """The regular files of a finished stage's folder that travel (its model's too, ``with_models``), and
    whether its model is among them; a link, device or pipe there is refused, naming it."""
    model = _model_folder(stage, record, src) if with_models else None
    model = model if model is not None and (src / model).is_dir() else None

    def keep(rel: Path, is_dir: bool) -> bool:
        if model is not None and (rel == model or model in rel.parents or (is_dir and rel in model.parents)):
            return True
        return portable(rel, is_dir=is_dir)

    return regular_files(src, keep), model is not None


def export_results(
    stages: Sequence[Stage],
    root: Path,
    out: Path,
    *,
    name: str,
    tracking_uri: str | None = None,
    with_models: bool = False,
    dry_run: bool = False,
) -> list[str]:
    """Write every finished stage's results into ``out`` (a folder per stage); returns the stages written
    (``dry_run``: every check made, the stages it would write returned, nothing written).
    A folder written before is replaced stage by stage, so exporting again after more stages finished adds
    them. With ``tracking_uri``, every stage's MLflow runs lend their metrics (``<stage>/mlflow/metrics.csv``)
    and sample trajectories (``<stage>/mlflow/samples/``) — a stage that failed or was stopped too (listed
    under ``unfinished``: its logs only). With ``with_models``, each stage's model folder (its
    ``outputs.path``) travels too. Regular files only: a link in a stage's folder is refused before anything
    is written. ``export.json`` lists every file written, with its size (an import copies no other)."""
    _outside_experiment(stages, root, out)
    finished, unfinished = [], []
    for stage in stages:  # every check before anything is written
        record, src = read_stage(stage, root), stage.dir(root)
        if record is not None:
            finished.append((stage, record, *_files_to_export(stage, record, src, with_models)))
        elif tracking_uri is not None and src.is_dir() and stage_runs(src, None):
            unfinished.append(stage)
    if dry_run:
        return [stage.name for stage, *_ in finished]
    then = f"then export again (each stage is written whole, {MANIFEST} last; no temporary folder was left)"
    with named_write_fault(out, f"--export {out}", then):
        out.mkdir(parents=True, exist_ok=True)
    written, models, listed = [], [], {}
    for stage, record, files, has_model in finished:
        src, tmp = stage.dir(root), out / f".{stage.name}.tmp"
        with _written(tmp, f"--export {out}: writing {stage.name}", then):
            if (
                stage.kind == Kind.report
            ):  # its tables and plot live in the experiment's folder: they travel too
                for name in REPORT_FILES:
                    if (root / name).is_file():
                        tmp.mkdir(parents=True, exist_ok=True)
                        _copy_regular(root / name, tmp / name)
            for path in files:
                target = tmp / path.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                if path.name == STAGE_FILE and path.parent == src:
                    target.write_text(
                        relative_to_root(path.read_text(), root)
                    )  # a record written before <root>
                else:
                    _copy_regular(path, target)
            if tracking_uri is not None:
                export_logs(stage_runs(src, record), tracking_uri, tmp / "mlflow")
            listed[stage.name] = _sizes(tmp)
            _replace(tmp, out / stage.name)
        written.append(stage.name)
        if has_model:
            models.append(stage.name)
    logged = []
    for stage in unfinished:  # no results to reuse: what it logged, to read why it failed or stopped
        tmp = out / f".{stage.name}.tmp"
        with _written(tmp, f"--export {out}: writing {stage.name}'s logs", then):
            if export_logs(stage_runs(stage.dir(root), None), tracking_uri, tmp / "mlflow"):
                _replace(tmp, out / stage.name)
                logged.append(stage.name)
    manifest = {
        "experiment": name,
        "stages": written,
        "models": models,
        "unfinished": logged,
        "files": listed,
    }
    with named_write_fault(out, f"--export {out}: writing {MANIFEST}", then):
        atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=2))
    return written


def _sizes(folder: Path) -> dict[str, int]:
    if not folder.is_dir():
        return {}
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in regular_files(folder)}


def _replace(tmp: Path, dst: Path) -> None:
    if dst.is_symlink() or dst.is_file():
        dst.unlink()
    shutil.rmtree(dst, ignore_errors=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, dst)


def _copy_regular(src: Path, dst: Path) -> None:
    """Copy a regular file's bytes, never through a link (one put in its place since it was checked)."""
    fd = os.open(src, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ConfigError(f"{src} is not a regular file: only regular files are copied")
        with dst.open("wb") as g:
            shutil.copyfileobj(f, g)


def _load_json(path: Path) -> Any:
    """``path`` parsed as JSON, or ValueError saying why not in a phrase (``not JSON (...)``): over
    :data:`MAX_JSON_BYTES`, not JSON, or nested deeper than the parser's recursion allows."""
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{size} bytes, over the {MAX_JSON_BYTES}-byte bound for a manifest or record")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    except RecursionError:  # e.g. 100,000 "[": Python's parser recurses once per level
        raise ValueError(f"nested too deep to read (over {sys.getrecursionlimit()} levels)") from None


def read_manifest(source: Path) -> dict[str, Any]:
    """An export's ``export.json``, checked: a mapping with the experiment's name, lists of stage names, and
    (from exports that list them) each stage's files with their sizes. Anything else is refused in one line
    naming the file and what is wrong."""
    path = source / MANIFEST
    if path.is_symlink() or not path.is_file():
        raise ConfigError(
            f"--import {source}: no {MANIFEST} there (a regular file); point it at a folder written by "
            "`zerosim experiment --export`"
        )

    def bad(what: str) -> ConfigError:
        return ConfigError(
            f"--import {source}: {path} {what}; it is not a manifest written by `zerosim experiment --export` "
            "(export the results again)"
        )

    try:
        data = _load_json(path)
    except ValueError as exc:
        raise bad(f"is {exc}") from None
    if not isinstance(data, dict):
        raise bad(f"is a {type(data).__name__}, not a mapping (experiment, stages, ...)")
    if not isinstance(data.get("experiment"), str):
        raise bad('names no experiment ("experiment": the experiment\'s name)')
    for key in ("stages", "models", "unfinished"):
        names = data.setdefault(key, [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise bad(f'has "{key}" as {json.dumps(names)[:60]}, not a list of stage names')
    files = data.get("files")
    if files is not None and not (
        isinstance(files, dict)
        and all(
            isinstance(listing, dict)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in listing.values())
            for listing in files.values()
        )
    ):
        raise bad('has "files" that is not a mapping of stage -> {file: bytes}')
    return data


def _exported_record(stage: Stage, src: Path) -> dict[str, Any]:
    path = src / STAGE_FILE
    try:
        record = _load_json(path)
    except ValueError as exc:
        raise ConfigError(f"{path}: damaged stage record ({exc}); nothing was imported") from None
    if not isinstance(record, dict) or not isinstance(record.get("outputs"), dict) or "key" not in record:
        raise ConfigError(f"{path}: not a stage record (no key or outputs); nothing was imported")
    outside = outputs_outside(stage, record)
    if outside is not None:
        raise ConfigError(f"{path}: {outside}; nothing was imported. Export the results again")
    return record


def _same_work(stage: Stage, record: dict[str, Any], view: Path, stages: Mapping[str, Stage]) -> bool:
    """Whether another experiment's stage record did this stage's work: the same key, or the key today's rules
    give its recorded settings and the exported records of the stages it read (``view``: this experiment's root
    with the export's stages in it) — a warm start exported before its key left out the RL recipe it shares a
    config with, an arm and its evaluation recorded before a key rule changed."""
    if record.get("key") == stage.key:
        return True
    return recorded_key(stage, record, view, stages) == stage.key


def _within_manifest(src: Path, files: list[Path], listing: Any, manifest: Path) -> int:
    """Refuse a file the manifest does not list, or lists with another size, or one it lists that is absent;
    the bytes to copy."""
    if listing is None:
        return sum(p.stat().st_size for p in files)
    if not isinstance(listing, dict):
        raise ConfigError(f'{src}: its files are not listed in {manifest} ("files"); nothing was imported')
    found = {p.relative_to(src).as_posix(): p for p in files}
    for rel, path in found.items():
        if rel not in listing:
            raise ConfigError(
                f"{path} is not listed in {manifest}: an import copies only what the export wrote; delete "
                "it (or export again); nothing was imported"
            )
        if path.stat().st_size != listing[rel]:
            raise ConfigError(
                f"{path} is {path.stat().st_size} bytes, but {manifest} lists {listing[rel]} bytes: it changed "
                "since it was exported; nothing was imported"
            )
    for rel in listing:
        if rel not in found:
            raise ConfigError(f"{src / rel} is listed in {manifest} but absent; nothing was imported")
    return sum(listing.values())


def _plan(
    stages: Sequence[Stage], root: Path, source: Path, name: str, taken: Sequence[str] = ()
) -> list[tuple[Stage, list[Path]]]:
    """Every check of an import, nothing written: the stages it brings in, with the files it copies."""
    exported = read_manifest(source)
    # another experiment's results: only its stages that did exactly this experiment's work (the same name and
    # key: the same settings, the same upstream stages) — a shared warm start, a baseline's evaluation
    foreign = exported["experiment"] != name
    known = {s.name: s for s in stages}
    coming = []
    present = {
        n: source / n for n in exported["stages"] if n in known and (source / n / STAGE_FILE).is_file()
    }
    # another experiment's records are read beside the exported records of the stages they read
    with preview(stages, root, present) if foreign else nullcontext(root) as view:
        for stage_name in exported["stages"]:
            stage, src = known.get(stage_name), source / stage_name
            if stage is None or stage_name in taken or read_stage(stage, root) is not None:
                continue  # not a stage of this config, brought by an earlier --import, or finished here already
            if not src.is_symlink() and not (src / STAGE_FILE).is_file():
                continue  # not in this copy of the export
            if (
                foreign
                and not src.is_symlink()
                and not _same_work(stage, _exported_record(stage, src), view, known)
            ):
                continue  # the same name for other work
            coming.append(stage)
    files, total, listed = {}, 0, exported.get("files")
    for stage in coming:  # regular files only, and only those the manifest lists
        src = source / stage.name
        files[stage.name] = regular_files(src)
        # None: an export from before file lists; False: a stage whose files it does not list
        listing = None if listed is None else listed.get(stage.name, False)
        total += _within_manifest(src, files[stage.name], listing, source / MANIFEST)
    if listed is None and total > UNLISTED_LIMIT:
        raise ConfigError(
            f"--import {source}: {total / 2**30:.1f} GiB of results, and its {MANIFEST} (written before exports "
            f"listed their files) does not say how much to expect: more than {UNLISTED_LIMIT / 2**30:.0f} GiB "
            "is refused; export the results again"
        )
    for stage in coming:  # each record read, each model and results file what the record says
        src = source / stage.name
        record = _exported_record(stage, src)
        _check_model(stage, record, src)
        # the report's tables and plot, when they came along (exports before they travelled hold none: the
        # report is then written again), are checked against its record as another stage's results are
        report_files = stage.kind == Kind.report and any((src / name).is_file() for name in REPORT_FILES)
        problem = files_problem(stage, record, src, root=src if report_files else None)
        if problem is not None:
            raise ConfigError(
                f"--import {source}: {stage.name}: {problem}. These are not the results the stage measured; "
                "nothing was imported. Export them again from the experiment they ran in"
            )
    return [(stage, files[stage.name]) for stage in coming]


def plan_import(
    stages: Sequence[Stage], root: Path, source: Path, *, name: str, taken: Sequence[str] = ()
) -> list[Stage]:
    """The stages ``--import source`` would bring into ``root``, every check made and nothing written (the
    dry run); ``taken``: stages an earlier ``--import`` brings."""
    return [stage for stage, _ in _plan(stages, root, source, name, taken)]


def import_results(stages: Sequence[Stage], root: Path, source: Path, *, name: str) -> list[str]:
    """Bring the results exported into ``source`` into ``root`` for the stages of this experiment that have
    not finished here; returns the stages brought in. A stage finished here is kept (its own results win).
    Everything is checked first (:func:`plan_import`); when anything is refused, nothing is copied."""
    brought = []
    for stage, files in _plan(stages, root, source, name):
        src, dst = source / stage.name, stage.dir(root)
        tmp = dst.parent / f".{stage.name}.import"
        then = (
            f"then import again ({', '.join(brought) or 'no stage'} came in whole before it; nothing of "
            f"{stage.name} was left)"
        )
        with _written(tmp, f"--import {source}: writing {stage.name} into {root}", then):
            for path in files:  # its record's paths stay <root>: read as this folder
                target = tmp / path.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                _copy_regular(path, target)
            tmp.mkdir(parents=True, exist_ok=True)
            _replace(tmp, dst)
            if stage.kind == Kind.report:  # its tables and plot live in the experiment's folder
                for report in REPORT_FILES:
                    if (dst / report).is_file():
                        os.replace(dst / report, root / report)
        brought.append(stage.name)
    return brought


@contextmanager
def _written(tmp: Path, what: str, then: str) -> Iterator[None]:
    """Write one stage's folder through ``tmp``: a fault of the disk or file system (full, read-only, a file-size
    limit, permissions) is one line naming the file, what its errno means and the way out
    (:func:`~zerosim.core.fsutil.named_write_fault`), and ``tmp`` is removed on any failure."""
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with named_write_fault(tmp.parent, what, then):
            yield
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def preview(stages: Sequence[Stage], root: Path, sources: Mapping[str, Path]) -> Iterator[Path]:
    """A temporary folder that reads as ``root`` with ``sources`` (stage name -> exported stage folder)
    imported: links to this experiment's stage folders and report, and to the exported ones. What the dry
    run of ``--import`` plans against; nothing is written into ``root``."""
    with tempfile.TemporaryDirectory(prefix="zerosim-import-preview-") as tmp:
        view = Path(tmp) / root.name
        (view / "stages").mkdir(parents=True)
        for stage in stages:
            here = stage.dir(root)
            src = sources.get(stage.name) or (here if here.is_dir() else None)
            if src is not None:
                (view / "stages" / stage.name).symlink_to(src.resolve(), target_is_directory=True)
        for stage in stages:  # the report's tables and plot (an imported report's where they came along),
            src = sources.get(stage.name)  # copied: a record's paths are read as the files they resolve to
            for report in REPORT_FILES if stage.kind == Kind.report else ():
                came = src is not None and (src / report).is_file()
                if came or (root / report).is_file():  # an export's: regular files (its walk refuses links)
                    shutil.copyfile((src if came else root) / report, view / report)
        yield view


def _check_model(stage: Stage, record: dict, src: Path) -> None:
    """Refuse an exported stage whose model folder came along with other weights than its record's digest."""
    folder = _model_folder(stage, record, src)
    recorded = written_digest(record)
    if folder is None or recorded is None or not (src / folder).is_dir():
        return  # no model, a record from before digests, or the model stayed behind
    found = (as_recorded(record, src / folder) or {}).get("sha256")
    if found != recorded:
        raise ConfigError(
            f"--import {src.parent}: the model of {stage.name} ({src / folder}) has sha256 {short(found)}, but "
            f"its record says {short(recorded)}: these are not the weights that stage wrote, nor the ones its "
            f"readers read; nothing was imported. Export it again (--export --with-models), or delete "
            f"{src / folder} to import the results without the model"
        )

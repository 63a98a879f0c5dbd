"""Results that travel: ``zerosim experiment ... --export DIR`` writes the finished stages' results, ``--import
DIR`` brings them into another output directory, where they are reused as if they had run there.

What travels is what the report and the stages downstream read — each finished stage's record
(``stage.json``), its per-question scores and answers, tables and collected data, its MLflow run ids (in the
record) and its run's sample trajectories (``mlflow/samples/``; the other artifacts stay in the MLflow store) — and never a model: folders named ``final`` or ``checkpoint-*`` and weight files stay behind. Paths
under the experiment's folder are written as ``<root>`` and read back as the folder imported into, so arms run
on different machines (one arm per GPU node, or one CPU machine after another) merge into one report.

A reused stage whose model is absent (it ran elsewhere) is not run again while every stage that reads it is
reused too; a stage that still has to read it runs it again (:func:`zerosim.experiment.run.statuses`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from zerosim.core.config import ConfigError
from zerosim.core.fsutil import atomic_write_text
from zerosim.experiment.kinds import ROOT, STAGE_FILE, Stage, read_stage, relative_to_root  # noqa: F401 (ROOT: public here too)

MANIFEST = "export.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


def _portable(path: Path, stage_dir: Path) -> bool:
    """Whether a file of a stage's folder travels: not a model (weights, ``final/``, ``checkpoint-*/``)."""
    parts = path.relative_to(stage_dir).parts
    if any(p == "final" or p.startswith("checkpoint-") for p in parts[:-1]):
        return False
    return not path.name.endswith(WEIGHT_SUFFIXES) and not path.name.startswith(".")


SAMPLES = "samples"  # a stage's MLflow run artifacts that travel: its sample trajectories (small JSONL)


def _samples(run_id: str, tracking_uri: str | None, dst: Path) -> int:
    """Copy the ``samples/`` artifacts of an MLflow run (a training run's trajectories, an eval's) into ``dst``;
    how many files. A store that does not hold the run (results imported from another machine) gives 0."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient(tracking_uri)
    try:
        names = [a.path for a in client.list_artifacts(run_id, SAMPLES) if not a.is_dir]
    except (MlflowException, OSError):
        return 0
    if names:
        client.download_artifacts(run_id, SAMPLES, str(dst))  # the folder: dst/samples/<file>
    return len(names)


def export_results(
    stages: Sequence[Stage], root: Path, out: Path, *, name: str, tracking_uri: str | None = None
) -> list[str]:
    """Write every finished stage's results into ``out`` (a folder per stage); returns the stages written.
    A folder written before is replaced stage by stage, so exporting again after more stages finished adds
    them. With ``tracking_uri``, each stage's MLflow run lends its ``samples/`` (the trajectories to read when
    a score surprises) to ``<stage>/mlflow/samples/``."""
    written = []
    out.mkdir(parents=True, exist_ok=True)
    for stage in stages:
        record = read_stage(stage, root)
        if record is None:
            continue
        src, dst = stage.dir(root), out / stage.name
        tmp = out / f".{stage.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for path in sorted(p for p in src.rglob("*") if p.is_file() and _portable(p, src)):
            target = tmp / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            if path.name == STAGE_FILE and path.parent == src:
                target.write_text(relative_to_root(path.read_text(), root))  # a record written before <root>
            else:
                shutil.copy2(path, target)
        run_id = (record.get("outputs") or {}).get("run_id")
        if tracking_uri is not None and isinstance(run_id, str):
            (tmp / "mlflow").mkdir(parents=True, exist_ok=True)
            if not _samples(run_id, tracking_uri, tmp / "mlflow"):
                (tmp / "mlflow").rmdir()
        shutil.rmtree(dst, ignore_errors=True)
        os.replace(tmp, dst)
        written.append(stage.name)
    atomic_write_text(out / MANIFEST, json.dumps({"experiment": name, "stages": written}, indent=2))
    return written


def import_results(stages: Sequence[Stage], root: Path, source: Path, *, name: str) -> list[str]:
    """Bring the results exported into ``source`` into ``root`` for the stages of this experiment that have
    not finished here; returns the stages brought in. A stage finished here is kept (its own results win)."""
    manifest = source / MANIFEST
    if not manifest.is_file():
        raise ConfigError(
            f"--import {source}: no {MANIFEST} there; point it at a folder written by `zerosim experiment "
            "--export`"
        )
    exported = json.loads(manifest.read_text())
    if exported.get("experiment") != name:
        raise ConfigError(
            f"--import {source} holds results of experiment {exported.get('experiment')!r}, not {name!r}: "
            "import them with that experiment's config (its name= decides the folder and the stages)"
        )
    known = {s.name: s for s in stages}
    brought = []
    for stage_name in exported.get("stages", []):
        stage, src = known.get(stage_name), source / stage_name
        if stage is None or not (src / STAGE_FILE).is_file() or read_stage(stage, root) is not None:
            continue  # not a stage of this config, not in this copy of the export, or finished here already
        dst = stage.dir(root)
        tmp = dst.parent / f".{stage_name}.import"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)  # its record's paths stay <root>: read as this folder
        shutil.rmtree(dst, ignore_errors=True)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dst)
        brought.append(stage_name)
    return brought

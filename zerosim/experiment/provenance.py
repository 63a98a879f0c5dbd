"""Which weights a result came from: a digest of each model a stage writes, the digests of the models it read,
and what follows when they differ.

A stage's key fingerprints its settings, not its weights: a warm start re-run under the same key (its model
was deleted, or the results were continued on another machine) may give other weights — bf16 updates on an
AMX CPU, fp32 elsewhere, other code. So every stage that writes a model records ``model`` (a sha256 over its
weight files) and ``machine`` (the CPU kind or GPU it ran on), and every stage records ``reads``: the digest
of each model it read, taken from the record of the stage that wrote it when it ran. A finished stage whose
``reads`` differ from the models there now runs again (:func:`provenance`); an equal one is reused.

Nothing here imports the stage table (the report reads these helpers, and the stage table runs the report):
stages are read through the ``record_of`` the caller gives (``kinds.read_stage`` bound to the root).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# the stage kinds (kinds.Kind values) whose ``path`` is a model
MODEL_KINDS = frozenset({"sft", "dpo", "warmstart", "train"})
Stage = Any  # a kinds.Stage (name, kind, deps)
RecordOf = Callable[[Any], Mapping[str, Any] | None]  # a stage -> its finished record (kinds.read_stage)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
NOT_WEIGHTS = ("training_args.bin",)  # pickled run arguments (paths, dates), not weights
# a stage's model folders: its final policy, the best validated one (zerosim.training.guard.BEST_DIR) and a
# PPO run's critic, a LoRA run's merged policy (policy.lora.merge_final), and its trainer checkpoints; they travel only with --with-models, so an arm may not take
# one of these names (its run folder would not travel)
MODEL_DIRS = ("final", "best", "critic", "merged")
CHECKPOINT_PREFIX = "checkpoint-"
SHORT = 8  # digest characters shown in the dry run and the report
UNRECORDED = "unrecorded"  # a record from before digests: which instance it read is unknown


NOT_BEHAVIOUR = ("training_args.bin", "README.md")  # in a model folder, files that change nothing it does
# sha256 per file version (path, size, mtime, inode), while this process runs: a file read twice (a model
# checked by the plan and again before its reader, a results file at every re-plan) is hashed once
_SHA256: dict[tuple, str] = {}


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file, read in ``chunk``-byte pieces (a model's shards are never held in memory); cached
    per file version for the process."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _SHA256:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while block := f.read(chunk):
                digest.update(block)
        _SHA256[key] = digest.hexdigest()
    return _SHA256[key]


def model_files(folder: Path) -> list[Path]:
    """Every file of a model folder that changes what the model does: weights, adapters, config.json,
    generation_config.json, the tokenizer's files and chat template (not training_args.bin, a README, dotfiles)."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not p.name.startswith(".") and p.name not in NOT_BEHAVIOUR
    )


def weight_files(folder: Path) -> list[Path]:
    """The files a model's weights are in: its safetensors files and their index (a sharded model); else its
    other weight files; else (no weight file: not a model folder we know) every file."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    safetensors = [p for p in files if p.name.endswith((".safetensors", ".safetensors.index.json"))]
    if safetensors:
        return safetensors
    weights = [p for p in files if p.name.endswith(WEIGHT_SUFFIXES) and p.name not in NOT_WEIGHTS]
    return weights or files


def _base_files(folder: Path) -> dict[str, str]:
    """A LoRA adapter folder's base (``policy.lora``): what the adapter computes with is the base too, so its
    files count as ``base/<name>``; a base named by a Hugging Face id counts as that id (``base``)."""
    from zerosim.core.models import adapter_base, is_adapter, resolve_model

    if not is_adapter(folder):
        return {}
    name = adapter_base(folder)
    base = Path(resolve_model(name))
    if not base.is_dir():
        return {"base": hashlib.sha256(name.encode()).hexdigest()}
    return {f"base/{p.relative_to(base).as_posix()}": file_sha256(p) for p in model_files(base)}


def model_digest(path: str | Path, covers: str = "folder") -> dict[str, Any] | None:
    """``{"sha256": ..., "files": {name: sha256}, "covers": covers}`` of a model folder (or file): each file's
    sha256 and one sha256 over those lines. ``covers``: ``"folder"`` (every file that changes what the model
    does, :func:`model_files`) or ``"weights"`` (its weight files only: what records before ``covers`` hashed,
    :func:`weight_files`). None when ``path`` is absent."""
    path = Path(path)
    if path.is_file():
        files = {path.name: file_sha256(path)}
    elif path.is_dir():
        chosen = model_files(path) if covers == "folder" else weight_files(path)
        files = {p.relative_to(path).as_posix(): file_sha256(p) for p in chosen}
        if covers == "folder":
            files.update(_base_files(path))
    else:
        return None
    lines = "".join(f"{name}\t{sha}\n" for name, sha in sorted(files.items()))
    digest = {"sha256": hashlib.sha256(lines.encode()).hexdigest(), "files": files}
    return {**digest, "covers": covers} if covers != "weights" else digest


def as_recorded(record: Mapping[str, Any] | None, path: str | Path) -> dict[str, Any] | None:
    """The digest of the model at ``path`` taken as ``record``'s was (its ``covers``; a record without one
    hashed the weights only), so the two compare."""
    model = (record or {}).get("model")
    covers = model.get("covers", "weights") if isinstance(model, dict) else "folder"
    return model_digest(path, covers=covers)


def model_problem(name: str, record: Mapping[str, Any] | None) -> str | None:
    """Why the model a finished stage's record names (``outputs.path``) is not the one on disk now, or None
    (no model, no digest recorded, or the model absent: a results-only import)."""
    recorded = written_digest(record)
    path = ((record or {}).get("outputs") or {}).get("path")
    if recorded is None or not isinstance(path, str) or not Path(path).exists():
        return None
    found = as_recorded(record, path) or {}
    if found.get("sha256") == recorded:
        return None
    was = (record.get("model") or {}).get("files") or {}
    now = found.get("files") or {}
    changed = sorted(n for n in set(was) | set(now) if was.get(n) != now.get(n))
    return (
        f"{name}'s model {path} is not the one its record names (sha256 {short(found.get('sha256'))}, recorded "
        f"{short(recorded)}; changed: {', '.join(changed[:6]) or 'its files'}): a stage reading it would use "
        "other weights than its record and the report say. Put the recorded model back, or delete the stage's "
        "folder to run it again"
    )


def machine_kind() -> str:
    """What a model was computed on, as far as it decides the weights: the GPU, or the CPU kind and its
    matrix instructions (AMX: bf16 updates; AVX-512, AVX2: fp32)."""
    import torch

    from zerosim.core.runtime import cpu_kind

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return cpu_kind()


def short(digest: str | None) -> str:
    return f"{digest[:SHORT]}…" if digest else UNRECORDED


def written_digest(record: Mapping[str, Any] | None) -> str | None:
    """The sha256 of the model a finished stage's record says it wrote (None: no model, or no digest)."""
    model = (record or {}).get("model")
    return model.get("sha256") if isinstance(model, dict) else None


def read_by(stage: Stage, by_name: Mapping[str, Stage], record_of: RecordOf) -> dict[str, str | None]:
    """What ``stage`` reads now: for each stage it reads that writes a model, that model's digest in its
    record (None: not recorded). Written into the record of a stage when it runs."""
    reads: dict[str, str | None] = {}
    for name in stage.deps:
        dep = by_name.get(name)
        if dep is not None and dep.kind in MODEL_KINDS:
            reads[name] = written_digest(record_of(dep))
    return reads


def provenance(
    stage: Stage, done: Mapping[str, Any], by_name: Mapping[str, Stage], record_of: RecordOf
) -> tuple[list[str], list[str]]:
    """How a finished stage's ``reads`` compare with the models there now: (changed, notes). ``changed``: one
    ``reads warmstart a1b2…, now c3d4…`` per model re-run since with other weights (the stage must run
    again); ``notes``: the models it read that no digest can be compared for (a record from before digests)."""
    deps = [d for d in stage.deps if (s := by_name.get(d)) is not None and s.kind in MODEL_KINDS]
    if not deps:
        return [], []
    reads = done.get("reads")
    if not isinstance(reads, dict):
        return [], [f"reads {', '.join(deps)}: instance {UNRECORDED} (a record from before digests)"]
    changed, notes = [], []
    for name in deps:
        was, now = reads.get(name), written_digest(record_of(by_name[name]))
        if was and now and was != now:
            changed.append(f"reads {name} {short(was)}, now {short(now)}")
        elif not was:
            notes.append(f"reads {name}: instance {UNRECORDED}")
    return changed, notes


def lineage(name: str, records: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Every model a finished stage read, directly or through the models it read: ``{stage: digest prefix}``,
    ``unrecorded`` where a record predates digests, and ``a1b2… (now c3d4…)`` where that model was re-run
    since with other weights (its own reads are then unknown)."""
    out: dict[str, str] = {}
    todo = [name]
    while todo:
        record = records.get(todo.pop(0)) or {}
        reads = record.get("reads")
        if not isinstance(reads, dict):
            continue
        for dep, was in reads.items():
            if dep in out:
                continue
            now = written_digest(records.get(dep))
            out[dep] = short(was) + (f" (now {short(now)})" if was and now and now != was else "")
            if was and now == was:
                todo.append(dep)
    return out


def row_provenance(records: Mapping[str, Mapping[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(arm, engine) -> seed -> :func:`lineage` of that seed's eval stage (``unrecorded`` for an eval record
    from before digests), from the finished stages' records."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for name, record in records.items():
        meta = record.get("meta") or {}
        if record.get("kind") != "eval" or "arm" not in meta:
            continue
        seed = "-" if meta.get("seed") is None else str(meta["seed"])
        instance = lineage(name, records) if isinstance(record.get("reads"), dict) else UNRECORDED
        out.setdefault((meta["arm"], str(meta.get("engine"))), {})[seed] = instance
    return out


def add_row_provenance(report: dict[str, Any], records: Mapping[str, Mapping[str, Any]]) -> None:
    """Each report row's ``provenance``: for each seed, the model instances its eval stage read."""
    by_row = row_provenance(records)
    for row in report["rows"]:
        row["provenance"] = by_row.get((row["arm"], row["engine"]), {})


def provenance_markdown(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The report's section saying which model instance (digest prefix) each seed's row read."""
    seen, lines = set(), []
    for row in sorted(rows, key=lambda r: (r["arm"], r["engine"])):
        for seed, instance in (row.get("provenance") or {}).items():
            if (row["arm"], row["engine"], seed) in seen:
                continue
            seen.add((row["arm"], row["engine"], seed))
            read = (
                instance
                if isinstance(instance, str)
                else ", ".join(f"{dep} {digest}" for dep, digest in instance.items())
                or "the base policy (no model of this experiment)"
            )
            lines.append(f"| {row['arm']} | {row['engine']} | {seed} | {read} |")
    if not lines:
        return []
    return [
        "",
        "### Provenance (the model instances each seed's row read: sha256 prefixes from the stage records)",
        "",
        "| arm | engine | seed | models read |",
        "|---|---|---|---|",
        *lines,
    ]

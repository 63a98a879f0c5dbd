"""Resumable checkpoints bound to their run: what a ``checkpoint-N`` holds beside transformers' files, when
it counts as complete, and which run and config may continue from it (the resume contract, docs/training.md).

transformers writes the model, optimizer, LR scheduler, RNG states and ``trainer_state.json``; then
:class:`ZerosimState` writes ``zerosim_state.pt`` (atomically, always last): the MLflow run id and config the
checkpoint belongs to, a list of the files written before it, the curriculum state, the PPO critic and its
optimizer, and what the run has only in memory (sample trajectories, validation history). A checkpoint is
complete when that file is there and every file it lists is there at its size; a resume also checks every
file's sha256, recorded at save (:func:`damaged_files`), so a same-size damage is refused, not resumed. Old checkpoints are deleted
only after the newest is complete (transformers' own rotation, which runs before our file is written, is
off: ``save_total_limit=None``), so a kill at any point leaves one to resume from.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from zerosim.core.config import ConfigError, flatten
from zerosim.training.config import TrainConfig

STATE_FILE = "zerosim_state.pt"  # our part of a checkpoint, written last: its presence makes it complete
RUN_FILE = "mlflow_run.json"  # <output_dir>/<name>/mlflow_run.json: the run a resume continues
_TMP_STATE = ".tmp-state-"  # our state file while it is written (torch.save wants a plain name)
_DELETING = ".deleting-"  # a checkpoint being deleted is renamed to this first: never half a checkpoint-N
INCOMPLETE = "incomplete-"  # checkpoints that no save completed, moved aside by a fresh run into their folder

# What a resume may change: where the run folder is, how long the run goes, how often it saves, where and what
# it logs (the run id, kept in the checkpoint, finds the run), how many threads it computes with. Every other
# field is bound to the checkpoint.
RESUMABLE_FIELDS = (
    "run.resume",
    "run.name",
    "run.output_dir",
    "trainer.max_steps",
    "trainer.save_steps",
    "trainer.save_total_limit",
    "trainer.save_final",
    "tracking.",
    "runtime.",  # the machine a run continues on
    "trainer.logging_steps",
    "trainer.collapse_patience",
    # where the servers are and how long to wait for them: a run killed by a timeout continues with a longer one
    "trainer.vllm_server_url",
    "search.http.url",
    "search.http.connect_timeout",
    "search.http.read_timeout",
    "search.http.retries",
    "search.http.max_connections",
    "search.simulator.url",
    "search.simulator.connect_timeout",
    "search.simulator.read_timeout",
    "search.simulator.retries",
    "search.simulator.backoff",
    "search.simulator.max_concurrency",
)

logger = logging.getLogger(__name__)


class CheckpointError(ConfigError):
    """A run folder's checkpoints cannot be used as asked (another run's, another config, not plain data);
    the message names the way out."""


def bound_config(cfg: TrainConfig) -> dict[str, Any]:
    """The resolved config a checkpoint is bound to: every field except :data:`RESUMABLE_FIELDS`, as plain
    JSON values."""
    keep = {
        k: v
        for k, v in flatten(cfg).items()
        if not any(k == f or (f.endswith(".") and k.startswith(f)) for f in RESUMABLE_FIELDS)
    }
    return json.loads(json.dumps(keep, sort_keys=True, default=str))


def resumed_changes(cfg: TrainConfig, params: dict[str, str]) -> dict[str, Any]:
    """The :data:`RESUMABLE_FIELDS` a resume changed: ``{field: new value}`` against the run's params."""
    bound = bound_config(cfg)
    return {
        k: v
        for k, v in flatten(cfg).items()
        if k != "run.resume" and k not in bound and k in params and params[k] != str(v)
    }


def config_changes(state: dict[str, Any], bound: dict[str, Any]) -> list[str] | None:
    """How the config a checkpoint was saved with (``state``) differs from ``bound`` (:func:`bound_config`), one
    line per setting; ``None`` when the fingerprints match. A setting the checkpoint lacks that is at its
    default now was added by a later release at a default that changes nothing (as stage keys read it), so it
    is no difference: a run started before ``trainer.gradient_checkpointing`` existed continues."""
    if state.get("fingerprint") == config_fingerprint(bound):
        return None
    saved = state.get("config", {})
    defaults = bound_config(TrainConfig())
    return [
        f"{k}: {saved.get(k, '(absent)')!r} in the checkpoint, {bound.get(k, '(absent)')!r} now"
        for k in sorted(set(saved) | set(bound))
        if not (k not in saved and k in bound and k in defaults and bound[k] == defaults[k])
        and (k not in saved or k not in bound or saved[k] != bound[k])
    ]


def config_fingerprint(bound: dict[str, Any]) -> str:
    """sha256 of a :func:`bound_config`."""
    return hashlib.sha256(json.dumps(bound, sort_keys=True).encode()).hexdigest()


def checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``checkpoint-N`` folder in ``output_dir``, complete or not, oldest first."""
    found = []
    for path in Path(output_dir).glob("checkpoint-*"):
        step = path.name.rpartition("-")[2]
        if step.isdigit() and path.is_dir():
            found.append((int(step), path))
    return sorted(found)


def read_state(checkpoint: Path, mmap: bool = False) -> dict[str, Any]:
    """Our state file of ``checkpoint``, loaded with ``weights_only=True``: tensors and plain values only.

    A file holding anything else (a pickled object could run code as it loads) is refused.
    """
    path = Path(checkpoint) / STATE_FILE
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain values; refusing to load it (unpickling them "
            f"could run code). zerosim writes only tensors and plain values there: this file is not one of "
            f"its checkpoints. Delete {checkpoint} to resume from an earlier one, or start a new run under "
            "another run.name."
        ) from exc


def _missing_files(checkpoint: Path, state: dict[str, Any]) -> list[str]:
    """The files our state lists (written before it) that are gone or of another size."""
    missing = []
    for name, size in state.get("files", {}).items():
        path = checkpoint / name
        if not path.is_file() or path.stat().st_size != size:
            missing.append(name)
    return missing


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, read in chunks (hashlib's ``file_digest``)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def damaged_files(checkpoint: Path, state: dict[str, Any]) -> list[str]:
    """The files of ``checkpoint`` whose bytes are not those recorded at save (``state["digests"]``); [] for
    a checkpoint of a version that recorded none (its sizes were checked by :func:`complete`)."""
    return [
        name
        for name, digest in state.get("digests", {}).items()
        if not (checkpoint / name).is_file() or file_digest(checkpoint / name) != digest
    ]


def verified_checkpoint(output_dir: Path) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
    """The newest complete checkpoint whose files hold what was saved, and the newer complete ones that do not
    (each with its damaged files), newest first."""
    damaged = []
    for _, path in reversed(checkpoints(output_dir)):
        if not complete(path):
            continue
        bad = damaged_files(path, read_state(path, mmap=True))
        if not bad:
            return path, damaged
        damaged.append((path, bad))
    return None, damaged


def complete(path: Path) -> bool:
    """Whether ``checkpoint-N`` is complete: our state file (readable), ``trainer_state.json`` and every file
    the state lists (model, optimizer, scheduler, RNG states: written before it) at their sizes."""
    if not ((path / STATE_FILE).is_file() and (path / "trainer_state.json").is_file()):
        return False  # a save killed before it completed
    try:
        state = read_state(path, mmap=True)
    except (RuntimeError, EOFError, OSError) as exc:  # e.g. emptied by a crash of the machine
        logger.warning("skipping %s: its %s cannot be read (%s)", path, STATE_FILE, exc)
        return False
    missing = _missing_files(path, state)
    if missing:
        logger.warning("skipping %s: %s missing or of another size", path, ", ".join(missing))
        return False
    return True


def last_complete_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete ``checkpoint-N`` (:func:`complete`)."""
    for _, path in reversed(checkpoints(output_dir)):
        if complete(path):
            return path
    return None


def _fsync(path: Path) -> None:
    """Flush a file, or a folder's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ZerosimState(TrainerCallback):
    """A ``TrainerCallback`` completing each checkpoint with what transformers does not save, then rotating.

    ``zerosim_state.pt`` holds: the MLflow run id and :func:`bound_config` (checked on resume), the files
    transformers wrote (with sizes), the curriculum state (adaptive schedules), the PPO critic and its
    optimizer, the rollout's sample trajectories and recent answers, the validation history and last rows, and
    the collapse guard's state (streaks, best validated step, rollbacks). Plain values and tensors only (it is loaded with ``weights_only=True``). Written to a
    temporary name and renamed, after the trainer's own files; only then are older checkpoints deleted,
    keeping the newest ``keep`` complete ones (``keep`` < 1: all).

    The trainer is built after its callbacks: :meth:`bind` gives it to this one (its critic and accelerator),
    before training starts and before :meth:`load`.
    """

    def __init__(
        self,
        schedule,
        *,
        run_id: str,
        config: dict[str, Any],
        keep: int = 0,
        rollout=None,
        validation=None,
        guard=None,
    ):
        self.schedule = schedule
        self.trainer = None  # set by bind()
        self.run_id = run_id
        self.config = config
        self.keep = keep
        self.rollout, self.validation, self.guard = rollout, validation, guard

    def bind(self, trainer) -> ZerosimState:
        """Give this callback the trainer it runs in (built after it); returns ``self``."""
        self.trainer = trainer
        return self

    def _bound(self, what: str):
        if self.trainer is None:
            raise RuntimeError(
                f"ZerosimState has no trainer to {what}: call state_callback.bind(trainer) once the trainer "
                "is built, before training or load()"
            )
        return self.trainer

    def payload(self, checkpoint: Path, step: int) -> dict[str, Any]:
        files = {
            p.relative_to(checkpoint).as_posix(): p.stat().st_size
            for p in sorted(checkpoint.rglob("*"))
            if p.is_file() and p.name != STATE_FILE and not p.name.startswith(_TMP_STATE)
        }
        payload: dict[str, Any] = {
            "global_step": int(step),
            "run_id": self.run_id,
            "config": self.config,
            "fingerprint": config_fingerprint(self.config),
            "files": files,
            # what each file holds, checked before a resume loads it (a same-size damage passes the sizes)
            "digests": {name: file_digest(checkpoint / name) for name in files},
        }
        if hasattr(self.schedule, "state_dict"):
            payload["schedule"] = self.schedule.state_dict()
        trainer = self._bound("save the critic of")
        if getattr(trainer, "critic", None) is not None:
            payload["critic"] = trainer.critic.state_dict()
            payload["critic_optimizer"] = trainer.critic_optimizer.state_dict()
        # JSON round trips: what reaches the state file is plain (it is logged as JSON lines anyway)
        if self.rollout is not None:
            payload["samples"] = json.loads(json.dumps(self.rollout.samples))
        if self.validation is not None:
            payload["validation_history"] = json.loads(json.dumps(self.validation.history))
            payload["validation_rows"] = json.loads(json.dumps(self.validation.last_rows))
        if self.rollout is not None:
            payload["recent_answers"] = list(getattr(self.rollout, "recent_answers", ()))
        if self.guard is not None:
            payload["collapse_streak"] = int(self.guard.streak)
            if hasattr(self.guard, "state_dict"):
                payload["guard"] = self.guard.state_dict()
        return payload

    def on_save(self, args, state, control, **kwargs):
        # every rank writes its own files (RNG state, ZeRO / FSDP shards) on its own schedule: wait for all of
        # them before the file list is taken, or a half-written one would be listed (or missed)
        trainer = self._bound("synchronise the ranks of")
        if trainer.accelerator.num_processes > 1:
            trainer.accelerator.wait_for_everyone()
        if not state.is_world_process_zero:  # one writer; every rank holds the same curriculum and critic
            return
        output_dir = Path(args.output_dir)
        checkpoint = output_dir / f"checkpoint-{state.global_step}"
        for stale in checkpoint.glob(f"{_TMP_STATE}*"):  # a killed attempt's half-written state file
            stale.unlink()
        tmp = checkpoint / f"{_TMP_STATE}{os.getpid()}.pt"
        torch.save(self.payload(checkpoint, state.global_step), tmp)
        _fsync(tmp)  # on disk before it makes the checkpoint complete: a power loss must not leave it empty
        os.replace(tmp, checkpoint / STATE_FILE)  # the checkpoint is complete from here
        _fsync(checkpoint)
        self.rotate(output_dir, state.global_step)
        return control

    def rotate(self, output_dir: Path, newest: int) -> None:
        """Delete what a resume will never need, now that ``checkpoint-<newest>`` is complete: complete
        checkpoints beyond the newest ``keep``, the leftovers of saves killed before ``newest`` and of
        deletions killed midway. Each is renamed out of the ``checkpoint-N`` names first, then removed."""
        remove_leftovers(output_dir)
        kept = 0
        for step, path in reversed(checkpoints(output_dir)):
            if step > newest:
                continue  # not ours to judge: only a later save of this run writes there
            if complete(path) and (self.keep < 1 or kept < self.keep):
                kept += 1
                continue
            remove_checkpoint(path)

    def load(self, checkpoint: Path) -> None:
        """Restore our part of ``checkpoint`` (its binding was checked by :func:`resume_point`)."""
        payload = read_state(checkpoint)
        if "schedule" in payload:
            self.schedule.load_state_dict(payload["schedule"])
        trainer = self._bound("restore the critic into") if "critic" in payload else None
        if getattr(trainer, "critic", None) is not None:
            trainer.critic.load_state_dict(payload["critic"])
            trainer.critic_optimizer.load_state_dict(payload["critic_optimizer"])
        if self.rollout is not None:
            self.rollout.samples[:] = payload.get("samples", [])
        if self.validation is not None:
            self.validation.history[:] = payload.get("validation_history", [])
            self.validation.last_rows = payload.get("validation_rows", [])
        if self.rollout is not None and hasattr(self.rollout, "recent_answers"):
            self.rollout.recent_answers.clear()
            self.rollout.recent_answers.extend(payload.get("recent_answers", []))
        if self.guard is not None:
            if "guard" in payload and hasattr(self.guard, "load_state_dict"):
                self.guard.load_state_dict(payload["guard"])
            else:  # a checkpoint from before the guard kept more than its streak
                self.guard.streak = int(payload.get("collapse_streak", 0))


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint folder; renamed out of the ``checkpoint-N`` names first, so no reader (nor a
    kill midway) ever sees half of one."""
    doomed = path.parent / f"{_DELETING}{path.name}"
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_leftovers(output_dir: Path) -> None:
    """Remove what deletions killed midway left (``.deleting-checkpoint-N``: out of the checkpoint names)."""
    for leftover in Path(output_dir).glob(f"{_DELETING}checkpoint-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def remove_all(output_dir: Path) -> None:
    """Remove every ``checkpoint-N`` folder of a finished run (each as :func:`remove_checkpoint`), and the
    leftovers of deletions killed midway."""
    for _, path in checkpoints(output_dir):
        remove_checkpoint(path)
    remove_leftovers(output_dir)


def discard_after(checkpoint: Path) -> None:
    """Remove the ``checkpoint-M`` folders newer than ``checkpoint`` (a resume redoes those steps): what a
    killed attempt left there must not mix with the files the redone steps write."""
    step = int(checkpoint.name.rpartition("-")[2])
    for later, path in checkpoints(checkpoint.parent):
        if later > step:
            remove_checkpoint(path)


def recorded_run(output_dir: Path) -> str | None:
    """The MLflow run id in ``<output_dir>/mlflow_run.json``, if any."""
    run_file = Path(output_dir) / RUN_FILE
    return json.loads(run_file.read_text())["run_id"] if run_file.is_file() else None


def set_aside_incomplete(output_dir: Path) -> list[Path]:
    """Rename every ``checkpoint-N`` of ``output_dir`` (none complete: saves that died midway) out of the
    checkpoint names, to ``incomplete-checkpoint-N`` (a numbered suffix where that exists), and say so: a
    fresh run may start there, and nothing a save wrote is deleted. Returns the new paths."""
    moved = []
    for _, path in checkpoints(output_dir):
        target, n = path.parent / f"{INCOMPLETE}{path.name}", 1
        while target.exists():
            target, n = path.parent / f"{INCOMPLETE}{path.name}.{n}", n + 1
        os.replace(path, target)
        moved.append(target)
    if moved:
        logger.warning(
            "%s held only incomplete checkpoints (saves that died midway): moved aside to %s; delete them when "
            "no longer wanted",
            output_dir,
            ", ".join(p.name for p in moved),
        )
    return moved


def resume_point(cfg: TrainConfig, output_dir: Path, main: bool = True) -> tuple[Path | None, str | None]:
    """``(checkpoint, MLflow run id)`` to continue from, or ``(None, None)`` for a fresh run.

    Reads files only (no weights), so it runs before any model loads. Refuses a fresh run into a folder
    holding complete ``checkpoint-N`` folders (a resume would later mix the two runs), and a resume from a
    checkpoint of another MLflow run or of a config that differs outside :data:`RESUMABLE_FIELDS`. A folder
    whose checkpoints are all incomplete (a save that died midway) takes a fresh run, which moves them aside
    (``main``: the process that renames; the other ranks of a launch only read), and a resume there is refused
    saying so — the two never point at each other.
    """
    output_dir = Path(output_dir)
    existing = checkpoints(output_dir)
    if not cfg.run.resume:
        if existing and not any(
            complete(p) for _, p in existing
        ):  # saves that died midway: nothing to resume
            if main:
                set_aside_incomplete(output_dir)
            return None, None
        if existing:
            names = ", ".join(p.name for _, p in existing)
            owner = recorded_run(output_dir)
            raise CheckpointError(
                f"{output_dir} already holds checkpoints ({names}) of "
                f"{f'MLflow run {owner}' if owner else 'an earlier run'}; a new run there would mix with them. "
                "Continue that run with resume=true, or start this one under another run.name or "
                "run.output_dir (or delete those checkpoint folders)."
            )
        return None, None
    checkpoint = last_complete_checkpoint(output_dir)
    run_id = recorded_run(output_dir)
    if checkpoint is not None:
        _refuse_damaged(output_dir, checkpoint)
    if checkpoint is None and existing:
        names = ", ".join(p.name for _, p in existing)
        raise FileNotFoundError(
            f"resume=true but {output_dir} holds only incomplete checkpoints ({names}: saves that died midway, "
            "a full disk or a kill), nothing a resume can continue. Start it without resume=true: a fresh run "
            f"moves them aside ({INCOMPLETE}checkpoint-N) and starts over."
        )
    if checkpoint is None or run_id is None:
        raise FileNotFoundError(
            f"resume=true but {output_dir} holds no complete checkpoint-N (with {STATE_FILE}) and {RUN_FILE}; "
            "a run saves them when trainer.save_steps > 0. Start it without resume=true."
        )
    state = read_state(checkpoint, mmap=True)
    if "run_id" not in state and "fingerprint" not in state:
        raise CheckpointError(
            f"{checkpoint} was saved by an older zerosim, which did not record the run and config a checkpoint "
            "belongs to, so this version cannot check that resuming it continues the same run. Finish it with "
            "the zerosim version that started it, or start a new run under another run.name or run.output_dir "
            "(policy.model can point at that checkpoint to start from its weights)."
        )
    if state.get("run_id") != run_id:
        saved_by = state.get("run_id") or "no run (an older zerosim did not record it)"
        raise CheckpointError(
            f"{checkpoint} was saved by MLflow run {saved_by}, but {output_dir / RUN_FILE} names run {run_id}: "
            "the folder mixes two runs and resume=true cannot tell which to continue. Start a new run under "
            "another run.name or run.output_dir."
        )
    bound = bound_config(cfg)
    differ = config_changes(state, bound)
    if differ is not None and (differ or not state.get("config")):
        raise CheckpointError(
            f"resume=true, but run {run_id}'s {checkpoint.name} was trained with another config — "
            f"{'; '.join(differ[:8]) or 'no config recorded (an older zerosim)'}"
            f"{f' (and {len(differ) - 8} more)' if len(differ) > 8 else ''}. Resume with the run's own config "
            "(a resume may change only run.name/output_dir, trainer.max_steps, trainer.save_*, tracking.*), "
            "or start a new run under another run.name or run.output_dir."
        )
    _check_tracked(cfg, run_id)
    return checkpoint, run_id


def _refuse_damaged(output_dir: Path, newest: Path) -> None:
    """A newest complete checkpoint whose bytes are not those saved (a lost write, a cut copy) is refused,
    naming its damaged files and the newest one that verifies (reading every file of the checkpoints checked:
    about a second per GB)."""
    good, damaged = verified_checkpoint(output_dir)
    if not damaged or damaged[0][0] != newest:
        return
    path, bad = damaged[0]
    shown = ", ".join(bad[:4]) + (f" (and {len(bad) - 4} more)" if len(bad) > 4 else "")
    if good is not None:
        way = (
            f"{good.name} is complete and verifies: move the damaged one aside (mv {path} "
            f"{path.parent / ('damaged-' + path.name)}) and resume again, which continues from {good.name}"
        )
    else:
        way = "no earlier checkpoint verifies either: start the run again (without resume=true) elsewhere"
    raise CheckpointError(
        f"{path} is damaged: {shown} no longer hold the bytes saved there (same size, other content: a lost "
        f"write or a cut copy), so resuming would continue from wrong weights. {way}"
    )


def _check_tracked(cfg: TrainConfig, run_id: str) -> None:
    """The MLflow run a resume continues must be in the configured store (every rank checks, before any
    weight loads, so no rank waits on one that failed)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        mlflow.MlflowClient(tracking_uri=cfg.tracking.tracking_uri).get_run(run_id)
    except MlflowException as exc:
        raise CheckpointError(
            f"MLflow run {run_id} (the run this job continues) is not in {cfg.tracking.tracking_uri}: resume "
            "with the tracking.tracking_uri the run was started with"
        ) from exc

"""Stopping a training job between two steps — every rank at the same step — within its launcher's grace.

A job is asked to stop by a SIGTERM (:mod:`zerosim.core.signals`: SLURM, Kubernetes, ``timeout``, torchrun
forwarding its own) or by a file named ``STOP`` in its run folder (``touch <run.output_dir>/<run.name>/STOP``:
for a launcher that would kill the job before a step can finish). At each step end the ranks agree on one
decision (an all-reduce of "asked to stop" over the process group), so a signal that reached one rank — one
node's agent, one pod — stops all of them after the same step, each saving its part of that step's checkpoint;
without it, the rank that stopped leaves the others waiting in the next step's collectives.

torchrun (under ``accelerate launch`` too) forwards a SIGTERM to its workers and kills them
:data:`TORCHRUN_DEFAULT_GRACE` seconds later unless ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` says otherwise (torch
2.12 and later read it; older ones fix the 30 s). A stop finishes the step and saves, which takes longer than
30 s for a 3B policy: :func:`stop_plan` sizes the grace from the plan's step time and checkpoint size (the dry
run prints it, an experiment's ``train_launcher`` gets it in its environment), and :class:`StopControl`
measures both as the job runs and warns once when the launcher's grace is shorter.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from transformers import TrainerCallback

log = logging.getLogger(__name__)

GRACE_ENV = (
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # torchrun's wait between its SIGTERM and its SIGKILL (torch >= 2.12)
)
TORCHRUN_DEFAULT_GRACE = 30  # seconds: torchrun's wait when nothing sets it (and the only one before 2.12)
STOP_FILE = "STOP"  # <run folder>/STOP: stop after the current step, as a SIGTERM would
SAVE_GB_PER_S = 0.5  # the disk write rate a planned grace assumes for a checkpoint (network filesystems)
GB = 1e9


def launcher_reads_grace() -> bool:
    """Whether this torch's torchrun takes its shutdown timeout from :data:`GRACE_ENV` (added in 2.12)."""
    try:
        from torch.distributed.launcher.api import LaunchConfig
    except ImportError:  # a torch built without distributed
        return False
    return "shutdown_timeout" in getattr(LaunchConfig, "__dataclass_fields__", {})


def launcher_grace(environ: dict[str, str] | None = None) -> tuple[int, str] | None:
    """(seconds torchrun waits after its SIGTERM before killing this process, where that comes from); None when
    no torchrun (``accelerate launch`` included) started this process."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    if not launcher_reads_grace():
        return TORCHRUN_DEFAULT_GRACE, "fixed by this torch's torchrun (before 2.12)"
    value = env.get(GRACE_ENV)
    if value is None:
        return TORCHRUN_DEFAULT_GRACE, f"torchrun's default ({GRACE_ENV} unset)"
    try:
        return int(value), GRACE_ENV
    except ValueError:
        return (
            TORCHRUN_DEFAULT_GRACE,
            f"{GRACE_ENV}={value!r} is not a number of seconds: torchrun refuses it",
        )


def grace_for(seconds: float) -> int:
    """The launcher grace that covers ``seconds`` of step and save: half as much again, whole minutes, >= 60."""
    return max(60, 60 * math.ceil(seconds * 1.5 / 60))


@dataclass
class StopPlan:
    """What a stop costs before the job may be killed: the rest of a step and the checkpoint."""

    step_s: (
        float  # a whole step at the recipe's longest rows (the worst case: a SIGTERM just after a step began)
    )
    save_gb: float  # the checkpoint one rank writes (the model on the main process, its optimizer part)
    basis: str  # where step_s comes from

    @property
    def save_s(self) -> float:
        return self.save_gb / SAVE_GB_PER_S

    @property
    def grace(self) -> int:
        return grace_for(self.step_s + self.save_s)


def stop_plan(cfg, plan) -> StopPlan | None:
    """The stop's cost for ``cfg`` under a :class:`~zerosim.training.memory.MemoryPlan` (None: sizes unknown).

    The step time scales the shipped GPU guess (:data:`zerosim.experiment.estimates.GPU_RATES`: 80 s for 40
    trajectories per GPU of 1,000 completion tokens, Qwen2.5-3B) by trajectories per GPU, the longest completion
    the recipe allows and the policy's size — a guess until the job measures its own (:class:`StopControl`)."""
    if plan is None:
        return None
    from zerosim.training.memory import longest_row

    t = cfg.trainer
    per_gpu = t.per_device_train_batch_size * t.gradient_accumulation_steps
    _, completion, _ = longest_row(cfg)
    params = plan.shape.params
    step = 80.0 * per_gpu / 40 * completion / 1000 * params / 3.09e9
    if cfg.policy.lora.enabled:  # an adapter checkpoint: the adapters (fp32) and their AdamW moments
        save = 12.0 * plan.adapter_params
    else:
        whole = (2 if cfg.policy.dtype == "bfloat16" or plan.launch.bf16_module else 4) * params
        save = whole + plan.parts.get("optimizer", (0.0, ""))[0]
    save += sum(b for name, (b, _) in plan.parts.items() if name == "critic")
    basis = f"the GPU guess of 80 s per 40 trajectories x 1,000 tokens at 3B, scaled to {per_gpu} x {completion:,}"
    return StopPlan(step, save / GB, basis)


def stop_row(cfg, plan) -> list[tuple[str, str]]:
    """The dry run's row on stopping a launched job: the grace to launch with."""
    sp = stop_plan(cfg, plan)
    if sp is None:
        return []
    run = Path(cfg.run.output_dir) / cfg.run.name
    if launcher_reads_grace():
        launcher = f"this torch's torchrun reads {GRACE_ENV}"
    else:
        launcher = (
            f"this torch's torchrun ignores {GRACE_ENV} and kills {TORCHRUN_DEFAULT_GRACE} s after its SIGTERM "
            f"(torch >= 2.12 reads it): stop with `touch {run / STOP_FILE}` instead of a SIGTERM"
        )
    return [
        (
            "stop",
            f"a SIGTERM or {run / STOP_FILE} finishes the step (up to ~{sp.step_s:.0f} s: {sp.basis}) and saves "
            f"~{sp.save_gb:.1f} GB per rank (~{sp.save_s:.0f} s at {SAVE_GB_PER_S:g} GB/s): launch with "
            f"{GRACE_ENV}={sp.grace} and a scheduler grace over {sp.grace} s (SLURM --signal, Kubernetes "
            f"terminationGracePeriodSeconds); {launcher}",
        )
    ]


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agree(flag: bool, device) -> bool:
    """Whether any rank raised ``flag`` (every rank gets the same answer; one process: ``flag``)."""
    if _world() == 1:
        return flag
    import torch
    import torch.distributed as dist

    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


class StopControl(TrainerCallback):
    """At each step end: stop (save this step's checkpoint, end the loop) when any rank was asked to — by a
    SIGTERM or the run folder's ``STOP`` file — so that every rank stops at the same step;
    :func:`zerosim.training.recipe.train` then raises ``Terminated`` on each, the run ends FAILED, resumable.
    Times each step and save, and warns once when the launcher's grace is shorter than a step and a save."""

    def __init__(self, run_dir: Path | None = None, main: bool = True) -> None:
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.main = main
        self.step_s = 0.0  # the longest step so far
        self.save_s: float | None = None  # the last checkpoint's save
        self._began = self._ended = None
        self.warned = False
        self.since = time.time()  # a STOP file older than this job was left by another: not this job's

    @property
    def stop_file(self) -> Path | None:
        return None if self.run_dir is None else self.run_dir / STOP_FILE

    def _asked_by_file(self) -> bool:
        """A ``STOP`` file written since this job started (an older one is stale: see on_train_begin)."""
        try:
            return self.stop_file is not None and self.stop_file.stat().st_mtime >= self.since - 1.0
        except FileNotFoundError:
            return False

    def on_train_begin(self, args, state, control, **kwargs):
        """A ``STOP`` left in the run folder before this job started (an earlier run's, never read) is
        removed, naming it, instead of stopping this run after its first step."""
        stop = self.stop_file
        try:
            written = None if stop is None else stop.stat().st_mtime
        except FileNotFoundError:
            written = None
        if written is not None and written < self.since - 1.0 and self.main:
            log.warning(
                "removed %s: it was written at %s, before this job started, so it is not a request to stop "
                "this run (touch it again to stop)",
                stop,
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(written)),
            )
            stop.unlink(missing_ok=True)
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        self._began = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        from zerosim.core.signals import request_stop, stop_requested

        self._ended = time.monotonic()
        if self._began is not None:
            self.step_s = max(self.step_s, self._ended - self._began)
        asked = stop_requested()
        by_file = self._asked_by_file()
        if agree(asked or by_file, args.device):
            reason = (
                "SIGTERM"
                if asked
                else str(self.stop_file)
                if by_file
                else "another rank's SIGTERM or STOP file"
            )
            request_stop(
                reason
            )  # this rank raises Terminated too once the loop ends (a SIGTERM's reason stays)
            if by_file and self.main:
                self.stop_file.unlink(
                    missing_ok=True
                )  # read by every rank (the decision above waited for all)
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        if self._ended is not None:
            self.save_s = time.monotonic() - self._ended
        self._check_grace()
        return control

    def _check_grace(self) -> None:
        """Once the job has taken a step and saved: a launcher whose grace is shorter than both is named."""
        grace = launcher_grace()
        if self.warned or grace is None or not self.main or not self.step_s or self.save_s is None:
            return
        seconds, source = grace
        needed = self.step_s + self.save_s
        if needed <= seconds:
            return
        self.warned = True
        way = (
            f"launch with {GRACE_ENV}={grace_for(needed)}"
            if launcher_reads_grace()
            else f"this torch's torchrun cannot wait longer: stop the job with `touch {self.stop_file}`"
        )
        log.warning(
            "a SIGTERM would lose this job's step: torchrun kills %d s after it (%s), but a step takes up to %.0f s "
            "and a checkpoint %.0f s; %s",
            seconds,
            source,
            self.step_s,
            self.save_s,
            way,
        )
        try:
            import mlflow

            if mlflow.active_run() is not None:
                mlflow.set_tag("zerosim.stop_grace", f"{seconds} s < {needed:.0f} s needed: {way}")
        except Exception:  # the warning above is the message; a tag is a convenience
            log.debug("could not tag the stop grace", exc_info=True)

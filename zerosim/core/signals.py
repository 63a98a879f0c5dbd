"""How a zerosim process ends on SIGTERM: the way ``timeout``, SLURM (``scancel``, a job's time limit) and
Kubernetes stop a job.

Python's default for SIGTERM ends the process at once, with no ``finally`` run: an MLflow run stays RUNNING
forever and a training job loses the steps since its last checkpoint. Every command installs
:func:`install` instead, so a SIGTERM becomes :class:`Terminated` (a ``SystemExit`` with code 143, as a
shell reports a process killed by SIGTERM): every ``with`` block unwinds, :func:`zerosim.core.tracking.mlflow_run`
ends its run FAILED, temporary files are removed.

While a training loop runs (:func:`graceful`), the first SIGTERM only asks it to stop: the step in progress
finishes, a checkpoint is saved (``resume`` continues from it) and then :class:`Terminated` is raised.
Give the job a grace period longer than one step (SLURM ``--signal``/``KillWait``, Kubernetes
``terminationGracePeriodSeconds``); a second SIGTERM stops at once.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

EXIT_CODE = 128 + signal.SIGTERM  # 143: what a shell reports for a process ended by SIGTERM


class Terminated(SystemExit):
    """Raised where a SIGTERM arrived (or once a graceful stop has saved its checkpoint)."""

    def __init__(self, message: str = "stopped by SIGTERM") -> None:
        super().__init__(EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


_stop = threading.Event()  # a SIGTERM arrived while a graceful section ran
_graceful = 0  # graceful sections open (a training loop)
_reason = ["SIGTERM"]  # what asked the loop to stop


def _on_sigterm(signum: int, frame: object) -> None:
    if _graceful and not _stop.is_set():
        _reason[0] = "SIGTERM"
        _stop.set()
        log.warning(
            "SIGTERM: finishing this step and saving a checkpoint before stopping (a second SIGTERM stops at once)"
        )
        return
    raise Terminated()


def install() -> bool:
    """Make SIGTERM raise :class:`Terminated` in this process; False where it cannot (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True


def stop_requested() -> bool:
    """Whether a SIGTERM asked the running training loop to stop after its current step."""
    return _stop.is_set()


def request_stop(reason: str) -> None:
    """Ask the running training loop to stop after its current step, as a SIGTERM would (another rank's
    SIGTERM, a stop file: :mod:`zerosim.training.stopping`); ``reason`` names what asked."""
    if not _stop.is_set():
        _reason[0] = reason
        _stop.set()


def stop_reason() -> str:
    """What asked the training loop to stop (``"SIGTERM"`` unless :func:`request_stop` named another)."""
    return _reason[0]


@contextmanager
def graceful() -> Iterator[None]:
    """A section (a training loop) that a first SIGTERM asks to stop at its next safe point, read by
    :func:`stop_requested`, instead of interrupting it mid-step."""
    global _graceful
    _graceful += 1
    try:
        yield
    finally:
        _graceful -= 1
        if not _graceful:
            _stop.clear()

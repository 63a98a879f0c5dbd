"""How many CPU threads this process computes with: never more than the cores it may use, split among the
processes that share them.

torch and OpenMP default to one thread per core of the machine, whatever else runs there: two processes on
2 cores (a training job beside ``zerosim simulator serve``, or two accelerate ranks on one CPU host) each
spin 2 threads, and their busy-waiting threads slow ``generate`` several-fold. Each zerosim process therefore
sets its thread count once, at start-up, from ``runtime.threads`` (``--threads`` for the servers):

- a number: exactly that many threads;
- ``None`` (default): the cores this process may run on (``os.sched_getaffinity``, which respects
  ``taskset`` and container CPU sets) divided by the processes launched beside it on this host
  (``LOCAL_WORLD_SIZE``, set by ``accelerate launch`` / ``torchrun``), at least 1.

A user who starts a server by hand beside training splits the cores themselves, e.g. on 2 cores
``zerosim simulator serve --threads 1`` and ``zerosim train ... runtime.threads=1`` (docs/scaling.md).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from zerosim.core.config import ranged


@dataclass
class RuntimeConfig:
    # torch/OpenMP threads of this process; None = the cores it may use (CPU affinity) / processes on this host (LOCAL_WORLD_SIZE)
    threads: int | None = ranged(
        None, ">=1", "null = the cores this process may use / processes on this host"
    )
    # bf16 compute on CPU (weights stay fp32): null = the RL update under autocast (trainer.bf16=null follows it) where the CPU multiplies bf16 in hardware (AMX, AVX512_BF16), generation fp32; true = the update and the policy's and in-process simulator's generation (hi+lo bf16 weights); false = fp32
    bf16: bool | None = None


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), or ``os.cpu_count()`` where that is unknown."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def thread_budget(threads: int | None = None) -> int:
    """Threads for this process: ``threads`` when given, else its cores divided among the local ranks."""
    if threads is not None:
        if threads < 1:
            raise ValueError(
                f"runtime.threads must be >= 1 (or null: the cores this process may use), got {threads}"
            )
        return threads
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, available_cores() // max(1, local))


def apply_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads (and ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` for the libraries and
    child processes that read them) to :func:`thread_budget`; returns the count."""
    import torch

    n = thread_budget(threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)
    torch.set_num_threads(n)
    return n


# -- what the machine is ---------------------------------------------------------------------------------------
def _cpuinfo_fields(cpuinfo: str | None) -> dict[str, str]:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def bf16_units(cpuinfo: str | None = None) -> str | None:
    """The CPU's bf16 matrix instructions: ``"AMX"`` (tile units), ``"AVX512_BF16"`` (bf16 dot products in the
    vector units), or None (bf16 is emulated: slower than fp32). ``cpuinfo``: ``/proc/cpuinfo``'s text (read
    when None). oneDNN multiplies bf16 matrices 2-3x faster than fp32 with either (benchmarks/update.py)."""
    flags = set(_cpuinfo_fields(cpuinfo).get("flags", "").split())
    if "amx_bf16" in flags or "amx_tile" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512_BF16"
    return None


def cpu_kind(cpuinfo: str | None = None) -> str:
    """The CPU in a few words, as times are stated beside it: model, cores this process may use, and the
    matrix instructions that decide CPU speed here (AMX: bf16 matmuls in hardware; else AVX-512 or AVX2),
    e.g. ``AMD EPYC, 2 cores, AVX2 (no AMX)``; AVX-512 says whether it has bf16 dot products (``AVX-512 with
    bf16 (no AMX)``). ``cpuinfo``: ``/proc/cpuinfo``'s text (read when None)."""
    import platform

    fields = _cpuinfo_fields(cpuinfo)
    model = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    flags = set(fields.get("flags", "").split())
    if "amx_bf16" in flags or "amx_tile" in flags:
        isa = "AMX"
    elif "avx512f" in flags:
        isa = "AVX-512 with bf16 (no AMX)" if "avx512_bf16" in flags else "AVX-512 (no AMX)"
    elif "avx2" in flags:
        isa = "AVX2 (no AMX)"
    else:
        isa = "no AVX2"
    return f"{model}, {available_cores()} cores, {isa}"


# -- bf16 compute on CPU ------------------------------------------------------------------------------------------
# Where the CPU multiplies bf16 in hardware, the update and both generators compute their matrix products in bf16
# (fp32 weights kept: the optimizer's masters, and what the generators' bf16 copies are cast from). Set once per
# process by apply_precision (beside apply_threads, from runtime.bf16); until then fp32 (a library caller's and
# a test's default). A stage key reads the decision, not the setting (zerosim.experiment.keys).
_CPU_BF16 = False
_CPU_BF16_GENERATION = False


@dataclass(frozen=True)
class Precision:
    """The process's CPU compute precision and why, in words for the machine line: ``bf16`` for the update
    (what ``trainer.bf16=auto`` follows), ``generation`` for the policy's and the simulator's in-process
    generation."""

    bf16: bool
    why: str
    generation: bool | None = None  # None: as bf16

    def __post_init__(self) -> None:
        if self.generation is None:
            object.__setattr__(self, "generation", self.bf16)


def decide_precision(setting: bool | None, units: str | None) -> Precision:
    """bf16 on CPU for ``runtime.bf16`` (True / False / None: auto) on a CPU whose bf16 matrix instructions are
    ``units`` (:func:`bf16_units`)."""
    if setting is not None:
        return Precision(bool(setting), f"runtime.bf16={str(setting).lower()}: as set")
    if units is not None:
        # generation stays fp32 under auto: greedy rows of a fine-tuned 135M policy drift in bf16 arithmetic
        # (docs/training.md, "bf16 on CPU": the v2 sim arm fell from ~25 EM to 10-15)
        return Precision(
            True, f"runtime.bf16=auto: {units} multiplies bf16 in hardware (the update; generation fp32)",
            generation=False,
        )  # fmt: skip
    return Precision(
        False, "runtime.bf16=auto: no bf16 matrix instructions on this CPU (AVX2), fp32 is faster"
    )


def apply_precision(setting: bool | None = None, cpuinfo: str | None = None) -> Precision:
    """Decide this process's CPU compute precision from ``runtime.bf16`` (:func:`decide_precision`); returns it.
    With a GPU the CPU precision is unused (fp32), the GPU's is the recipe's."""
    global _CPU_BF16, _CPU_BF16_GENERATION
    import torch

    decided = decide_precision(setting, bf16_units(cpuinfo))
    if torch.cuda.is_available():
        decided = Precision(False, "a GPU computes: its precision is the recipe's")
    _CPU_BF16 = decided.bf16
    _CPU_BF16_GENERATION = decided.generation
    return decided


def cpu_bf16() -> bool:
    """Whether this process's update computes in bf16 on CPU under trainer.bf16=auto (:func:`apply_precision`'s
    decision; False before it)."""
    return _CPU_BF16


def cpu_bf16_generation() -> bool:
    """Whether this process generates in bf16 on CPU (:func:`apply_precision`'s decision; False before it)."""
    return _CPU_BF16_GENERATION


# -- how quiet the machine was -------------------------------------------------------------------------------
@dataclass(frozen=True)
class CPUTimes:
    """CPU seconds used so far by the whole machine and by this process (with the children it waited for)."""

    machine_busy: float
    own: float
    cpus: int
    at: float  # time.monotonic()


def cpu_times() -> CPUTimes | None:
    """Now's :class:`CPUTimes`, read from ``/proc/stat``; None where that is not there (not Linux)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    # user nice system idle iowait irq softirq (steal: the hypervisor's, not a process of this machine)
    values = [int(v) for v in lines[0].split()[1:8]]
    idle = values[3] + values[4]
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    ticks = os.sysconf("SC_CLK_TCK")
    t = os.times()
    return CPUTimes(
        machine_busy=(sum(values) - idle) / ticks,
        own=t.user + t.system + t.children_user + t.children_system,
        cpus=max(cpus, 1),
        at=time.monotonic(),
    )


def others_cpu_share(start: CPUTimes | None, end: CPUTimes | None) -> float | None:
    """The share of the machine's CPU capacity that *other* processes used between two :func:`cpu_times`
    (0 = nothing else ran, 1 = every core busy with something else); None where unknown.

    A timing taken beside other CPU-bound work is not this job's speed: on 2 cores, a second torch process
    slows ``generate`` several-fold (OpenMP threads spin waiting for each other).
    """
    if start is None or end is None or end.at <= start.at:
        return None
    others = (end.machine_busy - start.machine_busy) - (end.own - start.own)
    return max(0.0, others / ((end.at - start.at) * end.cpus))

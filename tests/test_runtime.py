"""Threads: each process computes with its share of the cores (runtime.threads), never all cores each."""

from __future__ import annotations

import pytest

from zerosim.core.runtime import apply_threads, available_cores, thread_budget


@pytest.fixture
def restore_threads():
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_budget_is_the_affinity_split_among_local_ranks(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert available_cores() == 4 and thread_budget() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # accelerate launch / torchrun, 2 ranks on this host
    assert thread_budget() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert thread_budget() == 1  # never 0
    assert thread_budget(3) == 3  # runtime.threads wins
    with pytest.raises(ValueError, match="runtime.threads must be >= 1"):
        thread_budget(0)


def test_apply_sets_torch_and_the_openmp_env(monkeypatch, restore_threads):
    import os

    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert apply_threads(1) == 1
    assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--dry-run", "runtime.threads=1"],
        [
            "eval",
            "--limit",
            "1",
            "runtime.threads=1",
            "--policy",
            "no/such/checkpoint",
        ],  # fails after loading
    ],
    ids=["train", "eval"],
)
def test_a_command_started_with_one_thread_computes_with_one(args, tmp_path, monkeypatch, restore_threads):
    import torch
    from typer.testing import CliRunner

    from zerosim.cli import app

    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(2)
    CliRunner().invoke(app, args)
    assert torch.get_num_threads() == 1


def test_a_threads_value_below_one_is_refused():
    from zerosim.core.config import ConfigError, load_config
    from zerosim.training.config import TrainConfig

    with pytest.raises(ConfigError, match="runtime.threads must be >= 1"):
        load_config(None, ["runtime.threads=0"], schema=TrainConfig)


@pytest.mark.parametrize(
    ("flags", "kind"),
    [
        ("fpu avx2 avx512f amx_bf16 amx_tile", "AMX"),
        ("fpu avx2 avx512f avx512_bf16", "AVX-512 with bf16 (no AMX)"),
        ("fpu avx2 avx512f", "AVX-512 (no AMX)"),
        ("fpu avx2", "AVX2 (no AMX)"),
        ("fpu sse4_2", "no AVX2"),
    ],
)
def test_the_cpu_kind_names_the_matrix_instructions_that_decide_its_speed(flags, kind, monkeypatch):
    """Times are stated beside it (README): the same job runs ~2.5x apart on a 2-core CPU with and without AMX."""
    from zerosim.core.runtime import cpu_kind

    monkeypatch.setattr("zerosim.core.runtime.available_cores", lambda: 2)
    info = f"processor\t: 0\nmodel name\t: Some CPU 9000\nflags\t\t: {flags}\n\nprocessor\t: 1\n"
    assert cpu_kind(info) == f"Some CPU 9000, 2 cores, {kind}"


CPUINFO = "processor\t: 0\nmodel name\t: Some CPU 9000\nflags\t\t: {flags}\n"


@pytest.mark.parametrize(
    ("flags", "setting", "bf16", "why"),
    [
        (
            "fpu avx2 avx512f amx_bf16 amx_tile",
            None,
            True,
            "runtime.bf16=auto: AMX multiplies bf16 in hardware",
        ),
        (
            "fpu avx2 avx512f avx512_bf16",
            None,
            True,
            "runtime.bf16=auto: AVX512_BF16 multiplies bf16 in hardware",
        ),
        ("fpu avx2 avx512f", None, False, "no bf16 matrix instructions"),
        ("fpu avx2", None, False, "no bf16 matrix instructions"),
        ("fpu avx2 avx512f avx512_bf16", False, False, "runtime.bf16=false: as set"),
        ("fpu avx2", True, True, "runtime.bf16=true: as set"),
    ],
)
def test_bf16_compute_is_decided_by_the_cpus_bf16_matrix_instructions(flags, setting, bf16, why, monkeypatch):
    """AMX and AVX512_BF16 multiply bf16 matrices in hardware (2-3x fp32 here); AVX2 emulates it (slower)."""
    import torch

    from zerosim.core import runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(runtime, "_CPU_BF16", False)
    monkeypatch.setattr(runtime, "_CPU_BF16_GENERATION", False)
    decided = runtime.apply_precision(setting, CPUINFO.format(flags=flags))
    assert (decided.bf16, runtime.cpu_bf16()) == (bf16, bf16) and why in decided.why
    # generation in bf16 only where set: under auto a fine-tuned policy's greedy rows drift (docs/training.md)
    assert decided.generation == runtime.cpu_bf16_generation() == (bf16 and setting is True)


@pytest.mark.parametrize(
    ("flags", "overrides", "says"),
    [
        (
            "avx512f avx512_bf16",
            [],
            "bf16 compute (runtime.bf16=auto: AVX512_BF16 multiplies bf16 in hardware (the update; generation "
            "fp32); fp32 weights): generation in fp32, update in bf16 autocast (trainer.bf16=auto: as runtime.bf16)",
        ),
        (
            "amx_tile amx_bf16",
            [],
            "generation in fp32, update in bf16 autocast (trainer.bf16=auto: as runtime.bf16)",
        ),
        (
            "avx512_bf16",
            ["runtime.bf16=true"],
            "generation in bf16 (hi+lo weights), update in bf16 autocast (trainer.bf16=auto: as runtime.bf16)",
        ),
        ("avx2", [], "fp32 compute (runtime.bf16=auto: no bf16 matrix instructions on this CPU (AVX2)"),
        ("avx2", [], "generation in fp32, update in fp32 (trainer.bf16=auto: as runtime.bf16)"),
        (
            "avx512_bf16",
            ["trainer.beta=0.001"],
            "generation in fp32, update in fp32 (trainer.bf16=auto: trainer.beta != 0",
        ),
        ("avx512_bf16", ["runtime.bf16=false"], "fp32 compute (runtime.bf16=false: as set; fp32 weights)"),
        (
            "avx2",
            ["trainer.bf16=true"],
            "generation in fp32, update in bf16 autocast (trainer.bf16=true: as set)",
        ),
    ],
)
def test_train_says_at_start_which_cpu_it_runs_on_and_why_it_computes_in_bf16_or_not(
    flags, overrides, says, monkeypatch
):
    import torch

    from zerosim.core.config import load_config
    from zerosim.training.config import TrainConfig
    from zerosim.training.recipe import machine_line

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("zerosim.core.runtime.available_cores", lambda: 2)
    from pathlib import Path

    cfg = load_config(Path(__file__).parents[1] / "configs" / "demo.yaml", overrides, schema=TrainConfig)
    line = machine_line(cfg, CPUINFO.format(flags=flags))
    assert line.startswith("machine: Some CPU 9000, 2 cores, ") and says in line, line

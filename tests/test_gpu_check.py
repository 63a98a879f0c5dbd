"""The device kit and the one-call check: the kit builds under the device tool's 64 MiB, and
`benchmarks/gpu_check.sh --cpu` — the GPU script end to end on CPU with a tiny model — passes every check."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_passes_on_cpu(tmp_path):
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--cpu", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== 5/5 checks passed" in proc.stdout
    figures = json.loads((tmp_path / "gpu_check.json").read_text())["figures"]
    assert figures["precision"]["bf16_weights_moved"] < 0.05 < figures["precision"]["fp32_weights_moved"]
    assert figures["grpo"]["policy_tokens_per_s"] > 0 and figures["decode"]["identical"] == "16/16"


def _gpu_check(*args):
    return subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--cpu", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_gpu_check_refuses_bad_arguments_before_any_check_runs(tmp_path):
    """--steps 0 (a ZeroDivisionError after the checks) and an --out that cannot be written (the figures
    lost after every check ran) end at once, exit code 2, naming the argument."""
    steps = _gpu_check("--steps", "0", "--out", str(tmp_path / "g.json"))
    assert steps.returncode == 2 and "--steps must be >= 1" in steps.stderr, steps.stdout + steps.stderr
    out = _gpu_check("--out", "/proc/zerosim-gpu-check/g.json")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--out /proc/zerosim-gpu-check/g.json" in out.stderr, out.stderr
    folder = _gpu_check("--out", str(tmp_path))
    assert folder.returncode == 2 and "is a folder" in folder.stderr, folder.stdout + folder.stderr
    for proc in (steps, out, folder):
        assert "==" not in proc.stdout, proc.stdout  # no check ran
    assert list(tmp_path.iterdir()) == []


def test_gpu_check_script_stops_when_its_output_folder_cannot_be_made():
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--cpu", "/proc/zerosim-gpu-check"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHON": "false"},
    )  # fmt: skip
    # (PYTHON=false: the checks themselves never run here, whatever the script does)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "FAIL  output: cannot make the folder /proc/zerosim-gpu-check" in proc.stdout, proc.stdout

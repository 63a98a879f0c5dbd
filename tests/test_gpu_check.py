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

"""The layers of docs/architecture.md, held by import-linter: apps > components > agent > foundation, the
components independent of each other, and no import cycle between the modules of any package."""

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports")
    assert exe, "lint-imports is missing: bash scripts/install.sh test installs import-linter"
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2 kept, 0 broken" in proc.stdout

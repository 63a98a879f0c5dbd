"""The layers of docs/architecture.md, held by import-linter: a package per layer (apps > components > agent >
foundation), the components independent of each other, every module of ``zerosim/`` in a layer, and no
import cycle between the modules of any package."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("zerosim", "simulators", "eval", "curricula")


def lint_imports(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # beside the running interpreter: a venv's python runs the suite without the venv activated
    exe = Path(sys.executable).parent / "lint-imports"
    if not exe.is_file():
        exe = shutil.which("lint-imports")
    assert exe, "lint-imports is missing: bash scripts/install.sh test installs import-linter"
    return subprocess.run(
        [str(exe), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300, env=env
    )


def test_import_contracts_are_kept():
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "3 kept, 0 broken" in proc.stdout


def test_a_module_outside_every_layer_breaks_the_contracts(tmp_path):
    """A copy of the tree with one new module at the top of ``zerosim/``, given no layer: import-linter
    refuses it by name."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}  # the copy, not the installed tree, is analysed

    kept = lint_imports(tmp_path, env)
    assert kept.returncode == 0, kept.stdout[-4000:]

    (tmp_path / "zerosim" / "helpers.py").write_text('"""A module nobody placed in a layer."""\n')
    broken = lint_imports(tmp_path, env)
    assert broken.returncode != 0
    assert "every module of zerosim has a layer BROKEN" in broken.stdout
    assert "zerosim.helpers" in broken.stdout

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_reference_is_current():
    proc = subprocess.run(
        [sys.executable, "scripts/gen_config_docs.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_every_rollout_metric_is_documented():
    source = (ROOT / "zerosim" / "agent" / "rollout.py").read_text()
    names = set(re.findall(r'"((?:curriculum|search|rollout|time)/[a-z_]+)"', source))
    documented = (ROOT / "docs" / "metrics.md").read_text()
    assert names and all(f"`{n}`" in documented for n in names), names


def test_readme_starts_with_the_two_commands():
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:12])
    assert "zerosim train --config configs/demo.yaml" in head and "python -m pytest" in head
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/install.sh test && python -m pytest -q" in ci
    assert "bash scripts/install.sh test && python -m pytest -q" in head

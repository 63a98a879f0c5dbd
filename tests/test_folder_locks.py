"""One writer per output folder: a second job into a folder another process is writing is refused at once."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOLD = """
import sys
from zerosim.core.fsutil import folder_lock
with folder_lock(sys.argv[1], sys.argv[2]):
    print("held", flush=True)
    sys.stdin.readline()
"""


@contextmanager
def held_by_another_process(folder: Path, job: str):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder), job],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc.pid
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_a_second_training_into_a_held_run_folder_is_refused_naming_the_holder(
    tmp_path, zerosim_cli, tiny_model_dir
):
    run = tmp_path / "out" / "twice"
    with held_by_another_process(run, "zerosim train") as pid:
        refused = zerosim_cli(
            "train", "--config", str(ROOT / "configs" / "demo.yaml"), f"run.output_dir={tmp_path / 'out'}",
            "run.name=twice", f"policy.model={tiny_model_dir}", code=None,
        )  # fmt: skip
    assert refused.exit_code == 2
    assert f"{run} is being written by another process (zerosim train, pid {pid} on" in refused.output
    assert not (run / "mlflow_run.json").exists()


def test_index_build_and_eval_refuse_a_held_folder_and_release_theirs(tmp_path, zerosim_cli):
    from eval.index import build_index
    from zerosim.core.config import ConfigError
    from zerosim.core.data.embedded import ensure_factbook

    corpus = ensure_factbook(progress=False).corpus
    out = tmp_path / "index"
    with (
        held_by_another_process(out, "zerosim index build"),
        pytest.raises(ConfigError, match="index build, pid"),
    ):
        build_index(corpus, "bm25", out, progress=False)
    assert not out.exists()
    build_index(corpus, "bm25", out, progress=False)  # free again: built, and no lock left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]
    with held_by_another_process(tmp_path / "eval" / "eval-held", "zerosim eval"):
        refused = zerosim_cli(
            "eval", "--method", "direct", "--limit", "1", f"output_dir={tmp_path / 'eval'}", "run_name=eval-held",
            f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db", code=None,
        )  # fmt: skip
    assert refused.exit_code == 2 and "is being written by another process (zerosim eval" in refused.output

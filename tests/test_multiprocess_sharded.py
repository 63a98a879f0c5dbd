"""DeepSpeed ZeRO-2 and ZeRO-3 for real, on two CPU processes (DeepSpeed's CPU accelerator, gloo): one GRPO step
through the CLI moves the weights, the optimizer steps fp32 master partitions (the trainer's check says which),
the job ends in one finished MLflow run and a complete, loadable final model.

FSDP2 does not train here: accelerate does not shard on CPU (docs/scaling.md, "Tested here"), and the last test
shows that such a launch is refused rather than trained unsharded.
DeepSpeed's shared-memory comm op (C++, compiled on a machine's first run: ~2 minutes) is left out by the helper;
gloo carries the collectives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[1]


def _failure(proc) -> str:
    lines = (proc.stdout + proc.stderr).splitlines()
    ranks = [line for line in lines if line.startswith(("[rank0]", "[rank1]", "error:"))]
    return "\n".join(ranks[-80:]) + "\n" + "\n".join(lines[-40:])


def _data(folder: Path) -> tuple[Path, Path]:
    """Four questions and a corpus that answers them (BM25 over it)."""
    qa, corpus = folder / "qa.jsonl", folder / "corpus.jsonl"
    with qa.open("w") as q, corpus.open("w") as c:
        for i, x in enumerate("ABCD"):
            row = {"id": f"q{i}", "question": f"What is the capital of {x}?", "golden_answers": [f"City{x}"]}
            q.write(json.dumps(row) + "\n")
            c.write(json.dumps({"id": f"p{i}", "contents": f"{x}\nThe capital of {x} is City{x}."}) + "\n")
    return qa, corpus


@pytest.mark.parametrize(
    ("launch_config", "masters"),
    [
        ("zero2-cpu.yaml", "DeepSpeed ZeRO-1/2 master partitions (single_partition_of_fp32_groups)"),
        ("zero3-cpu.yaml", "DeepSpeed ZeRO-3 master partitions (fp32_partitioned_groups_flat)"),
    ],
    ids=["zero2", "zero3"],
)
def test_one_grpo_step_under_zero_on_two_cpu_processes(tmp_path, tiny_model_dir, launch_config, masters):
    import mlflow
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    qa, corpus = _data(tmp_path)
    db, trace = tmp_path / "mlflow.db", tmp_path / "trace"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(ROOT / "configs" / "accelerate" / launch_config), "--main_process_port", "0",
        str(ROOT / "tests" / "helpers" / "sharded_train.py"), "--config", str(ROOT / "configs" / "demo.yaml"),
        f"run.output_dir={tmp_path / 'out'}", "run.name=mp", f"policy.model={tiny_model_dir}",
        "search.engine=bm25", f"search.bm25.corpus={corpus}", f"data.train={qa}", "trainer.max_steps=1",
        "trainer.per_device_train_batch_size=2", "trainer.num_generations=2", "rollout.max_new_tokens=8",
        "rollout.max_turns=1", f"tracking.tracking_uri=sqlite:///{db}", "tracking.experiment=mp",
        "warmstart.enabled=false", "validation.every=0",
    ]  # fmt: skip
    env = {**os.environ, "ZEROSIM_TRACE": str(trace), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, _failure(proc)

    # each rank checked what its optimizer steps when training began: DeepSpeed's fp32 master partitions
    for rank in (0, 1):
        log = (trace / f"log{rank}.txt").read_text()
        checked = [line for line in log.splitlines() if "mixed precision checked: the policy: fp32, " in line]
        assert len(checked) == 1 and checked[0].endswith(f" tensors ({masters})"), log

    mlflow.set_tracking_uri(f"sqlite:///{db}")
    (run,) = mlflow.search_runs(experiment_names=["mp"], output_format="list")  # one run, the main process's
    assert run.info.status == "FINISHED" and run.data.tags["zerosim.processes"] == "2"
    assert run.data.metrics["reward_std"] > 0 and run.data.metrics["grad_norm"] > 0

    final = tmp_path / "out" / "mp" / "final"
    assert run.data.tags["zerosim.checkpoint"] == str(final.resolve())
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = AutoModelForCausalLM.from_pretrained(str(final)).state_dict()  # loadable, gathered whole (ZeRO-3)
    for name, weight in before.items():
        # whole (not a ZeRO-3 shard or an empty placeholder) and fp32
        assert after[name].shape == weight.shape and after[name].dtype == torch.float32, name
        moved = after[name] - weight
        # one AdamW step at lr 1e-6 moves (nearly) every weight by about the learning rate
        assert (moved != 0).float().mean() > 0.99, name
        assert moved.abs().max() < 1e-5, name


def test_an_fsdp_launch_on_cpu_processes_is_refused_not_trained_unsharded(tmp_path, tiny_model_dir):
    """accelerate runs an FSDP config on CPU processes as plain DDP; each rank stops when training begins,
    naming what it got and the CPU configs that shard — before, the step trained whole copies silently."""
    import yaml

    qa, corpus = _data(tmp_path)
    launch = yaml.safe_load((ROOT / "configs" / "accelerate" / "fsdp2.yaml").read_text())
    launch.update(num_processes=2, mixed_precision="no", main_process_ip="127.0.0.1")
    (tmp_path / "fsdp2-cpu.yaml").write_text(yaml.safe_dump(launch))
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "fsdp2-cpu.yaml"),
        "--main_process_port", "0", str(ROOT / "tests" / "helpers" / "sharded_train.py"),
        "--config", str(ROOT / "configs" / "demo.yaml"), f"run.output_dir={tmp_path / 'out'}", "run.name=mp",
        f"policy.model={tiny_model_dir}", "search.engine=bm25", f"search.bm25.corpus={corpus}",
        f"data.train={qa}", "trainer.max_steps=1", "trainer.per_device_train_batch_size=2",
        "trainer.num_generations=2", "rollout.max_new_tokens=8", "rollout.max_turns=1",
        f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", "tracking.experiment=mp",
        "warmstart.enabled=false", "validation.every=0",
    ]  # fmt: skip
    env = {**os.environ, "ZEROSIM_TRACE": str(tmp_path / "trace"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode != 0, _failure(proc)
    assert "the launch config asks for FSDP but accelerate runs MULTI_CPU" in proc.stdout + proc.stderr, (
        _failure(proc)
    )
    assert not (tmp_path / "out" / "mp" / "final").exists()

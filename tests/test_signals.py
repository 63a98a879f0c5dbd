"""SIGTERM — how ``timeout``, SLURM and Kubernetes stop a job — ends every MLflow run FINISHED or FAILED,
never RUNNING; a training job first finishes its step and saves a checkpoint to resume from."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from zerosim.core import signals

REPO = Path(__file__).resolve().parents[1]


class _Job:
    """``python -m zerosim.cli ARGS`` with its output (stdout and stderr, progress bars' ``\\r`` included)
    read by a thread, so the test can wait for a line without blocking and the job never blocks on a pipe."""

    def __init__(self, *args: str, cwd: Path):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zerosim.cli", *args],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while chunk := self.proc.stdout.read1(65536):
            self.chunks.append(chunk)

    @property
    def output(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")

    def wait_for(self, text: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert self.proc.poll() is None, (
                f"ended (code {self.proc.returncode}) before {text!r}:\n{self.output[-3000:]}"
            )
            assert time.monotonic() < deadline, f"no {text!r} after {timeout} s:\n{self.output[-3000:]}"
            time.sleep(0.2)

    def stop(self) -> int:
        """SIGTERM, then the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=300)
        self.reader.join(timeout=10)
        return code


def test_sigterm_in_training_saves_a_checkpoint_and_ends_the_run_failed(
    tmp_path, tiny_model_dir, capitals, mlflow_db
):
    import mlflow

    from zerosim.core.config import load_config
    from zerosim.training.checkpoint import recorded_run
    from zerosim.training.config import TrainConfig
    from zerosim.training.recipe import RESULT_FILE, resume_point

    qa, corpus = capitals(8)
    overrides = [
        f"policy.model={tiny_model_dir}", "search.engine=bm25", f"search.bm25.corpus={corpus}", f"data.train={qa}",
        "trainer.max_steps=200", "trainer.save_steps=0", "trainer.logging_steps=1", "trainer.collapse_patience=0",
        "trainer.per_device_train_batch_size=2", "trainer.num_generations=2", "rollout.max_new_tokens=6",
        "rollout.max_turns=1", "rollout.max_completion_tokens=64", "warmstart.enabled=false", "validation.every=0",
        f"run.output_dir={tmp_path / 'out'}", "run.name=run", f"tracking.tracking_uri={mlflow_db}",
    ]  # fmt: skip
    job = _Job("train", "--config", str(REPO / "configs" / "demo.yaml"), *overrides, cwd=tmp_path)
    job.wait_for("'loss'")  # a step logged: the job is inside its training loop
    code, err = job.stop(), job.output

    assert code == signals.EXIT_CODE, err[-3000:]
    assert "stopped: stopped by SIGTERM after step" in err
    folder = tmp_path / "out" / "run"
    assert not (folder / "final").exists() and not (folder / RESULT_FILE).exists()  # it did not finish
    # the step in progress ended with a checkpoint that a resume continues from, in the same run
    cfg = load_config(REPO / "configs" / "demo.yaml", [*overrides, "run.resume=true"], schema=TrainConfig)
    checkpoint, run_id = resume_point(cfg, folder)
    assert checkpoint is not None and int(checkpoint.name.split("-")[1]) >= 1
    assert run_id == recorded_run(folder)
    mlflow.set_tracking_uri(mlflow_db)
    assert mlflow.MlflowClient().get_run(run_id).info.status == "FAILED"


def test_a_stop_file_in_the_run_folder_stops_like_a_sigterm_and_is_consumed(
    tmp_path, tiny_model_dir, capitals, mlflow_db
):
    """`touch <run>/STOP`: for a launcher that would kill the job before a step can finish (torchrun before
    torch 2.12 waits 30 s after its SIGTERM), the job stops after its step with a checkpoint, as on a SIGTERM."""
    from zerosim.core.config import load_config
    from zerosim.training.config import TrainConfig
    from zerosim.training.recipe import RESULT_FILE, resume_point

    qa, corpus = capitals(8)
    overrides = [
        f"policy.model={tiny_model_dir}", "search.engine=bm25", f"search.bm25.corpus={corpus}", f"data.train={qa}",
        "trainer.max_steps=200", "trainer.save_steps=0", "trainer.logging_steps=1", "trainer.collapse_patience=0",
        "trainer.per_device_train_batch_size=2", "trainer.num_generations=2", "rollout.max_new_tokens=6",
        "rollout.max_turns=1", "rollout.max_completion_tokens=64", "warmstart.enabled=false", "validation.every=0",
        f"run.output_dir={tmp_path / 'out'}", "run.name=run", f"tracking.tracking_uri={mlflow_db}",
    ]  # fmt: skip
    job = _Job("train", "--config", str(REPO / "configs" / "demo.yaml"), *overrides, cwd=tmp_path)
    job.wait_for("'loss'")  # inside the training loop
    folder = tmp_path / "out" / "run"
    (folder / "STOP").touch()
    code = job.proc.wait(timeout=300)
    job.reader.join(timeout=10)
    assert code == signals.EXIT_CODE, job.output[-3000:]
    assert f"stopped by {folder / 'STOP'} after step" in job.output
    assert not (folder / "STOP").exists()  # consumed: a resume does not stop at once
    assert not (folder / RESULT_FILE).exists()
    cfg = load_config(REPO / "configs" / "demo.yaml", [*overrides, "run.resume=true"], schema=TrainConfig)
    assert resume_point(cfg, folder)[0] is not None


def test_the_launcher_grace_comes_from_torchrun_or_its_environment(monkeypatch):
    from zerosim.training import stopping

    assert stopping.launcher_grace({}) is None  # not under torchrun
    run = {"TORCHELASTIC_RUN_ID": "r"}
    monkeypatch.setattr(stopping, "launcher_reads_grace", lambda: True)
    assert stopping.launcher_grace(run) == (30, "torchrun's default (TORCH_ELASTIC_SHUTDOWN_TIMEOUT unset)")
    assert stopping.launcher_grace({**run, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "240"}) == (
        240,
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
    )
    monkeypatch.setattr(stopping, "launcher_reads_grace", lambda: False)
    assert (
        stopping.launcher_grace({**run, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "240"})[0] == 30
    )  # older torchrun
    assert stopping.grace_for(10) == 60 and stopping.grace_for(143) == 240  # 1.5x, whole minutes


def test_the_dry_run_of_a_launched_recipe_says_how_long_a_stop_takes():
    from zerosim.core.config import load_config
    from zerosim.training.config import TrainConfig
    from zerosim.training.dry_run import plan as dry_run
    from zerosim.training.memory import launch_from_config, memory_plan
    from zerosim.training.stopping import stop_plan

    cfg = load_config(REPO / "configs" / "zerosearch-qwen2.5-3b.yaml", [], schema=TrainConfig)
    zero2 = REPO / "configs" / "accelerate" / "zero2.yaml"
    rows = dict(dry_run(cfg, None, launch_config=zero2, gpu_memory=80))
    plan = stop_plan(cfg, memory_plan(cfg, launch_from_config(zero2)))
    # a 3B policy's step and checkpoint take far longer than torchrun's default 30 s
    assert plan.step_s + plan.save_s > 60 and plan.grace >= 120
    assert f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={plan.grace}" in rows["stop"]
    assert "stop" not in dict(dry_run(cfg, 1, gpu_memory=80))  # one process: no launcher to outlast


def test_a_lora_jobs_stop_saves_its_adapters_not_the_base():
    """An adapter checkpoint holds the adapters and their AdamW moments (12 bytes a parameter), not the 15 GB
    base the stop row sized before."""
    from zerosim.core.config import load_config
    from zerosim.training.config import TrainConfig
    from zerosim.training.memory import launch_from_config, memory_plan
    from zerosim.training.stopping import stop_plan

    cfg = load_config(REPO / "configs" / "zerosearch-qwen2.5-7b-lora.yaml", [], schema=TrainConfig)
    memory = memory_plan(cfg, launch_from_config(REPO / "configs" / "accelerate" / "zero2-7.yaml"))
    assert stop_plan(cfg, memory).save_gb * 1e9 == pytest.approx(12 * memory.adapter_params)
    assert stop_plan(cfg, memory).save_gb < 1.5


def test_sigterm_in_an_experiment_ends_its_runs_and_a_killed_attempts_runs_are_ended_after(tiny_experiment):
    import mlflow

    from zerosim.experiment import load_experiment
    from zerosim.experiment.run import EXPERIMENT_FILE, _run_locked
    from zerosim.experiment.stages import build_stages

    config, tmp = tiny_experiment
    root = tmp / "experiments" / "sim-vs-real-smoke"
    job = _Job("experiment", "--config", str(config), cwd=REPO)
    job.wait_for("sim-sft: run")
    time.sleep(2)  # inside the stage's MLflow run
    code, err = job.stop(), job.output
    assert code == signals.EXIT_CODE, err[-3000:]
    store = f"sqlite:///{tmp / 'mlflow.db'}"
    mlflow.set_tracking_uri(store)
    runs = mlflow.search_runs(experiment_names=["exp"], output_format="list")
    assert runs and {r.info.status for r in runs} <= {"FINISHED", "FAILED"}, [r.info.status for r in runs]
    parent = next(r for r in runs if r.data.tags.get("zerosim.job") == "experiment")
    assert parent.info.status == "FAILED"

    # a SIGKILL leaves no time to end a run: the next attempt ends the stage runs it left RUNNING
    client = mlflow.MlflowClient(store)
    stale = client.create_run(parent.info.experiment_id, tags={"mlflow.parentRunId": parent.info.run_id})
    assert client.get_run(stale.info.run_id).info.status == "RUNNING"
    cfg = load_experiment(config)
    echoed: list[str] = []
    _run_locked(cfg, root, build_stages(cfg, root), echoed.append, stop_after="sim-sft")
    assert client.get_run(stale.info.run_id).info.status == "FAILED"
    assert any("left RUNNING by a killed attempt" in line for line in echoed)
    assert (root / EXPERIMENT_FILE).is_file()


def test_a_sigterm_outside_training_raises_at_once_and_inside_asks_the_loop_to_stop():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert signals.install()
        with pytest.raises(signals.Terminated) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert stopped.value.code == 143
        with signals.graceful():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            assert signals.stop_requested()  # the first: the loop stops at its next step
            with pytest.raises(signals.Terminated):  # the second: at once
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
        assert not signals.stop_requested()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_stale_stop_file_is_removed_at_the_start_not_obeyed(tmp_path, caplog):
    """A STOP left by an earlier run (written before this job started) stopped a fresh run after its first
    step; it is removed at the start, naming it, and only a STOP written since stops the run."""
    import logging
    import os
    import time
    from types import SimpleNamespace

    from transformers import TrainerControl

    from zerosim.core import signals as sig
    from zerosim.training.stopping import StopControl

    stop = tmp_path / "STOP"
    stop.touch()
    old = time.time() - 3600
    os.utime(stop, (old, old))
    control, args = TrainerControl(), SimpleNamespace(device="cpu")
    callback = StopControl(tmp_path)
    with caplog.at_level(logging.WARNING, logger="zerosim.training.stopping"):
        callback.on_train_begin(args, None, control)
    assert not stop.exists() and f"removed {stop}" in caplog.text and "before this job started" in caplog.text
    callback.on_step_end(args, None, control)
    assert not control.should_training_stop
    stop.touch()  # asked now
    try:
        callback.on_step_end(args, None, control)
        assert control.should_training_stop and sig.stop_reason() == str(stop)
    finally:
        sig._stop.clear()  # this process's stop request, made by the callback, is the test's only
        sig._reason[0] = "SIGTERM"

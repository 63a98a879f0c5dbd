"""Two training processes (accelerate launch, gloo on CPU) whose ranks finish their trajectories on
different turns and earn different rewards: the job must neither hang nor split its MLflow run, and the
ranks must agree — on the curriculum's noise probability too, which follows the whole batch's reward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from curricula import AdaptiveSchedule, trajectory_noise

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def qa_files(tmp_path):
    rows = [
        {"id": f"q{i}", "question": f"What is the capital of country {c}?", "golden_answers": [f"City{c}"]}
        for i, c in enumerate("ABCDEFGH")
    ]
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "contents": f"Country {c}\nThe capital of country {c} is City{c}."})
            + "\n"
            for i, c in enumerate("ABCDEFGH")
        )
    )
    return qa, corpus


def _failure(proc) -> str:
    """The first failing rank's own traceback, not only the launcher's "connection closed" echo from the other."""
    lines = (proc.stdout + proc.stderr).splitlines()
    rank0 = [line for line in lines if line.startswith("[rank0]")]
    return "\n".join(rank0[-80:]) + "\n" + "\n".join(lines[-40:])


def test_two_processes_uneven_turns_one_run(tmp_path, tiny_model_dir, qa_files):
    import mlflow

    qa, corpus = qa_files
    db = tmp_path / "mlflow.db"
    trace = tmp_path / "trace"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(ROOT / "configs" / "accelerate" / "ddp-cpu.yaml"), "--main_process_port", "0",
        str(ROOT / "tests" / "helpers" / "multiproc_train.py"),
        "--config", str(ROOT / "configs" / "demo.yaml"),
        f"run.output_dir={tmp_path / 'out'}", "run.name=mp", f"policy.model={tiny_model_dir}",
        "search.engine=bm25", f"search.bm25.corpus={corpus}", "search.negatives=random",
        "curriculum.granularity=document",
        # adaptive: +0.1 after each step whose mean reward is >= 0.5 (window 1), from 0.5 up to 0.9
        "curriculum.schedule=adaptive", "curriculum.p_start=0.5", "curriculum.p_end=0.9",
        "curriculum.adaptive_window=1", "curriculum.adaptive_delta=0.1",
        f"data.train={qa}", "trainer.max_steps=2", "trainer.per_device_train_batch_size=4",
        "trainer.num_generations=2", "rollout.max_new_tokens=16", "rollout.max_turns=3",
        f"tracking.tracking_uri=sqlite:///{db}", "tracking.experiment=mp", "warmstart.enabled=false",
        # validation at steps 0, 1, 2: 3 questions over 2 ranks, one per batch (rank 1's second batch is empty)
        "validation.every=1", "validation.max_examples=3", "validation.batch_size=1",
    ]  # fmt: skip
    env = {**os.environ, "ZEROSIM_TRACE": str(trace), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, _failure(proc)

    records = [
        [json.loads(line) for line in (trace / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)
    ]
    # validation rollouts run without curriculum noise (p 0); the training ones at the curriculum's p (>= 0.5)
    ranks = [[r for r in rank if r["p"] > 0] for rank in records]
    passes = [[r for r in rank if r["p"] == 0.0] for rank in records]
    assert len(ranks[0]) == len(ranks[1]) == 2  # one rollout per step on each rank
    assert len(passes[0]) == len(passes[1]) == 6  # 3 validation passes x 2 batches on each rank
    for v0, v1 in zip(*passes, strict=True):
        if len(v1["finish"]) == 1:  # rank 0's question answers at turn 1, rank 1's searches first
            assert v0["generate_calls"] == [1, 0] and v1["generate_calls"] == [1, 1]
        else:  # rank 1 has no question left: it idles through rank 0's turn
            assert v0["generate_calls"] == [1] and v1["generate_calls"] == [0]
    for r0, r1 in zip(*ranks, strict=True):
        assert r0["step"] == r1["step"] and r0["p"] == r1["p"]  # the same curriculum step and probability
        assert set(r0["finish"]) == {"answer"} and set(r1["finish"]) == {"answer"}
        # rank 0 is done after turn 1, rank 1 after turn 2: both take part in both turns, then stop together
        assert r0["generate_calls"] == [4, 0] and r1["generate_calls"] == [4, 4]
        assert r0["engine_calls"] == [0, 0] and r1["engine_calls"] == [4, 0]
        assert (r0["offset"], r1["offset"]) == (0, 4)  # rank 1 holds trajectories 4..7 of the global batch
        for index, noisy in r1["noise"]:  # a pure function of (seed, step, global trajectory, search)
            expected = trajectory_noise(
                seed=0, step=r1["step"], trajectory=index, search=0, k=3, p=r1["p"], granularity="document"
            )
            assert tuple(noisy) == expected
        assert len({tuple(n) for _, n in r1["noise"]}) > 1  # distinct draws per trajectory

    # the adaptive curriculum: each rank saw only its own rewards (rank 0 right, rank 1 wrong), yet both were
    # given the mean over the whole batch and hold the p one process with all the rewards would hold
    observed = [
        [json.loads(line) for line in (trace / f"observe{r}.jsonl").read_text().splitlines()] for r in (0, 1)
    ]
    assert [o["step"] for o in observed[0]] == [o["step"] for o in observed[1]] == [0, 1]
    alone = AdaptiveSchedule(p_start=0.5, p_end=0.9, window=1, delta=0.1)
    for o0, o1 in zip(*observed, strict=True):
        assert sum(o0["local"]) / len(o0["local"]) > sum(o1["local"]) / len(o1["local"])  # ranks differ
        everything = o0["local"] + o1["local"]
        assert o0["mean"] == o1["mean"] == pytest.approx(sum(everything) / len(everything))
        alone.observe(o0["step"], sum(everything) / len(everything))
        assert o0["p"] == o1["p"] == pytest.approx(alone.p)
    assert alone.p > 0.5  # the batch's reward raised the noise (rank 1's own rewards alone would not have)
    assert [r["p"] for r in ranks[1]] == [0.5, observed[1][0]["p"]]  # step 1 rolled out at the new p

    mlflow.set_tracking_uri(f"sqlite:///{db}")
    runs = mlflow.search_runs(experiment_names=["mp"], output_format="list")
    assert len(runs) == 1  # the main process owns the one run
    (run,) = runs
    assert run.info.status == "FINISHED" and run.data.tags["zerosim.processes"] == "2"
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "rollout/searches_per_traj")
    assert sorted(m.step for m in history) == [1, 2]
    assert [m.value for m in history] == [0.5, 0.5]  # averaged over both ranks: 0 and 1 search per trajectory
    assert (tmp_path / "out" / "mp" / "final" / "model.safetensors").is_file()
    client = mlflow.MlflowClient()
    questions = client.get_metric_history(run.info.run_id, "val/questions")
    assert sorted((m.step, m.value) for m in questions) == [(0, 3.0), (1, 3.0), (2, 3.0)]  # summed over ranks
    searches = client.get_metric_history(run.info.run_id, "val/searches")
    assert {round(m.value, 6) for m in searches} == {round(1 / 3, 6)}  # only rank 1's one question searched


def test_a_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, tiny_model_dir, qa_files):
    """One node's agent or one pod stopped: the SIGTERM reaches one rank. The ranks agree at the step's end, so
    both stop after that step with its checkpoint (each saving its part), the job ends resumable (143 on each
    rank), the MLflow run FAILED — instead of the signalled rank leaving the other in the next step's
    collectives."""
    import mlflow

    from zerosim.core.config import load_config
    from zerosim.core.signals import EXIT_CODE
    from zerosim.training.checkpoint import last_complete_checkpoint, recorded_run, resume_point
    from zerosim.training.config import TrainConfig

    qa, corpus = qa_files
    db = tmp_path / "mlflow.db"
    trace = tmp_path / "trace"
    overrides = [
        f"run.output_dir={tmp_path / 'out'}", "run.name=mp", f"policy.model={tiny_model_dir}",
        "search.engine=bm25", f"search.bm25.corpus={corpus}", f"data.train={qa}", "trainer.max_steps=4",
        "trainer.save_steps=0", "trainer.per_device_train_batch_size=2", "trainer.num_generations=2",
        "rollout.max_new_tokens=8", "rollout.max_turns=1", "trainer.collapse_patience=0",
        f"tracking.tracking_uri=sqlite:///{db}", "tracking.experiment=mp", "warmstart.enabled=false",
        "validation.every=0",
    ]  # fmt: skip
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(ROOT / "configs" / "accelerate" / "ddp-cpu.yaml"), "--main_process_port", "0",
        str(ROOT / "tests" / "helpers" / "signal_one_rank.py"), "--config", str(ROOT / "configs" / "demo.yaml"),
        *overrides,
    ]  # fmt: skip
    env = {
        **os.environ,
        "ZEROSIM_TRACE": str(trace),
        "OMP_NUM_THREADS": "1",
        "SIGNAL_RANK": "1",
        "SIGNAL_STEP": "1",
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]  # stopped, not finished
    assert [(trace / f"exit{r}").read_text() for r in (0, 1)] == [str(EXIT_CODE)] * 2  # resumable, each
    rolled = [json.loads((trace / f"rank{r}.json").read_text())["rolled_out"] for r in (0, 1)]
    assert rolled == [[0, 1], [0, 1]], output[-3000:]  # neither rank began step 2
    assert "stopped by SIGTERM after step 2" in output  # the signalled rank
    assert "stopped by another rank's SIGTERM or STOP file after step 2" in output  # the other, same step
    folder = tmp_path / "out" / "mp"
    assert last_complete_checkpoint(folder) == folder / "checkpoint-2"
    # the launcher exits 1 for ranks that exit 143: the run folder says the job stopped cleanly
    stopped = json.loads(
        (folder / "stopped.json").read_text()
    )  # the main rank's reason: its own or another's
    assert stopped["step"] == 2 and stopped["reason"] in ("SIGTERM", "another rank's SIGTERM or STOP file")
    cfg = load_config(ROOT / "configs" / "demo.yaml", [*overrides, "run.resume=true"], schema=TrainConfig)
    assert resume_point(cfg, folder)[0] == folder / "checkpoint-2"  # the same run continues from it
    mlflow.set_tracking_uri(f"sqlite:///{db}")
    assert mlflow.MlflowClient().get_run(recorded_run(folder)).info.status == "FAILED"

    # the two ranks resume it (before, both died loading the optimizer state: transformers mapped it to the
    # rank's device, "cpu:0", which torch cannot restore to) and train the one step left
    resumed = [*cmd[: cmd.index("--config") + 2], *overrides, "run.resume=true", "trainer.max_steps=3"]
    proc = subprocess.run(resumed, capture_output=True, text=True, timeout=300, env={**env, "SIGNAL_RANK": "9"},
                          cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, _failure(proc)
    rolled = [json.loads((trace / f"rank{r}.json").read_text())["rolled_out"] for r in (0, 1)]
    assert rolled == [[2], [2]], proc.stdout[-2000:]  # continued from checkpoint-2, each rank
    assert json.loads((folder / "result.json").read_text())["steps"] == 3
    assert not (folder / "stopped.json").exists()

"""End to end through the CLI (in process, see ``zerosim_cli``): 2 steps of each algorithm on a tiny model,
checked in the MLflow store; a run killed with SIGKILL (a process of its own) resumes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.yaml")


@pytest.mark.parametrize("engine,warmstart", [("simulator", False), ("bm25", True)])
def test_cli_train_two_steps_logs_metrics_and_checkpoint(
    tmp_path, tiny_model_dir, capitals, mlflow_db, zerosim_cli, engine, warmstart, monkeypatch
):
    import mlflow

    monkeypatch.chdir(tmp_path)  # the store's artifacts (./mlruns, a logged model among them) go to tmp_path

    qa, corpus = capitals(8)
    cmd = [
        "train", "--config", DEMO,
        f"run.output_dir={tmp_path / 'out'}", "run.name=e2e",
        f"policy.model={tiny_model_dir}", f"search.simulator.model={tiny_model_dir}",
        f"search.engine={engine}", f"search.bm25.corpus={corpus}",
        f"data.train={qa}", "trainer.max_steps=2", "trainer.per_device_train_batch_size=4",
        "trainer.num_generations=2", "rollout.max_new_tokens=8", "rollout.max_turns=2",
        "search.simulator.max_new_tokens=16", f"tracking.tracking_uri={mlflow_db}",
        "tracking.experiment=e2e", f"warmstart.enabled={warmstart}", f"warmstart.data={qa}",
        f"warmstart.search.bm25.corpus={corpus}", "warmstart.max_steps=1", "warmstart.batch_size=2",
        "warmstart.num_examples=2",
        # greedy validation at steps 0, 1, 2 on 3 questions; beside the simulator, against BM25
        "validation.every=1", "validation.max_examples=3", "validation.batch_size=2",
        f"validation.engine={'bm25' if engine == 'simulator' else 'train'}",
        "runtime.threads=1",  # the process computes with one thread (tag zerosim.threads)
        f"tracking.log_model={engine == 'simulator'}",  # the final policy as the run's MLflow model, once
    ]  # fmt: skip
    zerosim_cli(*cmd)

    mlflow.set_tracking_uri(mlflow_db)
    runs = mlflow.search_runs(experiment_names=["e2e"], output_format="list")
    (run,) = [r for r in runs if r.data.tags["zerosim.job"] == "train"]
    if warmstart:
        (ws,) = [r for r in runs if r.data.tags["zerosim.job"] == "warmstart"]
        assert run.data.tags["zerosim.policy_init"] == str(tmp_path / "out" / "e2e" / "warmstart" / "final")
        assert ws.data.tags["zerosim.checkpoint"] == str(
            (tmp_path / "out" / "e2e" / "warmstart" / "final").resolve()
        )
    assert run.info.status == "FINISHED"
    assert run.data.tags["zerosim.threads"] == "1"
    client = mlflow.MlflowClient()
    for key in [
        "reward",
        "curriculum/noise_prob",
        "search/noisy_doc_share",
        "rollout/searches_per_traj",
        "rollout/valid_format_rate",
        "rollout/answer_rate",
    ]:
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in history) == [1, 2], (key, history)
    assert run.data.params["trainer.max_steps"] == "2"
    checkpoint = tmp_path / "out" / "e2e" / "final"
    assert (checkpoint / "config.json").is_file() and (checkpoint / "model.safetensors").is_file()
    assert run.data.tags["zerosim.checkpoint"] == str(checkpoint.resolve())
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "samples", "plots"} <= artifacts
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert plots == {"plots/training.png", "plots/validation.png"}
    samples = client.download_artifacts(run.info.run_id, "samples/trajectories.jsonl", str(tmp_path))
    rows = [json.loads(line) for line in Path(samples).read_text().splitlines()]
    assert rows and {"question", "completion", "golden_answers", "step"} <= set(rows[0])
    for key in ["val/em", "val/f1", "val/valid_format", "val/searches", "val/questions"]:
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in history) == [0, 1, 2], (key, history)
    assert {m.value for m in client.get_metric_history(run.info.run_id, "val/questions")} == {3.0}
    val = client.download_artifacts(run.info.run_id, "samples/validation.jsonl", str(tmp_path))
    val_rows = [json.loads(line) for line in Path(val).read_text().splitlines()]
    # the last pass, on the first 3 training questions
    assert [r["question"] for r in val_rows] == [f"What is the capital of country {c}?" for c in "ABC"]
    assert {r["step"] for r in val_rows} == {2}
    if engine == "simulator":  # tracking.log_model: the model, its config and validation table linked
        tags, run_id = run.data.tags, run.info.run_id
        assert tags["zerosim.config"] == f"runs:/{run_id}/config.yaml"
        assert tags["zerosim.validation_table"] == f"runs:/{run_id}/samples/validation.jsonl"
        (model,) = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list")
        assert tags["zerosim.model_uri"] == model.model_uri and model.name == "policy"
        assert model.source_run_id == run_id
        assert "transformers" in mlflow.models.get_model_info(model.model_uri).flavors
    else:
        assert "zerosim.model_uri" not in run.data.tags


@pytest.mark.parametrize(
    "algorithm, credit",
    [("rloo", "sequence"), ("reinforce", "sequence"), ("reinforce_pp", "sequence"), ("ppo", "sequence"),
     ("grpo", "prefix")],
)  # fmt: skip
def test_cli_each_algorithm_runs_two_steps(
    tmp_path, tiny_model_dir, capitals, mlflow_db, zerosim_cli, algorithm, credit
):
    import mlflow

    qa, corpus = capitals(8)
    cmd = [
        "train", "--config", DEMO,
        f"run.output_dir={tmp_path / 'out'}", "run.name=algo", f"policy.model={tiny_model_dir}",
        "search.engine=bm25", f"search.bm25.corpus={corpus}", f"data.train={qa}",
        f"trainer.algorithm={algorithm}", "trainer.max_steps=2", "trainer.per_device_train_batch_size=4",
        "trainer.num_generations=2", "trainer.learning_rate=1e-3", "rollout.max_new_tokens=8", "rollout.max_turns=2",
        f"tracking.tracking_uri={mlflow_db}", "tracking.experiment=algo", "warmstart.enabled=false",
        "curriculum.schedule=constant", "curriculum.p_end=0.5", "curriculum.granularity=document",
        "reward.step_gain_weight=0.5", "reward.step_redundancy_weight=0.1", f"reward.step_credit={credit}",
    ]  # fmt: skip
    zerosim_cli(*cmd)
    mlflow.set_tracking_uri(mlflow_db)
    (run,) = mlflow.search_runs(experiment_names=["algo"], output_format="list")
    assert run.info.status == "FINISHED" and run.data.params["trainer.algorithm"] == algorithm
    client = mlflow.MlflowClient()
    for key in [
        "reward",
        "entropy",
        "algorithm/advantage_abs_mean",
        "search/noisy_doc_share",
        "time/reward_s",
        "time/update_s",
        "time/step_s",
        "memory/peak_rss_gb",
        "rollout/step_reward_per_traj",
    ]:
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [1, 2], key
    if algorithm == "ppo":
        for key in ["critic/value_loss", "critic/explained_variance", "time/critic_s"]:
            assert len(client.get_metric_history(run.info.run_id, key)) == 2, key
        assert (tmp_path / "out" / "algo" / "critic" / "config.json").is_file()


def test_resume_after_sigkill_loses_no_completed_step(
    tmp_path, tiny_model_dir, capitals, mlflow_db, zerosim_cli
):
    import os
    import signal
    import time

    import mlflow

    qa, corpus = capitals(8)
    out = tmp_path / "out"
    cmd = [
        "train", "--config", DEMO,
        f"run.output_dir={out}", "run.name=res", f"policy.model={tiny_model_dir}",
        "search.engine=bm25", f"search.bm25.corpus={corpus}", f"data.train={qa}",
        "trainer.algorithm=ppo", "trainer.max_steps=6", "trainer.save_steps=1", "trainer.save_total_limit=3", "trainer.collapse_patience=0",
        "trainer.per_device_train_batch_size=4", "trainer.num_generations=2", "rollout.max_new_tokens=8",
        "rollout.max_turns=2", "curriculum.schedule=adaptive", f"tracking.tracking_uri={mlflow_db}",
        "tracking.experiment=res", "warmstart.enabled=false",
    ]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerosim.cli", *cmd],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.time() + 600
    while not (out / "res" / "checkpoint-2" / "zerosim_state.pt").is_file():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "no checkpoint-2 within 10 minutes"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # no clean-up of any kind
    proc.wait()
    proc.stderr.close()
    from zerosim.training.recipe import last_complete_checkpoint

    done = int(last_complete_checkpoint(out / "res").name.rpartition("-")[2])
    assert 2 <= done < 6

    zerosim_cli(*cmd, "resume=true")
    mlflow.set_tracking_uri(mlflow_db)
    (run,) = mlflow.search_runs(experiment_names=["res"], output_format="list")  # the same run, continued
    assert run.info.status == "FINISHED"
    assert run.data.tags["zerosim.resumed_from"].endswith(f"checkpoint-{done}")
    steps = [m.step for m in mlflow.MlflowClient().get_metric_history(run.info.run_id, "reward")]
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]  # every step once: none lost, none logged twice
    state = json.loads((out / "res" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6


def test_cli_collapse_guard_rolls_back_then_stops_and_keeps_the_best_policy(
    tmp_path, tiny_model_dir, capitals, mlflow_db, zerosim_cli
):
    """A collapse (the tiny policy never answers: silence, at patience 1) is first rolled back to the best validated
    policy at half the learning rate, then stopped at the second; the final checkpoint is the best validated
    policy; the collapse signals are logged every step. (Each trigger: tests/test_guard.py.)"""
    import mlflow
    import torch
    from safetensors.torch import load_file

    qa, corpus = capitals(8)
    out = tmp_path / "out" / "guarded"
    cmd = [
        "train", "--config", DEMO,
        f"run.output_dir={tmp_path / 'out'}", "run.name=guarded", f"policy.model={tiny_model_dir}",
        "search.engine=bm25", f"search.bm25.corpus={corpus}", f"data.train={qa}",
        "trainer.max_steps=4", "trainer.per_device_train_batch_size=4", "trainer.num_generations=2",
        "trainer.learning_rate=1e-2", "rollout.max_new_tokens=8", "rollout.max_turns=1",
        f"tracking.tracking_uri={mlflow_db}", "tracking.experiment=guard", "warmstart.enabled=false",
        "validation.every=1", "validation.max_examples=2",
        "trainer.collapse_patience=1", "trainer.collapse_window=2", "trainer.collapse_answer_share=0.3",
        "trainer.collapse_action=rollback", "trainer.final_policy=best",
    ]  # fmt: skip
    zerosim_cli(*cmd)
    mlflow.set_tracking_uri(mlflow_db)
    (run,) = mlflow.search_runs(experiment_names=["guard"], output_format="list")
    tags = run.data.tags
    events = tags["zerosim.collapse_events"].split("; ")
    assert [e.rsplit("-> ", 1)[1] for e in events] == ["rollback", "stop"], events
    assert all("silence" in e for e in events)
    assert tags["zerosim.final_policy"] == "best: step 0, val/em 0.0000"
    client = mlflow.MlflowClient()
    for key in ["collapse/distinct_answers", "entropy"]:
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [1, 2], key
    final = load_file(str(out / "final" / "model.safetensors"))
    best = load_file(str(out / "best" / "model.safetensors"))
    assert final.keys() == best.keys() and all(torch.equal(final[k], best[k]) for k in final)


def test_cli_train_speaks_tool_calls_with_rollout_protocol_tools(
    tmp_path, tiny_model_dir, capitals, mlflow_db, zerosim_cli
):
    """rollout.protocol=tools end to end: the warm start's demonstrations in the tools format (its own folder),
    two GRPO steps and validation over tool calls, tools/* in MLflow."""
    import mlflow

    qa, corpus = capitals(8)
    cmd = [
        "train", "--config", DEMO, f"run.output_dir={tmp_path / 'out'}", "run.name=tools",
        f"policy.model={tiny_model_dir}", "search.engine=bm25", f"search.bm25.corpus={corpus}", f"data.train={qa}",
        "rollout.protocol=tools", "trainer.max_steps=2", "trainer.per_device_train_batch_size=4",
        "trainer.num_generations=2", "rollout.max_new_tokens=8", "rollout.max_turns=2",
        f"tracking.tracking_uri={mlflow_db}", "tracking.experiment=tools", "warmstart.enabled=true",
        f"warmstart.data={qa}", f"warmstart.search.bm25.corpus={corpus}", "warmstart.max_steps=1",
        "warmstart.batch_size=2", "warmstart.num_examples=2", "validation.every=2", "validation.max_examples=2",
        "validation.batch_size=2",
    ]  # fmt: skip
    zerosim_cli(*cmd)
    mlflow.set_tracking_uri(mlflow_db)
    runs = mlflow.search_runs(experiment_names=["tools"], output_format="list")
    (run,) = [r for r in runs if r.data.tags["zerosim.job"] == "train"]
    assert run.info.status == "FINISHED" and run.data.params["rollout.protocol"] == "tools"
    assert run.data.tags["zerosim.policy_init"] == str(
        tmp_path / "out" / "tools" / "warmstart-tools" / "final"
    )
    client = mlflow.MlflowClient()
    for key in ["tools/calls_per_traj", "tools/invalid_call_share", "tools/invalid/no_action", "reward"]:
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [1, 2], key
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/em")] == [0, 2]

"""transformers' MLflowCallback, as zerosim wires it: synchronous, and each (metric, step) logged once."""

from __future__ import annotations


def test_the_trainer_callback_logs_each_step_once_through_our_logger(tmp_path, monkeypatch):
    """``trainer_mlflow_callback`` replaces the callback's private ``_ml_flow`` module: if transformers
    renamed it, metrics would silently go back to asynchronous logging with duplicates after a resume."""
    import mlflow
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from zerosim.core.tracking import TrackingConfig, mlflow_run, trainer_mlflow_callback

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    tracking = TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="t")
    callback = trainer_mlflow_callback()
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    state = TrainerState(is_world_process_zero=True, is_local_process_zero=True)
    with mlflow_run(tracking, "callback") as run:
        for step, reward in [(1, 0.5), (1, 0.9), (2, 0.7)]:  # step 1 twice: a redone step after a resume
            state.global_step = step
            callback.on_log(args, state, TrainerControl(), logs={"reward": reward})
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "reward")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.7)]

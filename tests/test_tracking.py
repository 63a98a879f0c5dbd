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


def _stub_server(status: int):
    """A local HTTP server answering every GET with ``status``; its base URL and the server (shut it down)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"experiments": []}'
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def test_the_store_check_tries_the_store_and_leaves_nothing(tmp_path):
    """A writable sqlite store and an answering server pass; a folder only root's os.access calls writable,
    a file that is no database, a dead server and a server with no MLflow API are refused within seconds."""
    import time

    import pytest

    from zerosim.core.config import ConfigError
    from zerosim.core.tracking import check_tracking_uri

    check_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    check_tracking_uri(str(tmp_path / "mlruns" / "deeper"))  # a file store: MLflow makes the folders
    assert list(tmp_path.iterdir()) == []  # the probes removed their files
    (tmp_path / "junk.db").write_text("not a database\n" * 100)
    url, server = _stub_server(200)
    missing, other = _stub_server(404)
    try:
        check_tracking_uri(url)
        refused = {
            "sqlite:////proc/mlflow.db": "/proc is not writable",
            f"sqlite:///{tmp_path / 'junk.db'}": "is not an sqlite database",
            "http://127.0.0.1:9": "no answer within 5s",
            missing: "no MLflow tracking API there",
        }
        for uri, words in refused.items():
            started = time.monotonic()
            with pytest.raises(ConfigError) as err:
                check_tracking_uri(uri)
            assert time.monotonic() - started < 10
            message = str(err.value)
            assert f"tracking.tracking_uri={uri}" in message and words in message, message
    finally:
        server.shutdown()
        other.shutdown()


def test_an_mlflow_failure_mid_run_is_one_line_naming_the_key(tmp_path, monkeypatch):
    """The store failing after the checks passed (gone, unwritable): one line naming tracking.tracking_uri,
    exit code 2, no traceback."""
    import mlflow
    import typer
    from typer.testing import CliRunner

    from zerosim.cli import ZerosimGroup

    app = typer.Typer(cls=ZerosimGroup)

    @app.command()
    def job() -> None:
        mlflow.MlflowClient().search_experiments()  # the store of this process: a server gone

    @app.command()
    def other() -> None:  # two commands: typer takes the command's name from the line
        pass

    monkeypatch.delenv("ZEROSIM_DEBUG", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retries take minutes
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri("http://127.0.0.1:9")
    try:
        result = CliRunner().invoke(app, ["job"])
    finally:
        mlflow.set_tracking_uri(before)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, (result.output, result.exception)
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert "tracking.tracking_uri=http://127.0.0.1:9" in lines[0], lines[0]


def test_a_simulator_evaluation_tries_its_store_before_it_loads_anything():
    import pytest

    from simulators.config import SimulatorEvalConfig
    from simulators.quality import run_quality
    from zerosim.core.config import ConfigError
    from zerosim.core.tracking import TrackingConfig

    cfg = SimulatorEvalConfig(tracking=TrackingConfig(tracking_uri="http://127.0.0.1:9"))
    with pytest.raises(ConfigError, match="tracking.tracking_uri=http://127.0.0.1:9"):
        run_quality(cfg, engine=object())  # an engine that cannot search: nothing gets that far

"""``tracking.log_model``: the final simulator / policy logged to its MLflow run as a transformers model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerosim.core.config import ConfigError

ROWS = [
    {
        "prompt": [{"role": "user", "content": f"Write a document for the query: capital of country {c}"}],
        "completion": [{"role": "assistant", "content": f"Doc 1: The capital of country {c} is City{c}."}],
    }
    for c in "ABCD"
]


def test_simulator_train_logs_a_loadable_model(tmp_path, tiny_model_dir, mlflow_db, zerosim_cli, monkeypatch):
    import mlflow
    import mlflow.transformers

    monkeypatch.chdir(tmp_path)  # the store's artifacts (./mlruns, the model among them) go to tmp_path

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = zerosim_cli("simulator", "train", "--data", data, "--model", tiny_model_dir, "--full", "--max-steps", 1,
                      "--output-dir", tmp_path / "sim", "batch_size=2", "max_length=128",
                      f"tracking.tracking_uri={mlflow_db}", "tracking.log_model=true").stdout  # fmt: skip
    ckpt = Path(out.strip().splitlines()[-1])

    mlflow.set_tracking_uri(mlflow_db)
    (run,) = mlflow.search_runs(experiment_names=["zerosim-simulator"], output_format="list")
    tags, run_id = run.data.tags, run.info.run_id
    assert run.data.params["sft.tracking.log_model"] == "True"
    assert tags["zerosim.config"] == f"runs:/{run_id}/config.yaml"
    uri = tags["zerosim.model_uri"]
    assert uri.startswith("models:/") and "zerosim.eval_table" not in tags  # no eval yet
    assert mlflow.models.get_model_info(uri).flavors["transformers"]["task"] == "text-generation"
    # the logged model is the checkpoint: loaded back, it generates what the folder's model generates
    logged = mlflow.transformers.load_model(uri, return_type="components")
    from zerosim.core.models import load_causal_lm

    model, tokenizer = logged["model"], logged["tokenizer"]
    ids = tokenizer("capital of country A", return_tensors="pt").input_ids
    expected = load_causal_lm(str(ckpt), "float32").generate(ids, max_new_tokens=4, do_sample=False)
    assert model.generate(ids, max_new_tokens=4, do_sample=False).tolist() == expected.tolist()

    # an eval of the checkpoint links its table back to the run and to the logged model
    qa = tmp_path / "qa.jsonl"
    qa.write_text(
        json.dumps({"id": "q0", "question": "capital of country A?", "golden_answers": ["CityA"]}) + "\n"
    )
    zerosim_cli("eval", "--policy", ckpt, "--method", "direct", "--dataset", qa, "max_answer_tokens=4",
                f"output_dir={tmp_path / 'eval'}", "run_name=ev", f"tracking.tracking_uri={mlflow_db}")  # fmt: skip
    (ev,) = mlflow.search_runs(experiment_names=["zerosim-eval"], output_format="list")
    assert ev.data.tags["zerosim.train_run_id"] == run_id
    link = f"runs:/{ev.info.run_id}/table.json"
    assert mlflow.get_run(run_id).data.tags["zerosim.eval_table"] == link
    assert mlflow.get_logged_model(uri.removeprefix("models:/")).tags["zerosim.eval_table"] == link
    assert json.loads(Path(mlflow.artifacts.download_artifacts(link)).read_text())[0]["dataset"]


def test_log_model_refuses_an_adapter_only_checkpoint(tmp_path, tiny_model_dir, zerosim_cli):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    result = zerosim_cli("simulator", "train", "--data", data, "--model", tiny_model_dir, "--lora", "merge_lora=false",
                         "--output-dir", tmp_path / "sim", "tracking.log_model=true", code=None)  # fmt: skip
    assert result.exit_code != 0
    assert "merge_lora=true" in result.stderr + result.stdout


def test_log_model_is_a_boolean_flag():
    """(``zerosim train`` with the flag: tests/test_train_e2e.py::test_cli_train_two_steps_logs_metrics_and_checkpoint.)"""
    from zerosim.training.config import load_train_config

    assert load_train_config(None, []).tracking.log_model is False
    assert load_train_config(None, ["tracking.log_model=true"]).tracking.log_model is True
    with pytest.raises(ConfigError, match="tracking.log_model"):
        load_train_config(None, ["tracking.log_model=maybe"])

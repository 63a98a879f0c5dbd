"""The resume contract (docs/training.md): a checkpoint is bound to its run and config, a kill at any phase
of a save leaves a complete checkpoint to continue from, and nothing is lost or logged twice."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from zerosim.core.config import ConfigError
from zerosim.training.config import TrainConfig, load_train_config

REPO = Path(__file__).resolve().parents[1]
HELPER = REPO / "tests" / "helpers" / "kill_during_save.py"
PHASES = ["before_model", "model_optimizer", "state_file", "rotation"]
RESUMED_FROM = {"before_model": 1, "model_optimizer": 1, "state_file": 1, "rotation": 2}  # last complete


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume-data")
    qa, corpus = root / "qa.jsonl", root / "corpus.jsonl"
    qa.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"q{i}",
                    "question": f"What is the capital of country {c}?",
                    "golden_answers": [f"City{c}"],
                }
            )
            + "\n"
            for i, c in enumerate("ABCDEFGH")
        )
    )
    corpus.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "contents": f"Country {c}\nThe capital of country {c} is City{c}."})
            + "\n"
            for i, c in enumerate("ABCDEFGH")
        )
    )
    return qa, corpus


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, tiny_model_dir, data_files):
    """``algorithm -> (workdir, helper log)``: every phase killed once (SIGKILL during the save of
    checkpoint-2 of 3 steps), then resumed with resume=true — one helper process per algorithm (imports
    once, one fork per run), run on first use."""
    done = {}

    def run(algorithm: str) -> tuple[Path, str]:
        if algorithm not in done:
            workdir = tmp_path_factory.mktemp(f"kill-{algorithm}")
            qa, corpus = data_files
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),  # this checkout
                "ZEROSIM_HOME": str(workdir / "home"),
                "TOKENIZERS_PARALLELISM": "false",
            }
            cmd = [
                sys.executable,
                str(HELPER),
                str(workdir),
                algorithm,
                str(tiny_model_dir),
                str(qa),
                str(corpus),
            ]
            proc = subprocess.run([*cmd, *PHASES], capture_output=True, text=True, timeout=900, env=env)
            assert proc.returncode == 0, proc.stderr[-4000:]
            done[algorithm] = workdir, proc.stderr
        return done[algorithm]

    return run


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
@pytest.mark.parametrize("phase", PHASES)
def test_kill_at_any_phase_of_a_save_resumes_losing_nothing(killed_and_resumed, algorithm, phase, tmp_path):
    import mlflow

    workdir, log = killed_and_resumed(algorithm)
    result = json.loads((workdir / phase / "result.json").read_text())
    assert result["killed_by_sigkill"], f"the {phase} kill never fired"
    assert "error" not in result, f"{algorithm}/{phase}: resume failed: {result.get('error')}\n{log[-3000:]}"
    folder = workdir / phase / "run"

    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = mlflow.search_runs(experiment_names=[phase], output_format="list")  # the same run, continued
    assert (
        run.info.run_id == result["run_id"] == json.loads((folder / "mlflow_run.json").read_text())["run_id"]
    )
    assert run.info.status == "FINISHED"
    assert run.data.tags["zerosim.resumed_from"].endswith(f"checkpoint-{RESUMED_FROM[phase]}")
    assert result["steps"] == 3
    client = mlflow.MlflowClient()
    # every step once: none lost, none logged twice (the killed attempt had logged step 2 already)
    assert [
        m.step for m in sorted(client.get_metric_history(run.info.run_id, "reward"), key=lambda m: m.step)
    ] == [1, 2, 3]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val/em")) == [0, 1, 2, 3]
    for key in run.data.metrics:
        steps = Counter(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert max(steps.values()) == 1, (key, steps)
    # what the run held in memory before the kill: sample trajectories and validation history
    samples = client.download_artifacts(run.info.run_id, "samples/trajectories.jsonl", str(tmp_path))
    per_step = Counter(json.loads(line)["step"] for line in Path(samples).read_text().splitlines())
    assert per_step == {0: 2, 1: 2, 2: 2}  # rollout steps (0-based), 2 kept per step, none twice
    assert result["validation_steps"] == [0, 1, 2, 3]
    assert "plots/validation.png" in {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    # rotation kept one complete checkpoint, the last; no half-deleted leftovers
    assert sorted(p.name for p in folder.iterdir() if "checkpoint" in p.name) == ["checkpoint-3"]
    state = torch.load(folder / "checkpoint-3" / "zerosim_state.pt", weights_only=True)
    assert state["run_id"] == run.info.run_id and state["global_step"] == 3
    assert ("critic" in state) == (algorithm == "ppo")


def _cfg(out: Path, *overrides: str) -> TrainConfig:
    return load_train_config(
        None, [f"run.output_dir={out}", "run.name=run", "policy.model=/nonexistent/policy", *overrides]
    )


def test_fresh_run_into_a_folder_with_checkpoints_refuses_before_loading_weights(
    tmp_path, monkeypatch, data_files
):
    import zerosim.training.recipe as train_module

    qa, _ = data_files
    folder = tmp_path / "run"
    _checkpoint(folder, 4, {"global_step": 4, "files": {}})  # complete: a resume could continue it
    (folder / "mlflow_run.json").write_text(json.dumps({"run_id": "a" * 32}))

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the folder was checked")

    monkeypatch.setattr(train_module, "load_causal_lm", no_weights)
    monkeypatch.setattr(train_module, "load_tokenizer", no_weights)
    with pytest.raises(ConfigError) as info:
        train_module.train(
            _cfg(tmp_path, f"data.train={qa}", f"tracking.tracking_uri=sqlite:///{tmp_path / 'm.db'}")
        )
    message = str(info.value)
    assert "checkpoint-4" in message and "a" * 32 in message  # what is there, whose
    assert "resume=true" in message and "run.name" in message and "run.output_dir" in message  # both ways out


def test_a_save_that_died_midway_leaves_one_way_out_not_two(tmp_path):
    """A checkpoint save that died midway (a full disk, a kill: no state file) sent a fresh run to resume=true
    and resume=true back to a fresh run. Now a resume says there is nothing to continue and how, and a fresh
    run moves the incomplete checkpoint aside (the main process; a dry run or another rank moves nothing)."""
    from zerosim.training.checkpoint import resume_point

    folder = tmp_path / "run"
    half = folder / "checkpoint-1"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"x" * 10)
    (folder / "mlflow_run.json").write_text(json.dumps({"run_id": "b" * 32}))
    with pytest.raises(
        FileNotFoundError, match=r"only incomplete checkpoints \(checkpoint-1: .*without resume=true"
    ):
        resume_point(_cfg(tmp_path, "run.resume=true"), folder)
    assert resume_point(_cfg(tmp_path), folder, main=False) == (None, None) and half.is_dir()
    assert resume_point(_cfg(tmp_path), folder) == (None, None)
    assert not half.exists() and (folder / "incomplete-checkpoint-1" / "model.safetensors").is_file()


def test_a_folder_holding_only_final_or_warmstart_is_reused_by_a_fresh_run(tmp_path):
    from zerosim.training.recipe import resume_point

    folder = tmp_path / "run"
    for sub in ("final", "warmstart/final", "critic"):
        (folder / sub).mkdir(parents=True)
    (folder / "mlflow_run.json").write_text(json.dumps({"run_id": "b" * 32}))
    assert resume_point(_cfg(tmp_path), folder) == (None, None)


@pytest.fixture
def finished_run(killed_and_resumed, tmp_path, tiny_model_dir, data_files):
    """A copy of a run folder whose last checkpoint is complete (the before_model case, resumed to the end),
    and the config it ran with (resume=true)."""
    import importlib.util

    algorithm = "grpo"  # one is enough for the binding checks
    workdir, _ = killed_and_resumed(algorithm)
    spec = importlib.util.spec_from_file_location("kill_during_save", HELPER)
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    qa, corpus = data_files
    cfg = helper.config(workdir, algorithm, str(tiny_model_dir), str(qa), str(corpus), "before_model", True)
    folder = tmp_path / "copy" / "run"
    shutil.copytree(workdir / "before_model" / "run", folder)
    cfg.run.output_dir = str(folder.parent)  # a moved folder resumes too
    return folder, cfg


def test_resume_accepts_its_own_run_and_the_fields_a_resume_may_change(finished_run):
    from zerosim.training.recipe import resume_point

    folder, cfg = finished_run
    checkpoint, run_id = resume_point(cfg, folder)
    assert (
        checkpoint == folder / "checkpoint-3"
        and run_id == json.loads((folder / "mlflow_run.json").read_text())["run_id"]
    )
    cfg.trainer.max_steps, cfg.trainer.save_steps, cfg.tracking.experiment = 10, 5, "elsewhere"
    cfg.search.http.read_timeout, cfg.search.simulator.url = (
        600.0,
        "http://other:8001",
    )  # servers moved, slower
    cfg.runtime.threads, cfg.trainer.logging_steps = 1, 2
    assert resume_point(cfg, folder)[0] == checkpoint


def test_resume_refuses_a_store_that_does_not_hold_the_run(finished_run, tmp_path):
    from zerosim.training.recipe import resume_point

    folder, cfg = finished_run
    cfg.tracking.tracking_uri = f"sqlite:///{tmp_path / 'other.db'}"
    with pytest.raises(
        ConfigError, match="is not in sqlite:///.*other.db: resume with the tracking.tracking_uri"
    ):
        resume_point(cfg, folder)


def test_resume_refuses_a_checkpoint_trained_with_another_config(finished_run):
    from zerosim.training.recipe import resume_point

    folder, cfg = finished_run
    cfg.run.seed, cfg.trainer.learning_rate = 1, 0.5
    with pytest.raises(ConfigError) as info:
        resume_point(cfg, folder)
    message = str(info.value)
    assert "run.seed: 0 in the checkpoint, 1 now" in message and "trainer.learning_rate" in message
    assert "run.name" in message  # the way out: a new run elsewhere


def test_resume_continues_a_checkpoint_saved_before_a_setting_existed(finished_run):
    """A release that adds a setting at its default (trainer.gradient_checkpointing) continues runs saved
    before it (the stage keys read such settings the same way); the setting away from its default is a change."""
    import torch

    from zerosim.training.checkpoint import STATE_FILE, config_fingerprint
    from zerosim.training.recipe import resume_point

    folder, cfg = finished_run
    checkpoint = folder / "checkpoint-3"
    state = torch.load(checkpoint / STATE_FILE, weights_only=True)
    older = {k: v for k, v in state["config"].items() if not k.endswith(".gradient_checkpointing")}
    assert len(older) == len(state["config"]) - 2  # the trainer's and the warm start's
    state["config"], state["fingerprint"] = older, config_fingerprint(older)
    torch.save(state, checkpoint / STATE_FILE)
    assert resume_point(cfg, folder)[0] == checkpoint
    cfg.trainer.gradient_checkpointing = True
    with pytest.raises(
        ConfigError, match=r"trainer.gradient_checkpointing: '\(absent\)' in the checkpoint, True now"
    ):
        resume_point(cfg, folder)


def test_resume_refuses_a_checkpoint_of_another_run(finished_run):
    from zerosim.training.recipe import resume_point

    folder, cfg = finished_run
    ours = json.loads((folder / "mlflow_run.json").read_text())["run_id"]
    (folder / "mlflow_run.json").write_text(json.dumps({"run_id": "c" * 32}))  # another run took the folder
    with pytest.raises(ConfigError) as info:
        resume_point(cfg, folder)
    assert ours in str(info.value) and "c" * 32 in str(info.value)


class RunsCode:
    """Unpickling this creates a file: what a hostile checkpoint could do instead."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def test_a_state_file_holding_code_is_refused_not_run(tmp_path):
    from zerosim.training import recipe as train_module

    folder = tmp_path / "run"
    checkpoint = folder / "checkpoint-1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    (folder / "mlflow_run.json").write_text(json.dumps({"run_id": "d" * 32}))
    marker = tmp_path / "code-ran"
    torch.save({"global_step": 1, "schedule": RunsCode(marker)}, checkpoint / "zerosim_state.pt")

    cfg = _cfg(tmp_path, "run.resume=true")
    with pytest.raises(ConfigError, match="refusing to load it"):
        train_module.resume_point(cfg, folder)
    assert not marker.exists()
    with pytest.raises(ConfigError, match="tensors and plain values"):
        train_module.ZerosimState(None, run_id="d" * 32, config={}).load(checkpoint)
    assert not marker.exists()


def _checkpoint(folder: Path, step: int, state: dict | None, files: dict[str, bytes] | None = None) -> Path:
    """A hand-made ``checkpoint-<step>``: trainer_state.json, ``files``, and our state file (``None``: empty)."""
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text("{}")
    for name, data in (files or {}).items():
        (path / name).write_bytes(data)
    if state is None:
        (path / "zerosim_state.pt").write_bytes(b"")
    else:
        torch.save(state, path / "zerosim_state.pt")
    return path


def test_an_unreadable_state_file_falls_back_to_the_checkpoint_before(tmp_path):
    """A machine crash can leave a renamed but empty state file: that checkpoint is skipped, not a crash."""
    from zerosim.training.checkpoint import last_complete_checkpoint

    good = _checkpoint(tmp_path, 1, {"global_step": 1, "files": {"model.bin": 3}}, {"model.bin": b"abc"})
    _checkpoint(tmp_path, 2, None, {"model.bin": b"abc"})
    assert last_complete_checkpoint(tmp_path) == good


def test_rotation_keeps_the_last_complete_checkpoint_when_the_new_one_is_not(tmp_path):
    """save_total_limit=1: a new checkpoint whose listed files are not all there (another rank still writing,
    a short write) does not make the previous one deletable."""
    from zerosim.training.checkpoint import ZerosimState, last_complete_checkpoint

    good = _checkpoint(tmp_path, 1, {"global_step": 1, "files": {"model.bin": 3}}, {"model.bin": b"abc"})
    _checkpoint(tmp_path, 2, {"global_step": 2, "files": {"model.bin": 3}}, {"model.bin": b"ab"})  # short
    ZerosimState(None, run_id="r", config={}, keep=1).rotate(tmp_path, newest=2)
    assert good.is_dir() and last_complete_checkpoint(tmp_path) == good


def test_a_checkpoint_of_an_older_zerosim_is_refused_saying_so(tmp_path):
    from zerosim.training.checkpoint import resume_point

    folder = tmp_path / "run"
    _checkpoint(folder, 1, {"global_step": 1})  # no run id, no config: what earlier versions wrote
    (folder / "mlflow_run.json").write_text(json.dumps({"run_id": "e" * 32}))
    with pytest.raises(ConfigError, match="saved by an older zerosim"):
        resume_point(_cfg(tmp_path, "run.resume=true"), folder)


def test_a_same_size_damaged_checkpoint_is_refused_naming_the_file(finished_run):
    """256 KiB zeroed in the middle of the weights keeps every size: the digests recorded at save refuse it."""
    from zerosim.training.recipe import resume_point

    folder, cfg = finished_run
    weights = folder / "checkpoint-3" / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\0" * min(256 * 1024, size // 4))
    assert weights.stat().st_size == size
    with pytest.raises(ConfigError, match=r"checkpoint-3 is damaged: model.safetensors no longer hold"):
        resume_point(cfg, folder)


def test_a_damaged_newest_checkpoint_names_the_one_before_that_verifies(tmp_path):
    from zerosim.training.checkpoint import _refuse_damaged, file_digest

    blob = {"model.bin": b"abc"}
    first = _checkpoint(tmp_path, 1, {"global_step": 1, "files": {"model.bin": 3}}, blob)
    digest = file_digest(first / "model.bin")
    torch.save({"global_step": 1, "files": {"model.bin": 3}, "digests": {"model.bin": digest}},
               first / "zerosim_state.pt")  # fmt: skip
    newest = _checkpoint(
        tmp_path, 2, {"global_step": 2, "files": {"model.bin": 3}, "digests": {"model.bin": digest}},
        {"model.bin": b"abd"},
    )  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"checkpoint-1 is complete and verifies: move the damaged one aside"
    ):
        _refuse_damaged(tmp_path, newest)
    _refuse_damaged(tmp_path, first)  # an intact newest passes

"""SIGKILL a training run at one phase of a checkpoint save, then resume it — for each phase, one process.

The code under test is unchanged: each kill comes from wrapping, in a forked child, the transformers / torch /
shutil function that phase runs (no hook in zerosim). Imports are paid once: the parent only imports and
forks; each phase runs in a child that is killed, then a second child that resumes with ``resume=true``.

Usage: python tests/helpers/kill_during_save.py WORKDIR ALGORITHM MODEL QA CORPUS PHASE [PHASE ...]
Writes WORKDIR/<phase>/result.json: how the killed child ended, and the resumed run's id, steps and
validation history (or the error it raised). MLflow: sqlite WORKDIR/mlflow.db, one experiment per phase.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import sys
import traceback
from pathlib import Path

import torch
import transformers

from zerosim.core.config import load_config
from zerosim.training.config import TrainConfig
from zerosim.training.recipe import train

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
KILL_AT = 2  # the save of checkpoint-2: checkpoint-1 is complete, step 2 is logged
MAX_STEPS = 3


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def at_kill_step(trainer) -> bool:
    return int(trainer.state.global_step) == KILL_AT


def arm(phase: str) -> None:
    """Wrap the function run at ``phase`` of the save of checkpoint-KILL_AT so that it kills the process."""
    Trainer = transformers.Trainer
    if phase == "before_model":  # nothing of checkpoint-2 written yet
        save = Trainer._save_checkpoint

        def killing_save(self, *args, **kwargs):
            if at_kill_step(self):
                die()
            return save(self, *args, **kwargs)

        Trainer._save_checkpoint = killing_save
    elif phase == "model_optimizer":  # the model files written, the optimizer not
        save = Trainer._save_optimizer_and_scheduler

        def killing_optimizer(self, *args, **kwargs):
            if at_kill_step(self):
                die()
            return save(self, *args, **kwargs)

        Trainer._save_optimizer_and_scheduler = killing_optimizer
    elif phase == "state_file":  # half of zerosim's state file written
        save = torch.save

        def killing_torch_save(obj, f, *args, **kwargs):
            if isinstance(obj, dict) and obj.get("global_step") == KILL_AT:
                buffer = io.BytesIO()
                save(obj, buffer, *args, **kwargs)
                data = buffer.getvalue()
                with open(f, "wb") as out:
                    out.write(data[: len(data) // 2])
                die()
            return save(obj, f, *args, **kwargs)

        torch.save = killing_torch_save
    elif phase == "rotation":  # deleting the older checkpoint: one file gone, then killed
        rmtree = shutil.rmtree

        def killing_rmtree(path, *args, **kwargs):
            path = Path(path)
            if "checkpoint-" in path.name:
                files = sorted(p for p in path.rglob("*") if p.is_file())
                model = [p for p in files if p.name == "model.safetensors"]
                (model or files)[0].unlink()
                die()
            return rmtree(path, *args, **kwargs)

        shutil.rmtree = killing_rmtree
    else:
        raise SystemExit(f"unknown phase {phase}")


def config(workdir: Path, algorithm: str, model: str, qa: str, corpus: str, phase: str, resume: bool):
    return load_config(
        RECIPE,
        [
            f"run.output_dir={workdir / phase}",
            "run.name=run",
            f"run.resume={resume}",
            f"policy.model={model}",
            "search.engine=bm25",
            f"search.bm25.corpus={corpus}",
            f"data.train={qa}",
            f"trainer.algorithm={algorithm}",
            f"trainer.max_steps={MAX_STEPS}",
            "trainer.save_steps=1",
            "trainer.save_total_limit=1",
            "trainer.collapse_patience=0",
            "trainer.per_device_train_batch_size=2",
            "trainer.num_generations=2",
            "rollout.max_new_tokens=6",
            "rollout.max_turns=1",  # an answer, no search: the save is under test, not the rollout
            "rollout.max_completion_tokens=64",
            "curriculum.schedule=adaptive",
            "warmstart.enabled=false",
            "validation.every=1",
            "validation.max_examples=2",
            "validation.batch_size=2",
            f"tracking.tracking_uri=sqlite:///{workdir / 'mlflow.db'}",
            f"tracking.experiment={phase}",
            "tracking.num_sample_trajectories=2",
        ],
        schema=TrainConfig,
    )


def in_child(job) -> int:
    """Run ``job`` in a forked child; its wait status."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            job()
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return os.waitpid(pid, 0)[1]


def run_phase(workdir: Path, algorithm: str, model: str, qa: str, corpus: str, phase: str) -> None:
    out = workdir / phase
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"phase": phase}

    def killed_run():
        arm(phase)
        train(config(workdir, algorithm, model, qa, corpus, phase, resume=False))

    status = in_child(killed_run)
    result["killed_by_sigkill"] = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL

    def resumed_run():
        try:
            done = train(config(workdir, algorithm, model, qa, corpus, phase, resume=True))
            result.update(
                run_id=done.run_id, steps=done.steps, validation_steps=[v["step"] for v in done.validation]
            )
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            (out / "result.json").write_text(json.dumps(result))

    in_child(resumed_run)
    if not (out / "result.json").is_file():
        (out / "result.json").write_text(json.dumps({**result, "error": "the resumed run wrote nothing"}))


if __name__ == "__main__":
    workdir, algorithm, model, qa, corpus, *phases = sys.argv[1:]
    for phase in phases:
        run_phase(Path(workdir), algorithm, model, qa, corpus, phase)

"""``zerosim train --dry-run`` over every recipe, the plan's arithmetic, and the vLLM guard."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerosim.core.config import ConfigError
from zerosim.training.config import load_train_config
from zerosim.training.dry_run import plan
from zerosim.training.recipe import require_vllm, vllm_args

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.fixture
def gpu_machine(monkeypatch):
    """This process as on the machine a GPU recipe is meant for: a CUDA device of 141 GB and vLLM installed
    (without them, trainer.generation=vllm_* is refused: tests/test_vllm_modes.py)."""
    import importlib.machinery
    import sys
    import types

    import torch

    vllm = types.ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: types.SimpleNamespace(name="NVIDIA H200", total_memory=141e9),
    )


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_passes_dry_run(recipe, tmp_path, zerosim_cli, monkeypatch, request):
    monkeypatch.chdir(tmp_path)
    if "generation: vllm" in recipe.read_text():  # a GPU recipe, planned as on its GPU machine
        request.getfixturevalue("gpu_machine")
    out = zerosim_cli(
        "train", "--config", recipe, "--dry-run", "--processes", 8, env={"WORLD_SIZE": None}
    ).stdout
    assert "dry run: nothing loaded" in out and "per step" in out
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "outputs").exists()  # nothing started


def test_plan_batch_arithmetic_and_curriculum(gpu_machine):
    cfg = load_train_config(ROOT / "configs" / "zerosearch-qwen2.5-3b.yaml")
    rows = dict(plan(cfg, processes=8))
    assert rows["per step"] == "320 trajectories = 64 prompts x 5 rollouts"  # the paper's 64 x 5
    assert rows["curriculum"].startswith("exponential (call): p = 0.00@0") and rows["curriculum"].endswith(
        "0.50@203"
    )
    assert "vllm_colocate" in rows["generation"]


def test_dry_run_fails_on_what_would_fail_at_start(tmp_path):
    cfg = load_train_config(None, [f"policy.model={tmp_path / 'missing-checkpoint'}"])
    from zerosim.core.models import ModelError

    with pytest.raises(ModelError, match="does not exist"):
        plan(cfg)
    with pytest.raises(ConfigError, match="must look like http://HOST:PORT"):
        plan(load_train_config(None, ["search.engine=http", "search.http.url=localhost:8000"]))
    with pytest.raises(ConfigError, match="data file .* does not exist"):
        plan(load_train_config(None, [f"data.train={tmp_path / 'nope.jsonl'}"]))


def test_vllm_generation_is_refused_clearly_where_vllm_is_missing():
    import importlib.util

    cfg = load_train_config(None, ["trainer.generation=vllm_server"])
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match="trainer.generation=hf"):
            require_vllm(cfg)
    require_vllm(load_train_config(None, []))  # hf needs nothing
    args = vllm_args(cfg)
    assert args["use_vllm"] and args["vllm_mode"] == "server"
    assert args["generation_kwargs"] == {
        "stop": ["</search>", "</answer>"],
        "include_stop_str_in_output": True,
    }
    assert vllm_args(load_train_config(None, [])) == {}
    with pytest.raises(ConfigError, match="valid values: hf, vllm_colocate, vllm_server"):
        load_train_config(None, ["trainer.generation=vllm"])

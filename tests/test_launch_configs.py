"""Every recipe under every accelerate config passes the consistency check transformers applies when a Trainer
starts under DeepSpeed: the DeepSpeed config is built as `accelerate launch` builds it from the YAML (its own
parser, defaults and environment), then transformers fills its `auto` values from the recipe's training
arguments and refuses any value that contradicts them (e.g. gradient_accumulation_steps 1 against a recipe's 4)."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))
LAUNCH_CONFIGS = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))

pytest.importorskip("deepspeed", reason="bash scripts/install.sh test installs deepspeed (CPU, no ops built)")


def deepspeed_plugin(config_file: Path, monkeypatch):
    """accelerate's DeepSpeedPlugin as a process started by `accelerate launch --config_file X` builds it, or
    None when the config does not use DeepSpeed."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if not args.use_deepspeed:
        return None
    # as accelerate's launch_command does before it starts the DeepSpeed launcher
    fields = list(defaults.deepspeed_config) if defaults else []
    args.deepspeed_fields_from_accelerate_config = ",".join(
        [*fields, *(["mixed_precision"] if mp_from_config else [])]
    )
    _, env = prepare_deepspeed_cmd_env(args)
    for key, value in env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    return DeepSpeedPlugin()


@pytest.mark.parametrize("launch", LAUNCH_CONFIGS, ids=lambda p: p.stem)
def test_every_recipe_agrees_with_the_launch_config(launch, tmp_path, monkeypatch):
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from zerosim.core.config import load_config
    from zerosim.training.config import TrainConfig
    from zerosim.training.recipe import grpo_args

    plugin = deepspeed_plugin(launch, monkeypatch)
    if plugin is None:
        pytest.skip(f"{launch.name} does not use DeepSpeed")
    for recipe in RECIPES:
        cfg = load_config(recipe, [], schema=TrainConfig)
        args = grpo_args(cfg, tmp_path)
        args.bf16 = cfg.trainer.bf16 is not False  # as grpo_args sets it on a GPU machine (this one has none)
        ds = HfTrainerDeepSpeedConfig(dict(plugin.deepspeed_config))
        ds.trainer_config_process(args)
        assert not ds.mismatches, f"{recipe.name} under {launch.name}: {ds.mismatches}"
    assert os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"

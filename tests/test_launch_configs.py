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


def launch_args(config_file: Path):
    """The arguments `accelerate launch --config_file X` runs with, its config's values filled in."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    return _validate_launch_command(args)[0]


def test_seven_gpu_launcher_leaves_the_eighth_gpu_to_the_simulator(monkeypatch):
    """7 ranks on GPUs 0-6 (accelerate sets CUDA_VISIBLE_DEVICES for them), GPU 7 free for `vllm serve`."""
    import accelerate.utils.launch as accelerate_launch
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    launch = ROOT / "configs" / "accelerate" / "zero2-7.yaml"
    args = launch_args(launch)
    assert args.num_processes == 7 and args.num_machines == 1
    assert args.gpu_ids == "0,1,2,3,4,5,6"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args.deepspeed_fields_from_accelerate_config = ""  # as launch_command sets it (deepspeed_plugin above)
    # as on a GPU machine: accelerate names the CUDA variable only where the backend is cuda
    monkeypatch.setattr(accelerate_launch, "get_torch_accelerator_backend", lambda **kw: ("cuda", None))
    _, env = prepare_deepspeed_cmd_env(args)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6"
    assert deepspeed_plugin(launch, monkeypatch).deepspeed_config["zero_optimization"]["stage"] == 2


def test_multi_node_launcher_runs_the_same_command_on_every_node():
    """Two nodes: the `standard` DeepSpeed multinode launcher is torchrun on each node (the command the config
    documents); without it accelerate starts pdsh from node 0 with a hostfile, which this layout has not."""
    args = launch_args(ROOT / "configs" / "accelerate" / "multi-node.yaml")
    assert args.num_machines == 2 and args.num_processes % args.num_machines == 0
    assert args.deepspeed_multinode_launcher == "standard"

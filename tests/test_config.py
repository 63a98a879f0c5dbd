import pytest

from zerosim.core.config import ConfigError, flatten
from zerosim.training.config import TrainConfig, load_train_config


def test_defaults_and_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  max_steps: 7\nsearch:\n  engine: bm25\n")
    cfg = load_train_config(recipe, ["trainer.learning_rate=0.001", "rollout.max_turns=2"])
    assert isinstance(cfg, TrainConfig)
    assert cfg.trainer.max_steps == 7 and cfg.trainer.learning_rate == 0.001
    assert cfg.search.engine == "bm25" and cfg.rollout.max_turns == 2
    assert flatten(cfg)["trainer.max_steps"] == 7


def test_demo_recipe_loads():
    cfg = load_train_config("configs/demo.yaml")
    assert cfg.policy.model == "smollm2" and cfg.search.engine == "simulator"


def test_unknown_key_names_key_and_valid_ones():
    with pytest.raises(ConfigError) as err:
        load_train_config(None, ["trainer.learning_rat=0.1"])
    msg = str(err.value)
    assert "trainer.learning_rat" in msg and "learning_rate" in msg and "max_steps" in msg


def test_unknown_key_in_file_names_file(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("serch:\n  k: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*unknown config key 'serch'.*search"):
        load_train_config(recipe)


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"wrong type for config key 'trainer.max_steps'"):
        load_train_config(None, ["trainer.max_steps=many"])


def test_bad_choice_and_ranges():
    with pytest.raises(ConfigError, match=r"search.engine.*valid values: simulator, bm25"):
        load_train_config(None, ["search.engine=google"])
    with pytest.raises(ConfigError, match="num_generations must be >= 2"):
        load_train_config(None, ["trainer.num_generations=1"])
    with pytest.raises(ConfigError, match="multiple of"):
        load_train_config(None, ["trainer.per_device_train_batch_size=6", "trainer.num_generations=4"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_train_config("nope.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        load_train_config(None, ["trainer.max_steps"])


def test_every_recipe_in_configs_loads():
    from pathlib import Path

    recipes = sorted(Path("configs").glob("*.yaml"))
    assert len(recipes) >= 3
    for recipe in recipes:
        load_train_config(recipe)


def test_override_reaches_a_mapping_key_with_dots():
    """An arm may be named with a dot (the v2 ablation's ``sim-noise-0.3``); the documented
    ``arms.<name>.enabled=false`` must reach it, not split it into ``sim-noise-0`` and ``3``."""
    from zerosim.experiment.config import load_experiment

    preset = "configs/experiments/curriculum-ablation-v2-cpu.yaml"
    pairs = "report.pairs=[sim-curriculum:sim-fixed-matched]"  # the preset pairs the arm; drop that pair
    cfg = load_experiment(preset, ["arms.sim-noise-0.3.enabled=false", pairs])
    assert cfg.arms["sim-noise-0.3"].enabled is False and cfg.arms["sim-noise-0"].enabled is True
    assert "sim-noise-0.3" not in cfg.enabled_arms()
    # the bracketed form still works, and a key the config does not hold is still refused by name
    cfg = load_experiment(preset, ["arms[sim-noise-0.3].enabled=false", pairs])
    assert cfg.arms["sim-noise-0.3"].enabled is False
    with pytest.raises(ConfigError, match=r"unknown config key 'arms.sim-noise-0.3.enabld'"):
        load_experiment(preset, ["arms.sim-noise-0.3.enabld=false"])

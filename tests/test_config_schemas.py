"""Config schemas beside their jobs (issue 17, item 3): choices are StrEnums that read as the same strings
everywhere, validated wherever the schema is nested; ranges live on the fields."""

from __future__ import annotations

import dataclasses
import json

import pytest

from zerosim.core.config import ConfigError, flatten, load_config, to_yaml
from zerosim.engines import SearchConfig
from zerosim.job_config import EvalConfig
from zerosim.training.config import load_train_config


def test_a_choice_is_checked_wherever_its_schema_is_nested():
    # warmstart.search is a SearchConfig like search: its engine is a choice there too (it was not checked)
    with pytest.raises(ConfigError) as err:
        load_train_config(None, ["warmstart.search.engine=google"])
    assert str(err.value) == (
        "config key 'warmstart.search.engine' is 'google'; valid values: simulator, bm25, dense, hybrid, http, web, "
        "mixed (set by override 'warmstart.search.engine=google')"
    )
    with pytest.raises(
        ConfigError, match=r"'search.dense.faiss_type' is 'ivf'; valid values: flat, hnsw, ivfpq"
    ):
        load_config(None, ["search.dense.faiss_type=ivf"], schema=EvalConfig)


def test_a_bad_choice_in_a_recipe_names_the_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  algorithm: sac\n")
    with pytest.raises(
        ConfigError,
        match=r"'trainer.algorithm' is 'sac'; valid values: grpo, dr_grpo, .* \(set in .*r\.yaml\)",
    ):
        load_train_config(recipe)


def test_a_choice_reads_as_its_string_everywhere():
    cfg = load_train_config(None, ["search.engine=bm25", "reward.metric=f1"])
    engine = cfg.search.engine
    assert (
        engine == "bm25" and f"{engine}" == "bm25" and str(engine) == "bm25" and engine in ("bm25", "dense")
    )
    assert json.dumps({"engine": engine}) == '{"engine": "bm25"}'
    assert {"bm25": 1}[engine] == 1
    assert flatten(cfg)["search.engine"] == "bm25" and str(flatten(cfg)["reward.metric"]) == "f1"
    assert "  engine: bm25\n" in to_yaml(cfg) and "  metric: f1\n" in to_yaml(cfg)
    assert load_train_config(None, ["search.engine=bm25"]) == load_train_config(
        None, ["search.engine='bm25'"]
    )


def test_a_numeric_range_lives_on_its_field():
    k = {f.name: f for f in dataclasses.fields(SearchConfig)}["k"]
    assert k.metadata["range"] == ">=1"
    with pytest.raises(ConfigError, match=r"search\.k must be >= 1, got 0: set e\.g\. search\.k=3"):
        load_train_config(None, ["search.k=0"])

"""One preflight per engine (``zerosim.engines.ENGINES``), run by ``zerosim train --dry-run`` and by the build."""

from __future__ import annotations

import pytest

from zerosim.core.config import ConfigError
from zerosim.engines import ENGINES, EngineName, build_search_engine
from zerosim.training.config import load_train_config
from zerosim.training.dry_run import plan


def test_every_engine_has_a_preflight_and_a_builder():
    assert set(ENGINES) == set(EngineName)


REAL = ["bm25", "dense", "hybrid", "http", "web"]


def test_the_engine_choices_are_derived_from_engine_name():
    """``EngineName`` is the one list of engines: a new retriever among its real ones is a choice of
    ``validation.engine`` and ``search.mixed.real``; a new index kind is one ``zerosim index build`` writes and an
    experiment report fingerprints. Each assertion names where a new engine would be missing."""
    from curricula.config import RealEngine
    from eval.index import KINDS
    from zerosim.core.engine_names import EngineName as Source
    from zerosim.training.config import ValidationEngine

    assert EngineName is Source  # zerosim.engines re-exports the foundation's enum
    real = [e.value for e in EngineName if e.real]
    assert real == REAL, "EngineName.real"
    assert [e.value for e in ValidationEngine] == ["train", "simulator", *real], "validation.engine"
    assert [e.name for e in ValidationEngine] == [e.value for e in ValidationEngine]
    assert [e.value for e in RealEngine] == real, "search.mixed.real"
    assert list(KINDS) == [e.value for e in EngineName if e.index_kind] == ["bm25", "dense"], (
        "eval.index.KINDS"
    )
    indexed = [e.value for e in EngineName if e.indexed]
    assert indexed == [*KINDS, "hybrid"], "EngineName.indexed: the index kinds and hybrid, which fuses them"
    assert set(indexed) <= set(real) and {e.value for e in EngineName if e.simulated} == {
        "simulator",
        "mixed",
    }


@pytest.mark.parametrize(
    ("override", "valid"),
    [
        ("validation.engine=mixed", "train, simulator, bm25, dense, hybrid, http, web"),
        ("search.mixed.real=simulator", "bm25, dense, hybrid, http, web"),
    ],
)
def test_a_derived_engine_choice_refuses_as_before(override, valid):
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError) as refused:
        load_train_config(None, [override])
    assert str(refused.value) == (
        f"config key '{key}' is '{value}'; valid values: {valid} (set by override '{override}')"
    )


def test_a_derived_engine_choice_reads_as_its_string():
    cfg = load_train_config(
        None, ["validation.engine=hybrid", "search.engine=mixed", "search.mixed.real=http"]
    )
    assert cfg.validation.engine == "hybrid" and str(cfg.validation.engine) == "hybrid"
    assert type(cfg.validation.engine).__name__ == "ValidationEngine"
    assert cfg.search.mixed.real == "http" and f"{cfg.search.mixed.real}" == "http"


BAD = [
    pytest.param(["search.engine=bm25", "search.bm25.corpus={tmp}/nope.jsonl"], id="bm25-missing-corpus"),
    pytest.param(["search.engine=dense", "search.dense.index_dir={tmp}/nope"], id="dense-missing-index"),
    pytest.param(["search.engine=http", "search.http.url=localhost:8000"], id="http-malformed-url"),
    pytest.param(
        ["search.engine=mixed", "search.mixed.real=http", "search.http.url=nope"], id="mixed-real-part-url"
    ),
    pytest.param(["search.engine=hybrid", "search.rerank.model={tmp}/no-model"], id="missing-reranker"),
    pytest.param(["search.simulator.prompts_file={tmp}/nope.yaml"], id="simulator-missing-prompts"),
]


@pytest.mark.parametrize("overrides", BAD)
def test_a_bad_engine_config_fails_alike_in_the_dry_run_and_the_build(overrides, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_train_config(None, [o.format(tmp=tmp_path) for o in overrides])
    with pytest.raises(ConfigError) as dry:
        plan(cfg, processes=1)
    with pytest.raises(ConfigError) as built:
        build_search_engine(cfg.search, total_steps=cfg.trainer.max_steps)
    assert str(dry.value) == str(built.value)

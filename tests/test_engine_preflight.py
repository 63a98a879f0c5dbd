"""One preflight per engine (``zerosim.engines.ENGINES``), run by ``zerosim train --dry-run`` and by the build."""

from __future__ import annotations

import pytest

from zerosim.core.config import ConfigError
from zerosim.engines import ENGINES, EngineName, build_search_engine
from zerosim.training.config import load_train_config
from zerosim.training.dry_run import plan


def test_every_engine_has_a_preflight_and_a_builder():
    assert set(ENGINES) == set(EngineName)


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

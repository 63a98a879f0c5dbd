"""search.engine=web against loopback stubs replaying each provider's documented answers (no network here)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from web_stub import WebStub

from eval.web import PROVIDERS, WebAuthError, WebQuotaError
from zerosim.core.config import ConfigError
from zerosim.core.search import NO_RESULTS, SearchError, SearchRequest
from zerosim.engines import build_search_engine, check_noise_config, preflight
from zerosim.training.config import load_train_config

KEY = "zsk-test-0123456789abcdef-SECRET"
ROOT = Path(__file__).resolve().parents[1]
NAMES = list(PROVIDERS)


def web_config(provider: str, stub: WebStub, tmp_path, *extra: str):
    return load_train_config(
        None,
        [
            "search.engine=web",
            f"search.web.provider={provider}",
            f"search.web.endpoint={stub.url}",
            f"search.web.cache_path={tmp_path}/web-cache.sqlite",
            "search.web.backoff=0",
            "search.web.requests_per_second=null",
            *extra,
        ],
    )


@pytest.fixture
def keyed(monkeypatch):
    for provider in PROVIDERS.values():
        monkeypatch.setenv(provider.key_env, KEY)


def _engine(provider, stub, tmp_path, *extra):
    return build_search_engine(web_config(provider, stub, tmp_path, *extra).search, seed=0)


@pytest.mark.parametrize("provider", NAMES)
def test_each_provider_maps_to_the_same_documents_k_clipped(provider, keyed, tmp_path):
    with WebStub(provider, KEY) as stub:
        engine = _engine(provider, stub, tmp_path)
        [docs] = engine.search([SearchRequest(query="capital of France")], 3)
        [few] = engine.search([SearchRequest(query="few-results please")], 3)
        engine.close()
    assert [d.title for d in docs] == [f"Result {i} about the query" for i in (1, 2, 3)]
    assert docs[0].text == "Snippet 1: a page that mentions Paris, the capital of France."  # <strong> gone
    assert len({d.id for d in docs}) == 3 and all(d.id.startswith("web-") for d in docs)
    assert stub.seen[0]["n"] == 3 and stub.seen[0]["query"] == "capital of France"
    assert len(few) == 2  # fewer than k is what the web had


@pytest.mark.parametrize("provider", NAMES)
def test_an_empty_result_is_an_answer_counted_not_an_error(provider, keyed, tmp_path):
    with WebStub(provider, KEY) as stub:
        engine = _engine(provider, stub, tmp_path)
        assert engine.search([SearchRequest(query="nothing-at-all here")], 3) == [[]]
        assert engine.stats["empty"] == 1 and engine.stats["requests"] == 1
        engine.close()


@pytest.mark.parametrize("provider", NAMES)
def test_a_malformed_body_fails_in_one_line_naming_the_provider(provider, keyed, tmp_path):
    with WebStub(provider, KEY, mode="malformed") as stub:
        engine = _engine(provider, stub, tmp_path, "search.web.retries=2")
        with pytest.raises(SearchError) as failed:
            engine.search([SearchRequest(query="q")], 3)
        engine.close()
    message = str(failed.value)
    assert "\n" not in message and PROVIDERS[provider].label in message and "cannot read" in message
    assert stub.hits == 2  # retried, then stopped


@pytest.mark.parametrize("provider", NAMES)
def test_a_rejected_key_stops_at_once_naming_the_provider_and_the_variable(provider, monkeypatch, tmp_path):
    env = PROVIDERS[provider].key_env
    monkeypatch.setenv(env, "zsk-wrong-key-7777")
    with WebStub(provider, KEY) as stub:
        engine = _engine(provider, stub, tmp_path)
        with pytest.raises(WebAuthError) as refused:
            engine.search([SearchRequest(query="q")], 3)
        engine.close()
    message = str(refused.value)
    assert PROVIDERS[provider].label in message and f"${env}" in message
    assert "zsk-wrong-key-7777" not in message and stub.hits == 1


@pytest.mark.parametrize("provider", NAMES)
def test_a_used_up_quota_stops_naming_the_quota(provider, keyed, tmp_path):
    with WebStub(provider, KEY, mode="quota") as stub:
        engine = _engine(provider, stub, tmp_path)
        with pytest.raises(WebQuotaError, match="quota is used up.*search.web.fallback"):
            engine.search([SearchRequest(query="q")], 3)
        engine.close()
    assert stub.hits == 1


def test_a_used_up_quota_hands_the_rest_of_the_run_to_the_fallback(keyed, tmp_path):
    with WebStub("serper", KEY, mode="quota") as stub:
        engine = _engine("serper", stub, tmp_path, "search.web.fallback=bm25")
        first = engine.search([SearchRequest(query="capital of Peru")], 3)
        later = engine.search([SearchRequest(query="capital of Chile"), SearchRequest(query="Lima")], 3)
        web = engine  # not reranked
        assert web.stats["fallback"] == 3 and web.stats["requests"] == 0
        engine.close()
    assert stub.hits == 1  # the web is not asked again once its quota is gone
    assert len(first[0]) == 3 and all(len(d) == 3 for d in later)


def test_429_waits_its_retry_after_and_a_longer_ask_is_refused(keyed, tmp_path):
    with WebStub("serper", KEY, mode="rate_limited") as stub:
        engine = _engine("serper", stub, tmp_path, "search.web.max_retry_after=0.5")
        with pytest.raises(SearchError, match=r"wait 1s .*max_retry_after=0.5s"):
            engine.search([SearchRequest(query="q")], 3)
        assert stub.hits == 1
        engine.close()
        engine = _engine("serper", stub, tmp_path, "search.web.retries=2")
        started = time.monotonic()
        with pytest.raises(SearchError, match="after 2 attempts: HTTP 429"):
            engine.search([SearchRequest(query="q")], 3)
        assert time.monotonic() - started >= 1.0  # Retry-After: 1 was waited before the second attempt
        assert stub.hits == 3
        engine.close()


def test_a_slow_provider_is_cut_off_by_the_deadline(keyed, tmp_path):
    with WebStub("tavily", KEY) as stub:
        stub.delay = 2.0
        engine = _engine(
            "tavily",
            stub,
            tmp_path,
            "search.web.retries=1",
            "search.web.read_timeout=0.3",
            "search.web.connect_timeout=0.3",
        )
        with pytest.raises(SearchError, match=r"web search \(Tavily\).*read_timeout=0.3s"):
            engine.search([SearchRequest(query="q")], 3)
        engine.close()


def test_a_replay_through_the_cache_asks_the_web_nothing_and_the_ledger_prices_it(keyed, tmp_path):
    queries = [SearchRequest(query=q) for q in ("a", "b", "nothing-at-all")]
    with WebStub("brave", KEY) as stub:
        engine = _engine("brave", stub, tmp_path, "search.web.price_per_1k=2")
        first = engine.search(queries, 3)
        assert stub.hits == 3
        assert engine.ledger() | {"cache_hits": 0} == {
            "provider": "Brave Search",
            "requests": 3,
            "cache_hits": 0,
            "empty": 1,
            "fallback": 0,
            "cost_usd": pytest.approx(0.006),
            "price_per_1k": 2.0,
            "price_source": "search.web.price_per_1k",
        }
        engine.close()
        again = _engine("brave", stub, tmp_path)  # a new process's engine over the same cache file
        assert again.search(queries, 3) == first and stub.hits == 3
        assert again.stats["requests"] == 0 and again.stats["cache_hits"] == 3
        again.close()


@pytest.mark.parametrize("mode", ["hard", "random"])
def test_noisy_slots_are_other_web_results_never_a_gold_answer(mode, keyed, tmp_path):
    with WebStub("serper", KEY) as stub:
        engine = _engine("serper", stub, tmp_path, f"search.negatives={mode}", "search.negatives_depth=8")
        engine.search([SearchRequest(query="an earlier query")], 3)  # the pool random negatives draw from
        noisy = SearchRequest(query="capital of France", answers=("Paris",), noise=(False, True, True))
        [docs] = engine.search([noisy], 3)
        engine.close()
    assert [d.noisy for d in docs] == [False, True, True]
    assert "Paris" in docs[0].text and not any("Paris" in d.contents for d in docs[1:])
    assert stub.seen[-1]["n"] == 8  # asked deeper than k for the noisy slots


def test_a_curriculum_over_web_without_negatives_is_refused_at_start():
    cfg = load_train_config(None, ["search.engine=web", "search.negatives=none", "curriculum.p_end=0.5"])
    with pytest.raises(ConfigError, match="search.negatives=none leaves the web"):
        check_noise_config(cfg.search, cfg.curriculum)


def test_the_key_variable_is_checked_and_a_pasted_key_is_not_repeated(monkeypatch):
    with pytest.raises(ConfigError) as pasted:
        load_train_config(None, ["search.engine=web", "search.web.api_key_env=a1b2c3d4e5f6secretvalue"])
    assert "a1b2c3d4e5f6secretvalue" not in str(pasted.value) and "environment variable" in str(pasted.value)
    monkeypatch.delenv("SERPER_API_KEY", raising=False)
    cfg = load_train_config(None, ["search.engine=web"])
    with pytest.raises(ConfigError, match=r"SERPER_API_KEY is not set.*search.web.api_key_env"):
        preflight(cfg.search)


def test_an_http_web_proxy_may_answer_empty_when_told(tmp_path):
    from zerosim.core.http.client import _parse_result
    from zerosim.core.http.retry import Retryable

    with pytest.raises(Retryable, match="an empty result is not an answer"):
        _parse_result({"result": [[]]}, 1, 3)
    assert _parse_result({"result": [[]]}, 1, 3, empty_is_answer=True) == [[]]
    cfg = load_train_config(None, ["search.engine=http", "search.http.empty_is_answer=true"])
    assert cfg.search.http.empty_is_answer is True


class _Empty:
    """An engine that finds nothing; ``empty_is_answer`` as given."""

    def __init__(self, empty_is_answer):
        self.empty_is_answer = empty_is_answer

    def search(self, requests, k):
        return [[] for _ in requests]


class _SearchThenAnswer:
    """Searches on its first turn, answers on its second."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def generate(self, prompts, max_new_tokens):
        from zerosim.core.generation import Generation

        text = "<search>nothing-at-all</search>" if self.calls == 0 else "<answer>x</answer>"
        self.calls += 1
        tok = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [Generation(tok, [-0.5] * len(tok), "stop") for _ in prompts]


@pytest.mark.parametrize("answer", [True, False])
def test_the_policy_reads_no_results_only_from_an_engine_whose_empty_is_an_answer(tokenizer, answer):
    from zerosim.agent.rollout import RolloutConfig, SearchRollout, build_prompt

    question = "What is the capital of Peru?"
    examples = {build_prompt(question): (question, ("Lima",))}
    rollout = SearchRollout(
        tokenizer,
        _Empty(answer),
        config=RolloutConfig(max_turns=2, max_new_tokens=32, max_completion_tokens=300),
        k=3,
        examples=examples,
    )
    if not answer:
        with pytest.raises(SearchError, match="returned no documents"):
            rollout.run(_SearchThenAnswer(tokenizer), list(examples), step=0)
        return
    [traj], _ = rollout.run(_SearchThenAnswer(tokenizer), list(examples), step=0)
    assert traj.searches == 1 and NO_RESULTS in tokenizer.decode(traj.completion_ids)


def _scan(root, needle: str) -> list[str]:
    """Every file under ``root`` whose bytes hold ``needle``."""
    return [str(p) for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


def test_eval_and_collect_over_web_run_end_to_end_and_the_key_is_written_nowhere(
    keyed, tmp_path, tiny_model_dir, monkeypatch
):
    from typer.testing import CliRunner

    from zerosim.cli import app

    monkeypatch.setenv("ZEROSIM_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "questions.jsonl"
    rows = [
        {"id": "q1", "question": "What is the capital of France?", "golden_answers": ["Paris"]},
        {"id": "q2", "question": "Which mountains are the highest?", "golden_answers": ["Himalaya"]},
        {"id": "q3", "question": "nothing-at-all is known of this?", "golden_answers": ["none"]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runner = CliRunner()
    with WebStub("serper", KEY) as stub:
        common = [f"search.web.endpoint={stub.url}", "search.web.requests_per_second=null"]
        evaluated = runner.invoke(
            app,
            [
                "eval",
                "--policy",
                str(tiny_model_dir),
                "--dataset",
                str(data),
                "--search",
                "web",
                "--method",
                "rag",
                *common,
                f"output_dir={tmp_path}/eval",
                f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
                "max_answer_tokens=8",
            ],
        )
        assert evaluated.exit_code == 0, evaluated.output
        asked = stub.hits
        collected = runner.invoke(
            app,
            [
                "simulator",
                "collect",
                "--search",
                "web",
                "--data",
                str(data),
                "--queries",
                "question",
                "--label",
                "contains",
                "--out",
                f"{tmp_path}/sft.jsonl",
                *common,
                "depth=3",
            ],
        )
        assert collected.exit_code == 0, collected.output
    assert asked == 3  # each question once
    assert stub.hits == 3  # collect at depth 3 asked the same (provider, query, 3): all from the cache
    assert "web search: Serper (Google), 3 requests" in evaluated.output  # the ledger under the table
    assert (tmp_path / "sft.jsonl").is_file()
    assert KEY not in evaluated.output + collected.output
    assert _scan(tmp_path, KEY) == []


def test_a_dry_run_with_a_web_arm_prints_its_most_queries_and_their_cost(
    zerosim_cli, keyed, tmp_path, monkeypatch
):
    monkeypatch.chdir(ROOT)
    out = zerosim_cli(
        "experiment", "--config", "configs/experiments/sim-vs-real-smoke.yaml", "--dry-run",
        f"output_dir={tmp_path}", "arms.web.overrides=[search.engine=web,search.web.price_per_1k=2.5,curriculum.p_start=0.0,curriculum.p_end=0.0]",
    ).output  # fmt: skip
    from zerosim.experiment.config import load_experiment
    from zerosim.training.config import load_train_config

    cfg = load_experiment(ROOT / "configs/experiments/sim-vs-real-smoke.yaml", [])
    t = load_train_config(ROOT / cfg.base, cfg.overrides).trainer
    r = load_train_config(ROOT / cfg.base, cfg.overrides).rollout
    most = t.max_steps * t.per_device_train_batch_size * t.gradient_accumulation_steps * r.max_turns
    assert f"train-web-s0: at most {most:,} queries to Serper (Google), est. ${most * 2.5 / 1000:,.2f}" in out
    assert "web search: at most" in out


def test_the_report_prints_the_ledger_and_what_the_searches_would_have_cost(tmp_path):
    from eval.config import WebConfig
    from zerosim.experiment.kinds import Kind, Stage
    from zerosim.experiment.report import _cost_markdown, search_costs
    from zerosim.training.recipe import read_search_ledger

    run = tmp_path / "run"
    run.mkdir()
    web = {"provider": "Serper (Google)", "requests": 40, "cache_hits": 10, "empty": 1, "fallback": 0,
           "cost_usd": 0.04, "price_per_1k": 1.0, "price_source": "2026-12"}  # fmt: skip
    for rank, searches in ((0, 30), (1, 20)):  # two ranks of one training run
        (run / f"search_ledger.rank{rank}.json").write_text(json.dumps({"searches": searches, "web": [web]}))
    assert read_search_ledger(run) == {"searches": 50, "web": [{**web, "requests": 80, "cache_hits": 20,
                                       "empty": 2, "cost_usd": pytest.approx(0.08)}]}  # fmt: skip
    stages = [
        Stage("train-google-s0", Kind.train, None, [], meta={"arm": "google", "seed": 0}),
        Stage("train-sim-s0", Kind.train, None, [], meta={"arm": "sim", "seed": 0}),
        Stage("eval-google-s0-web", Kind.eval, None, [], meta={"arm": "google", "seed": 0}),
    ]
    outputs = {
        "train-google-s0": {"search_ledger": read_search_ledger(run)},
        "train-sim-s0": {"search_ledger": {"searches": 4000, "web": []}},
        "eval-google-s0-web": {"search_ledger": {"web": [web]}},
    }
    costs = search_costs(stages, outputs, WebConfig(price_per_1k=2.0))
    by_arm = {r["arm"]: r for r in costs["arms"]}
    assert by_arm["sim"]["searches"] == 4000 and by_arm["sim"]["searches_at_web_price_usd"] == pytest.approx(
        8.0
    )
    assert by_arm["google"]["web_requests"] == 120 and by_arm["google"]["web_cost_usd"] == pytest.approx(0.12)
    md = "\n".join(_cost_markdown(costs))
    assert "| sim | 1 | 4000 | 0 | 0 | $0.00 | $8.00 |" in md and "what the simulator saved" in md


def test_mixed_search_routes_its_real_part_to_the_web(keyed, tmp_path, tiny_model_dir):
    with WebStub("tavily", KEY) as stub:
        cfg = web_config(
            "tavily", stub, tmp_path, "search.engine=mixed", "search.mixed.real=web",
            f"search.simulator.model={tiny_model_dir}",
        )  # fmt: skip
        engine = build_search_engine(cfg.search, seed=0)
        [docs] = engine.search([SearchRequest(query="capital of France", source="real")], 3)
        engine.close()
    assert stub.hits == 1 and docs[0].title == "Result 1 about the query"


def test_training_over_web_logs_its_ledger_and_writes_the_key_nowhere(
    keyed, tmp_path, tiny_model_dir, capitals, mlflow_db, zerosim_cli, monkeypatch
):
    """`zerosim train` with search.engine=web (validation over the web too): the run's config, params, logs and
    files hold the variable's name, never the key; each rank's search ledger lands beside the result."""
    import mlflow

    monkeypatch.setenv("ZEROSIM_HOME", str(tmp_path / "home"))
    qa, _ = capitals(4)
    with WebStub("serper", KEY) as stub:
        out = zerosim_cli(
            "train", "--config", str(ROOT / "configs" / "demo.yaml"), f"run.output_dir={tmp_path / 'out'}",
            "run.name=web", f"policy.model={tiny_model_dir}", "search.engine=web", f"search.web.endpoint={stub.url}",
            "search.web.requests_per_second=null", f"data.train={qa}", "trainer.max_steps=1",
            "trainer.per_device_train_batch_size=4", "trainer.num_generations=2", "rollout.max_new_tokens=8",
            "rollout.max_turns=2", f"tracking.tracking_uri={mlflow_db}", "tracking.experiment=web",
            "warmstart.enabled=false", "curriculum.p_start=0.0", "curriculum.p_end=0.0", "validation.every=1",
            "validation.engine=web", "validation.max_examples=2", "validation.batch_size=2",
        ).output  # fmt: skip
    mlflow.set_tracking_uri(mlflow_db)
    (run,) = mlflow.search_runs(experiment_names=["web"], output_format="list")
    assert run.info.status == "FINISHED" and run.data.params["search.web.api_key_env"] == "None"
    assert "search/web/requests" in run.data.metrics and "search/web/cost_usd" in run.data.metrics
    ledger = json.loads((tmp_path / "out" / "web" / "search_ledger.rank0.json").read_text())
    assert ledger["web"][0]["provider"] == "Serper (Google)" and ledger["web"][0]["requests"] == stub.hits
    assert KEY not in out and _scan(tmp_path, KEY) == []

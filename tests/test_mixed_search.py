"""Mixed search (``search.engine=mixed``): the per-search source draw, the routing engine, the rollout's
per-source record and metrics, the config, the plan, and one real training step."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from curricula import search_source, trajectory_noise
from curricula.config import CurriculumConfig
from curricula.mixed import MixedSearchEngine, find_mixed, share_schedule
from zerosim.agent.rollout import SearchRollout, build_prompt, engine_counters
from zerosim.core.config import ConfigError
from zerosim.core.generation import Generation
from zerosim.core.metrics import exact_match, f1_score
from zerosim.core.search import Document, SearchRequest
from zerosim.training.config import load_train_config

ROOT = Path(__file__).resolve().parents[1]


# -- the draw ---------------------------------------------------------------------------------------------


def _draws(share, seed=0, step=0, n=2000):
    return [
        search_source(seed=seed, step=step, trajectory=t, search=s, real_share=share)
        for t in range(n // 4)
        for s in range(4)
    ]


def test_source_draw_is_a_reproducible_pure_function_with_the_asked_share():
    assert _draws(0.3) == _draws(0.3)  # same arguments, same sources
    assert set(_draws(0.0)) == {"sim"} and set(_draws(1.0)) == {"real"}
    for share in (0.1, 0.3, 0.7):
        draws = _draws(share, n=4000)
        assert abs(draws.count("real") / len(draws) - share) < 0.03, share
    # another seed or step draws afresh
    assert _draws(0.5) != _draws(0.5, seed=1) and _draws(0.5) != _draws(0.5, step=1)
    with pytest.raises(ValueError, match=r"real_share must be in \[0, 1\]"):
        search_source(seed=0, step=0, trajectory=0, search=0, real_share=1.5)


def test_source_draw_is_independent_of_the_noise_draw():
    pairs = [
        (
            search_source(seed=7, step=3, trajectory=t, search=s, real_share=0.5),
            trajectory_noise(seed=7, step=3, trajectory=t, search=s, k=1, p=0.5)[0],
        )
        for t in range(1000)
        for s in range(4)
    ]
    # with one shared stream, "real" would be exactly the noisy draws (both compare one uniform with 0.5)
    for source in ("real", "sim"):
        for noisy in (True, False):
            share = sum(p == (source, noisy) for p in pairs) / len(pairs)
            assert abs(share - 0.25) < 0.03, (source, noisy, share)


def test_share_schedule_moves_from_real_share_to_real_share_end():
    constant = share_schedule(0.3, None, "linear", 10)
    assert [constant.probability(i) for i in (0, 5, 10, 50)] == [0.3] * 4
    falling = share_schedule(0.5, 0.1, "linear", 10)
    assert falling.probability(0) == pytest.approx(0.5)
    assert falling.probability(5) == pytest.approx(0.3)
    assert falling.probability(10) == pytest.approx(0.1) and falling.probability(99) == pytest.approx(0.1)
    rising = share_schedule(0.0, 1.0, "cosine", 4)
    assert [round(rising.probability(i), 3) for i in range(5)] == [0.0, 0.146, 0.5, 0.854, 1.0]
    engine = MixedSearchEngine(Recorder("sim"), Recorder("real"), share=falling)
    assert engine.real_share(5) == pytest.approx(0.3)


# -- the engine -------------------------------------------------------------------------------------------


class Recorder:
    """An engine that records its calls and answers with documents naming itself and the query."""

    def __init__(self, name):
        self.name = name
        self.calls: list[list[SearchRequest]] = []
        self.closed = False
        self.stats = {"calls": 0}

    def search(self, requests, k):
        self.calls.append(list(requests))
        self.stats["calls"] += 1
        return [
            [
                Document(f"{self.name}:{r.query}:{i}", "t", f"{self.name} text", noisy=r.noise_for(k)[i])
                for i in range(k)
            ]
            for r in requests
        ]

    def close(self):
        self.closed = True


class FakeSim(Recorder):
    metrics_name = "fakesim"


class FakeReal(Recorder):
    metrics_name = "fakereal"


def test_mixed_engine_routes_by_source_in_order_one_call_per_part():
    sim, real = FakeSim("sim"), FakeReal("real")
    engine = MixedSearchEngine(sim, real, share=0.5)
    sources = ["real", "sim", "sim", "real", "sim"]
    requests = [
        SearchRequest(f"q{i}", question="Q", answers=("A",), noise=(i % 2 == 0,) * 2, source=s)
        for i, s in enumerate(sources)
    ]
    results = engine.search(requests, 2)
    assert [docs[0].id for docs in results] == [f"{s}:q{i}:0" for i, s in enumerate(sources)]
    assert [[d.noisy for d in docs] for docs in results] == [[i % 2 == 0] * 2 for i in range(5)]
    # each part called once, with its requests in order, the source taken off and the rest kept
    assert [[r.query for r in call] for call in sim.calls] == [["q1", "q2", "q4"]]
    assert [[r.query for r in call] for call in real.calls] == [["q0", "q3"]]
    assert all(r.source is None and r.answers == ("A",) for r in sim.calls[0] + real.calls[0])
    assert engine.stats == {"sim_searches": 3, "real_searches": 2}
    # one-source calls and empty calls still reach each part exactly once (lockstep ranks call both)
    engine.search([SearchRequest("x", source="sim")], 2)
    assert engine.search([], 2) == []
    assert [len(c) for c in sim.calls] == [3, 1, 0] and [len(c) for c in real.calls] == [2, 0, 0]
    counters = engine_counters(engine)
    assert counters["search/mixed/sim_searches"] == 4 and counters["search/mixed/real_searches"] == 2
    assert counters["search/fakesim/calls"] == 3 and counters["search/fakereal/calls"] == 3
    with pytest.raises(ValueError, match="routes 'sim' or 'real'"):
        engine.search([SearchRequest("x", source="bm25")], 2)
    engine.close()
    assert sim.closed and real.closed


def test_requests_without_source_are_drawn_reproducibly_by_the_engine():
    def routes(share):
        engine = MixedSearchEngine(FakeSim("sim"), FakeReal("real"), share=share, seed=3)
        out = []
        for batch in range(5):
            results = engine.search([SearchRequest(f"q{batch}-{i}") for i in range(40)], 1)
            out += [docs[0].id.split(":")[0] for docs in results]
        return out

    assert routes(0.4) == routes(0.4)
    assert set(routes(0.0)) == {"sim"} and set(routes(1.0)) == {"real"}
    assert 0.3 < routes(0.4).count("real") / 200 < 0.5


def test_build_search_engine_mixed_parts_noise_check_and_real_ids(tmp_path, monkeypatch, tiny_model_dir):
    from eval.config import BM25Config
    from simulators.config import SimulatorConfig
    from zerosim.engines import SearchConfig, build_search_engine, check_noise_config

    monkeypatch.setenv("ZEROSIM_HOME", str(tmp_path / "home"))  # the bm25 index is built there
    corpus = tmp_path / "corpus.jsonl"
    rows = [("p0", "Peru\nThe capital of Peru is Lima.")] + [
        (f"c{i}", f"Chile\nChile fact {i} about copper mines.") for i in range(12)
    ]
    corpus.write_text("".join(json.dumps({"id": i, "contents": c}) + "\n" for i, c in rows))
    cfg = SearchConfig(
        engine="mixed",
        bm25=BM25Config(corpus=str(corpus)),
        simulator=SimulatorConfig(
            model=str(tiny_model_dir), max_new_tokens=8, on_short="fill", on_leak="keep"
        ),
    )
    engine = build_search_engine(cfg, seed=0, noise=True)
    assert isinstance(engine, MixedSearchEngine) and find_mixed(engine) is engine
    assert type(engine.real).__name__ == "CorpusNegatives"  # honours the curriculum's noise
    assert type(engine.simulator).__name__ == "LLMSimulator"
    real = SearchRequest("capital of Peru", question="capital?", answers=("Lima",), source="real")
    sim = SearchRequest("capital of Peru", question="capital?", answers=("Lima",), source="sim")
    plain = engine.real.retriever.search([SearchRequest("capital of Peru")], 2)[0]
    got_real, got_sim = engine.search([real, sim], 2)
    assert [d.id for d in got_real] == [d.id for d in plain]  # the real part's own document ids
    assert {d.id for d in got_sim}.isdisjoint({r[0] for r in rows})  # written by the simulator
    noisy = engine.search(
        [SearchRequest("capital of Peru", answers=("Lima",), noise=(True, True), source="real")], 2
    )
    assert all(d.noisy for d in noisy[0]) and "p0" not in {d.id for d in noisy[0]}
    engine.close()

    # a noisy curriculum needs the real part to fill its noisy slots: negatives=none is refused, naming it
    none = SearchConfig(engine="mixed", negatives="none", bm25=BM25Config(corpus=str(corpus)))
    with pytest.raises(ConfigError, match=r"search.engine=mixed.*bm25 retriever's noisy slots unfilled"):
        check_noise_config(none, CurriculumConfig())
    check_noise_config(none, CurriculumConfig(p_start=0.0, p_end=0.0))  # no noise: fine
    with pytest.raises(ConfigError, match=r"real part \(search.mixed.real=bm25\).*set search.negatives=hard"):
        build_search_engine(
            SearchConfig(
                engine="mixed",
                negatives="none",
                bm25=BM25Config(corpus=str(corpus)),
                simulator=SimulatorConfig(model=str(tiny_model_dir)),
            ),
            noise=True,
        )


# -- the rollout ------------------------------------------------------------------------------------------


class PlannedGenerator:
    """Question ``Q<i>``: searches ``i % 4`` times (as the turns allow), then answers Lima (even i) or Quito."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, contexts, max_new_tokens):
        out = []
        for ids in contexts:
            text = self.tokenizer.decode(ids)
            i = int(re.search(r"Q(\d+)", text).group(1))
            done = text.count("Doc 1 (Title:")  # observations so far
            turn = (
                f"<search> q{i} search {done} </search>"
                if done < i % 4
                else (f"<answer> {'Lima' if i % 2 == 0 else 'Quito'} </answer>")
            )
            tok = self.tokenizer(turn, add_special_tokens=False)["input_ids"]
            out.append(Generation(tok, [-0.1] * len(tok), "stop"))
        return out


def _mixed_rollout(tokenizer, engine, n=24):
    from curricula import ConstantSchedule, CurriculumNoise
    from zerosim.agent.rollout import RolloutConfig

    questions = [f"Q{i} what is the capital?" for i in range(n)]
    examples = {build_prompt(q): (q, ("Lima",)) for q in questions}
    config = RolloutConfig(max_turns=4, max_new_tokens=32, max_completion_tokens=2000)
    rollout = SearchRollout(
        tokenizer,
        engine,
        config=config,
        k=2,
        noise=CurriculumNoise(ConstantSchedule(0.5), seed=5, k=2),
        source=None if find_mixed(engine) is None else find_mixed(engine).draw_source,  # as train.py does
        examples=examples,
    )
    return rollout, list(examples)


def test_rollout_records_drawn_sources_and_logs_per_source_metrics(tokenizer):
    sim, real = FakeSim("sim"), FakeReal("real")
    engine = MixedSearchEngine(sim, real, share=share_schedule(0.2, 0.8, "linear", 10), seed=5)
    rollout, prompts = _mixed_rollout(tokenizer, engine)
    step = 5
    trajectories, timing = rollout.run(PlannedGenerator(tokenizer), prompts, step)
    searched = 0
    for t in trajectories:
        i = int(re.search(r"Q(\d+)", t.question).group(1))
        assert t.searches == len(t.sources) == min(i % 4, 3)
        expected = [
            search_source(seed=5, step=step, trajectory=t.index, search=s, real_share=0.5)
            for s in range(t.searches)
        ]
        assert t.sources == expected  # the pure draw at the scheduled share (0.5 at step 5)
        # each search was answered by the engine its source names, and the samples' events say which
        assert [docs[0].id.split(":")[0] for docs in t.search_docs] == expected
        assert [e["source"] for e in t.events] == expected
        searched += t.searches
    assert sum(len(c) for c in sim.calls + real.calls) == searched

    metrics = rollout.metrics(trajectories, step, timing)
    real_searches = sum(s == "real" for t in trajectories for s in t.sources)
    assert metrics["mixed/real_search_share"] == pytest.approx(real_searches / searched)
    groups = {g: [t for t in trajectories if t.source_group == g] for g in ("real", "sim", "both", "none")}
    for g, members in groups.items():
        if not members:
            assert not any(k.startswith(f"mixed/{g}/") for k in metrics), g  # absent: no keys, not 0
            continue
        n = len(members)
        assert metrics[f"mixed/{g}/share"] == pytest.approx(n / len(trajectories))
        assert metrics[f"mixed/{g}/em"] == pytest.approx(
            sum(exact_match(t.answer, t.answers) for t in members) / n
        )
        assert metrics[f"mixed/{g}/f1"] == pytest.approx(
            sum(f1_score(t.answer, t.answers) for t in members) / n
        )
        assert metrics[f"mixed/{g}/searches"] == pytest.approx(sum(t.searches for t in members) / n)
    assert {g for g, m in groups.items() if m} >= {"real", "sim", "both", "none"}  # this batch has each
    assert 0 < metrics["mixed/sim/em"] < 1 and metrics["search/mixed/real_searches"] == real_searches


def test_rollout_sources_do_not_depend_on_how_the_batch_is_split(tokenizer):
    """Two ranks rolling out halves (offsets 0 and 12) draw what one process rolling out all 24 does."""
    engine = MixedSearchEngine(FakeSim("sim"), FakeReal("real"), share=0.5)
    rollout, prompts = _mixed_rollout(tokenizer, engine)
    whole, _ = rollout.run(PlannedGenerator(tokenizer), prompts, 2)
    first, _ = rollout.run(PlannedGenerator(tokenizer), prompts[:12], 2, offset=0)
    second, _ = rollout.run(PlannedGenerator(tokenizer), prompts[12:], 2, offset=12)
    assert [t.sources for t in whole] == [t.sources for t in first + second]


def test_validation_and_eval_wrappers_keep_the_mix(tokenizer):
    """Validation and evaluation wrap the engine (``WithheldAnswers``): the rollout still finds the mixed
    engine, draws at the share it is given the step of, and the source survives the answers' removal."""
    from eval.harness import WithheldAnswers

    sim, real = FakeSim("sim"), FakeReal("real")
    mixed = MixedSearchEngine(sim, real, share=share_schedule(0.5, 0.9, "linear", 4), seed=5)
    wrapped = WithheldAnswers(mixed)
    assert find_mixed(wrapped) is mixed
    rollout, prompts = _mixed_rollout(tokenizer, wrapped, n=8)
    trajectories, _ = rollout.run(PlannedGenerator(tokenizer), prompts, 0)
    expected = [
        [
            search_source(seed=5, step=0, trajectory=t.index, search=s, real_share=0.5)
            for s in range(t.searches)
        ]
        for t in trajectories
    ]
    assert [t.sources for t in trajectories] == expected
    assert all(r.answers == () for call in sim.calls + real.calls for r in call)  # answers withheld


def test_rollout_over_a_plain_engine_has_no_mixed_record(tokenizer):
    sim = FakeSim("sim")
    rollout, prompts = _mixed_rollout(tokenizer, sim, n=6)
    trajectories, timing = rollout.run(PlannedGenerator(tokenizer), prompts, 0)
    assert all(not t.sources and all("source" not in e for e in t.events) for t in trajectories)
    assert all(r.source is None for call in sim.calls for r in call)
    assert not any(k.startswith("mixed/") for k in rollout.metrics(trajectories, 0, timing))


def test_reward_by_source_groups_the_trainers_rewards():
    from zerosim.training.recipe import reward_by_source

    rewards = [1.0, 0.0, 0.5, None, 1.0]
    groups = ["real", "sim", "sim", "real", "none"]
    assert reward_by_source(rewards, groups) == {
        "mixed/real/reward": 1.0,
        "mixed/sim/reward": 0.25,
        "mixed/none/reward": 1.0,
    }
    assert reward_by_source(rewards, None) == {}


# -- config, plan, CLI ------------------------------------------------------------------------------------


def test_mixed_config_errors_name_the_key_and_the_fix():
    with pytest.raises(
        ConfigError, match=r"'search.mixed.real' is 'simulator'; valid values: bm25, dense, hybrid, http"
    ):
        load_train_config(None, ["search.engine=mixed", "search.mixed.real=simulator"])
    with pytest.raises(ConfigError, match=r"search.mixed.real_share must be in \[0, 1\].*got 1.5: set e.g."):
        load_train_config(None, ["search.engine=mixed", "search.mixed.real_share=1.5"])
    with pytest.raises(ConfigError, match=r"search.mixed.real_share_end must be in \[0, 1\].*got -0.1"):
        load_train_config(None, ["search.mixed.real_share_end=-0.1"])
    with pytest.raises(ConfigError, match=r"'search.mixed.schedule' is 'adaptive'; valid values: linear"):
        load_train_config(None, ["search.mixed.schedule=adaptive"])
    cfg = load_train_config(
        None, ["search.engine=mixed", "search.mixed.real=dense", "search.mixed.real_share_end=0.9"]
    )
    assert (cfg.search.mixed.real, cfg.search.mixed.real_share, cfg.search.mixed.real_share_end) == (
        "dense",
        0.5,
        0.9,
    )


def test_plan_shows_both_parts_and_the_share_over_the_run():
    from zerosim.training.dry_run import plan

    cfg = load_train_config(
        ROOT / "configs" / "demo.yaml",
        ["search.engine=mixed", "search.mixed.real_share=0.8", "search.mixed.real_share_end=0.2",
         "trainer.max_steps=8", "validation.every=2"],
    )  # fmt: skip
    rows = dict(plan(cfg, processes=1))
    assert rows["search"] == "mixed, k=3"
    assert rows["mixed"] == (
        "each search drawn: bm25 with share linear: 0.80@0, 0.65@2, 0.50@4, 0.35@6, 0.20@8, the simulator otherwise"
    )
    assert rows["simulator"].startswith("smollm2") and rows["corpus"] == "factbook"
    assert rows["noise over a real retriever"] == "hard"
    assert "the training mix at real share 0.8" in rows["validation"]


def test_cli_dry_run_with_mixed_search(tmp_path, zerosim_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proc = zerosim_cli("train", "--config", ROOT / "configs" / "demo.yaml", "--dry-run", "search.engine=mixed",
                       "search.mixed.real_share=0.3", env={"WORLD_SIZE": None})  # fmt: skip
    out = " ".join(proc.stdout.split())
    assert "dry run: nothing loaded" in out
    assert "each search drawn: bm25 with share 0.30 throughout, the simulator otherwise" in out
    assert "mixed, k=3" in out and "smollm2" in out
    assert not (tmp_path / "mlflow.db").exists()


def test_one_training_step_with_mixed_search_logs_mixed_metrics(
    tmp_path, tiny_model_dir, capitals, mlflow_db, zerosim_cli, monkeypatch
):
    import mlflow

    qa, corpus = capitals(4)
    cmd = [
        "train", "--config", str(ROOT / "configs" / "demo.yaml"),
        f"run.output_dir={tmp_path / 'out'}", "run.name=mixed", f"policy.model={tiny_model_dir}",
        f"search.simulator.model={tiny_model_dir}", "search.engine=mixed", "search.mixed.real_share=0.5",
        f"search.bm25.corpus={corpus}", f"data.train={qa}", "trainer.max_steps=1",
        "trainer.per_device_train_batch_size=4", "trainer.num_generations=2", "rollout.max_new_tokens=8",
        "rollout.max_turns=2", "search.simulator.max_new_tokens=16", f"tracking.tracking_uri={mlflow_db}",
        "tracking.experiment=mixed", "warmstart.enabled=false", "trainer.save_final=false", "runtime.threads=1",
    ]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    zerosim_cli(*cmd, env={"ZEROSIM_HOME": str(tmp_path / "home"), "WORLD_SIZE": None})
    mlflow.set_tracking_uri(mlflow_db)
    (run,) = mlflow.search_runs(experiment_names=["mixed"], output_format="list")
    metrics = run.data.metrics
    assert metrics["mixed/real_share"] == 0.5
    groups = [g for g in ("real", "sim", "both", "none") if f"mixed/{g}/share" in metrics]
    assert groups and sum(metrics[f"mixed/{g}/share"] for g in groups) == pytest.approx(1.0)
    for g in groups:  # the trainer's reward, split by the same groups
        assert f"mixed/{g}/reward" in metrics and f"mixed/{g}/f1" in metrics
    assert run.data.params["search.engine"] == "mixed" and run.data.params["search.mixed.real_share"] == "0.5"

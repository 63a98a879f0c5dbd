"""The LLM judge reward (``reward.metric: judge``): yes/no verdicts from an OpenAI-compatible server, cached
per (question, answer), combined with F1 by ``reward.weights``, counted for MLflow, and every failure of the
server an error naming its URL within the bounded time (never a silent 0).

A fake judge (a few lines of FastAPI) answers by rule — ``yes`` when a gold answer appears in the predicted
one — so the verdicts are known; the real in-process tiny-model server (``zerosim simulator serve``) takes
one call through the same client path (either api), and its random-weight answer must be the clear error.
A server without the endpoint ``reward.judge.api`` asks is refused at start-up, before any rollout.
"""

from __future__ import annotations

import re
import socket
import time

import fastapi
import pytest

from zerosim.agent.rewards import make_reward_func
from zerosim.core.config import ConfigError
from zerosim.core.http.retry import RetryPolicy
from zerosim.core.http.server import running_app
from zerosim.core.judge import JudgeError, LLMJudge, parse_verdict
from zerosim.training.config import load_train_config

FAST = RetryPolicy(connect_timeout=0.3, read_timeout=0.5, retries=2, backoff=0.05)
BOUND = FAST.retries * FAST.attempt_timeout + FAST.backoff


def _verdict(prompt: str) -> str:
    """The fake judge's rule: ``yes`` when a gold answer is inside the predicted one; nonsense for 'garbage'."""
    golds = re.search(r"Gold answers: (.*)", prompt).group(1).lower().split(" | ")
    answer = re.search(r"Predicted answer: (.*)", prompt).group(1).lower()
    if answer == "garbage":
        return " Perhaps, it depends."
    return " Yes." if any(g in answer for g in golds) else " no"


@pytest.fixture(scope="module")
def fake_judge():
    app = fastapi.FastAPI()
    app.state.requests = []

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "judge", "object": "model"}]}

    @app.post("/v1/chat/completions")
    def chat(body: dict):
        app.state.requests.append(body)
        text = _verdict(body["messages"][-1]["content"])
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}

    @app.post("/v1/completions")
    def completions(body: dict):
        app.state.requests.append(body)
        return {"choices": [{"index": i, "text": _verdict(p)} for i, p in enumerate(body["prompt"])]}

    with running_app(app, label="fake judge") as url:
        yield url, app.state.requests


def _call(reward, answers, golds, questions=None, metrics=None):
    n = len(answers)
    return reward(
        prompts=[""] * n,
        completions=[""] * n,
        final_answer=answers,
        golden_answers=golds,
        question=questions or ["Capital of Peru?"] * n,
        log_metric=None if metrics is None else lambda name, value: metrics.append((name, value)),
    )


def test_parse_verdict_reads_the_first_word():
    assert [parse_verdict(t) for t in (" Yes.", "no", "**YES** it is", "No, Cusco", "  'yes'")] == [
        1,
        0,
        1,
        0,
        1,
    ]
    assert [parse_verdict(t) for t in ("", "maybe yes", "yesterday", "nope", "42")] == [None] * 5


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_scores_follow_the_judge_and_repeats_are_cached(fake_judge, api):
    url, requests = fake_judge
    judge = LLMJudge(url, "judge", api=api, retry=FAST)
    judge.check()
    reward = make_reward_func("judge", judge=judge)
    assert reward.__name__ == "judge"
    answers = ["Lima", "Cusco", None, "it is Lima", "Lima"]  # a repeat in the batch is asked once
    golds = [["Lima"]] * 5
    metrics: list[tuple[str, float]] = []
    before = len(requests)
    assert _call(reward, answers, golds, metrics=metrics) == [1.0, 0.0, 0.0, 1.0, 1.0]
    sent = len(requests) - before
    assert sent == (3 if api == "chat" else 1)  # chat: one request per unique pair; completions: one for all
    stats = dict(metrics)
    assert (stats["judge/judged"], stats["judge/requests"], stats["judge/cache_hits"]) == (3, sent, 0)
    assert stats["judge/seconds"] > 0

    metrics.clear()
    assert _call(reward, answers, golds, metrics=metrics) == [1.0, 0.0, 0.0, 1.0, 1.0]
    stats = dict(metrics)
    assert len(requests) - before == sent  # nothing asked again
    assert (stats["judge/judged"], stats["judge/requests"], stats["judge/cache_hits"]) == (0, 0, 4)
    # the same answer to another question is another pair
    assert _call(reward, ["Lima"], [["Santiago"]], questions=["Capital of Chile?"]) == [0.0]
    judge.close()


def test_weights_combine_the_judge_with_f1_and_the_training_wrapper_logs_it(fake_judge):
    from zerosim.training.recipe import build_dataset, instrumented

    url, _ = fake_judge
    judge = LLMJudge(url, "judge", retry=FAST)
    reward = instrumented(object(), make_reward_func("em", weights={"judge": 0.5, "f1": 0.5}, judge=judge))
    metrics: list[tuple[str, float]] = []
    # "Lima Peru" vs "Lima": judge yes (1), f1 = 2/3; "Cusco": judge no, f1 0
    out = _call(reward, ["Lima Peru", "Cusco", None], [["Lima"]] * 3, metrics=metrics)
    assert out == pytest.approx([0.5 + 0.5 * 2 / 3, 0.0, 0.0])
    assert {"judge/requests", "judge/judged", "judge/cache_hits", "judge/seconds", "time/reward_s"} <= {
        name for name, _ in metrics
    }
    with pytest.raises(ValueError, match="judge=LLMJudge"):
        make_reward_func("judge")

    from zerosim.core.data.qa import QAExample

    dataset, _ = build_dataset([QAExample(id="a", question="Capital of Peru?", golden_answers=["Lima"])])
    assert dataset["question"] == ["Capital of Peru?"]  # the column the judge reward reads
    judge.close()


def test_garbage_answers_raise_after_the_retries_naming_the_url(fake_judge):
    url, requests = fake_judge
    judge = LLMJudge(url, "judge", api="completions", retry=FAST)
    reward = make_reward_func("judge", judge=judge)
    before = len(requests)
    with pytest.raises(JudgeError, match=rf"{re.escape(url)}.*2 attempts.*neither yes nor no.*Perhaps"):
        _call(reward, ["Lima", "garbage"], [["Lima"]] * 2)
    assert len(requests) - before == 2  # retried, only the undecided prompt the second time
    assert requests[-1]["prompt"] == [requests[-2]["prompt"][1]]
    assert ("Capital of Peru?", "garbage", ("Lima",)) not in judge.cache
    with pytest.raises(JudgeError, match="serves judge, not reward.judge.model='other'"):
        LLMJudge(url, "other", retry=FAST).check()


def test_a_down_server_raises_within_the_bounded_time():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    judge = LLMJudge(url, "judge", retry=FAST)
    started = time.monotonic()
    with pytest.raises(JudgeError, match=rf"judge server {re.escape(url)}.*2 attempts.*connection refused"):
        judge.score(["q"], ["a"], [["a"]])
    assert time.monotonic() - started < BOUND + 0.5
    with pytest.raises(JudgeError, match="reward.judge.url"):
        judge.check()


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_the_real_tiny_model_server_goes_through_the_client_and_its_garbage_is_an_error(
    tiny_model_dir, tokenizer, api
):
    from simulators import TransformersBackend
    from simulators.openai_server import running_openai_server
    from zerosim.core.models import load_causal_lm

    backend = TransformersBackend(
        load_causal_lm(str(tiny_model_dir), "float32"), tokenizer, apply_chat_template=False
    )
    with running_openai_server(backend, model_name="tiny") as url:
        judge = LLMJudge(
            url, "tiny", api=api, retry=RetryPolicy(connect_timeout=2, read_timeout=30, retries=1)
        )
        judge.check()  # up, serving "tiny", and answering on the api's endpoint
        with pytest.raises(JudgeError, match=rf"{re.escape(judge.endpoint)}.*neither yes nor no"):
            judge.score(["Capital of Peru?"], ["Lima"], [["Lima"]])
        assert judge.stats["requests"] == 1 and not judge.cache  # asked once, nothing scored
        judge.close()


@pytest.fixture(scope="module")
def completions_only_judge():
    """A judge server without ``/v1/chat/completions`` (as ``zerosim simulator serve`` was): it lists the
    model and answers completions; every request it sees is recorded as "METHOD path"."""
    app = fastapi.FastAPI()
    app.state.seen = []

    @app.middleware("http")
    async def record(request: fastapi.Request, call_next):
        app.state.seen.append(f"{request.method} {request.url.path}")
        return await call_next(request)

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "judge", "object": "model"}]}

    @app.post("/v1/completions")
    def completions(body: dict):
        return {"choices": [{"index": i, "text": _verdict(p)} for i, p in enumerate(body["prompt"])]}

    with running_app(app, label="completions-only judge") as url:
        yield url, app.state.seen


def test_the_start_up_check_asks_the_endpoint_the_judge_will_use(completions_only_judge):
    """``reward.judge.api=chat`` against a server without chat is refused by ``build_judge`` (start-up), in
    one line naming the URL, the api and the fix; the same server passes with ``api=completions``."""
    from zerosim.agent.rewards import RewardConfig, build_judge
    from zerosim.core.judge import JudgeConfig

    url, seen = completions_only_judge
    settings = {"url": url, "model": "judge", "connect_timeout": 0.3, "read_timeout": 2.0, "retries": 2}
    seen.clear()
    with pytest.raises(JudgeError) as err:
        build_judge(RewardConfig(metric="judge", judge=JudgeConfig(api="chat", **settings)))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"judge server {url} does not answer POST /v1/chat/completions (HTTP 404"), (
        message
    )
    assert "reward.judge.api=chat asks: set reward.judge.api=completions" in message, message
    assert seen == ["GET /v1/models", "POST /v1/chat/completions"]  # not retried: the route is missing

    seen.clear()
    judge = build_judge(RewardConfig(metric="judge", judge=JudgeConfig(api="completions", **settings)))
    assert seen == ["GET /v1/models", "POST /v1/completions"]
    assert judge.stats["requests"] == 0 and not judge.cache  # the probe is neither counted nor cached
    assert judge.score(["Capital of Peru?"], ["Lima"], [["Lima"]]) == [1.0]
    judge.close()


def test_training_with_a_judge_api_the_server_lacks_stops_before_any_rollout(
    completions_only_judge, tmp_path, tiny_model_dir, capitals, monkeypatch
):
    from zerosim.training.recipe import train
    from zerosim.training.trl_rollout import TRLRollout

    rollouts = []
    call = TRLRollout.__call__
    monkeypatch.setattr(
        TRLRollout, "__call__", lambda self, *a, **kw: rollouts.append(1) or call(self, *a, **kw)
    )
    url, seen = completions_only_judge
    qa, corpus = capitals(4)
    cfg = load_train_config(None, [
        "warmstart.enabled=false", f"run.output_dir={tmp_path / 'out'}", f"policy.model={tiny_model_dir}",
        "search.engine=bm25", f"search.bm25.corpus={corpus}", f"data.train={qa}", "trainer.max_steps=1",
        "trainer.per_device_train_batch_size=2", "trainer.num_generations=2", "rollout.max_new_tokens=8",
        "validation.every=0", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", "runtime.threads=1",
        "reward.metric=judge", f"reward.judge.url={url}", "reward.judge.api=chat", "reward.judge.retries=1",
    ])  # fmt: skip
    seen.clear()
    with pytest.raises(
        JudgeError, match=r"does not answer POST /v1/chat/completions.*reward.judge.api=completions"
    ):
        train(cfg)
    assert rollouts == []
    assert seen == ["GET /v1/models", "POST /v1/chat/completions"]
    assert not list((tmp_path / "out").rglob("checkpoint-*"))


def test_config_refuses_a_judge_without_url_and_dry_run_shows_it(zerosim_cli, tmp_path, monkeypatch):
    for overrides in (["reward.metric=judge"], ["reward.weights={judge: 0.5, f1: 0.5}"]):
        with pytest.raises(
            ConfigError, match=r"reward.judge.url is not set.*reward.judge.url=http://HOST:PORT"
        ):
            load_train_config(None, overrides)
    with pytest.raises(
        ConfigError, match="reward.judge.url 'localhost:8000' must look like http://HOST:PORT"
    ):
        load_train_config(None, ["reward.metric=judge", "reward.judge.url=localhost:8000"])
    with pytest.raises(ConfigError, match="reward.judge.api"):
        load_train_config(None, ["reward.judge.api=grpc"])
    load_train_config(None, ["reward.metric=em"])  # no judge asked: no url needed

    monkeypatch.chdir(tmp_path)
    out = zerosim_cli(
        "train",
        "--dry-run",
        "reward.metric=judge",
        "reward.judge.url=http://judge-host:8000",
        "reward.judge.model=qwen-judge",
    ).stdout
    assert "judge 1" in out
    assert re.search(r"qwen-judge at http://judge-host:8000 \(/v1/chat/completions", out), out


def test_training_asks_the_judge_and_logs_its_counts_to_mlflow(
    fake_judge, tmp_path, tiny_model_dir, capitals, mlflow_db, zerosim_cli, monkeypatch
):
    """One GRPO step on the tiny model with reward.metric=judge: the dataset's question column reaches the
    reward through TRL, and judge/* land in MLflow beside the reward. The judge's client and the search
    engine are closed when training returns."""
    import mlflow

    import zerosim.training.recipe
    from zerosim.core.judge import LLMJudge

    closed = []
    close_judge, build_engine = LLMJudge.close, zerosim.training.recipe.build_search_engine
    monkeypatch.setattr(LLMJudge, "close", lambda self: (closed.append("judge"), close_judge(self)))

    def build(*args, **kwargs):
        engine = build_engine(*args, **kwargs)
        engine.close = lambda: closed.append("engine")
        return engine

    monkeypatch.setattr(zerosim.training.recipe, "build_search_engine", build)
    url, _ = fake_judge
    qa, corpus = capitals(4)
    zerosim_cli(
        "train", "warmstart.enabled=false", f"run.output_dir={tmp_path / 'out'}", "run.name=judge",
        f"policy.model={tiny_model_dir}", "search.engine=bm25", f"search.bm25.corpus={corpus}",
        f"data.train={qa}", "trainer.max_steps=1", "trainer.per_device_train_batch_size=2",
        "trainer.num_generations=2", "rollout.max_new_tokens=8", "rollout.max_turns=1",
        "trainer.save_final=false", "validation.every=0", f"tracking.tracking_uri={mlflow_db}",
        "tracking.experiment=judge", "reward.metric=judge", f"reward.judge.url={url}", "runtime.threads=1",
    )  # fmt: skip
    mlflow.set_tracking_uri(mlflow_db)
    (run,) = mlflow.search_runs(experiment_names=["judge"], output_format="list")
    client = mlflow.MlflowClient()
    for key in ["judge/requests", "judge/judged", "judge/cache_hits", "judge/seconds", "rewards/judge/mean"]:
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [1], key
    assert run.data.params["reward.judge.url"] == url
    assert sorted(closed) == ["engine", "judge"]

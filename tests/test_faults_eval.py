"""Fault and bad-input suite, evaluation side (issue 14, items 5, 6 and 14).

Every bad input to ``zerosim eval`` stops with one clear sentence (exit code 2) before a model loads and
without an MLflow run; an evaluation never scores zero rows; dataset names are distinct; the simulator is
told the gold answers in training only (the prompt text it receives is checked); one containment test for
documents. New APIs are imported inside the tests, so on older code each case fails on its own.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from zerosim.agent.rollout import RolloutConfig, SearchRollout, build_prompt
from zerosim.core.data.qa import QAExample
from zerosim.core.generation import Generation
from zerosim.core.search import Document
from zerosim.job_config import EvalConfig
from zerosim.training.config import TrainConfig, ValidationConfig

GOLD = "Cair Paravel"  # in no question, query or simulated document: found in a prompt only if leaked
QUESTION = "What is the capital of Narnia?"


def qa_line(i: int, answer: str = "Lima") -> str:
    return json.dumps({"id": f"q{i}", "question": f"Capital of {i}?", "golden_answers": [answer]}) + "\n"


# -- bad eval inputs through the CLI: exit 2, one sentence, no model, no MLflow run -------------------------


def _files(tmp: Path) -> dict[str, str]:
    (tmp / "toy.jsonl").write_text("".join(qa_line(i) for i in range(3)))
    (tmp / "empty.jsonl").write_text("")
    (tmp / "blank.jsonl").write_text("\n  \n")
    (tmp / "bad.jsonl").write_text(qa_line(0) + '{"id": "q1", "question": "x?"}\n')
    # ids 1 and "1" are one id once read: the scores of both questions went under one id
    (tmp / "dupid.jsonl").write_text(
        qa_line(0)
        + "".join(
            json.dumps({"id": i, "question": f"{i} capital?", "golden_answers": ["Lima"]}) + "\n"
            for i in (1, "1")
        )
    )
    # an answer normalised away ("the"): scored 0 whatever the policy says
    (tmp / "the.jsonl").write_text(qa_line(0) + qa_line(1, "the"))
    (tmp / "blank-answer.jsonl").write_text(qa_line(0, ""))
    (tmp / "a-file").write_text("not a folder\n")
    return {"toy": str(tmp / "toy.jsonl"), "empty": str(tmp / "empty.jsonl"),
            "blank": str(tmp / "blank.jsonl"), "bad": str(tmp / "bad.jsonl"),
            "missing": str(tmp / "missing.jsonl"), "dupid": str(tmp / "dupid.jsonl"),
            "the": str(tmp / "the.jsonl"), "blank-answer": str(tmp / "blank-answer.jsonl")}  # fmt: skip


# (id, --dataset value (names from _files, comma-separated), extra CLI args after the test's own ({tmp}: the
# test's folder; --method direct unless they say otherwise), words the message must hold)
CLI_CASES = [
    ("empty-dataset-file", "empty", [], ["empty", "no rows"]),
    ("blank-lines-only", "blank", [], ["blank", "no rows"]),
    ("limit-0", "toy", ["--limit", "0"], ["limit"]),
    ("limit-negative", "toy", ["--limit", "-1"], ["limit"]),
    ("batch-size-0", "toy", ["batch_size=0"], ["batch_size"]),
    ("same-dataset-twice", "toy,toy", [], ["twice"]),
    ("repeated-question-id", "dupid", [], ["dupid.jsonl line 3", "question id '1' repeats the id of line 2"]),
    ("answers-only-articles", "the", [], ["the.jsonl line 2", "'golden_answers'", "normalisation"]),
    ("answer-blank", "blank-answer", [], ["blank-answer.jsonl line 1", "normalisation"]),
    ("output-dir-is-a-file", "toy", ["output_dir={tmp}/a-file"], ["output_dir", "a-file is an existing file"]),
    ("output-dir-under-a-file", "toy", ["output_dir={tmp}/a-file/evals"], ["output_dir", "a-file is an existing file"]),
    ("log-model", "toy", ["tracking.log_model=true"], ["tracking.log_model=true", "on the training job"]),
    # a reranker the engine could not load offline: refused before the policy, not by the library after it
    ("reranker-hub-id-not-cached", "toy", ["--method", "rag", "search.rerank.model=cross-encoder/zerosim-never-cached"], ["search.rerank.model", "not in the Hugging Face cache", "=null"]),
    ("reranker-relative-path-missing", "toy", ["--method", "agent", "search.rerank.model=models/reranker"], ["search.rerank.model", "models/reranker is no local folder"]),
    ("missing-file (already worked)", "missing", [], ["missing.jsonl", "no such file"]),
    ("malformed-row (already worked)", "bad", [], ["bad.jsonl line 2", "golden_answers"]),
]  # fmt: skip


@pytest.mark.parametrize("dataset, args, words", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_bad_eval_input_stops_before_a_model_loads(
    tmp_path, monkeypatch, tiny_model_dir, dataset, args, words
):
    from typer.testing import CliRunner

    import zerosim.core.models
    from zerosim.cli import app

    def no_model(*a, **kw):
        raise AssertionError("a model was loaded for an evaluation that cannot run")

    monkeypatch.setattr(zerosim.core.models, "load_causal_lm", no_model)
    monkeypatch.setattr(zerosim.core.models, "load_tokenizer", no_model)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "unset")  # restored after the test (mlflow_run would set it)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as the suite runs (conftest): the hub cannot be reached
    files = _files(tmp_path)
    db = tmp_path / "mlflow.db"
    result = CliRunner().invoke(
        app,
        ["eval", "--policy", str(tiny_model_dir), "--method", "direct",
         "--dataset", ",".join(files[d] for d in dataset.split(",")),
         f"output_dir={tmp_path / 'out'}", f"tracking.tracking_uri=sqlite:///{db}",
         *(a.format(tmp=tmp_path) for a in args)],
    )  # fmt: skip
    message = " ".join(result.output.split())
    assert result.exit_code == 2, (result.exit_code, message, result.exception)
    assert "Traceback" not in message
    for word in words:
        assert word in message, message
    assert not db.exists()  # no MLflow run, let alone a FINISHED one scoring 0.0
    assert not (tmp_path / "out").exists()


def test_evaluator_rejects_zero_rows_and_batch_size_0(tiny_model_dir):
    """The harness itself (API use, no config loader in front): no score over nothing."""
    from eval.harness import Evaluator
    from zerosim.core.models import load_causal_lm, load_tokenizer

    model, tok = load_causal_lm(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir))
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        Evaluator(EvalConfig(method="direct", batch_size=0), model, tok, None)
    with pytest.raises(ValueError, match="dataset nq .*no rows to evaluate"):
        Evaluator(EvalConfig(method="direct"), model, tok, None).evaluate("nq", [], progress=False)


# -- the experiment's report: one score per (dataset, question id) ------------------------------------------


def _question(dataset: str, qid, em: float) -> dict:
    return {"dataset": dataset, "id": qid, "em": em, "f1": em, "cover_em": em}


# (id, questions.jsonl rows, words the DataError must hold; None: read, one score per row)
SCORES_CASES = [
    ("same-id-twice", [_question("nq", "q1", 1.0), _question("nq", "q2", 0.0), _question("nq", "q1", 0.0)],
     ["questions.jsonl line 3", "dataset 'nq' question id 'q1' repeats line 1", "unique"]),
    ("int-and-str-id", [_question("nq", 1, 1.0), _question("nq", "1", 0.0)], ["line 2", "question id '1'"]),
    ("same-id-in-two-datasets (fine)", [_question("nq", "q1", 1.0), _question("hotpotqa", "q1", 0.0)], None),
]  # fmt: skip


@pytest.mark.parametrize("rows, words", [c[1:] for c in SCORES_CASES], ids=[c[0] for c in SCORES_CASES])
def test_report_refuses_a_questions_file_that_repeats_an_id(tmp_path, rows, words):
    """Keyed by id, a repeated question replaced the first: 4 questions under one id reported n=1."""
    from zerosim.core.data import DataError
    from zerosim.experiment.report import _scores

    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if words is None:
        scores = _scores(path)
        assert sum(len(questions) for questions in scores.values()) == len(rows)
        return
    with pytest.raises(DataError) as err:
        _scores(path)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


# -- dataset names: distinct, by folder when the file is named after its split ------------------------------

NAME_CASES = [
    ("split-files-by-folder", ["nq/test.jsonl", "hotpotqa/test.jsonl"], ["nq", "hotpotqa"]),
    ("other-split-of-one-folder", ["nq/test.jsonl", "nq/dev.jsonl"], ["nq", "nq:dev"]),
    ("same-folder-name", ["a/nq/test.jsonl", "b/nq/test.jsonl"], ["a/nq", "b/nq"]),
    ("same-stem", ["a/toy.jsonl", "b/toy.jsonl"], ["a/toy", "b/toy"]),
    (
        "plain-names-unchanged",
        ["toy.jsonl", "factbook", "factbook:dev"],
        ["toy", "factbook", "factbook:dev"],
    ),
]


@pytest.mark.parametrize("specs, names", [c[1:] for c in NAME_CASES], ids=[c[0] for c in NAME_CASES])
def test_dataset_names_are_distinct(tmp_path, specs, names):
    from eval.run import dataset_names

    specs = [s if s.startswith("factbook") else str(tmp_path / s) for s in specs]
    assert [name for name, _, _ in dataset_names(specs, "test")] == names


@pytest.mark.parametrize(
    "specs, error",
    [(["toy.jsonl", "./toy.jsonl"], "twice"), (["factbook", "factbook:test"], "twice"),
     (["average.jsonl"], "average")],
    ids=["same-file-twice", "same-split-twice", "named-average"],
)  # fmt: skip
def test_dataset_names_that_cannot_be_told_apart(monkeypatch, tmp_path, specs, error):
    from eval.run import dataset_names
    from zerosim.core.config import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=error):
        dataset_names(specs, "test")


# -- one containment test: whole normalised words, for recall as for labels --------------------------------

CONTAINMENT_CASES = [
    ("substring-of-a-word", "Let us have a party tonight.", "art", False),
    ("digit-in-a-year", "It was founded in 1995.", "5", False),
    ("whole-word", "Modern art is on show.", "art", True),
    ("normalised", "The capital is LIMA, Peru.", "lima peru", True),
]


@pytest.mark.parametrize(
    "text, gold, found", [c[1:] for c in CONTAINMENT_CASES], ids=[c[0] for c in CONTAINMENT_CASES]
)
def test_recall_and_labels_share_one_containment_test(text, gold, found):
    from eval.harness import gold_in_documents
    from zerosim.core.metrics import answer_in_text

    assert answer_in_text(text, [gold]) is found
    assert gold_in_documents([Document("1", "t", text)], [gold]) == float(found)


# -- gold answers reach the simulator in training only: the prompt text it receives ------------------------


class CaptureBackend:
    """A simulator backend that records every prompt and writes two harmless documents."""

    def __init__(self):
        self.prompts: list[str] = []

    def complete(self, prompts, *, max_new_tokens, temperature, top_p, seed):
        self.prompts += prompts
        return ["Doc 1: Narnia is a land of talking beasts.\nDoc 2: Narnia has a capital city."] * len(
            prompts
        )

    def describe(self):
        return {"backend": "capture"}


class SearchThenAnswer:
    """A policy that searches once, then answers (decided from its context: stateless)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompts, max_new_tokens, width=None):
        outs = []
        for ids in prompts:
            seen = "(Title:" in self.tokenizer.decode(ids)  # an <information> block came back
            reply = (
                "<answer> Narnia </answer>"
                if seen
                else "<think>x</think><search> capital of Narnia </search>"
            )
            tok = self.tokenizer(reply, add_special_tokens=False)["input_ids"]
            outs.append(Generation(tok, [0.0] * len(tok), "stop"))
        return outs

    def idle(self, max_new_tokens):
        pass


ROLLOUT = RolloutConfig(max_turns=2, max_new_tokens=32, max_completion_tokens=400, temperature=0.0)
QUESTIONS = [QAExample(f"n{i}", QUESTION, (GOLD,), {}) for i in range(3)]


def simulator(pass_answers):
    """A capturing simulator built as ``zerosim.engines.build_search_engine`` builds it from the config."""
    from simulators.llm import LLMSimulator

    return LLMSimulator(CaptureBackend(), pass_answers=pass_answers, on_short="fill")


def configure(search, pass_answers):
    """``search.engine=simulator``, k=2, and ``search.simulator.pass_answers`` unless left at its default."""
    search.engine, search.k = "simulator", 2
    if pass_answers != "default":
        search.simulator.pass_answers = pass_answers
    return search.simulator.pass_answers


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from zerosim.core.models import load_causal_lm, load_tokenizer

    return load_causal_lm(str(tiny_model_dir), "float32"), load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, policy):
    from datasets import Dataset
    from trl import GRPOConfig

    from zerosim.training.trainer import SearchTrainer

    model, tok = policy
    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trainer")), num_generations=2, per_device_train_batch_size=2,
        max_completion_length=8, use_cpu=True, report_to=[],
    )  # fmt: skip
    return SearchTrainer(
        model=model,
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "q"}] * 4),
        processing_class=tok,
    )


def _eval_prompts(policy, pass_answers, method="agent"):
    from eval.harness import Evaluator

    model, tok = policy
    cfg = EvalConfig(method=method, batch_size=2, max_answer_tokens=4, rollout=ROLLOUT)
    sim = simulator(configure(cfg.search, pass_answers))
    evaluator = Evaluator(cfg, model, tok, sim)
    evaluator.agent_generator = SearchThenAnswer(tok)
    evaluator.evaluate("narnia", QUESTIONS, progress=False)
    return sim.backend.prompts


def _training_prompts(policy, pass_answers):
    _, tok = policy
    sim = simulator(configure(TrainConfig().search, pass_answers))
    rollout = SearchRollout(
        tok, sim, config=ROLLOUT, k=2,
        examples={build_prompt(QUESTION): (QUESTION, (GOLD,))},
    )  # fmt: skip
    rollout.run(SearchThenAnswer(tok), [build_prompt(QUESTION)] * 2, step=0)
    return sim.backend.prompts


def _validation_prompts(policy, trainer, monkeypatch, pass_answers, engine):
    """Validation built as training builds it (``build_validation``), over the training engine or its own."""
    import zerosim.training.recipe

    _, tok = policy
    cfg = TrainConfig()
    value = configure(cfg.search, pass_answers)
    cfg.rollout = ROLLOUT
    cfg.validation = ValidationConfig(every=1, batch_size=2, engine=engine)
    train_sim, own_sim = simulator(value), simulator(value)
    monkeypatch.setattr(zerosim.training.recipe, "build_search_engine", lambda *a, **kw: own_sim)
    val = zerosim.training.recipe.build_validation(cfg, QUESTIONS, train_sim, tok).bind(trainer)
    val.generator_for = lambda model, sync: SearchThenAnswer(tok)
    val.validate(0)
    return (train_sim if engine == "train" else own_sim).backend.prompts


# (id, how the simulator is reached, search.simulator.pass_answers ("default": not set), gold in its prompts?)
LEAK_CASES = [
    ("eval-agent", "eval", "default", False),
    ("eval-agent-pass_answers-false", "eval", False, False),
    ("eval-agent-explicit-override", "eval", True, True),
    ("eval-rag (already worked)", "eval-rag", "default", False),
    ("validation-over-training-engine", "validation-train", "default", False),
    ("validation-own-simulator", "validation-simulator", "default", False),
    ("validation-explicit-override", "validation-train", True, True),
    ("training (already worked)", "training", "default", True),
    ("training-pass_answers-false (already worked)", "training", False, False),
]


@pytest.mark.parametrize(
    "path, pass_answers, shown", [c[1:] for c in LEAK_CASES], ids=[c[0] for c in LEAK_CASES]
)
def test_simulator_sees_gold_answers_in_training_only(
    policy, trainer, monkeypatch, caplog, path, pass_answers, shown
):
    caplog.set_level(logging.WARNING)
    if path == "training":
        prompts = _training_prompts(policy, pass_answers)
    elif path.startswith("eval"):
        prompts = _eval_prompts(policy, pass_answers, "rag" if path == "eval-rag" else "agent")
    else:
        prompts = _validation_prompts(policy, trainer, monkeypatch, pass_answers, path.split("-", 1)[1])
    assert prompts, "the simulator was never asked"
    leaked = [p for p in prompts if GOLD in p]
    if shown:
        assert len(leaked) == len(prompts) and "The correct answer is" in leaked[0]
    else:
        assert not leaked, leaked[0]
        assert all("correct answer" not in p for p in prompts)
    override = "pass_answers=true" in caplog.text
    assert override == (shown and path != "training")  # the override is announced, the default is silent


def test_eval_override_is_tagged_in_mlflow(tmp_path, monkeypatch, tiny_model_dir):
    """``zerosim eval`` with the override leaves a mark on its MLflow run (tag + param)."""
    import mlflow

    from eval.run import run_eval

    (tmp_path / "toy.jsonl").write_text(qa_line(0, GOLD))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "unset")
    cfg = EvalConfig(policy=str(tiny_model_dir), datasets=[str(tmp_path / "toy.jsonl")], method="agent",
                     rollout=RolloutConfig(max_turns=1, max_new_tokens=2, temperature=0.0),
                     output_dir=str(tmp_path / "out"))  # fmt: skip
    cfg.search.engine, cfg.search.simulator.pass_answers = "simulator", True
    cfg.tracking.tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = run_eval(cfg, build_engine=lambda *a, **kw: simulator(True), progress=False)
    run = mlflow.get_run(result.run_id)
    assert run.data.tags["zerosim.simulator_sees_answers"] == "eval"
    assert run.data.params["search.simulator.pass_answers"] == "True"

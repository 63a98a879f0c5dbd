"""The evaluation harness: every row counted, methods, table, and the CLI end to end on a tiny model."""

import json
from pathlib import Path

import pytest

from eval.harness import (
    DatasetResult,
    Evaluator,
    RowResult,
    _prediction,
    gold_in_documents,
    markdown_table,
    table,
)
from zerosim.core.data.qa import QAExample
from zerosim.core.search import Document
from zerosim.job_config import EvalConfig


class TinyEngine:
    def search(self, requests, k):
        return [
            [Document(f"d{i}", "Peru", f"The capital of Peru is Lima. ({r.query})") for i in range(k)]
            for r in requests
        ]


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    from zerosim.core.models import load_causal_lm, load_tokenizer

    return load_causal_lm(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir))


def examples(n):
    return [QAExample(f"q{i}", f"What is the capital of country {i}?", ("Lima",), {}) for i in range(n)]


@pytest.mark.parametrize("method", ["direct", "rag", "agent"])
def test_every_row_is_counted_with_a_partial_last_batch(model_and_tokenizer, method):
    model, tok = model_and_tokenizer
    cfg = EvalConfig(method=method, batch_size=4, max_answer_tokens=6)
    cfg.rollout.max_new_tokens, cfg.rollout.max_turns = 6, 2
    result = Evaluator(cfg, model, tok, TinyEngine()).evaluate("toy", examples(11), progress=False)
    assert [r.id for r in result.rows] == [f"q{i}" for i in range(11)]
    summary = result.summary()
    assert summary["n"] == 11 and 0.0 <= summary["em"] <= 1.0
    if method == "rag":
        assert summary["recall"] == 1.0 and summary["searches"] == 1.0
    if method == "direct":
        assert summary["searches"] == 0.0 and summary["recall"] != summary["recall"]  # NaN: no retrieval


def test_prediction_and_recall_helpers():
    assert _prediction("blah <answer> Lima </answer>") == ("Lima", True)
    assert _prediction("\n Lima is it\nmore") == ("Lima is it", False)
    assert _prediction("") == ("", False)
    docs = [Document("1", "Peru", "Its capital is Lima.")]
    assert gold_in_documents(docs, ["lima"]) == 1.0 and gold_in_documents(docs, ["Cusco"]) == 0.0
    assert gold_in_documents([Document("2", "Fun", "Let us have a party.")], ["art"]) == 0.0  # whole words


def test_table_average_row_and_markdown():
    def res(name, ems):
        r = DatasetResult(name)
        for i, em in enumerate(ems):
            r.rows.append(
                RowResult(str(i), "q", ["lima"], "lima" if em else "cusco", True, True, 1, 1, 1.0).score()
            )
        return r

    rows = table([res("A", [1, 1, 0, 0]), res("B", [1])])
    assert rows[-1]["dataset"] == "average" and rows[-1]["n"] == 5
    assert rows[-1]["em"] == pytest.approx((0.5 + 1.0) / 2)  # unweighted over datasets, as the papers
    md = markdown_table(rows, "t")
    assert "| average | 5 | 75.0 |" in md


def test_cli_eval_end_to_end(tmp_path, tiny_model_dir, mlflow_db, zerosim_cli):
    import mlflow

    rows = "".join(
        json.dumps({"id": f"q{i}", "question": f"Capital of {i}?", "golden_answers": ["Lima"]}) + "\n"
        for i in range(5)
    )
    nq, hotpotqa = tmp_path / "nq" / "test.jsonl", tmp_path / "hotpotqa" / "test.jsonl"
    for qa in (nq, hotpotqa):  # FlashRAG's layout: files named after their split, in a folder per dataset
        qa.parent.mkdir()
        qa.write_text(rows)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "contents": f"Country {i}\nThe capital of {i} is Lima."}) + "\n"
            for i in range(5)
        )
    )
    cmd = [
        "eval", "--policy", str(tiny_model_dir), "--dataset", f"{nq},{hotpotqa}",
        "--search", "bm25", "--method", "rag", f"search.bm25.corpus={corpus}", "batch_size=2",
        "max_answer_tokens=4", f"output_dir={tmp_path / 'out'}", f"tracking.tracking_uri={mlflow_db}",
    ]  # fmt: skip
    zerosim_cli(*cmd)
    rows = json.loads((tmp_path / "out" / "rag-bm25" / "table.json").read_text())
    assert [r["dataset"] for r in rows] == ["nq", "hotpotqa", "average"] and rows[0]["n"] == 5
    assert rows[0]["recall"] == 1.0
    # each question's answer is kept beside its scores: a surprising score is read without the MLflow store
    questions = [json.loads(line) for line in (tmp_path / "out" / "rag-bm25" / "questions.jsonl").open()]
    assert len(questions) == 10 and all(isinstance(q["prediction"], str) and "tagged" in q for q in questions)
    mlflow.set_tracking_uri(mlflow_db)
    (run,) = mlflow.search_runs(experiment_names=["zerosim-eval"], output_format="list")
    assert (
        run.data.tags["zerosim.job"] == "eval"
        and {"nq/em", "hotpotqa/em"} <= set(run.data.metrics)
        and "average/em" in run.data.metrics
    )
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert {"table.md", "table.json", "samples"} <= artifacts
    assert Path(tmp_path / "out" / "rag-bm25" / "table.md").read_text().startswith("### rag")


def test_a_greedy_evaluation_of_every_question_reads_no_seed(
    tmp_path, tiny_model_dir, mlflow_db, zerosim_cli, capitals
):
    """What lets an experiment leave the seed out of a greedy evaluation's stage key
    (zerosim/experiment/kinds.py::_eval_inert): every question, greedy, over BM25, two seeds answer alike —
    while sampling (temperature 1), they do not, so the comparison can tell."""
    qa, corpus = capitals(6)

    def transcripts(seed: int, temperature: float) -> list[str]:
        """Every question's whole trajectory (the tiny model rarely writes an answer to compare)."""
        import mlflow

        run_name = f"seed-{seed}-t{temperature}"
        zerosim_cli(
            "eval", "--policy", str(tiny_model_dir), "--dataset", str(qa), "--search", "bm25",
            "--method", "agent", f"search.bm25.corpus={corpus}", "batch_size=3", f"seed={seed}",
            f"rollout.temperature={temperature}", "rollout.max_new_tokens=12", "rollout.max_turns=2",
            "num_sample_trajectories=6", f"run_name={run_name}", f"output_dir={tmp_path / run_name}",
            f"tracking.tracking_uri={mlflow_db}",
        )  # fmt: skip
        mlflow.set_tracking_uri(mlflow_db)
        (run,) = mlflow.search_runs(
            experiment_names=["zerosim-eval"], filter_string=f"tags.mlflow.runName = '{run_name}'",
            output_format="list",
        )  # fmt: skip
        text = mlflow.artifacts.load_text(f"runs:/{run.info.run_id}/samples/trajectories.jsonl")
        rows = [json.loads(line) for line in text.splitlines()]
        assert len(rows) == 6
        return [row["transcript"] for row in rows]

    assert transcripts(0, 0.0) == transcripts(5, 0.0)
    assert transcripts(0, 1.0) != transcripts(5, 1.0)

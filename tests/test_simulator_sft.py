"""Simulator SFT pipeline: collect (labels, clipping, balance, policy queries), train, quality report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulators.collect import (
    ContainmentLabeler,
    JudgeLabeler,
    QueryDocs,
    RecordingEngine,
    balance_rows,
    build_rows,
    clip_words,
    format_completion,
    policy_queries,
)
from simulators.llm import MISSING_DOC_TEXT
from simulators.parsing import split_documents
from simulators.prompts import SimulatorPrompts
from simulators.quality import ResultScore, score
from simulators.sft import load_preference_dataset, load_sft_dataset, preference_pairs
from zerosim.core.config import ConfigError, load_config
from zerosim.core.data import DataError
from zerosim.core.data.qa import QAExample
from zerosim.core.generation import Generation
from zerosim.core.metrics import answer_in_text
from zerosim.core.search import Document, SearchRequest
from zerosim.job_config import SimulatorCollectConfig


def ex(q="What is the capital of Peru?", answers=("Lima",), id="q1"):
    return QAExample(id=id, question=q, golden_answers=tuple(answers))


# -- documents and labels ----------------------------------------------------------------------------------


def test_answer_in_text_is_whole_word_and_normalised():
    assert answer_in_text("The capital is LIMA.", ["lima"])
    assert not answer_in_text("founded in 1995", ["5"])
    assert answer_in_text("colours: red, white, blue", ["Red white blue"])
    assert not answer_in_text("anything", [""])  # an empty gold matches nothing


def test_clip_words_keeps_the_answer_segment_and_the_budget():
    fields = [f"Peru - Economy - Field {i}: filler words number {i} here" for i in range(12)]
    fields[9] = "Peru - Government - Capital: Lima"
    text = " | ".join(fields)
    clipped = clip_words(text, 20, ["Lima"])
    assert answer_in_text(clipped, ["Lima"])
    assert len(clipped.split()) <= 20
    assert clipped.startswith("Peru - ")  # cut on a field boundary, not mid-field
    # without answers the beginning is kept
    assert clip_words(text, 10).split()[:3] == ["Peru", "-", "Economy"]
    # a single long segment: a word window around the mention
    long = " ".join(["word"] * 100 + ["Lima"] + ["word"] * 100)
    window = clip_words(long, 15, ["Lima"])
    assert len(window.split()) == 15 and "Lima" in window.split()
    # short text is returned whole (whitespace normalised)
    assert clip_words("a  b\nc", 10) == "a b c"


def docs(*texts):
    return tuple(Document(id=f"d{i}", title="", text=t) for i, t in enumerate(texts))


def test_build_rows_round_trips_through_the_simulator_parser():
    items = [
        QueryDocs("capital of Peru", ex(), docs("Lima is the capital of Peru.", "Peru has mountains.", "Lima has a port.", "Cusco is old.")),
        QueryDocs("capital of Chile", ex("Capital of Chile?", ("Santiago",), "q2"), docs("Chile is long.", "Chile exports copper.")),
    ]  # fmt: skip
    prompts = SimulatorPrompts()
    rows, counts = build_rows(
        items, ContainmentLabeler(), k=3, words_per_doc=30, prompts=prompts, pass_answers=True
    )
    assert counts["documents_useful"] == 2 and counts["documents_noisy"] == 4
    assert counts["queries_without_useful"] == 1
    modes = [(r["question_id"], r["mode"], r["num_documents"]) for r in rows]
    assert modes == [("q1", "useful", 2), ("q1", "noisy", 2), ("q2", "noisy", 2)]
    useful = rows[0]
    # the prompt is exactly what the simulator sends at RL time for that many slots
    assert useful["prompt"][0]["content"] == prompts.render(
        query="capital of Peru", k=2, words=30, noisy=False, question=ex().question, answers=("Lima",)
    )
    parsed = split_documents(useful["completion"][0]["content"], 2)
    assert parsed == ["Lima is the capital of Peru.", "Lima has a port."]
    assert all(
        not answer_in_text(t, ["Lima"]) for t in split_documents(rows[1]["completion"][0]["content"], 3)
    )
    # withheld answers: the prompt carries neither question nor answer
    rows2, _ = build_rows(
        items, ContainmentLabeler(), k=3, words_per_doc=30, prompts=prompts, pass_answers=False
    )
    assert "Lima" not in rows2[0]["prompt"][0]["content"]


def test_balance_rows_is_equal_seeded_and_prefers_pairs():
    rows = [{"mode": "useful", "question_id": f"q{i}", "query": "x"} for i in range(3)]
    rows += [{"mode": "noisy", "question_id": f"q{i}", "query": "x"} for i in range(10)]
    a = balance_rows(rows, seed=1)
    assert a == balance_rows(rows, seed=1)
    assert sum(r["mode"] == "useful" for r in a) == sum(r["mode"] == "noisy" for r in a) == 3
    # the noisy rows kept are the ones whose query also has a useful row
    assert sorted(r["question_id"] for r in a if r["mode"] == "noisy") == ["q0", "q1", "q2"]
    # fewer pairs than needed: the rest is filled at random from the larger mode
    rows2 = [{"mode": "useful", "question_id": f"u{i}", "query": "x"} for i in range(4)]
    rows2 += [{"mode": "noisy", "question_id": f"q{i}", "query": "x"} for i in range(10)]
    b = balance_rows(rows2, seed=0)
    assert sum(r["mode"] == "noisy" for r in b) == 4


class FakeJudgeBackend:
    def __init__(self, answers):
        self.answers = answers
        self.prompts = []

    def complete(self, prompts, **kw):
        start = len(self.prompts)
        self.prompts.extend(prompts)
        assert kw["temperature"] == 0.0
        return [self.answers[i % len(self.answers)] for i in range(start, len(self.prompts))]


def test_judge_labels_and_falls_back_to_containment():
    backend = FakeJudgeBackend(["Yes, it does.", " no", "maybe"])
    labeler = JudgeLabeler(backend, batch_size=2)
    items = [(ex(), "Peru is big."), (ex(), "Lima is the capital."), (ex(), "Lima again."), (ex(), "nothing")]
    labels = labeler.label(items)
    # yes -> useful even without the answer; no -> noisy even with it; "maybe" -> containment fallback
    assert labels == [(True, "judge"), (False, "judge"), (True, "contains-fallback"), (True, "judge")]
    assert "Correct answer: Lima" in backend.prompts[0] and "Document: Peru is big." in backend.prompts[0]


def test_judge_rejects_a_wrong_number_of_answers():
    from zerosim.core.search import SearchError

    class Short(FakeJudgeBackend):
        def complete(self, prompts, **kw):
            return ["yes"]

    with pytest.raises(SearchError, match="1 answers for 2 documents"):
        JudgeLabeler(Short([]), batch_size=8).label([(ex(), "a"), (ex(), "b")])


class ListRetriever:
    def __init__(self, n=5):
        self.n = n
        self.calls = []

    def search(self, requests, k):
        self.calls.append((list(requests), k))
        return [
            [
                Document(id=f"{r.query}-{i}", title="", text=f"doc {i} about {r.query}")
                for i in range(min(k, self.n))
            ]
            for r in requests
        ]


def test_policy_queries_record_what_the_policy_searched(tokenizer):
    retriever = ListRetriever(n=6)
    cfg = SimulatorCollectConfig(depth=6, k=2)
    cfg.rollout.max_turns = 2
    questions = [ex(), ex("Capital of Chile?", ("Santiago",), "q2")]

    class Scripted:
        turn = 0

        def generate(self, prompts, n):
            text = "<search> capital city </search>" if self.turn == 0 else "<answer> Lima </answer>"
            self.turn += 1
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            return [Generation(ids, [0.0] * len(ids), "stop") for _ in prompts]

    items = policy_queries(cfg, questions, retriever, generator=Scripted(), tokenizer=tokenizer)
    assert [(i.query, i.example.id) for i in items] == [("capital city", "q1"), ("capital city", "q2")]
    assert all(len(i.documents) == 6 for i in items)  # depth documents for the data...
    ((requests, k),) = retriever.calls
    assert k == 6 and requests[0].noise is None


def test_recording_engine_gives_the_policy_k():
    rec = RecordingEngine(ListRetriever(n=10), depth=8)
    out = rec.search([SearchRequest(query="x", noise=(True, False))], 2)
    assert len(out[0]) == 2 and len(rec.records[0][1]) == 8


def test_collect_config_ranges():
    with pytest.raises(ConfigError, match="k <= depth"):
        load_config(None, ["k=5", "depth=3"], schema=SimulatorCollectConfig)
    with pytest.raises(ConfigError, match="valid values: question, policy"):
        load_config(None, ["queries=logs"], schema=SimulatorCollectConfig)


# -- dataset loading ---------------------------------------------------------------------------------------


def _collected(query, answers, mode, docs):
    prompt = SimulatorPrompts().render(
        query=query, k=len(docs), words=30, noisy=mode == "noisy", question=query, answers=answers
    )
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "completion": [{"role": "assistant", "content": format_completion(docs)}],
        "mode": mode,
        "query": query,
        "answers": list(answers),
    }


def test_preference_pairs_contrast_the_modes_at_equal_length():
    rows = [
        _collected("capital of Peru", ["Lima"], "useful", ["Lima is the capital of Peru.", "Peru: Lima."]),
        _collected(
            "capital of Peru", ["Lima"], "noisy", ["Peru has the Andes.", "Peru grows coffee.", "Cusco"]
        ),
        _collected("capital of Chile", ["Santiago"], "noisy", ["Chile is long."]),  # no useful partner
        _collected("capital of Spain", ["Madrid"], "useful", ["Madrid is big."]),
        _collected("capital of Spain", ["Madrid"], "noisy", ["Madrid again"]),  # mislabelled: skipped
    ]
    pairs = preference_pairs(rows, seed=3)
    assert [p["mode"] for p in pairs] == ["noisy", "useful"]
    for pair in pairs:
        chosen = split_documents(pair["chosen"][0]["content"], 10)
        rejected = split_documents(pair["rejected"][0]["content"], 10)
        assert len(chosen) == len(rejected)
        has = [answer_in_text(" ".join(d), ["Lima"]) for d in (chosen, rejected)]
        assert has == ([False, True] if pair["mode"] == "noisy" else [True, False])
        assert pair["rejected"][0]["role"] == "assistant"
    noisy_pair = pairs[0]
    assert noisy_pair["prompt"] == rows[1]["prompt"]  # the RL-time noisy prompt, not a new one
    # exactly one document swapped for an answer-bearing one
    chosen = split_documents(noisy_pair["chosen"][0]["content"], 10)
    rejected = split_documents(noisy_pair["rejected"][0]["content"], 10)
    assert sum(c != r for c, r in zip(chosen, rejected, strict=True)) == 1
    assert preference_pairs(rows, seed=3) == pairs  # seeded


def test_dpo_dataset_needs_pairable_rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    with pytest.raises(DataError, match="no 'mode', 'query', 'answers' field"):
        load_preference_dataset(path)
    row = _collected("capital of Chile", ["Santiago"], "noisy", ["Chile is long."])
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match="objective=sft"):
        load_preference_dataset(path)


def test_sft_dataset_errors_name_file_line_and_fix(tmp_path):
    with pytest.raises(DataError, match="zerosim simulator collect"):
        load_sft_dataset(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "completion": "c"}\nnot json\n')
    with pytest.raises(DataError, match="line 2: invalid JSON"):
        load_sft_dataset(bad)
    bad.write_text('{"prompt": [{"role": "user", "content": "p"}]}\n')
    with pytest.raises(DataError, match="line 1: no 'completion' field"):
        load_sft_dataset(bad)
    bad.write_text('{"prompt": [{"role": "user"}], "completion": "c"}\n')
    with pytest.raises(DataError, match="list of \\{role, content\\} messages"):
        load_sft_dataset(bad)
    bad.write_text("\n")
    with pytest.raises(DataError, match="has no rows"):
        load_sft_dataset(bad)


# -- quality numbers ---------------------------------------------------------------------------------------


def test_quality_score_by_hand():
    answers = ("Lima",)
    useful = [
        ResultScore.of(docs("Lima is the capital", "Peru is big", "peru is big"), answers),  # answer, 1 dup
        ResultScore.of(docs("Cusco", MISSING_DOC_TEXT, MISSING_DOC_TEXT), answers),  # no answer, 1 real
    ]
    noisy = [
        ResultScore.of(docs("Andes", "Amazon", "Pacific"), answers),  # clean
        ResultScore.of(docs("Lima!", "Andes", "x"), answers),  # leaks
        ResultScore.of(
            docs(MISSING_DOC_TEXT, MISSING_DOC_TEXT, MISSING_DOC_TEXT), answers
        ),  # nothing: not clean
    ]
    r = score(useful, noisy, k=3, seconds=2.0)
    assert r["useful_answer_share"] == 0.5
    assert r["noisy_clean_share"] == pytest.approx(1 / 3)
    assert r["useful_doc_answer_share"] == pytest.approx(1 / 4)
    assert r["noisy_doc_leak_share"] == pytest.approx(1 / 6)
    assert r["useful_valid_answer_share"] == 0.5  # the first: all 3 written, one has the answer
    assert r["noisy_valid_clean_share"] == pytest.approx(1 / 3)  # only the first is whole and clean
    assert r["format_valid"] == pytest.approx(3 / 5)
    assert r["duplicate_rate"] == pytest.approx(1 / 10)
    assert r["mean_words"] == pytest.approx(17 / 10)
    assert r["docs_per_second"] == 5.0


# -- end to end through the CLI -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def factoid_files(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("factoid")
    countries = {"Peru": "Lima", "Chile": "Santiago", "Spain": "Madrid", "Japan": "Tokyo", "Kenya": "Nairobi", "Egypt": "Cairo"}  # fmt: skip
    qa = tmp_path / "qa.jsonl"
    qa.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "question": f"What is the capital of {c}?", "golden_answers": [a]})
            + "\n"
            for i, (c, a) in enumerate(countries.items())
        )
    )
    corpus = tmp_path / "corpus.jsonl"
    lines = []
    for i, (c, a) in enumerate(countries.items()):
        lines.append(
            {
                "id": f"cap{i}",
                "contents": f"{c}\n{c} - Government - Capital: {a} | {c} - Government - Type: republic",
            }
        )
        lines.append(
            {
                "id": f"geo{i}",
                "contents": f"{c}\n{c} - Geography - Area: large | {c} - Geography - Climate: varied",
            }
        )
    corpus.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return qa, corpus


@pytest.fixture(scope="module")
def collected(factoid_files, zerosim_cli, tmp_path_factory):
    """``zerosim simulator collect`` over BM25 on the six factoid questions: (SFT file, stdout)."""
    qa, corpus = factoid_files
    data = tmp_path_factory.mktemp("collect") / "sft.jsonl"
    proc = zerosim_cli("simulator", "collect", "--data", qa, "--search", "bm25", "--out", data,
                       f"search.bm25.corpus={corpus}", "depth=4", "k=2", "words_per_doc=12")  # fmt: skip
    return data, proc.stdout


def test_cli_collect_writes_balanced_labelled_rows(collected):
    data, stdout = collected
    report = json.loads(Path(str(data) + ".report.json").read_text())
    assert json.loads(stdout) == report
    assert report["questions"] == 6 and report["rows"]["useful"] == report["rows"]["noisy"] > 0
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == sum(report["rows"].values())
    for row in rows:
        text = row["completion"][0]["content"]
        assert answer_in_text(text, row["answers"]) == (row["mode"] == "useful")
    from datasets import load_dataset

    assert load_dataset("json", data_files=str(data), split="train").num_rows == len(rows)


@pytest.mark.parametrize(("lora", "objective"), [(False, "sft"), (True, "sft"), (True, "dpo")])
def test_cli_train_then_eval(
    tmp_path, tiny_model_dir, factoid_files, collected, mlflow_db, zerosim_cli, lora, objective
):
    """Each way to train writes a merged checkpoint and its MLflow run; the eval of a checkpoint (the same
    command whatever trained it) runs once, on the full fine-tune."""
    import mlflow

    qa, _ = factoid_files
    data, _ = collected
    db = f"tracking.tracking_uri={mlflow_db}"
    mode = "--lora" if lora else "--full"
    ckpt = zerosim_cli("simulator", "train", "--data", data, "--model", tiny_model_dir, mode, "--max-steps", 2,
                       "--output-dir", tmp_path / "sim", "batch_size=2", "max_length=256",
                       f"objective={objective}", db).stdout.strip()  # fmt: skip
    ckpt = Path(ckpt.splitlines()[-1])
    assert ckpt == tmp_path / "sim" / "simulator-sft" / "final"
    assert (ckpt / "model.safetensors").is_file() and not (ckpt / "adapter_config.json").exists()

    mlflow.set_tracking_uri(mlflow_db)
    client = mlflow.MlflowClient()
    (sft,) = mlflow.search_runs(experiment_names=["zerosim-simulator"], output_format="list")
    assert sft.data.tags["zerosim.job"] == "simulator-sft"
    assert sft.info.status == "FINISHED" and sft.data.tags["zerosim.checkpoint"] == str(ckpt.resolve())
    assert sft.data.params["sft.lora"] == str(lora)
    assert sft.data.tags["zerosim.objective"] == objective
    assert [m.step for m in client.get_metric_history(sft.info.run_id, "loss")] == [1, 2]
    if objective == "dpo":  # TRL's preference metrics reach MLflow
        assert len(client.get_metric_history(sft.info.run_id, "rewards/margins")) == 2
    assert {a.path for a in client.list_artifacts(sft.info.run_id, "plots")} == {"plots/sft.png"}
    if lora:
        return

    out = zerosim_cli("simulator", "eval", "--model", ckpt, "--data", qa, "--limit", 3, "k=2", "batch_size=2",
                      "simulator.max_new_tokens=12", f"output_dir={tmp_path / 'q'}", "run_name=q", db).stdout  # fmt: skip
    assert "| simulator | n |" in out
    table = json.loads((tmp_path / "q" / "q" / "table.json").read_text())
    assert table["results"] == 6 and 0.0 <= table["useful_answer_share"] <= 1.0
    samples = (tmp_path / "q" / "q" / "samples.jsonl").read_text().splitlines()
    assert [json.loads(s)["mode"] for s in samples] == ["useful"] * 2 + ["noisy"] * 2 + ["useful", "noisy"]
    runs = mlflow.search_runs(experiment_names=["zerosim-simulator"], output_format="list")
    (ev,) = [r for r in runs if r.data.tags["zerosim.job"] == "simulator-eval"]
    assert ev.data.metrics["results"] == 6.0
    assert {"table.json", "table.md", "samples.jsonl", "plots"} <= {
        a.path for a in client.list_artifacts(ev.info.run_id)
    }


def test_cli_collect_refuses_a_simulator_as_retriever(tmp_path, factoid_files, zerosim_cli):
    qa, _ = factoid_files
    result = zerosim_cli("simulator", "collect", "--data", qa, "--search", "simulator", "--out", tmp_path / "x.jsonl", code=2)  # fmt: skip
    assert "needs a real retriever" in result.stderr
    assert not (tmp_path / "x.jsonl").exists()

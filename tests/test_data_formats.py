"""Bring your own data (issue 18, items 1-2): FlashRAG datasets as published — a local FlashRAG folder by
``DIR:NAME:SPLIT`` and the hub by ``REPO:NAME:SPLIT`` — and Search-R1's training parquet, each read as it is
from a small file written here in that format (no hub access: the hub call is intercepted, the code path real).
"""

import json

import pytest

from zerosim.core.data import DataError, load_qa

FLASHRAG_NAMES = ["nq", "hotpotqa", "triviaqa", "popqa", "2wikimultihopqa", "musique", "bamboogle"]


def _rows(name: str, n: int = 2) -> list[dict]:
    return [
        {"id": f"{name}-{i}", "question": f"{name} question {i}?", "golden_answers": [f"{name} answer {i}"],
         "metadata": {}}
        for i in range(n)
    ]  # fmt: skip


def _flashrag(root, names=FLASHRAG_NAMES, split="test", n=2):
    """FlashRAG's layout: one folder per dataset, its files named after their split."""
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(name, n)))
    return root


# -- 1. FlashRAG datasets as published --------------------------------------------------------------------


def test_a_flashrag_folder_is_read_by_dir_name_split(tmp_path):
    import pandas as pd

    root = _flashrag(tmp_path / "flashrag", ["nq"])
    (root / "hotpotqa").mkdir()
    pd.DataFrame(_rows("hotpotqa", 3)).drop(columns="metadata").to_parquet(
        root / "hotpotqa" / "dev.parquet"
    )  # .parquet files too
    nq = load_qa(f"{root}:nq:test")
    assert [e.id for e in nq] == ["nq-0", "nq-1"] and nq[0].golden_answers == ("nq answer 0",)
    assert [e.id for e in load_qa(f"{root}:hotpotqa:dev", split="train", limit=2)] == [
        "hotpotqa-0",
        "hotpotqa-1",
    ]
    assert len(load_qa(f"{root}:nq", split="test")) == 2  # DIR:NAME takes the caller's split
    # a folder whose own path holds ':' (POSIX allows it) still parses: the spec is split from the right
    _flashrag(tmp_path / "runs:v1", ["nq"])
    assert len(load_qa(f"{tmp_path}/runs:v1:nq:test")) == 2
    # an existing file wins over spec parsing, whatever its name
    odd = tmp_path / "nq:x:test"
    odd.write_text(json.dumps(_rows("odd")[0]) + "\n")
    assert [e.id for e in load_qa(str(odd))] == ["odd-0"]


@pytest.mark.parametrize(
    "spec, words",
    [
        ("{root}:tq:test", ["{root}:tq:test", "no folder 'tq'", "its folders: nq", "DIR/NAME/SPLIT.jsonl"]),
        ("{root}:nq:dev", ["{root}:nq:dev", "no dev.jsonl or dev.parquet", "its files: test.jsonl"]),
        ("{root}/missing:nq:test", ["{root}/missing:nq:test", "tried", "no such folder", "DIR:NAME:SPLIT",
                                    "REPO:NAME:SPLIT"]),
        ("{root}:nq+hotpotqa:test", ["several data sets (nq, hotpotqa)", "name one"]),
    ],
    ids=["unknown-dataset", "unknown-split", "missing-folder", "several-names-for-one-setting"],
)  # fmt: skip
def test_a_bad_spec_names_itself_what_was_tried_and_the_forms(tmp_path, spec, words):
    root = _flashrag(tmp_path / "flashrag", ["nq"])
    with pytest.raises(DataError) as error:
        load_qa(spec.format(root=root), split="test")
    for word in words:
        assert word.format(root=root) in str(error.value)


def test_a_hub_dataset_with_a_config_goes_through_load_dataset(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(path, name=None, *, split=None):
        calls.append((path, name, split))
        if name == "nope":
            raise ValueError("BuilderConfig 'nope' not found. Available: ['nq', 'hotpotqa']")
        return datasets.Dataset.from_list(_rows(name, 3))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    examples = load_qa("RUC-NLPIR/FlashRAG_datasets:nq:test", split="train", limit=2)  # the spec's split wins
    assert calls == [("RUC-NLPIR/FlashRAG_datasets", "nq", "test")]
    assert [e.id for e in examples] == ["nq-0", "nq-1"]
    with pytest.raises(DataError) as error:
        load_qa("RUC-NLPIR/FlashRAG_datasets:nope:test")
    message = str(error.value)
    assert message.startswith("RUC-NLPIR/FlashRAG_datasets:nope:test: datasets.load_dataset(")
    assert "BuilderConfig 'nope' not found" in message and "REPO:NAME:SPLIT" in message


def test_eval_names_each_dataset_by_its_own_name(tmp_path):
    from eval.run import dataset_names
    from zerosim.core.config import ConfigError

    root = _flashrag(tmp_path / "flashrag", ["nq", "hotpotqa"])
    _flashrag(tmp_path / "other", ["nq"])
    hub = "RUC-NLPIR/FlashRAG_datasets"
    specs = [f"{root}:nq:test", f"{root}:hotpotqa", f"{hub}:popqa:test", f"{hub}:popqa:dev", "factbook"]
    named = dataset_names(specs, "test")
    assert [n for n, _, _ in named] == ["nq", "hotpotqa", "popqa", "popqa:dev", "factbook"]
    assert named[1][1:] == (f"{root}:hotpotqa", "test")  # DIR:NAME: the default split
    # the same name from two folders: told apart by the folder, as files are
    names = [n for n, _, _ in dataset_names([f"{root}:nq:test", f"{tmp_path / 'other'}:nq:test"], "test")]
    assert names == ["flashrag/nq", "other/nq"]
    # DIR:nq:test, DIR:nq and DIR/nq/test.jsonl are one file
    for other in (str(root / "nq" / "test.jsonl"), f"{root}:nq"):
        with pytest.raises(ConfigError, match="twice"):
            dataset_names([f"{root}:nq:test", other], "test")


def test_seven_flashrag_datasets_evaluate_in_one_command(tmp_path, tiny_model_dir, mlflow_db, zerosim_cli):
    import mlflow

    root = _flashrag(tmp_path / "flashrag")
    zerosim_cli(
        "eval", "--policy", tiny_model_dir, "--method", "direct", "--dataset", f"{root}:{'+'.join(FLASHRAG_NAMES)}:test",
        "batch_size=14", "max_answer_tokens=2", "num_sample_trajectories=1", f"output_dir={tmp_path / 'out'}",
        f"tracking.tracking_uri={mlflow_db}",
    )  # fmt: skip
    rows = json.loads((tmp_path / "out" / "direct-none" / "table.json").read_text())
    assert [r["dataset"] for r in rows] == [*FLASHRAG_NAMES, "average"]
    assert all(r["n"] == 2 for r in rows[:-1])
    mlflow.set_tracking_uri(mlflow_db)
    (run,) = mlflow.search_runs(experiment_names=["zerosim-eval"], output_format="list")
    assert {f"{name}/em" for name in FLASHRAG_NAMES} <= set(run.data.metrics)


def test_train_dry_run_resolves_flashrag_specs(tmp_path):
    from zerosim.training.config import load_train_config
    from zerosim.training.dry_run import plan

    root = _flashrag(tmp_path / "flashrag", ["nq"], split="train")
    rows = dict(plan(load_train_config(None, [f"data.train={root}:nq:train"])))
    assert rows["data"] == f"{root / 'nq' / 'train.jsonl'} (2 questions, every row checked)"
    rows = dict(plan(load_train_config(None, ["data.train=RUC-NLPIR/FlashRAG_datasets:nq:dev"])))
    assert rows["data"] == "RUC-NLPIR/FlashRAG_datasets:nq:dev (dev; Hugging Face dataset, read at start)"


# -- 2. Search-R1's training parquet ------------------------------------------------------------------------

SEARCH_R1_PREFIX = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: "
)


def _search_r1_row(i: int, question: str, answers: list[str], source: str = "nq") -> dict:
    """One row as Search-R1's scripts/data_process/*_search.py write it."""
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": f"{SEARCH_R1_PREFIX}{question}\n"}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
        "extra_info": {"split": "train", "index": i},
    }


def test_search_r1_training_parquet_loads_as_questions_with_answers(tmp_path, zerosim_cli, monkeypatch):
    import pandas as pd

    from zerosim.core.data.qa import parse_qa_row

    path = tmp_path / "train.parquet"
    pd.DataFrame([
        _search_r1_row(0, "who wrote the iliad?", ["Homer"]),
        _search_r1_row(1, "what is the capital of peru?", ["Lima", "Lima, Peru"], source="hotpotqa"),
    ]).to_parquet(path)  # fmt: skip
    first, second = load_qa(path)
    assert (first.id, first.question, first.golden_answers) == ("0", "who wrote the iliad?", ("Homer",))
    assert (second.id, second.golden_answers) == ("1", ("Lima", "Lima, Peru"))
    assert second.metadata["data_source"] == "hotpotqa" and second.metadata["extra_info"]["split"] == "train"
    # pandas reads list columns as numpy arrays: the same rows, handed over as pandas has them
    for i, row in enumerate(pd.read_parquet(path).to_dict("records")):
        assert type(row["reward_model"]["ground_truth"]["target"]).__name__ == "ndarray"
        assert parse_qa_row(f"{path} row {i + 1}", row, i) == (first, second)[i]
    # the dry run reads it as training data
    monkeypatch.chdir(tmp_path)
    shown = " ".join(
        zerosim_cli("train", "--dry-run", f"data.train={path}", env={"WORLD_SIZE": None}).stdout.split()
    )
    assert str(path) in shown and "2 questions" in shown


def test_search_r1_rows_prefer_the_question_and_id_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # nq_search files keep FlashRAG's id and question next to the prompt; no extra_info here: row number
    row = {
        **_search_r1_row(0, "who wrote the iliad?", ["Homer"]),
        "question": "Who wrote the Iliad?",
        "id": None,
    }
    del row["extra_info"]
    path = tmp_path / "nq_search.parquet"
    pq.write_table(pa.Table.from_pylist([row, {**row, "id": "train_7"}]), path)
    first, second = load_qa(path)
    assert (first.id, first.question) == ("0", "Who wrote the Iliad?")
    assert second.id == "train_7"


@pytest.mark.parametrize(
    "change, words",
    [
        (
            lambda r: r["prompt"][0].update(content="Tell me who wrote the Iliad."),
            "no 'Question: <question>'",
        ),
        (lambda r: r["reward_model"]["ground_truth"].update(target=[]), "'reward_model.ground_truth.target'"),
    ],
    ids=["no-question-in-prompt", "empty-target"],
)
def test_a_bad_search_r1_row_names_file_row_and_fix(tmp_path, change, words):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good, bad = _search_r1_row(0, "q?", ["Lima"]), _search_r1_row(1, "q?", ["Lima"])  # not "a" (an article)
    change(bad)
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([good, bad]), path)
    with pytest.raises(DataError) as error:
        load_qa(path)
    assert str(error.value).startswith(f"{path} row 2: ") and words in str(error.value)
    assert "add a 'question' column" in str(error.value) or '"target": ["answer", ...]' in str(error.value)

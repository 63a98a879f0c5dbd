"""Shared fixtures: a tiny random Llama with the SmolLM2 tokenizer, a tiny sentence encoder and cross-encoder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(autouse=True)
def _cpu_precision_kept():
    """A command run in-process decides the process's CPU precision (runtime.bf16: bf16 on AMX/AVX512_BF16);
    each test starts from the library's default (fp32) whatever the one before it ran."""
    from zerosim.core import runtime

    yield
    runtime._CPU_BF16 = False


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from zerosim.core.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from zerosim.core.models import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


def _tiny_bert(**extra):
    """The MiniLM tokenizer and a 1-layer 32-d BERT config over its vocabulary (``extra`` added)."""
    from transformers import AutoTokenizer, BertConfig

    from eval.dense import resolve_encoder

    tokenizer = AutoTokenizer.from_pretrained(resolve_encoder("minilm")[1])
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
        **extra,
    )
    return tokenizer, config


@pytest.fixture(scope="session")
def tiny_encoder(tmp_path_factory):
    """A 1-layer 32-d BERT with random weights and the MiniLM vocabulary, saved as a sentence-transformers folder."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertModel

    root = tmp_path_factory.mktemp("tiny-encoder")
    tokenizer, config = _tiny_bert()
    torch.manual_seed(0)
    BertModel(config).save_pretrained(root / "bert")
    tokenizer.save_pretrained(root / "bert")
    modules = [Transformer(str(root / "bert"), max_seq_length=128), Pooling(32, "mean")]
    SentenceTransformer(modules=modules, device="cpu").save(str(root / "st"))
    return str(root / "st")


@pytest.fixture(scope="session")
def tiny_cross_encoder(tmp_path_factory):
    """A 1-layer BERT sequence classifier (1 label, random weights) with the MiniLM vocabulary."""
    import torch
    from transformers import BertForSequenceClassification

    folder = tmp_path_factory.mktemp("tiny-cross-encoder")
    # wide random weights, so pair scores are far apart
    tokenizer, config = _tiny_bert(num_labels=1, initializer_range=0.5)
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def capitals(tmp_path):
    """``capitals(n)`` writes ``qa.jsonl`` (n questions "What is the capital of country X?") and
    ``corpus.jsonl`` (8 passages naming each capital) into ``tmp_path``; returns both paths."""
    import json

    def write(n: int = 8):
        letters = "ABCDEFGH"
        rows = [
            {
                "id": f"q{i}",
                "question": f"What is the capital of country {c}?",
                "golden_answers": [f"City{c}"],
            }
            for i, c in enumerate(letters[:n])
        ]
        qa = tmp_path / "qa.jsonl"
        qa.write_text("".join(json.dumps(r) + "\n" for r in rows))
        corpus = tmp_path / "corpus.jsonl"
        corpus.write_text(
            "".join(
                json.dumps(
                    {"id": f"p{i}", "contents": f"Country {c}\nThe capital of country {c} is City{c}."}
                )
                + "\n"
                for i, c in enumerate(letters)
            )
        )
        return qa, corpus

    return write


@pytest.fixture(scope="session")
def _mlflow_template(tmp_path_factory):
    """An empty MLflow sqlite store with its tables created (the migrations take seconds per new store)."""
    import mlflow

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{path}")
    client.search_experiments()  # creates and migrates the tables
    return path


@pytest.fixture
def mlflow_db(tmp_path, _mlflow_template):
    """A fresh MLflow store for this test: ``sqlite:///<tmp_path>/mlflow.db``, copied from an empty one."""
    import shutil

    path = tmp_path / "mlflow.db"
    shutil.copyfile(_mlflow_template, path)
    return f"sqlite:///{path}"


@pytest.fixture(scope="session")
def zerosim_cli():
    """``zerosim_cli(*args)`` runs ``zerosim ARGS`` in this process through typer's CliRunner — the same
    command tree as the console script, without a new interpreter importing torch, transformers, TRL and
    MLflow for every command — and returns the result (``stdout``, ``stderr``, ``exit_code``), asserting
    exit code 0 unless ``code=`` says otherwise. What a command changes for the whole process is put back
    after each call: the environment (thread counts, ``MLFLOW_TRACKING_URI``), torch's thread count, the CPU
    precision, an MLflow run left active. Tests that kill a run or need a process of their own start ``python -m
    zerosim.cli``."""
    import traceback

    import mlflow
    import torch
    from typer.testing import CliRunner

    from zerosim.cli import app
    from zerosim.core import runtime

    def run(*args, code: int | None = 0, env=None):
        environ, threads = dict(os.environ), torch.get_num_threads()
        bf16 = runtime._CPU_BF16, runtime._CPU_BF16_GENERATION
        try:
            result = CliRunner().invoke(
                app, [str(a) for a in args], env={"ZEROSIM_DEBUG": None, **(env or {})}
            )
        finally:
            while mlflow.active_run() is not None:
                mlflow.end_run()
            os.environ.clear()
            os.environ.update(environ)
            torch.set_num_threads(threads)
            runtime._CPU_BF16, runtime._CPU_BF16_GENERATION = bf16  # what the command decided (runtime.bf16)
        if code is not None and result.exit_code != code:
            trace = "".join(traceback.format_exception(result.exception)) if result.exception else ""
            raise AssertionError(
                f"zerosim {' '.join(map(str, args))[:300]}\nexit code {result.exit_code}, expected {code}\n"
                f"{result.stderr[-4000:]}\n{trace[-4000:]}"
            )
        return result

    return run


_REPO = Path(__file__).resolve().parents[1]
_SMOKE = _REPO / "configs" / "experiments" / "sim-vs-real-smoke.yaml"


@pytest.fixture
def tiny_experiment(tmp_path, tiny_model_dir, capitals):
    """The smoke preset pointed at the tiny model, a tiny corpus and QA file, and a temporary store."""
    import yaml

    qa, corpus = capitals(8)
    cfg = yaml.safe_load(_SMOKE.read_text())
    cfg["base"] = str(_REPO / cfg["base"])
    cfg["output_dir"] = str(tmp_path / "experiments")
    cfg["tracking"] = {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "exp"}
    cfg["runtime"] = {"threads": 1}
    data = [f"data.train={qa}", f"search.bm25.corpus={corpus}", f"search.dense.corpus={corpus}"]
    cfg["overrides"] += [
        f"policy.model={tiny_model_dir}", f"search.simulator.model={tiny_model_dir}", *data,
        f"warmstart.data={qa}", f"warmstart.search.bm25.corpus={corpus}", "rollout.max_new_tokens=8",
        "search.simulator.max_new_tokens=16",
    ]  # fmt: skip
    sim = cfg["simulator"]
    sim["collect"] += [f"data={qa}", f"search.bm25.corpus={corpus}", "max_questions=8"]
    sim["sft"] += [f"model={tiny_model_dir}", "max_length=128"]
    sim["dpo_overrides"] += ["max_length=128"]
    sim["quality"] += [f"data={qa}", "limit=2", "split=train", "simulator.max_new_tokens=16"]
    cfg["eval"].update(datasets=[str(qa)], limit=4, batch_size=4)
    cfg["eval"]["overrides"] = ["max_answer_tokens=8"]
    path = tmp_path / "smoke.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, tmp_path

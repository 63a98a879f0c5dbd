"""Shared fixtures: a tiny random Llama with the SmolLM2 tokenizer, and an isolated MLflow store."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from zerosim.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from zerosim.models import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))

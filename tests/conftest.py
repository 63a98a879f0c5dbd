"""Shared fixtures: a tiny random Llama with the SmolLM2 tokenizer, a tiny sentence encoder."""

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


@pytest.fixture(scope="session")
def tiny_encoder(tmp_path_factory):
    """A 1-layer 32-d BERT with random weights and the MiniLM vocabulary, saved as a sentence-transformers folder."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import AutoTokenizer, BertConfig, BertModel

    from eval.dense import resolve_encoder

    root = tmp_path_factory.mktemp("tiny-encoder")
    tokenizer = AutoTokenizer.from_pretrained(resolve_encoder("minilm")[1])
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    BertModel(config).save_pretrained(root / "bert")
    tokenizer.save_pretrained(root / "bert")
    modules = [Transformer(str(root / "bert"), max_seq_length=128), Pooling(32, "mean")]
    SentenceTransformer(modules=modules, device="cpu").save(str(root / "st"))
    return str(root / "st")


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

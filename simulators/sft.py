"""``zerosim simulator train``: supervised fine-tuning of the simulator LLM with TRL's ``SFTTrainer``.

The dataset is the jsonl from ``zerosim simulator collect`` (conversational ``prompt``/``completion``);
the loss is on the completion only (the documents), full fine-tuning or a LoRA adapter (peft). The result
is a checkpoint any simulator config can name (``search.simulator.model``), and an MLflow run with the
config, the loss curve and the checkpoint path as a tag.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from zerosim.config import SimulatorTrainConfig
from zerosim.fsutil import atomic_directory

REQUIRED_COLUMNS = ("prompt", "completion")


class DatasetError(ValueError):
    """The SFT dataset is missing, empty or not in the prompt/completion form."""


def _check_row(path: Path, line_no: int, row: object) -> None:
    where = f"{path}, line {line_no}"
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    for column in REQUIRED_COLUMNS:
        value = row.get(column)
        if value is None:
            raise DatasetError(
                f"{where}: no '{column}' field; rows need 'prompt' and 'completion' "
                "(write the dataset with `zerosim simulator collect`)"
            )
        ok = isinstance(value, str) or (
            isinstance(value, list)
            and value
            and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value)
        )
        if not ok:
            raise DatasetError(
                f"{where}: '{column}' must be a string or a list of {{role, content}} messages"
            )


def load_sft_dataset(path: str | Path):
    """The prompt/completion rows of ``path`` as a ``datasets.Dataset``; every row checked first."""
    from datasets import Dataset

    path = Path(path)
    if not path.is_file():
        raise DatasetError(
            f"SFT dataset {path} does not exist; build one with `zerosim simulator collect --out {path}`"
        )
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}, line {line_no}: not valid JSON ({exc.msg})") from None
            _check_row(path, line_no, row)
            rows.append({c: row[c] for c in REQUIRED_COLUMNS})
    if not rows:
        raise DatasetError(f"SFT dataset {path} has no rows")
    return Dataset.from_list(rows)


def _lora_config(cfg: SimulatorTrainConfig):
    from peft import LoraConfig

    targets = cfg.lora_target_modules
    return LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")],
        task_type="CAUSAL_LM",
    )


def run_sft(cfg: SimulatorTrainConfig) -> Path:
    """Fine-tune ``cfg.model`` on ``cfg.data``; returns the checkpoint directory (written atomically)."""
    import mlflow
    import torch
    from trl import SFTConfig, SFTTrainer

    from zerosim.models import load_causal_lm, load_tokenizer
    from zerosim.tracking import SFT_PLOTTED, log_config, log_training_curves, mlflow_run

    dataset = load_sft_dataset(cfg.data)
    tokenizer = load_tokenizer(cfg.model)
    tokenizer.padding_side = "right"  # training pads on the right; generation code sets its own side
    model = load_causal_lm(cfg.model, cfg.dtype)
    on_gpu = torch.cuda.is_available()
    out = Path(cfg.output_dir) / cfg.name
    args = SFTConfig(
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
        completion_only_loss=True,  # learn to write documents, not to repeat the instructions
        gradient_checkpointing=False,
        dataloader_num_workers=0,
    )
    target = out / "final"
    tags = {"zerosim.job": "simulator-sft", "zerosim.base_model": cfg.model}
    with mlflow_run(cfg.tracking, cfg.name, tags=tags):
        log_config(cfg, prefix="sft.")
        mlflow.log_params({"sft.rows": len(dataset)})
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=_lora_config(cfg) if cfg.lora else None,
        )
        trainer.train()
        with atomic_directory(target) as tmp:
            trained = trainer.model
            if cfg.lora and cfg.merge_lora:
                trained = trained.merge_and_unload()
            trained.save_pretrained(str(tmp))
            tokenizer.padding_side = "left"  # what batched generation with this checkpoint wants
            tokenizer.save_pretrained(str(tmp))
        log_training_curves(trainer.state.log_history, "plots/sft.png", SFT_PLOTTED)
        mlflow.set_tag("zerosim.checkpoint", str(target.resolve()))
        mlflow.set_tag("zerosim.lora_adapter", str(cfg.lora and not cfg.merge_lora).lower())
    shutil.rmtree(out / "trainer", ignore_errors=True)
    return target

"""The collapse guard: signs that a run has fallen onto one answer or stopped learning, and what it does then.

Three triggers, read at each step's end (validation) and each logged step (the rest):

- **silence** — every trajectory of ``patience`` logged steps in a row scored exactly 0 (TRL's
  ``frac_reward_zero_std`` = 1 and reward 0): no estimator here has a gradient left;
- **one answer** — for ``patience`` logged steps in a row, one answer was given to more than
  ``answer_share`` of the rollout's recent questions (``collapse/top_answer_share``, logged by
  :class:`zerosim.training.trl_rollout.TRLRollout` over its last ``trainer.collapse_window`` questions) —
  the collapse a format or partial-credit reward keeps above 0, so the silence trigger never sees it;
- **validation fall** — greedy validation EM (``val/em``) fell more than ``val_drop`` below its best.

``action="stop"`` ends training there. ``action="rollback"`` restores the best validated weights (kept in
``<run>/best`` whenever validation EM improves, step 0's pass included), restarts the optimizer's moments,
multiplies the learning rate by ``lr_factor`` and goes on; a trigger after that stops. Either way
``collapsed_at`` (the first trigger's step) and ``events`` say what happened; the recipe tags the MLflow run.
With ``keep_best`` (``trainer.final_policy=best``) the run's final checkpoint holds the best validated
weights, not the last step's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

log = logging.getLogger(__name__)

BEST_DIR = "best"  # <run>/best: the best validated policy (model + tokenizer), written whole or not at all


@dataclass
class GuardEvent:
    step: int
    trigger: str  # silence | one_answer | validation_fall
    action: str  # stop | rollback
    detail: str

    def line(self) -> str:
        return f"step {self.step}: {self.trigger} ({self.detail}) -> {self.action}"


def load_saved(model, state: dict[str, torch.Tensor], source: Path) -> None:
    """``state`` (what ``save_model`` wrote to ``source``) back into ``model``: a full policy's weights, or a
    LoRA policy's adapters (``policy.lora``: saved under peft's names, without the adapter's name); raises when
    they do not fit it."""
    from accelerate.utils import is_peft_model

    if is_peft_model(model):
        from peft import set_peft_model_state_dict

        loaded = set_peft_model_state_dict(model, state)
        missing = [k for k in loaded.missing_keys if "lora_" in k]  # the base is not in an adapter's file
        unexpected = list(loaded.unexpected_keys)
    else:
        missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k}  # tied embeddings are saved once
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"collapse guard: {source} does not fit the policy (missing {sorted(set(missing) - tied)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )


class CollapseGuard(TrainerCallback):
    """Watches the logged signals of a run and stops it or rolls it back (see the module docstring).

    ``CollapseGuard(patience)`` alone is the silence trigger with ``action="stop"``, as before the other
    triggers existed. :meth:`bind` gives it the trainer (needed to roll back or keep the best weights), the
    run folder, the validation callback and the tokenizer; without them it can only stop."""

    def __init__(
        self,
        patience: int,
        *,
        answer_share: float | None = None,
        val_drop: float | None = None,
        action: str = "stop",
        lr_factor: float = 0.5,
        keep_best: bool = False,
    ):
        if action not in ("stop", "rollback"):
            raise ValueError(f"collapse action is 'stop' or 'rollback', got {action!r}")
        self.patience = patience
        self.answer_share = answer_share
        self.val_drop = val_drop
        self.action = action
        self.lr_factor = lr_factor
        self.keep_best = keep_best
        self.streak = 0  # silent logged steps in a row
        self.answer_streak = 0  # logged steps in a row over answer_share
        self.collapsed_at: int | None = None
        self.rollbacks = 0
        self.best_em: float | None = None
        self.best_step: int | None = None
        self.events: list[GuardEvent] = []
        self.trainer = None
        self.run_dir: Path | None = None
        self.validation = None
        self.tokenizer = None
        self._seen_validations = 0

    def bind(self, trainer, run_dir: Path, validation=None, tokenizer=None) -> CollapseGuard:
        self.trainer, self.run_dir, self.validation, self.tokenizer = (
            trainer,
            Path(run_dir),
            validation,
            tokenizer,
        )
        return self

    @property
    def needs_best(self) -> bool:
        """Whether the best validated weights are kept on disk (a rollback target, or the final policy)."""
        return self.action == "rollback" or self.keep_best

    @property
    def best_dir(self) -> Path | None:
        if self.run_dir is None or self.best_step is None:
            return None
        path = self.run_dir / BEST_DIR
        from zerosim.core.models import is_model_folder

        return path if is_model_folder(path) else None  # a LoRA policy's best/ is its adapter

    # -- triggers (the guard's callback runs after validation's: it sees each pass at the weights it scored) --
    def on_train_begin(self, args, state, control, **kwargs):
        self._note_validation()  # step 0's pass: the starting policy is the first best

    def on_step_end(self, args, state, control, **kwargs):
        fall = self._note_validation()
        if fall is not None:
            self._act(int(state.global_step), *fall, control)

    def on_log(self, args, state, control, logs=None, **kwargs):
        trigger = self._trigger(logs) if logs else None
        if trigger is not None:
            self._act(int(state.global_step), *trigger, control)

    def on_train_end(self, args, state, control, **kwargs):
        self._note_validation()  # the pass validation runs when training ends: its weights may be the best

    def _trigger(self, logs: dict[str, float]) -> tuple[str, str] | None:
        if "reward" in logs and self.patience >= 1:
            silent = logs.get("frac_reward_zero_std", 0.0) >= 1.0 and abs(logs["reward"]) < 1e-12
            self.streak = self.streak + 1 if silent else 0
            if self.streak >= self.patience:
                return "silence", f"every trajectory scored 0 for {self.streak} logged steps"
        share = logs.get("collapse/top_answer_share")
        if self.answer_share is not None and share is not None:
            self.answer_streak = self.answer_streak + 1 if share > self.answer_share else 0
            if self.answer_streak >= max(1, self.patience):
                return "one_answer", (
                    f"one answer on {share:.0%} of recent questions (> {self.answer_share:.0%}) for "
                    f"{self.answer_streak} logged steps"
                )
        return None

    def _note_validation(self) -> tuple[str, str] | None:
        """Read the validation passes run since the last look: keep the best weights; a fall below the best by
        more than ``val_drop`` is a trigger."""
        history = [] if self.validation is None else self.validation.history
        fresh = history[self._seen_validations :]
        self._seen_validations = len(history)
        fall = None
        for entry in fresh:
            em = float(entry.get("val/em", float("nan")))
            if em != em:  # NaN: nothing validated
                continue
            if self.best_em is None or em > self.best_em:
                self.best_em, self.best_step = em, int(entry["step"])
                if self.needs_best:
                    self._save_best()
            elif self.val_drop is not None and em < self.best_em - self.val_drop:
                fall = (
                    "validation_fall",
                    f"validation EM {em:.3f} at step {entry['step']}, best {self.best_em:.3f} at step "
                    f"{self.best_step} (fall > {self.val_drop:g})",
                )
        return fall

    def _act(self, step: int, trigger: str, detail: str, control) -> None:
        if self.collapsed_at is None:
            self.collapsed_at = step
        can_roll_back = self.action == "rollback" and self.rollbacks == 0 and self.best_dir is not None
        action = "rollback" if can_roll_back else "stop"
        event = GuardEvent(step, trigger, action, detail)
        self.events.append(event)
        log.warning("collapse guard: %s", event.line())
        self.streak = self.answer_streak = 0
        if action == "stop":
            control.should_training_stop = True
            return
        self._roll_back()

    # -- the best weights, and going back to them ------------------------------------------------------------
    def _save_best(self) -> None:
        if self.trainer is None or self.run_dir is None:
            return
        from zerosim.core.distributed import process_state, shared_atomic_directory

        trainer = self.trainer
        with shared_atomic_directory(self.run_dir / BEST_DIR, process_state()) as tmp:
            trainer.save_model(str(tmp))  # every rank (ZeRO-3 / FSDP gather); the main one writes
            if trainer.accelerator.is_main_process and self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(tmp))

    def _roll_back(self) -> None:
        """The best validated weights back into the policy, the optimizer's moments restarted, the learning
        rate scaled by ``lr_factor`` (every rank does the same: the triggers read all-reduced signals)."""
        from safetensors.torch import load_file

        trainer = self.trainer
        best = self.best_dir
        files = sorted(best.glob("*.safetensors"))
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        load_saved(trainer.accelerator.unwrap_model(trainer.model), state, best)
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
        optimizer.state.clear()
        for group in optimizer.param_groups:
            group["lr"] *= self.lr_factor
        scheduler = trainer.lr_scheduler
        if scheduler is not None and hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * self.lr_factor for lr in scheduler.base_lrs]
        self.rollbacks += 1

    # -- resume ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "collapse_streak": int(self.streak),
            "answer_streak": int(self.answer_streak),
            "rollbacks": int(self.rollbacks),
            "best_em": self.best_em,
            "best_step": self.best_step,
            "collapsed_at": self.collapsed_at,
            "seen_validations": int(self._seen_validations),
            "events": [vars(e) for e in self.events],
        }

    def load_state_dict(self, payload: dict[str, Any]) -> None:
        self.streak = int(payload.get("collapse_streak", 0))
        self.answer_streak = int(payload.get("answer_streak", 0))
        self.rollbacks = int(payload.get("rollbacks", 0))
        self.best_em = payload.get("best_em")
        self.best_step = payload.get("best_step")
        self.collapsed_at = payload.get("collapsed_at")
        self._seen_validations = int(payload.get("seen_validations", 0))
        self.events = [GuardEvent(**e) for e in payload.get("events", [])]

"""The collapse guard (zerosim.training.guard): each trigger — silence, one answer everywhere (with a reward above
0), a fall in validation EM — and each action (stop; roll back to the best validated weights at a lower learning
rate, then stop); the answer signals the rollout logs."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerControl, TrainerState

from zerosim.training.guard import BEST_DIR, CollapseGuard
from zerosim.training.trl_rollout import answer_signals


@dataclass
class Traj:
    question: str
    answer: str | None


def test_one_answer_across_questions_is_seen_only_across_questions():
    """A confident policy (each group agrees with itself) is not a collapse; one answer to every question is."""
    window: deque[str] = deque(maxlen=8)
    confident = [Traj(f"q{i}", f"answer {i}") for i in range(4) for _ in range(4)]
    out = answer_signals(confident, window)
    assert out["collapse/distinct_answers"] == 1.0
    assert out["collapse/step_top_answer_share"] == 0.25
    assert "collapse/top_answer_share" not in out  # the window is not full: a short one reads high by chance
    out = answer_signals([Traj(f"q{i}", f"answer {i}") for i in range(4, 8) for _ in range(4)], window)
    assert out["collapse/top_answer_share"] == 1 / 8
    collapsed = [Traj(f"c{i}", "Paris") for i in range(8) for _ in range(4)]
    out = answer_signals(collapsed, window)
    assert out["collapse/top_answer_share"] == 1.0 and out["collapse/step_top_answer_share"] == 1.0
    # answers are compared as EM compares them; a missing answer counts in none
    out = answer_signals([Traj("x", "The Paris."), Traj("x", "paris"), Traj("x", None)], deque(maxlen=1))
    assert out["collapse/distinct_answers"] == 1.0 and out["collapse/top_answer_share"] == 1.0


def _feed(guard, logs, start=1):
    control, state = TrainerControl(), TrainerState()
    for step, entry in enumerate(logs, start):
        state.global_step = step
        guard.on_log(None, state, control, logs=entry)
        if control.should_training_stop:
            return control, step
    return control, None


def test_reward_above_zero_but_one_answer_everywhere_stops_the_run():
    """The format reward keeps the reward above 0, so the silence trigger never fires: the one-answer one does."""
    logs = [{"reward": 0.35, "frac_reward_zero_std": 1.0, "collapse/top_answer_share": 0.9}] * 6
    assert _feed(CollapseGuard(3), logs)[1] is None  # the silence trigger alone is blind to it
    guard = CollapseGuard(3, answer_share=0.3)
    control, stopped = _feed(guard, logs)
    assert stopped == 3 and control.should_training_stop
    assert guard.collapsed_at == 3 and guard.events[0].trigger == "one_answer"
    # below the share, or not for patience steps in a row: no trigger
    mixed = [{"reward": 0.3, "collapse/top_answer_share": s} for s in (0.9, 0.9, 0.2, 0.9, 0.9, 0.25, 0.3)]
    assert _feed(CollapseGuard(3, answer_share=0.3), mixed)[1] is None


def test_silence_still_stops():
    guard = CollapseGuard(2, answer_share=0.5)
    control, stopped = _feed(guard, [{"reward": 0.0, "frac_reward_zero_std": 1.0}] * 3)
    assert stopped == 2 and guard.events[0].trigger == "silence" and guard.events[0].action == "stop"


class _Accelerator:
    is_main_process = True

    def unwrap_model(self, model):
        return model


class _Trainer:
    """What the guard uses of a SearchTrainer: the policy, its optimizer and scheduler, save_model."""

    def __init__(self, model):
        self.model = model
        self.accelerator = _Accelerator()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)

    def save_model(self, path):
        self.model.save_pretrained(path)


class _Validation:
    def __init__(self):
        self.history: list[dict] = []


def _train_a_step(trainer):
    loss = sum(p.float().pow(2).sum() for p in trainer.model.parameters())
    loss.backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad()
    trainer.lr_scheduler.step()


def test_a_fall_in_validation_em_rolls_back_to_the_best_weights_at_a_lower_rate(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer, validation = _Trainer(model), _Validation()
    guard = CollapseGuard(3, val_drop=0.05, action="rollback", lr_factor=0.5)
    guard.bind(trainer, tmp_path / "run", validation=validation)
    state, control = TrainerState(), TrainerControl()

    validation.history.append({"step": 0, "val/em": 0.30})
    guard.on_train_begin(None, state, control)  # the starting policy is the first best, kept on disk
    assert (tmp_path / "run" / BEST_DIR / "config.json").is_file() and guard.best_step == 0
    start = {k: v.clone() for k, v in model.state_dict().items()}

    for step in (1, 2):
        _train_a_step(trainer)
        state.global_step = step
        validation.history.append({"step": step, "val/em": 0.31 if step == 1 else 0.20})
        guard.on_step_end(None, state, control)
    # step 1 (0.31) became the best; step 2 fell 0.11 below it: back to step 1's weights
    assert guard.best_step == 1 and guard.rollbacks == 1 and not control.should_training_stop
    assert guard.events[0].trigger == "validation_fall" and guard.events[0].action == "rollback"
    best = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / BEST_DIR, dtype=torch.float32).state_dict()
    now = model.state_dict()
    assert all(torch.equal(now[k], best[k]) for k in best)
    assert not all(torch.equal(now[k], start[k]) for k in start)  # step 1's weights, not the start's
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-3)
    assert not trainer.optimizer.state  # the moments of the collapsing steps are gone
    _train_a_step(trainer)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(
        0.5e-3
    )  # the scheduler keeps the lower rate

    # a second trigger stops: one rollback per run
    state.global_step = 3
    validation.history.append({"step": 3, "val/em": 0.10})
    guard.on_step_end(None, state, control)
    assert control.should_training_stop and guard.events[-1].action == "stop"


def test_rollback_without_a_best_checkpoint_stops(tmp_path):
    guard = CollapseGuard(1, answer_share=0.3, action="rollback")
    control, stopped = _feed(guard, [{"collapse/top_answer_share": 0.8}])
    assert stopped == 1 and guard.events[0].action == "stop"


def test_guard_state_survives_a_resume():
    guard = CollapseGuard(3, answer_share=0.3)
    _feed(guard, [{"collapse/top_answer_share": 0.8}] * 2)
    guard.best_em, guard.best_step = 0.25, 4
    again = CollapseGuard(3, answer_share=0.3)
    again.load_state_dict(guard.state_dict())
    control, stopped = _feed(again, [{"collapse/top_answer_share": 0.8}], start=3)
    assert stopped == 3 and (again.best_em, again.best_step) == (0.25, 4)


@pytest.mark.parametrize(
    "setting",
    ["trainer.collapse_action=rollback", "trainer.final_policy=best", "trainer.collapse_val_drop=0.05"],
)
def test_what_reads_validation_is_refused_without_it(setting):
    from zerosim.core.config import ConfigError
    from zerosim.training.config import load_train_config

    with pytest.raises(ConfigError, match="validation.every=0 runs none"):
        load_train_config("configs/demo.yaml", [setting])
    assert load_train_config("configs/demo.yaml", [setting, "validation.every=4"])

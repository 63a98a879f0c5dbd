"""In-training validation: the greedy pass equals `zerosim eval`'s agent method, and its metrics are exact."""

import pytest
import torch

from eval.harness import Evaluator
from zerosim.agent.rollout import RolloutConfig
from zerosim.core.data.qa import QAExample
from zerosim.core.generation import Generation
from zerosim.core.search import Document
from zerosim.job_config import EvalConfig
from zerosim.training.config import ValidationConfig
from zerosim.training.validation import Validation, validation_examples


class LimaEngine:
    def __init__(self):
        self.calls = 0

    def search(self, requests, k):
        self.calls += 1
        assert all(not any(r.noise_for(k)) for r in requests)  # validation never adds curriculum noise
        return [
            [Document(f"d{i}", "Peru", f"The capital of Peru is Lima. ({r.query})") for i in range(k)]
            for r in requests
        ]


def examples(n):
    return [QAExample(f"q{i}", f"What is the capital of country {i}?", ("Lima",), {}) for i in range(n)]


@pytest.fixture
def trainer(tmp_path, tiny_model_dir, tokenizer):
    from datasets import Dataset
    from trl import GRPOConfig

    from zerosim.core.models import load_causal_lm
    from zerosim.training.trainer import SearchTrainer

    torch.manual_seed(0)
    args = GRPOConfig(
        output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=2, max_completion_length=8,
        use_cpu=True, report_to=[],
    )  # fmt: skip
    return SearchTrainer(
        model=load_causal_lm(str(tiny_model_dir), "float32"),
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "q"}] * 4),
        processing_class=tokenizer,
    )


ROLLOUT = RolloutConfig(max_turns=2, max_new_tokens=6, max_completion_tokens=64)


def test_greedy_pass_matches_the_eval_harness(trainer, tokenizer):
    """Same policy, same questions: validation's transcripts are `zerosim eval --method agent`'s, row by row."""
    qs = examples(5)
    val = Validation(
        ValidationConfig(every=1, batch_size=2), qs, rollout=ROLLOUT, k=2, engine=LimaEngine(),
        tokenizer=tokenizer,
    ).bind(trainer)  # fmt: skip
    trainer.model.train()
    metrics = val.validate(3)
    assert trainer.model.training  # put back in training mode
    cfg = EvalConfig(method="agent", batch_size=5)
    cfg.search.k, cfg.rollout = 2, RolloutConfig(**{**ROLLOUT.__dict__, "temperature": 0.0})
    expected = Evaluator(cfg, trainer.model, tokenizer, LimaEngine()).evaluate("v", qs, progress=False)
    assert [r["transcript"] for r in val.last_rows] == [r.transcript for r in expected.rows]
    summary = expected.summary()
    for key in ("em", "f1", "valid_format", "answer_rate", "searches"):
        assert metrics[f"val/{key}"] == pytest.approx(summary[key])
    assert metrics["val/questions"] == 5 and val.history[-1]["step"] == 3


class Scripted:
    """Even questions search, then answer Lima; odd ones answer Quito at once."""

    def __init__(self, tokenizer):
        self.tokenizer, self.turn_of = tokenizer, {}

    def generate(self, prompts, max_new_tokens, width=None):
        outs = []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            i = int(text.split("country ")[1].split("?")[0])
            turn = self.turn_of[i] = self.turn_of.get(i, -1) + 1
            if i % 2:
                reply = "<answer> Quito </answer>"
            else:
                reply = (
                    "<think>x</think><search> capital </search>" if turn == 0 else "<answer> Lima </answer>"
                )
            tok = self.tokenizer(reply, add_special_tokens=False)["input_ids"]
            outs.append(Generation(tok, [0.0] * len(tok), "stop"))
        return outs


def test_metrics_are_exact_over_uneven_batches(trainer, tokenizer):
    engine = LimaEngine()
    rollout = RolloutConfig(max_turns=2, max_new_tokens=32, max_completion_tokens=400)
    val = Validation(
        ValidationConfig(every=2, batch_size=3), examples(7), rollout=rollout, k=2, engine=engine,
        tokenizer=tokenizer,
    ).bind(trainer)  # fmt: skip
    val.generator_for = lambda model, sync: Scripted(tokenizer)
    m = val.validate(0)
    assert m["val/questions"] == 7
    assert m["val/em"] == pytest.approx(4 / 7)  # questions 0, 2, 4, 6
    assert m["val/searches"] == pytest.approx(4 / 7)
    assert m["val/answer_rate"] == 1.0 and m["val/valid_format"] == 1.0
    assert m["val/recall"] == pytest.approx(4 / 7)  # only the searching questions saw documents
    assert engine.calls == 3  # one search call per batch (turn 1 of each), batches of 3, 3, 1
    assert [r["prediction"] for r in val.last_rows] == ["Lima", "Quito"] * 3 + ["Lima"]


def test_schedule_of_passes(trainer, tokenizer):
    """Step 0, every N steps, and the last step once; none at step 0 of a resumed run."""
    from types import SimpleNamespace

    val = Validation(
        ValidationConfig(every=2), examples(2), rollout=ROLLOUT, k=2, engine=LimaEngine(),
        tokenizer=tokenizer,
    ).bind(trainer)  # fmt: skip
    steps = []
    val.validate = lambda step: steps.append(step)
    val.on_train_begin(None, SimpleNamespace(global_step=0), None)
    for s in range(1, 6):
        val.on_step_end(None, SimpleNamespace(global_step=s), None)
    val.history = [{"step": steps[-1]}]
    val.on_train_end(None, SimpleNamespace(global_step=5), None)
    assert steps == [0, 2, 4, 5]
    steps.clear()
    val.on_train_begin(None, SimpleNamespace(global_step=3), None)  # resumed: no step-0 pass
    val.history = [{"step": 6}]
    val.on_train_end(None, SimpleNamespace(global_step=6), None)  # just validated: not twice
    assert steps == []


def test_validation_questions(tmp_path):
    training = examples(10)
    assert validation_examples(ValidationConfig(max_examples=4), training) == training[:4]
    dev = validation_examples(ValidationConfig(data="factbook", split="dev", max_examples=5), training)
    assert len(dev) == 5 and dev[0].id != training[0].id

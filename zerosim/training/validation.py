"""In-training validation: a greedy agent pass over a fixed question set every N steps (``validation.*``).

The training reward is measured on sampled trajectories of the few prompts a step draws, so step to step it
mostly tells which questions were drawn. Search-R1 (veRL's ``test_freq``) validates during training instead;
so do we: every ``validation.every`` steps (and at step 0, and after the last step) the current policy
answers the same questions greedily, through the same multi-turn rollout and search engine as training but
without curriculum noise and without the gold answers (the engine sees each query as ``zerosim eval`` shows it:
a simulator is not told the answer, see :class:`eval.harness.WithheldAnswers`), scored like
``zerosim eval --method agent``. Logged as ``val/em``, ``val/f1``,
``val/cover_em``, ``val/valid_format``, ``val/answer_rate``, ``val/searches``, ``val/recall`` at the training
step, plotted at the end (``plots/validation.png``), the last pass's transcripts in
``samples/validation.jsonl``.

With several processes each rank answers its share of the questions; the ranks stay in lockstep per turn
(the rollout's :class:`zerosim.core.distributed.TurnSync`; every rank runs the same number of batches, a rank
with none left idles) and the sums are all-reduced, so the numbers are those of one process answering all.
Decoding is transformers ``generate`` whatever ``trainer.generation`` is (vLLM samples with the trainer's
settings, validation is greedy).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import TrainerCallback

from curricula import find_mixed
from zerosim.agent.rollout import RolloutConfig, SearchRollout, build_prompt, stop_strings, synced_decoding
from zerosim.core.data.qa import QAExample
from zerosim.core.distributed import TurnSync
from zerosim.core.generation import HFGenerator
from zerosim.core.sampling import Sampling
from zerosim.core.search import SearchEngine
from zerosim.training.config import ValidationConfig

# val/<metric> -> the RowResult field summed over questions (all-reduced across ranks, then divided by their count)
_SUMMED = {
    "em": "em",
    "f1": "f1",
    "cover_em": "cover_em",
    "valid_format": "valid_format",
    "answer_rate": "tagged",
    "searches": "searches",
}
PLOTTED = (
    ("val/em", "validation EM (greedy)"),
    ("val/f1", "validation F1 (greedy)"),
    ("val/valid_format", "validation valid format"),
    ("val/answer_rate", "validation answer rate"),
    ("val/searches", "validation searches / question"),
    ("val/recall", "validation: gold answer retrieved"),
)


class Validation(TrainerCallback):
    """Evaluates the policy being trained at step 0 (``on_start``), every ``every`` steps and at the end.

    The trainer is built after its callbacks: :meth:`bind` gives it to this one before training starts.
    ``history`` keeps one dict per pass: ``step`` plus the ``val/*`` metrics.
    """

    def __init__(
        self,
        cfg: ValidationConfig,
        examples: Sequence[QAExample],
        *,
        rollout: RolloutConfig,
        k: int,
        engine: SearchEngine,
        tokenizer,
        seed: int = 0,
        answers_shown: bool = False,
        page_by: str = "title",
    ):
        """``answers_shown`` lets the engine see the questions' gold answers (the explicit, logged override
        ``search.simulator.pass_answers=true``); by default they are withheld, as at evaluation."""
        from eval.harness import WithheldAnswers

        if not examples:
            raise ValueError("validation has no questions; set validation.data / validation.split")
        self.cfg = cfg
        self.examples = list(examples)
        self.tokenizer = tokenizer
        self.trainer = None  # set by bind()
        self.rollout = SearchRollout(
            tokenizer,
            engine if answers_shown else WithheldAnswers(engine),
            config=rollout,
            k=k,
            examples={build_prompt(ex.question): (ex.question, ex.golden_answers) for ex in self.examples},
            # the engine as it is (no curriculum noise); a mixed engine's sources drawn as in training
            source=getattr(find_mixed(engine), "draw_source", None),
            page_by=page_by,  # read_page: how the corpus's passages make pages (search.page_by)
        )
        self.history: list[dict[str, float]] = []
        self.last_rows: list[dict[str, Any]] = []

    def bind(self, trainer) -> Validation:
        """Give this callback the trainer whose policy it validates (built after it); returns ``self``."""
        self.trainer = trainer
        return self

    # -- callback hooks ------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if self.cfg.every and self.cfg.on_start and state.global_step == 0:  # not on resume
            self.validate(0)

    def on_step_end(self, args, state, control, **kwargs):
        if self.cfg.every and state.global_step % self.cfg.every == 0:
            self.validate(int(state.global_step))

    def on_train_end(self, args, state, control, **kwargs):
        if self.cfg.every and (not self.history or self.history[-1]["step"] != state.global_step):
            self.validate(int(state.global_step))

    # -- the pass ------------------------------------------------------------------------------------------
    def generator_for(self, model, sync) -> HFGenerator:
        """Greedy transformers decoding with the rollout's stop strings."""
        return HFGenerator(
            model,
            self.tokenizer,
            sampling=Sampling(
                temperature=0.0,
                stop_strings=stop_strings(self.rollout.config),
                eos_token_ids=self.rollout.eos_ids,
            ),
            logprobs=False,
            collective=synced_decoding(model, sync),
        )

    def validate(self, step: int) -> dict[str, float]:
        """One greedy pass at ``step``; logs and returns the ``val/*`` metrics (every rank gets them)."""
        from trl.models import unwrap_model_for_generation

        from eval.harness import agent_rows

        trainer = self.trainer
        if trainer is None:
            raise RuntimeError(
                "Validation has no trainer to validate: call validation.bind(trainer) once the trainer is "
                "built"
            )
        sync = TurnSync(trainer.accelerator)
        world, rank = sync.num_processes, sync.process_index
        shard = self.examples[rank::world]
        size = self.cfg.batch_size
        per_rank = math.ceil(len(self.examples) / world)
        batches = math.ceil(per_rank / size)  # the same count on every rank
        rows = []
        started = time.perf_counter()
        with unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
        ) as model:
            was_training = model.training
            model.eval()
            generator = self.generator_for(model, sync)
            try:
                for b in range(batches):
                    batch = shard[b * size : (b + 1) * size]
                    trajectories, _ = self.rollout.run(
                        generator, [build_prompt(ex.question) for ex in batch], 0, sync=sync
                    )
                    rows.extend(agent_rows(batch, trajectories, self.tokenizer))
            finally:
                if was_training:
                    model.train()
        recalls = [r.recall for r in rows if r.recall is not None]
        sums = [float(len(rows))]
        sums += [float(sum(getattr(r, field) for r in rows)) for field in _SUMMED.values()]
        sums += [float(sum(recalls)), float(len(recalls))]
        totals = torch.tensor(sums, dtype=torch.float64, device=trainer.accelerator.device)
        if world > 1:
            torch.distributed.all_reduce(totals, op=torch.distributed.ReduceOp.SUM)
        n, *values, recall_sum, recall_n = totals.tolist()
        metrics = {f"val/{name}": value / n for name, value in zip(_SUMMED, values, strict=True)}
        metrics["val/recall"] = recall_sum / recall_n if recall_n else float("nan")
        metrics["val/questions"] = n
        metrics["time/validation_s"] = time.perf_counter() - started
        self.history.append({"step": step, **metrics})
        samples = [
            {
                "step": step,
                "question": r.question,
                "golden_answers": r.golden_answers,
                "prediction": r.prediction,
                "em": r.em,
                "f1": r.f1,
                "valid_format": r.valid_format,
                "transcript": r.transcript,
            }
            for r in rows
        ]
        if world > 1:
            from accelerate.utils import gather_object

            samples = gather_object(samples)
        self.last_rows = samples
        if trainer.accelerator.is_main_process:
            import mlflow

            from zerosim.core.tracking import log_metrics  # once per step, also across a resume

            if mlflow.active_run() is not None:
                log_metrics({k: v for k, v in metrics.items() if v == v}, step=step)
        return metrics


def validation_examples(cfg: ValidationConfig, training: Sequence[QAExample]) -> list[QAExample]:
    """The questions validation answers: ``validation.data`` or else the first training questions."""
    from zerosim.core.data.embedded import load_questions

    if cfg.data is None:
        return list(training[: cfg.max_examples])
    return load_questions(cfg.data, cfg.split, limit=cfg.max_examples)

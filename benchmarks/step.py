"""Where a training step's time goes (on demand, not CI):

    python benchmarks/step.py --config configs/demo-learning.yaml [--steps 3] [--repeats 3] [--compare | --lora] [key=value ...]

Runs ``--steps`` real training steps of a recipe (``zerosim.training.recipe.train``: the same code as ``zerosim
train``) ``--repeats`` times and prints, per phase, the seconds per optimizer step — the median over repeats
of each run's mean over its steps — and its share of the step:

- generate (policy tokens), search (simulator or retriever), reward, logprob (no-grad log-prob passes:
  old policy / reference), update (forward + backward of every micro-batch and the optimizer step), critic
  (PPO) and other (the rest of the step: data, TRL's bookkeeping) — together the step; then validation, which
  runs beside the steps (at the start, every ``validation.every`` steps and at the end), spread over them;
- tokens/s of generation (policy tokens sampled per second of ``generate``) and of the update (prompt and
  completion tokens per second of ``update``).

The figures are the run's own ``time/*`` metrics (docs/metrics.md), read back from its MLflow run, so what
this prints is what a user sees in the MLflow UI. Checkpoints are off (``trainer.save_steps=0``,
``trainer.save_final=false``); a recipe's warm start is trained once into ``--out`` and reused by every repeat.
With ``--compare``, each repeat runs the recipe twice, the CPU path before (``benchmarks/paths.py``: fp32, one
prefill per row, transformers' sampler) and now, and the table prints both side by side with their ratio.
With ``--lora``, each repeat runs it as a full fine-tune and with LoRA adapters (``policy.lora.enabled=true``,
``--lora-overrides`` for the rest), each run in a process of its own, so that the peak resident memory each
prints (``memory/peak_rss_gb``) is that run's alone.

Measure on a quiet machine only (``uptime``: load average under 0.5; nothing else running): two torch
processes on 2 cores slow each other several-fold.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PHASES = ("generate", "search", "reward", "logprob", "update", "critic")  # inside time/step_s
LORA_OVERRIDES: list[str] = []  # --lora-overrides (set in the process that runs a lora path)


def run_alone(*args) -> dict[str, float]:
    """:func:`run_once` in a fresh process (spawned: its peak resident memory is its own run's)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_child, args)


def _child(lora_overrides: list[str], *args) -> dict[str, float]:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # paths.py, as in the parent
    LORA_OVERRIDES[:] = lora_overrides
    return run_once(*args)


def run_once(
    config: str, steps: int, overrides: list[str], out: Path, repeat: int, path: str = "now"
) -> dict[str, float]:
    """One training run on ``path`` (benchmarks/paths.py); returns seconds per step of each phase (mean over its
    steps) and token counts."""
    import mlflow
    from paths import BEFORE_OVERRIDES, PATHS

    if path == "before":
        overrides = [*overrides, *BEFORE_OVERRIDES]
    if path == "lora":
        overrides = [*overrides, "policy.lora.enabled=true", *LORA_OVERRIDES]

    from zerosim.training.config import load_train_config
    from zerosim.training.recipe import train

    db = Path(tempfile.mkdtemp(prefix="bench-step-")) / "mlflow.db"
    cfg = load_train_config(
        config,
        [
            f"trainer.max_steps={steps}",
            "trainer.save_steps=0",
            "trainer.save_final=false",
            f"run.output_dir={out}",
            f"tracking.tracking_uri=sqlite:///{db}",
            "tracking.experiment=bench-step",
            *overrides,
        ],
    )
    with PATHS.get(path, contextlib.nullcontext)():
        result = train(cfg)
    client = mlflow.MlflowClient()

    def per_step(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(result.run_id, key)}

    step_s = per_step("time/step_s")
    if not step_s:
        raise SystemExit("the run logged no time/step_s: is trainer.logging_steps > max_steps?")
    figures = {"step": statistics.fmean(step_s.values())}
    for phase in (*PHASES, "validation"):
        values = per_step(f"time/{phase}_s")
        # validation runs at a few steps only (and at the start): its cost spread over the steps, as a run pays it
        figures[phase] = (
            sum(values.values()) / len(step_s)
            if phase == "validation"
            else statistics.fmean(values.get(s, 0.0) for s in step_s)
        )
    trajectories = (
        cfg.trainer.per_device_train_batch_size * cfg.trainer.gradient_accumulation_steps
    )  # per process
    policy_tokens = per_step("rollout/policy_tokens_per_traj")
    figures["generated_tokens"] = statistics.fmean(policy_tokens.values()) * trajectories
    num_tokens = sorted(per_step("num_tokens").items())  # TRL: cumulative prompt + completion tokens
    deltas = [b - a for (_, a), (_, b) in zip([(0, 0.0), *num_tokens[:-1]], num_tokens, strict=True)]
    figures["update_tokens"] = statistics.fmean(deltas) if deltas else 0.0
    figures["peak_rss_gb"] = max(per_step("memory/peak_rss_gb").values(), default=0.0)
    print(f"  repeat {repeat} ({path}): " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()), flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="recipe, e.g. configs/demo-learning.yaml")
    parser.add_argument("--steps", type=int, default=3, help="training steps per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="runs; the median of each figure is printed")
    parser.add_argument("--out", default="outputs/bench-step", help="run folder (the warm start is reused)")
    parser.add_argument("--compare", action="store_true", help="the path before and now, side by side")
    parser.add_argument(
        "--lora",
        action="store_true",
        help="a full fine-tune and LoRA adapters, side by side, one process per run",
    )
    parser.add_argument(
        "--lora-overrides",
        nargs="*",
        default=[],
        help="the LoRA runs' own settings, e.g. trainer.learning_rate=1e-4",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.algorithm=ppo")
    args = parser.parse_args()
    if args.compare and args.lora:
        parser.error("--compare and --lora each set the two sides: pick one")
    load = os.getloadavg()[0]
    print(f"load average {load:.2f}" + ("  (not quiet: figures will be slow)" if load >= 0.5 else ""))
    from zerosim.core.runtime import cpu_kind

    print(f"machine: {cpu_kind()}")
    paths = ("before", "now") if args.compare else ("full", "lora") if args.lora else ("now",)
    runs: dict[str, list[dict[str, float]]] = {path: [] for path in paths}
    for i in range(args.repeats):  # the paths alternate, so a slow spell of the machine slows both
        for path in paths:
            job = (args.config, args.steps, args.overrides, Path(args.out), i + 1, path)
            runs[path].append(run_alone(args.lora_overrides, *job) if args.lora else run_once(*job))
    med = {
        path: {key: statistics.median(run[key] for run in rs) for key in rs[0]} for path, rs in runs.items()
    }
    print(f"\n{args.config} {' '.join(args.overrides)}: {args.steps} steps x {args.repeats} repeats (median)")
    two = len(paths) == 2
    print(
        f"  {'phase':<12}"
        + "".join(f"{path + ' s/step':>16}{'share':>7}" for path in paths)
        + (f"{'ratio':>10}" if two else "")
    )
    for phase in (*PHASES, "other", "step"):
        cells = ""
        seconds = {}
        for path in paths:
            m = med[path]
            other = max(0.0, m["step"] - sum(m[p] for p in PHASES))
            seconds[path] = other if phase == "other" else m[phase]
            cells += f"{seconds[path]:>16.2f}{seconds[path] / m['step']:>7.0%}"
        if two:
            first, second = seconds[paths[0]], seconds[paths[1]]
            cells += f"{first / second:>9.2f}x" if second > 0 else f"{'-':>10}"
        print(f"  {phase:<12}{cells}")
    if args.lora:
        rss = {path: med[path]["peak_rss_gb"] for path in paths}
        print(
            f"  {'peak RSS':<12}"
            + "".join(f"{rss[p]:>13.2f} GB{'':>7}" for p in paths)
            + f"{rss['full'] / rss['lora']:>9.2f}x"
        )
    for path in paths:
        m = med[path]
        print(
            f"  {path}: + validation {m['validation']:.2f} s/step ({m['validation'] / m['step']:.0%}, its passes spread over the steps)",
            end="",
        )
        if m["generate"] > 0:
            print(f"; generation {m['generated_tokens'] / m['generate']:.1f} policy tokens/s", end="")
        if m["update"] > 0:
            print(f"; update {m['update_tokens'] / m['update']:.1f} tokens/s (prompt + completion)", end="")
        print()


if __name__ == "__main__":
    main()

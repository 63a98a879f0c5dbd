"""The GRPO update's speed (on demand, not CI): ``python benchmarks/update.py [--repeats 3]``.

One optimizer step's forward + backward (every micro-batch, through ``SearchTrainer.training_step``: TRL's
``_prepare_inputs`` and loss, our micro-batching) on a generation batch shaped like
``configs/demo-learning.yaml``'s: the SmolLM2 policy, 16 rows (4 prompts x 4), micro-batches of 4,
``gradient_accumulation_steps`` 4, prompts of ~100 tokens, completions of 40-190 policy tokens of which most
hold one 250-token ``<information>`` block (at most 480 tokens). Variants, printed side by side (median of
``--repeats``, the repeats interleaved) with their ratio to TRL's micro-batches:

- ``trl``: TRL's micro-batches: rows shuffled, every micro-batch padded to the generation batch's longest
  prompt and completion; fp32; transformers' SDPA attention;
- ``sorted``: rows grouped by length, each micro-batch cut to its own longest row
  (``SearchTrainer.group_by_length``);
- ``compact``: the log-prob head projects only the positions in the loss mask (TRL's projects every position
  off CUDA: prompt, padding and ``<information>`` tokens too; ``SearchTrainer.compact_head``);
- ``+gqa``: the ``zerosim_sdpa`` attention (grouped-query attention inside SDPA, no repeated key/value heads);
- ``+bf16``: bf16 autocast over the log-prob passes (``trainer.bf16``), fp32 master weights.

Per variant: seconds of forward and backward, positions computed (rows x padded width, summed over
micro-batches), their padding share, and the relative difference of the summed gradient to ``trl``'s (the
largest ||g - g_trl|| / ||g_trl|| over the repeats; the weights never change between variants). Then the
cost of one no-grad log-prob pass over the generation batch (what a reference model costs when
``trainer.beta > 0``).

Measure on a quiet machine only (the load average is printed first; nothing else running).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402

VARIANTS = {  # name: (group_by_length, compact_head, attention, bf16)
    "trl": (False, False, None, False),
    "sorted": (True, False, None, False),
    "compact": (False, True, None, False),
    "sorted+compact": (True, True, None, False),
    "sorted+compact+gqa": (True, True, "zerosim_sdpa", False),
    "trl+bf16": (False, False, None, True),
    "sorted+compact+bf16": (True, True, None, True),
    "sorted+compact+gqa+bf16": (True, True, "zerosim_sdpa", True),
}


def generation_batch(rows: int, group: int, vocab: int, pad_id: int, seed: int) -> dict[str, torch.Tensor]:
    """What TRL's ``_generate_and_score_completions`` returns for a demo-learning step (no reference, no old
    log-probs): prompts left-padded, completions right-padded, the ``<information>`` block out of the loss."""
    g = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    prompts, completions, env = [], [], []
    for _ in range(rows):
        prompts.append(torch.randint(10, vocab, (randint(96, 106),), generator=g))
        policy = randint(40, 190)
        mask = [1] * policy
        if torch.rand(1, generator=g).item() < 0.85:  # one search: its documents after the first turn
            first = randint(20, min(96, policy - 10))
            mask = [1] * first + [0] * 250 + [1] * (policy - first)
        mask = mask[:480]
        completions.append(torch.randint(10, vocab, (len(mask),), generator=g))
        env.append(torch.tensor(mask))
    P, T = max(len(p) for p in prompts), max(len(c) for c in completions)
    prompt_ids = torch.full((rows, P), pad_id)
    prompt_mask = torch.zeros(rows, P, dtype=torch.long)
    completion_ids = torch.full((rows, T), pad_id)
    completion_mask = torch.zeros(rows, T, dtype=torch.long)
    tool_mask = torch.ones(rows, T, dtype=torch.long)  # TRL pads the tool mask with 1
    for i, (p, c, m) in enumerate(zip(prompts, completions, env, strict=True)):
        prompt_ids[i, P - len(p) :], prompt_mask[i, P - len(p) :] = p, 1
        completion_ids[i, : len(c)], completion_mask[i, : len(c)], tool_mask[i, : len(c)] = c, 1, m
    rewards = torch.rand(rows, generator=g).view(-1, group)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
        "advantages": advantages,
        "num_items_in_batch": (completion_mask * tool_mask).sum(),
        "sampling_per_token_logps": torch.zeros(rows, T),  # the rollout's log-probs (unused without vLLM)
    }


def build_trainer(out: Path):
    from datasets import Dataset

    from zerosim.core.models import load_causal_lm, load_tokenizer
    from zerosim.training.config import load_train_config
    from zerosim.training.recipe import grpo_args
    from zerosim.training.trainer import SearchTrainer

    cfg = load_train_config("configs/demo-learning.yaml", [f"run.output_dir={out}"])
    tokenizer = load_tokenizer(cfg.policy.model)
    args = grpo_args(cfg, out)
    trainer = SearchTrainer(
        algorithm=cfg.trainer.algorithm,
        model=load_causal_lm(cfg.policy.model, cfg.policy.dtype),
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "q"}] * 16),
        processing_class=tokenizer,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    return trainer, cfg


def one_step(trainer, batch, variant: str, seed: int) -> dict:
    """Forward + backward of every micro-batch of one optimizer step; seconds, positions, summed gradient."""
    from zerosim.core.decode import attention_implementation

    group, compact, attention, bf16 = VARIANTS[variant]
    trainer.group_by_length, trainer.compact_head, trainer.update_bf16 = group, compact, bf16
    trainer._step, trainer._buffered_inputs = 0, None
    trainer._generate_and_score_completions = lambda inputs: dict(batch)
    trainer.model.zero_grad(set_to_none=True)
    backward = trainer.accelerator.backward
    seconds = {"forward": 0.0, "backward": 0.0}
    positions = 0

    def timed_backward(loss, **kwargs):
        started = time.perf_counter()
        backward(loss, **kwargs)
        seconds["backward"] += time.perf_counter() - started

    trainer.accelerator.backward = timed_backward
    torch.manual_seed(seed)  # TRL's shuffle of the rows
    model = trainer.model
    with attention_implementation(model, attention or model.config._attn_implementation):
        for _ in range(trainer.args.gradient_accumulation_steps):
            started = time.perf_counter()
            before = seconds["backward"]
            trainer.training_step(trainer.model, [{}], None)
            seconds["forward"] += time.perf_counter() - started - (seconds["backward"] - before)
        for mb in trainer._buffered_inputs:
            positions += mb["prompt_ids"].numel() + mb["completion_ids"].numel()
    trainer.accelerator.backward = backward
    grad = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    return {
        **seconds,
        "total": seconds["forward"] + seconds["backward"],
        "positions": positions,
        "grad": grad,
    }


def logprob_pass(trainer, batch, compact: bool, bf16: bool) -> float:
    """One no-grad log-prob pass over the generation batch, as TRL runs it for a reference model."""
    trainer.compact_head, trainer.update_bf16 = compact, bf16
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    started = time.perf_counter()
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(
            trainer.model,
            ids,
            mask,
            batch["completion_ids"].shape[1],
            batch_size=trainer.args.per_device_train_batch_size,
        )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant (median printed)")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS)
    )
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    if "trl" not in variants:
        variants.insert(0, "trl")
    load = os.getloadavg()[0]
    print(f"load average {load:.2f}" + ("  (not quiet: figures will be slow)" if load >= 0.5 else ""))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    from zerosim.core.decode import register_attention

    register_attention()
    trainer, cfg = build_trainer(Path(tempfile.mkdtemp(prefix="bench-update-")))
    tok = trainer.processing_class
    batch = generation_batch(16, cfg.trainer.num_generations, len(tok), tok.pad_token_id, seed=0)
    real = int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())
    c = batch["completion_mask"].sum(1).tolist()
    print(
        f"batch: 16 rows, prompt {batch['prompt_ids'].shape[1]} + completion {batch['completion_ids'].shape[1]} "
        f"columns; completion lengths {sorted(c)}; {real} real tokens "
        f"({int(batch['num_items_in_batch'])} policy tokens in the loss)"
    )
    reference = one_step(trainer, batch, "trl", seed=0).pop("grad")  # also the warm-up (first-call costs)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in variants:
            run = one_step(trainer, batch, v, seed=r)
            run["grad diff"] = ((run.pop("grad") - reference).norm() / reference.norm()).item()
            runs[v].append(run)
            print(f"  repeat {r + 1} {v}: {run['total']:.2f} s", flush=True)
    base = statistics.median(x["total"] for x in runs["trl"])
    print(
        f"\none optimizer step, forward + backward of {cfg.trainer.gradient_accumulation_steps} micro-batches "
        f"of {cfg.trainer.per_device_train_batch_size}, median of {args.repeats} (seconds)"
    )
    print(
        f"  {'variant':<24}{'forward':>9}{'backward':>10}{'total':>8}{'vs trl':>8}{'positions':>11}"
        f"{'padding':>9}{'grad diff':>11}"
    )
    for v in variants:
        med = {k: statistics.median(x[k] for x in runs[v]) for k in ("forward", "backward", "total")}
        positions = runs[v][0]["positions"]
        diff = max(x["grad diff"] for x in runs[v])
        print(
            f"  {v:<24}{med['forward']:>9.2f}{med['backward']:>10.2f}{med['total']:>8.2f}"
            f"{base / med['total']:>7.2f}x{positions:>11}{1 - real / positions:>9.0%}{diff:>11.1e}"
        )
    passes = {
        (compact, bf16): statistics.median(
            logprob_pass(trainer, batch, compact, bf16) for _ in range(args.repeats)
        )
        for compact, bf16 in ((False, False), (True, False), (True, True))
    }
    print(
        "\none no-grad log-prob pass over the 16 rows (a reference model's cost when trainer.beta > 0): "
        f"TRL's head {passes[False, False]:.2f} s, compact head {passes[True, False]:.2f} s, "
        f"compact + bf16 {passes[True, True]:.2f} s"
    )


if __name__ == "__main__":
    main()

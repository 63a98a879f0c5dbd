"""Policy decode speed (on demand, not CI): ``python benchmarks/decode.py [--policy CHECKPOINT]``.

The rollout's generation, our decoding loop (``zerosim.core.decode``, the default) against transformers
``generate`` (``HFGenerator(decoder="transformers")``, fp32, what the rollout ran before), printed side by side
from one run: 16 factbook questions at batch 16, the multi-turn rollout (``SearchRollout.run``: stop
strings, log-probs, BM25 observations between turns), the same prompts for all. Three rows:

- ``generate``: transformers ``generate`` in fp32;
- ``zerosim before``: our loop on the path before (``benchmarks/paths.py``: fp32, one prefill per row,
  transformers' sampler);
- ``zerosim``: our loop now, in the precision this CPU decides (``runtime.bf16`` auto: bf16 with AMX or
  AVX512_BF16).

- **greedy**: generate and zerosim before write the same tokens (checked); the bf16 rows are counted against
  them (bf16 rounds the logits: a near tie can flip);
- **sampled** (``--temperature``, the v2 recipe's 0.7): 3 seeds, every decoder per seed; rows that leave the
  batch change which draws the others get, so the work differs a little: compared per policy token.

The headline ``decode speed-up over transformers generate`` is the sampled tokens/s ratio of zerosim over
generate (median of the seeds). ``share of bound``: the time this machine needs at least for the same tokens —
each decode step reads every weight once (at the measured copy bandwidth; 2 bytes a weight in bf16) or does
2 x params FLOPs per live row (at the measured matmul rate of its precision), whichever is longer, and every
other token is encoded once at that matmul rate (attention FLOPs not counted) — over the measured time.

Measure on a quiet machine (load average < 0.5 at the start), nothing else running.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DECODERS = ("generate", "zerosim before", "zerosim")


def run_rollout(rollout, generator, prompts, seed: int):
    import torch
    from bounds import Recorder

    recorder = Recorder(generator)
    torch.manual_seed(seed)
    started = time.perf_counter()
    trajectories, _ = rollout.run(recorder, prompts, step=0)
    seconds = time.perf_counter() - started
    policy_tokens = sum(sum(t.env_mask) for t in trajectories)
    return seconds, policy_tokens, trajectories, recorder


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--policy", default="outputs/demo/warmstart/final", help="a policy that speaks the tags"
    )
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.7, help="sampled runs (the v2 recipe's)")
    args = parser.parse_args()
    if not Path(args.policy).is_dir() and args.policy != "smollm2":
        raise SystemExit(
            f"policy {args.policy} not found: run `zerosim policy warmstart --config configs/demo-learning.yaml` "
            "first and pass --policy OUTPUT_DIR/NAME/warmstart/final (or --policy smollm2)"
        )

    import contextlib

    import torch
    from paths import before

    from zerosim.agent.rollout import STOP_STRINGS, RolloutConfig, SearchRollout, build_prompt
    from zerosim.core.data.embedded import load_questions
    from zerosim.core.generation import HFGenerator
    from zerosim.core.models import load_causal_lm, load_tokenizer
    from zerosim.core.runtime import apply_precision, cpu_kind
    from zerosim.core.sampling import Sampling
    from zerosim.engines import SearchConfig, build_search_engine

    precision = apply_precision(None)  # as a job on this CPU decides (runtime.bf16 auto)

    questions = load_questions("factbook", "dev", limit=args.questions)
    tokenizer, model = load_tokenizer(args.policy), load_causal_lm(args.policy)
    params = sum(p.numel() for p in model.parameters())
    engine = build_search_engine(SearchConfig(engine="bm25"))
    prompts = [build_prompt(q.question) for q in questions]

    def rollout_at(temperature: float) -> SearchRollout:
        config = RolloutConfig(
            max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, max_obs_tokens=240,
            max_completion_tokens=480, temperature=temperature,
        )  # fmt: skip
        examples = {build_prompt(q.question): (q.question, q.golden_answers) for q in questions}
        return SearchRollout(tokenizer, engine, config=config, k=2, examples=examples)

    def generator(decoder: str, temperature: float) -> HFGenerator:
        sampling = Sampling(temperature=temperature, stop_strings=STOP_STRINGS)
        if decoder == "generate":
            return HFGenerator(model, tokenizer, sampling=sampling, decoder="transformers", bf16=False)
        return HFGenerator(model, tokenizer, sampling=sampling, bf16=decoder == "zerosim" and precision.bf16)

    def path(decoder: str):
        return before() if decoder == "zerosim before" else contextlib.nullcontext()

    from bounds import machine_rates

    bandwidth, flops, bf16_flops = machine_rates()
    print(
        f"\n{cpu_kind()}; zerosim computes in {'bf16' if precision.bf16 else 'fp32'} ({precision.why})\n"
        f"{len(questions)} questions at batch {len(questions)}, policy {args.policy} ({params / 1e6:.0f}M params), "
        f"{args.max_turns} turns x {args.max_new_tokens} tokens, BM25 k=2; {torch.get_num_threads()} threads; "
        f"copy {bandwidth / 1e9:.1f} GB/s, fp32 matmul {flops / 1e9:.0f} GFLOP/s, bf16 {bf16_flops / 1e9:.0f}"
    )
    for decoder in DECODERS:  # warm-up: stop tables, kernels
        with path(decoder):
            rollout_at(1.0).run(generator(decoder, 1.0), prompts[:2], step=0)

    def bound(decoder: str, rec) -> float:
        if decoder == "zerosim" and precision.bf16:
            return rec.bound(params, bandwidth, bf16_flops, width=2)
        return rec.bound(params, bandwidth, flops)

    def line(name, seconds, tokens, bound):
        print(f"  {name:<34}{seconds:>9.1f}{tokens:>9}{tokens / seconds:>10.1f}{bound / seconds:>16.0%}")

    header = f"  {'':<34}{'seconds':>9}{'tokens':>9}{'tokens/s':>10}{'share of bound':>16}"
    print("\ngreedy, one run each")
    print(header)
    greedy = {}
    for decoder in DECODERS:
        with path(decoder):
            seconds, tokens, trajectories, rec = run_rollout(
                rollout_at(0.0), generator(decoder, 0.0), prompts, 0
            )
        greedy[decoder] = (seconds, [t.completion_ids for t in trajectories])
        line(decoder, seconds, tokens, bound(decoder, rec))
    same = greedy["zerosim before"][1] == greedy["generate"][1]
    rows = sum(a == b for a, b in zip(greedy["zerosim"][1], greedy["generate"][1], strict=True))
    print(
        f"  zerosim before writes generate's tokens: {same}; zerosim: {rows} of {len(prompts)} trajectories "
        f"the same; speed-up over generate {greedy['generate'][0] / greedy['zerosim'][0]:.1f}x "
        f"(before: {greedy['generate'][0] / greedy['zerosim before'][0]:.1f}x)"
    )

    print(f"\nsampled at temperature {args.temperature:g}, {args.seeds} seeds")
    print(header)
    rates: dict[str, list[float]] = {d: [] for d in DECODERS}
    for seed in range(args.seeds):
        for decoder in DECODERS:
            with path(decoder):
                seconds, tokens, _, rec = run_rollout(
                    rollout_at(args.temperature), generator(decoder, args.temperature), prompts, seed
                )
            rates[decoder].append(tokens / seconds)
            line(f"{decoder}, seed {seed}", seconds, tokens, bound(decoder, rec))
    med = {d: statistics.median(r) for d, r in rates.items()}
    print(
        f"\ndecode speed-up over transformers generate: {med['zerosim'] / med['generate']:.1f}x "
        f"(zerosim before: {med['zerosim before'] / med['generate']:.1f}x; now over before "
        f"{med['zerosim'] / med['zerosim before']:.1f}x)"
    )


if __name__ == "__main__":
    main()

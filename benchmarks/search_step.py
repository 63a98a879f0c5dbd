"""The simulator's part of a sim arm's step, before and now (on demand, not CI):

    python benchmarks/search_step.py --simulator SIM_CHECKPOINT [--requests 16] [--repeats 3]

One search call of a training step against the in-process simulator, as the v2 ablation's ``sim-curriculum`` arm
makes it (``configs/experiments/curriculum-ablation-v2-cpu.yaml``: k=2, ``search.simulator.max_new_tokens=128``,
the simulator's sampling, answers shown to queries about the question): ``--requests`` fact-tune questions as
queries, each with its gold answers, every other one noisy (what a curriculum at p=0.5 draws). The CPU path
before (``benchmarks/paths.py``: fp32, transformers' sampler) and now (the precision this CPU decides), the
same requests and seed for both, alternating, ``--repeats`` times; the median seconds, the tokens written, and
the share of the machine's bound (``benchmarks/bounds.py``: the least time those decode steps and prompt tokens
need here). Measure on a quiet machine (load average < 0.5 at the start), nothing else running.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--simulator", required=True, help="a trained simulator checkpoint (or smollm2)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"load average {load:.2f}" + ("  (not quiet: figures will be slow)" if load >= 0.5 else ""))

    import torch
    from bounds import Recorder, machine_rates
    from paths import before

    from zerosim.core.data.embedded import load_questions
    from zerosim.core.runtime import apply_precision, cpu_kind
    from zerosim.core.search import SearchRequest
    from zerosim.training.config import load_train_config

    precision = apply_precision(None)
    cfg = load_train_config(
        "configs/demo-learning.yaml",
        [
            "search.engine=simulator",
            f"search.simulator.model={args.simulator}",
            "search.simulator.max_new_tokens=128",
            "search.simulator.hint_min_coverage=0.5",
        ],
    )
    from simulators.llm import build_simulator

    k = cfg.search.k
    questions = load_questions("factbook", "fact-tune", limit=args.requests)
    requests = [
        SearchRequest(
            query=q.question, question=q.question, answers=q.golden_answers, noise=(i % 2 == 1,) * k
        )
        for i, q in enumerate(questions)
    ]
    paths = {"before": before, "now": contextlib.nullcontext}
    simulators = {}
    for name, path in paths.items():
        with path():
            sim = build_simulator(cfg.search.simulator, seed=0)
        recorder = Recorder(sim.backend.generator)
        sim.backend.generator = recorder
        simulators[name] = (sim, recorder)
    model = simulators["now"][0].backend.model
    params = sum(p.numel() for p in model.parameters())
    bandwidth, flops, bf16_flops = machine_rates()
    s = cfg.search.simulator
    print(
        f"{cpu_kind()}; now computes in {'bf16' if precision.bf16 else 'fp32'} ({precision.why})\n"
        f"simulator {args.simulator} ({params / 1e6:.0f}M params), {len(requests)} requests x k={k}, "
        f"{s.max_new_tokens} tokens, temperature {s.temperature:g}, top-p {s.top_p:g}; "
        f"{torch.get_num_threads()} threads; copy {bandwidth / 1e9:.1f} GB/s, matmul fp32 {flops / 1e9:.0f} / "
        f"bf16 {bf16_flops / 1e9:.0f} GFLOP/s"
    )
    for name, path in paths.items():  # warm-up: kernels, the stop table, the bf16 copy
        with path():
            simulators[name][0].search(requests[:2], k)
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    shares: dict[str, list[float]] = {name: [] for name in paths}
    tokens: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, path in paths.items():
            sim, recorder = simulators[name]
            recorder.calls.clear()
            with path():
                started = time.perf_counter()
                sim.search(requests, k)
                took = time.perf_counter() - started
            bf16 = name == "now" and precision.bf16
            bound = recorder.bound(params, bandwidth, bf16_flops if bf16 else flops, width=2 if bf16 else 4)
            seconds[name].append(took)
            shares[name].append(bound / took)
            tokens[name] = sum(sum(lengths) for _, lengths in recorder.calls)
    print(f"\n  {'path':<10}{'seconds':>10}{'tokens':>9}{'calls':>7}{'share of bound':>16}")
    for name in paths:
        calls = len(simulators[name][1].calls)
        print(
            f"  {name:<10}{statistics.median(seconds[name]):>10.2f}{tokens[name]:>9}{calls:>7}"
            f"{statistics.median(shares[name]):>16.0%}"
        )
    ratio = statistics.median(seconds["before"]) / statistics.median(seconds["now"])
    print(f"\nspeed-up of a search call: {ratio:.2f}x (median of {args.repeats})")


if __name__ == "__main__":
    main()

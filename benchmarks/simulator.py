"""Simulator speed (on demand, not CI): ``python benchmarks/simulator.py [--requests 16] [--model smollm2]``.

One run, three comparisons, printed side by side with their ratios:

1. In-process: one batched ``generate`` for all N requests of a search call (what ``LLMSimulator`` does)
   vs one call per request, sequentially (ZeroSearch's loop). Target: batched >= 4x at 16 requests.
2. HTTP (the in-process OpenAI-compatible server, as ``zerosim simulator serve`` runs it without vLLM):
   all prompts of a call in one ``/v1/completions`` request vs one request per query.
3. Cache: mean latency of a hit in ``CachedSearchEngine`` (memory, and sqlite after a restart).
   Target: < 1 ms.

Every variant gets the same prompts, the same greedy decoding and the same token budget, and writes the
same documents (checked), so the ratios measure the batching and transport alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def row(name: str, *cells: str) -> None:
    print(f"  {name:<44}" + "".join(f"{c:>14}" for c in cells))


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def requests_for(n: int):
    from zerosim.core.data.embedded import load_questions
    from zerosim.core.search import SearchRequest

    questions = load_questions("factbook", "dev", limit=n)
    return [SearchRequest(query=q.question, question=q.question, answers=q.golden_answers) for q in questions]


def one_by_one(sim, requests, k):
    return [docs for r in requests for docs in sim.search([r], k)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="simulator model: path, HF id or smollm2")
    parser.add_argument("--requests", type=int, default=16, help="requests in one search call")
    parser.add_argument("--k", type=int, default=3, help="documents per request")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="token budget per prompt")
    parser.add_argument("--cache-hits", type=int, default=2000, help="cache lookups to time")
    parser.add_argument(
        "--parts", default="batch,http,cache", help="comma-separated subset of batch,http,cache"
    )
    parser.add_argument(
        "--variants",
        default="",
        help="instead of the parts: time these simulator variants side by side, e.g. "
        "'float32,bfloat16,bfloat16+invariant' (dtype, '+invariant' = search.simulator.batch_invariant)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="with --variants: runs per side (median)")
    args = parser.parse_args()
    if args.variants:
        bench_variants(args)
        return

    import torch

    from simulators import LLMSimulator, TransformersBackend
    from zerosim.core.models import load_causal_lm, load_tokenizer

    torch.manual_seed(0)
    requests = requests_for(args.requests)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, on_short="fill", seed=0)
    model, tokenizer = load_causal_lm(args.model), load_tokenizer(args.model)
    sim = LLMSimulator(TransformersBackend(model, tokenizer, model_id=args.model), **options)
    sim.search(requests[:2], args.k)  # warm-up: first-call allocations out of the timings

    print(
        f"\nsimulator {args.model}: {len(requests)} requests, k={args.k}, {args.max_new_tokens} new tokens each"
    )
    parts = set(args.parts.split(","))
    batched, t_batched = timed(sim.search, requests, args.k)  # also the cache's miss cost below
    if "batch" in parts:
        bench_batch(sim, requests, args, batched, t_batched)
    if "http" in parts:
        bench_http(model, tokenizer, requests, args, options, t_batched)
    if "cache" in parts:
        bench_cache(sim, requests, args, t_batched)


class StepCounter:
    """Counts the model's one-token forwards (decode steps) and the rows they carry."""

    def __init__(self, model):
        self.steps = self.rows = 0
        self.hook = model.register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, _module, _args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] == 1:
            self.steps += 1
            self.rows += ids.shape[0]


def bench_batch(sim, requests, args, batched, t_batched):
    print("\n1. in-process transformers")
    model = sim.backend.model
    counter = StepCounter(model)
    sim.search(requests, args.k)
    batched_steps, batched_rows = counter.steps, counter.rows
    counter.steps = counter.rows = 0
    sequential, t_seq = timed(one_by_one, sim, requests, args.k)
    counter.hook.remove()
    row("", "seconds", "requests/s", "speed-up")
    row("one call per request (sequential)", f"{t_seq:.2f}", f"{len(requests) / t_seq:.2f}", "1.0x")
    row(
        "one batched call (zerosim)",
        f"{t_batched:.2f}",
        f"{len(requests) / t_batched:.2f}",
        f"{t_seq / t_batched:.1f}x",
    )
    same = sum(a == b for a, b in zip(batched, sequential, strict=True))
    print(f"  identical results batched vs sequential (ids, texts, labels): {same}/{len(requests)}")
    # A batched call decodes until its longest completion ends: its steps are the longest request's, the
    # sequential loop's the sum of all. Their ratio bounds the speed-up even if a step on many rows cost
    # no more than a step on one.
    print(
        f"  decode steps: sequential {counter.steps}, batched {batched_steps} (mean {batched_rows / max(batched_steps, 1):.1f} "
        f"rows per step); steps ratio {counter.steps / max(batched_steps, 1):.1f}x = the bound on the speed-up"
    )


def bench_variants(args) -> None:
    """Batched vs sequential for several simulator variants in one run: each side's median of ``--repeats``,
    the speed-up over the variant's own sequential loop and over the fastest sequential loop of the run."""
    import torch

    from simulators import LLMSimulator, TransformersBackend
    from zerosim.core.models import load_causal_lm, load_tokenizer

    requests = requests_for(args.requests)
    tokenizer = load_tokenizer(args.model)
    results = {}
    for variant in args.variants.split(","):
        dtype, _, flag = variant.partition("+")
        torch.manual_seed(0)
        backend = TransformersBackend(
            load_causal_lm(args.model, dtype),
            tokenizer,
            model_id=args.model,
            batch_invariant=flag == "invariant",
        )
        sim = LLMSimulator(
            backend, max_new_tokens=args.max_new_tokens, temperature=0.0, on_short="fill", seed=0
        )
        sim.search(requests[:2], args.k)  # warm-up
        runs_b, runs_s = [], []
        counter = StepCounter(backend.model)
        for _ in range(args.repeats):
            counter.steps = 0
            batched, t = timed(sim.search, requests, args.k)
            runs_b.append(t)
            steps_b = counter.steps
            counter.steps = 0
            sequential, t = timed(one_by_one, sim, requests, args.k)
            runs_s.append(t)
            steps_s = counter.steps
        counter.hook.remove()
        same = sum(a == b for a, b in zip(batched, sequential, strict=True))
        bound = steps_s / max(steps_b, 1)
        results[variant] = (statistics.median(runs_b), statistics.median(runs_s), same, bound)
        print(
            f"  {variant}: batched {[round(t, 2) for t in runs_b]}, sequential {[round(t, 2) for t in runs_s]}; "
            f"decode steps {steps_b} batched, {steps_s} sequential",
            flush=True,
        )
    fastest = min(t_s for _, t_s, _, _ in results.values())
    print(
        f"\nsimulator {args.model}: {len(requests)} requests, k={args.k}, {args.max_new_tokens} new tokens, "
        f"median of {args.repeats}"
    )
    # steps bound: the sequential loop's decode steps over the batched call's (its longest completion)
    row("variant", "batched s", "sequential s", "vs own seq", "vs fastest", "steps bound", "identical")
    for variant, (t_b, t_s, same, bound) in results.items():
        row(
            variant,
            f"{t_b:.2f}",
            f"{t_s:.2f}",
            f"{t_s / t_b:.1f}x",
            f"{fastest / t_b:.1f}x",
            f"{bound:.1f}x",
            f"{same}/{len(requests)}",
        )


def bench_http(model, tokenizer, requests, args, options, t_batched):
    from simulators import LLMSimulator, TransformersBackend
    from simulators.openai_server import running_openai_server

    print("\n2. HTTP, OpenAI-compatible /v1/completions (in-process server)")
    server_backend = TransformersBackend(model, tokenizer, apply_chat_template=False, model_id=args.model)
    with running_openai_server(server_backend, model_name="sim") as url:
        client = LLMSimulator.from_openai(url, "sim", tokenizer=tokenizer, max_concurrency=1, **options)
        client.search(requests[:2], args.k)
        _, t_one = timed(client.search, requests, args.k)
        _, t_each = timed(one_by_one, client, requests, args.k)
        client.close()
    row("", "seconds", "requests/s", "speed-up")
    row("one HTTP request per query", f"{t_each:.2f}", f"{len(requests) / t_each:.2f}", "1.0x")
    row(
        "one HTTP request per call (zerosim)",
        f"{t_one:.2f}",
        f"{len(requests) / t_one:.2f}",
        f"{t_each / t_one:.1f}x",
    )
    row("HTTP overhead vs in-process batched", f"{t_one - t_batched:+.2f}", "", "")


def bench_cache(sim, requests, args, t_batched):
    from simulators import CachedSearchEngine

    print("\n3. cache hits")
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "cache.sqlite"
        # store every result (the simulator refuses ones holding failure documents): we time the lookup path
        keep_all = lambda docs: True  # noqa: E731
        cached = CachedSearchEngine(sim, sqlite_path=db, cacheable=keep_all)
        cached.search(requests, args.k)  # fill: one miss per request
        lookups = [[requests[i % len(requests)]] for i in range(args.cache_hits)]
        memory = [timed(cached.search, r, args.k)[1] for r in lookups]
        cached.close()
        reopened = CachedSearchEngine(sim, sqlite_path=db, cacheable=keep_all)  # memory empty, sqlite warm
        disk = [timed(reopened.search, [r], args.k)[1] for r in requests]
        assert reopened.stats["misses"] == 0, "sqlite should have answered every request"
        reopened.close()
    row("", "mean ms", "p99 ms", "target")
    p99 = lambda xs: sorted(xs)[int(0.99 * (len(xs) - 1))]  # noqa: E731
    row("memory hit", f"{1e3 * statistics.mean(memory):.3f}", f"{1e3 * p99(memory):.3f}", "< 1 ms")
    row(
        "sqlite hit (after restart)", f"{1e3 * statistics.mean(disk):.3f}", f"{1e3 * p99(disk):.3f}", "< 1 ms"
    )
    miss = t_batched / len(requests)
    row("miss (batched generation, per request)", f"{1e3 * miss:.1f}", "", "")


if __name__ == "__main__":
    main()

"""Served vs in-process simulator (on demand, not CI): ``python benchmarks/simulator_served.py [--model smollm2]``.

One search call of N requests written by the same simulator three ways, back to back in one run, each
repetition in turn (the order rotates, so a machine whose speed drifts favours no side), median of
``--repeats``:

- **in-process**: ``LLMSimulator`` over ``TransformersBackend`` (one batched ``generate``);
- **served (thread)**: the same through ``/v1/completions`` of the in-process OpenAI-compatible server run
  in a thread of this process (``running_openai_server``, what ``benchmarks/simulator.py`` times);
- **served (process)**: through ``zerosim simulator serve --threads T`` in its own process, as training
  talks to it.

It prints each side's seconds and its ratio to in-process, and where the served time goes: the server's
``generate`` (timed inside the server thread, with the torch threads it ran with), the rest of the request
(HTTP, JSON, the context check's tokenisation, queueing), and the client's chat-template formatting. All
sides write the same documents (greedy; checked). The share of the CPU other processes used during the
timings is printed too: on a busy machine the seconds are not quiet-machine figures, the ratios hold
better.

``--omp-wait-policy passive`` runs every side with ``OMP_WAIT_POLICY=PASSIVE``: with it unset, a server
process whose cores something else uses spends most of a call in libgomp's spin-wait (docs/simulator.md,
"Served vs in-process": 6.8x the in-process time for SmolLM2 on 2 cores, 0.55x with ``PASSIVE``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from simulator import requests_for, row, timed  # noqa: E402  (the sibling benchmark's helpers)


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used, from ``/proc``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server_process(model: str, threads: int, dtype: str) -> tuple[subprocess.Popen, str]:
    """``zerosim simulator serve`` on a free port; returns it and its URL once ``/health`` answers."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = ["zerosim", "simulator", "serve", "--model", model, "--port", str(port)]
    command += ["--threads", str(threads), "--dtype", dtype]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{' '.join(command)} exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError(f"{' '.join(command)} did not answer /health within 300 s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="simulator model: path, HF id or smollm2")
    parser.add_argument("--requests", type=int, default=16, help="requests in one search call")
    parser.add_argument("--k", type=int, default=3, help="documents per request")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="token budget per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timings per side (median)")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 (all sides)")
    parser.add_argument("--sides", default="thread,process", help="served sides: thread, process or both")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads of every side (default: this process's)"
    )
    parser.add_argument(
        "--omp-wait-policy",
        default=None,
        choices=["passive", "active"],
        help="OMP_WAIT_POLICY of every side (this process and the server process); default: as the "
        "environment says (unset: libgomp spins ~3 ms at each barrier before sleeping)",
    )
    args = parser.parse_args()
    if args.omp_wait_policy:  # read by libgomp when torch loads: set before the import below
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()

    import torch

    from simulators import LLMSimulator, TransformersBackend
    from simulators.openai_server import running_openai_server
    from zerosim.core.http.retry import RetryPolicy
    from zerosim.core.models import format_chat_prompt, load_causal_lm, load_tokenizer
    from zerosim.core.runtime import apply_threads, cpu_times

    threads = apply_threads(args.threads)
    requests = requests_for(args.requests)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, on_short="fill", seed=0)
    patient = RetryPolicy(read_timeout=1800.0, retries=1)  # a retry would make the server write it twice
    model, tokenizer = load_causal_lm(args.model, args.dtype), load_tokenizer(args.model)
    local = TransformersBackend(model, tokenizer, model_id=args.model)
    served = TransformersBackend(model, tokenizer, apply_chat_template=False, model_id=args.model)

    # the server thread's generate, timed where it runs, with the torch threads it runs with
    inside: list[tuple[float, int, str]] = []
    generate = served.generate

    def timed_generate(prompts, **settings):
        started = time.perf_counter()
        out = generate(prompts, **settings)
        inside.append(
            (time.perf_counter() - started, torch.get_num_threads(), threading.current_thread().name)
        )
        return out

    served.generate = timed_generate
    asked: list[str] = []  # the user-message texts of the last in-process call (for the small costs below)
    local_generate = local.generate

    def recording_generate(prompts, **settings):
        asked[:] = prompts
        return local_generate(prompts, **settings)

    local.generate = recording_generate
    sides = {"in-process": LLMSimulator(local, **options)}
    server = None
    with running_openai_server(served, model_name="sim") as url:
        if "thread" in args.sides:
            sides["served (thread)"] = LLMSimulator.from_openai(
                url, "sim", tokenizer=tokenizer, retry=patient, **options
            )
        if "process" in args.sides:
            server, process_url = start_server_process(args.model, threads, args.dtype)
            sides["served (process)"] = LLMSimulator.from_openai(
                process_url, args.model, tokenizer=tokenizer, retry=patient, **options
            )
        try:
            for sim in sides.values():
                sim.search(requests[:2], args.k)  # warm-up: first-call allocations out of the timings
            inside.clear()
            times: dict[str, list[float]] = {name: [] for name in sides}
            results = {}
            server_cpu = process_cpu_seconds(server.pid) if server else 0.0
            before = cpu_times()
            names = list(sides)
            for r in range(args.repeats):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    results[name], seconds = timed(sides[name].search, requests, args.k)
                    times[name].append(seconds)
                print(
                    f"  repeat {r + 1}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()),
                    flush=True,
                )
            after = cpu_times()
            server_cpu = (process_cpu_seconds(server.pid) if server else 0.0) - server_cpu
        finally:
            for sim in sides.values():
                sim.close()
            if server is not None:
                server.terminate()
                server.wait(timeout=30)

    others = None
    if before is not None and after is not None:
        busy = (after.machine_busy - before.machine_busy) - (after.own - before.own) - server_cpu
        others = max(0.0, busy / ((after.at - before.at) * after.cpus))
    base = statistics.median(times["in-process"])
    print(
        f"\nsimulator {args.model} ({args.dtype}, {threads} torch threads, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}): {len(requests)} requests, k={args.k}, "
        f"{args.max_new_tokens} new tokens, greedy; median of {args.repeats}, order rotated"
    )
    row("side", "seconds", "vs in-process", "same docs")
    for name, runs in times.items():
        same = sum(a == b for a, b in zip(results[name], results["in-process"], strict=True))
        row(
            name,
            f"{statistics.median(runs):.2f}",
            f"{statistics.median(runs) / base:.2f}x",
            f"{same}/{len(requests)}",
        )
    if inside:
        thread_side = statistics.median(times["served (thread)"])
        in_generate = statistics.median(t for t, _, _ in inside)
        counts = sorted({n for _, n, _ in inside})
        where = sorted({w for _, _, w in inside})
        formatted, formatting = timed(lambda: [format_chat_prompt(tokenizer, p) for p in asked])
        tokens, tokenising = timed(lambda: [served.encode(p) for p in formatted])
        print(
            f"  served (thread): generate inside the server {in_generate:.2f}s "
            f"({in_generate / thread_side:.1%} of the call; torch threads there {counts}, main {torch.get_num_threads()}, "
            f"run in {where}); the rest {thread_side - in_generate:+.2f}s. "
            f"Client chat templates {1e3 * formatting:.1f} ms, server context-check tokenisation "
            f"{1e3 * tokenising:.1f} ms for the call's {len(tokens)} prompts "
            f"({statistics.mean(map(len, tokens)):.0f} tokens each on average)"
        )
    if others is not None:
        print(f"  other processes used {others:.0%} of the machine's CPU during the timings")


if __name__ == "__main__":
    main()

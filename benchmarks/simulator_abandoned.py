"""What abandoned requests cost the next caller of the simulator server (on demand, not CI):
``python benchmarks/simulator_abandoned.py [--model smollm2] [--abandoned 3] [--max-tokens 1500]``.

The in-process OpenAI-compatible server (``zerosim simulator serve`` without vLLM) runs in a thread of this
process. Each repetition, in turn:

- **alone**: a small request (``--small-tokens`` tokens) on an idle server, timed;
- **after abandoned**: ``--abandoned`` clients each ask for ``--max-tokens`` tokens and hang up once the
  first one has generated for ``--hang-up`` seconds (one generating, the others waiting), as a client's
  read timeout does; the same small request is sent at once and timed.

It prints both medians side by side, their ratio, and the difference in decode steps (one step timed on
the same server), next to what the next caller would have waited if the abandoned generations ran to the
end (the server before cancellation). With cancellation the difference stays within about one decode
step: the generating request stops before its next forward, the waiting ones never run. The machine's
load average is printed beside the figures: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path
from urllib.parse import urlsplit

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = "Write a short encyclopedia article about Lima, the capital of Peru."


def completion(max_tokens: int) -> dict:
    return {"model": "simulator", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}


def send_and_leave_open(url: str, body: dict) -> socket.socket:
    """A whole ``POST /v1/completions`` on a raw socket, the answer left unread."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=60)
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def timed_request(client, url: str, max_tokens: int) -> tuple[float, int]:
    """Seconds for one completion, and the tokens it wrote."""
    started = time.perf_counter()
    answer = client.post(f"{url}/v1/completions", json=completion(max_tokens))
    seconds = time.perf_counter() - started
    answer.raise_for_status()
    return seconds, answer.json()["usage"]["completion_tokens"]


def wait_until(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not get there within {timeout}s")
        time.sleep(0.005)


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="simulator model: path, HF id or smollm2")
    parser.add_argument("--dtype", default="float32", help="auto | float32 | bfloat16")
    parser.add_argument("--abandoned", type=int, default=3, help="clients that hang up each repetition")
    parser.add_argument("--max-tokens", type=int, default=1500, help="tokens each abandoned client asks for")
    parser.add_argument("--hang-up", type=float, default=1.0, help="seconds of generation before they go")
    parser.add_argument("--small-tokens", type=int, default=2, help="tokens the next caller asks for")
    parser.add_argument("--step-tokens", type=int, default=32, help="tokens generated to time one step")
    parser.add_argument("--repeats", type=int, default=5, help="repetitions (medians are printed)")
    args = parser.parse_args()

    import httpx

    from simulators import TransformersBackend
    from simulators.openai_server import create_openai_app
    from zerosim.core.http.server import running_app
    from zerosim.core.models import resolve_model

    backend = TransformersBackend.from_pretrained(
        resolve_model(args.model), args.dtype, apply_chat_template=False
    )
    app = create_openai_app(backend, model_name="simulator", max_tokens_limit=args.max_tokens)
    queue = app.state.queue
    alone, after = [], []
    with running_app(app) as url, httpx.Client(timeout=600) as client:
        timed_request(client, url, args.small_tokens)  # warm-up
        seconds, tokens = timed_request(client, url, args.step_tokens)
        small, _ = timed_request(client, url, args.small_tokens)
        step = max(seconds - small, 0.0) / max(tokens - args.small_tokens, 1)
        for _ in range(args.repeats):
            alone.append(timed_request(client, url, args.small_tokens)[0])
            socks = [send_and_leave_open(url, completion(args.max_tokens))]
            wait_until(lambda: not queue.idle)
            socks += [
                send_and_leave_open(url, completion(args.max_tokens)) for _ in range(args.abandoned - 1)
            ]
            wait_until(lambda: queue.waiting == args.abandoned - 1)
            time.sleep(args.hang_up)
            for sock in socks:
                sock.close()
            after.append(timed_request(client, url, args.small_tokens)[0])
            wait_until(lambda: queue.idle)
        stats = dict(queue.stats)

    quiet, busy = statistics.median(alone), statistics.median(after)
    uncancelled = args.abandoned * args.max_tokens * step  # what the old server made the next caller wait
    print(
        f"model {args.model} ({args.dtype}), one decode step {step * 1000:.1f} ms; load average {load_average()}"
    )
    print(f"next caller ({args.small_tokens} tokens), median of {args.repeats}:")
    print(f"  alone                      {quiet * 1000:8.1f} ms")
    print(f"  after {args.abandoned} abandoned requests  {busy * 1000:8.1f} ms")
    print(f"  ratio {busy / quiet:.2f}x; extra wait {(busy - quiet) / step if step else 0:.1f} decode steps")
    print(f"  had they run to the end: ~{uncancelled:.0f} s ({args.abandoned} x {args.max_tokens} steps)")
    print(f"server: {stats}")


if __name__ == "__main__":
    main()

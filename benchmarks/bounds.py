"""What a machine can do at least, for benchmarks that state a phase's share of its bound (not CI).

:func:`machine_rates` measures this process's copy bandwidth and matmul rates (fp32, bf16); :class:`Recorder`
wraps a generator (``generate(prompts, max_new_tokens)``), records each call's rows and how many tokens each
wrote, and gives the least time those calls need on this machine (:meth:`Recorder.bound`): each decode step
reads every weight once (at the copy bandwidth) or does 2 x params FLOPs per live row (at the matmul rate),
whichever is longer, and every other token is encoded once at the matmul rate (attention FLOPs not counted).
"""

from __future__ import annotations

import statistics
import time


def machine_rates() -> tuple[float, float, float]:
    """(copy bandwidth in bytes/s, fp32 matmul FLOP/s, bf16 matmul FLOP/s), median of 5, at this process's
    thread count."""
    import torch

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    src = torch.empty(64 * 2**20)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / best(lambda: dst.copy_(src))  # read + write
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    flops = 2 * 2048**3 / best(lambda: a @ b)
    a, b = a.bfloat16(), b.bfloat16()
    bf16_flops = 2 * 2048**3 / best(lambda: a @ b)
    return bandwidth, flops, bf16_flops


class Recorder:
    """Wraps a generator: records each call's prompts and output lengths (the work done)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[list[tuple[int, ...]], list[int]]] = []  # (prompt + output, output length)

    @property
    def sampling(self):  # a caller may set another between calls (the simulator: per request)
        return self.inner.sampling

    @sampling.setter
    def sampling(self, value) -> None:
        self.inner.sampling = value

    def generate(self, prompts, max_new_tokens, width=None):
        outs = self.inner.generate(prompts, max_new_tokens)
        rows = [tuple(p) + tuple(o.token_ids) for p, o in zip(prompts, outs, strict=True)]
        self.calls.append((rows, [len(o.token_ids) for o in outs]))
        return outs

    def bound(self, params: int, bandwidth: float, flops: float, width: int = 4) -> float:
        """Seconds this machine needs at least for the tokens of these calls (see the module doc), its weights
        ``width`` bytes each."""
        seconds, fed_in_steps = 0.0, 0
        for _, lengths in self.calls:
            for step in range(max(lengths, default=0) - 1):  # a row's last sampled token is never fed
                live = sum(1 for n in lengths if n > step + 1)
                seconds += max(params * width / bandwidth, 2 * params * live / flops)
                fed_in_steps += live
        return seconds + 2 * params * max(self.distinct_tokens() - fed_in_steps, 0) / flops

    def distinct_tokens(self) -> int:
        """Tokens fed at least once: each row's prompt + output (less its last token), counted with the row
        of the next call that continues it where there is one."""
        total = 0
        for call, (rows, _) in enumerate(self.calls):
            following = self.calls[call + 1][0] if call + 1 < len(self.calls) else []
            for row in rows:
                if not any(len(f) > len(row) and f[: len(row)] == row for f in following):
                    total += len(row) - 1
        return total

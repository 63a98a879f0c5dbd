"""Today's CPU path and the one before it, for benchmarks that time both in one run (not CI).

``before()`` puts back, for the ``with`` block, what the rollout and the simulator ran before bf16 compute on
CPUs with bf16 matrix instructions (zerosim.core.runtime.apply_precision), the prefill shared by a group's
repeated prompt (zerosim.core.decode.SHARE_REPEATED_PROMPTS) and the inverse-CDF sampler
(zerosim.core.decode.sample): fp32 everywhere, one prefill per row, and transformers' sampler (temperature,
top-p over a sorted vocabulary, ``torch.multinomial``). A job started inside the block is told
``runtime.bf16=false`` (:data:`BEFORE_OVERRIDES`), so it does not decide bf16 again.
"""

from __future__ import annotations

import contextlib

BEFORE_OVERRIDES = ("runtime.bf16=false",)


def sample_like_generate(logits, temperature: float, top_p: float):
    """transformers' sampling: temperature, then ``TopPLogitsWarper`` (a sort of the vocabulary), then
    ``torch.multinomial`` (one exponential drawn per vocabulary entry); greedy at 0."""
    import torch
    import torch.nn.functional as F

    if temperature <= 0:
        return logits.argmax(dim=-1)
    scores = logits / temperature
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(1, sorted_idx, remove), -float("inf"))
    return torch.multinomial(F.softmax(scores, dim=-1), num_samples=1).squeeze(1)


@contextlib.contextmanager
def before():
    """The path before: fp32, one prefill per row, transformers' sampler (see the module)."""
    import zerosim.core.decode as decode
    from zerosim.core import runtime

    saved = (decode.sample, decode.SHARE_REPEATED_PROMPTS, runtime._CPU_BF16)
    decode.sample, decode.SHARE_REPEATED_PROMPTS, runtime._CPU_BF16 = sample_like_generate, False, False
    try:
        yield
    finally:
        decode.sample, decode.SHARE_REPEATED_PROMPTS, runtime._CPU_BF16 = saved


PATHS = {"before": before, "now": contextlib.nullcontext}

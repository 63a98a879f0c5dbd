"""Batched token-in/token-out generation with stop strings: transformers ``generate`` or TRL's vLLM.

The rollout and the in-process simulator both go through :class:`HFGenerator`: left-padded batches,
one ``generate`` call per batch, generation stopped at EOS or at any stop string (so no tokens are
wasted past ``</search>`` / ``</answer>``), each row cut right after its stop, and the sampling
log-probability of every kept token (``log_softmax(logits / temperature)``, as TRL computes it).

:class:`VLLMGenerator` gives the rollout the same interface over the vLLM engine TRL's ``GRPOTrainer``
runs (``vllm_mode`` colocate or server), so weight syncing stays TRL's. Evaluation's engines (a ``vllm.LLM`` of
its own, a served policy) are in :mod:`zerosim.core.inference`.

A generator whose ``collective`` is true must be called by every rank the same number of times (vLLM
server mode gathers all ranks' prompts; transformers under ZeRO-3/FSDP synchronises each decoding step);
``generate(..., width=W)`` pads this rank's batch to the batch-wide ``W`` where the backend needs equal
slices, and ``idle`` takes part in a turn without trajectories.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zerosim.core.decode import (
    PrefixStore,
    attention_implementation,
    decode,
    decode_invariant,
    register_attention,
    supports_fast_decode,
)
from zerosim.core.sampling import DEFAULT_SAMPLING, Sampling

DECODERS = ("zerosim", "transformers")  # zerosim.core.decode's loop | transformers generate

# tokenizer -> {stop strings: StopStringCriteria}. transformers builds the criterion (a pass over the whole
# vocabulary, ~1 s for SmolLM2's 49k tokens) on every ``generate`` call that names ``stop_strings``, and its
# own cache misses because ``get_vocab()`` does not keep one order; the criterion is stateless, so one per
# (tokenizer, stop strings) serves every call.
_STOP_CRITERIA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stop_criterion(tokenizer, stop_strings: Sequence[str]):
    """The ``StopStringCriteria`` of ``stop_strings`` for ``tokenizer``, built once and reused."""
    from transformers import StopStringCriteria

    per_tokenizer = _STOP_CRITERIA.setdefault(tokenizer, {})
    key = tuple(stop_strings)
    if key not in per_tokenizer:
        per_tokenizer[key] = StopStringCriteria(tokenizer, list(key))
    return per_tokenizer[key]


@dataclass
class Generation:
    """One generated continuation: kept tokens, their log-probs, and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish: str  # "stop" (a stop string completed) | "eos" | "length"


class HFGenerator:
    """Sampling from a transformers causal LM in batches."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        sampling: Sampling = DEFAULT_SAMPLING,
        logprobs: bool = True,
        collective: bool = False,
        decoder: str = "zerosim",
        reuse_prefix: bool = True,
        batch_invariant: bool = False,
        bf16: bool | None = None,
    ):
        if decoder not in DECODERS:
            raise ValueError(f"decoder {decoder!r} is not one of {', '.join(DECODERS)}")
        self.model = model
        # zerosim's loop (zerosim.core.decode) unless the model needs generate, or ranks sync decoding steps
        self.decoder = decoder if not collective and supports_fast_decode(model) else "transformers"
        # each row computed as if decoded alone (zerosim.core.decode.decode_invariant): a batched call writes
        # what one call per prompt writes; the simulator's choice, not the policy's
        self.batch_invariant = batch_invariant and self.decoder == "zerosim"
        # zerosim's loop keeps the last call's rows cached: a multi-turn context is not encoded again
        reuse = reuse_prefix and self.decoder == "zerosim" and not self.batch_invariant
        self.store = PrefixStore(model) if reuse else None
        self.collective = collective  # transformers syncs decoding steps across ranks (ZeRO-3 / FSDP)
        # bf16 matmuls on CPU from a bf16 copy of the linear layers (zerosim.core.bf16); None: the process's
        # decision (runtime.bf16, zerosim.core.runtime.apply_precision). A model already in bf16 (or on a GPU)
        # computes in its own dtype
        if bf16 is None:
            from zerosim.core.runtime import cpu_bf16_generation

            bf16 = cpu_bf16_generation()
        # not where ranks sync decoding steps: a ZeRO-3/FSDP model's weights are shards, gathered per forward
        on_cpu = next(model.parameters()).device.type == "cpu"
        fp32 = next(model.parameters()).dtype == torch.float32
        # nor for a LoRA policy in training (a PeftModel): its adapter layers are not split into the copy, and
        # the forwards TRL patched under peft's wrapper would run the live model; it generates as it is
        from accelerate.utils import is_peft_model

        peft = is_peft_model(model)
        self.bf16 = bool(bf16) and on_cpu and fp32 and not collective and not peft
        self._bf16_copy = None
        self.logprobs = logprobs  # False: skip keeping every step's logits (callers that need only text)
        self.tokenizer = tokenizer
        self.sampling = sampling  # a caller may set another between calls (the simulator: per request)
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The token ids a row ends at (:meth:`Sampling.eos_ids`)."""
        return self.sampling.eos_ids(self.tokenizer)

    def idle(self, max_new_tokens: int) -> None:
        """Take part in a collective turn with nothing to generate (a one-token dummy row)."""
        if self.collective:
            self.generate([[self.pad_token_id]], max_new_tokens)

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, width: int | None = None
    ) -> list[Generation]:
        """Continue each token-id prompt by at most ``max_new_tokens`` tokens (``width``: unused here)."""
        if not prompts or max_new_tokens < 1:  # nothing to write: no rows, or an empty one per prompt
            return [Generation([], [], "length") for _ in prompts]
        if self.decoder == "zerosim":
            return self._decode(prompts, max_new_tokens)
        with self._precision() as model:
            return self._generate(model, prompts, max_new_tokens)

    def _precision(self):
        """Context manager giving the model to compute with: the bf16 copy under autocast, or the model."""
        import contextlib

        if not self.bf16:
            return contextlib.nullcontext(self.model)
        from zerosim.core.bf16 import Bf16Copy, cpu_autocast

        if self._bf16_copy is None:
            self._bf16_copy = Bf16Copy(self.model)

        @contextlib.contextmanager
        def bf16():
            copy = self._bf16_copy.current()
            with cpu_autocast():
                yield copy

        return bf16()

    def _generate(self, model, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Generation]:
        device = next(model.parameters()).device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            if ids:
                input_ids[row, width - len(ids) :] = torch.tensor(list(ids), dtype=torch.long)
                attention[row, width - len(ids) :] = 1
        from transformers import StoppingCriteriaList

        s = self.sampling
        was_training = model.training
        model.eval()
        try:
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=s.sampled,
                temperature=s.temperature if s.sampled else None,
                top_p=s.top_p if s.sampled else None,
                top_k=None,
                stopping_criteria=(
                    StoppingCriteriaList([stop_criterion(self.tokenizer, s.stop_strings)])
                    if s.stop_strings
                    else None
                ),
                eos_token_id=sorted(self.eos_token_ids),
                pad_token_id=self.pad_token_id,
                return_dict_in_generate=True,
                output_logits=self.logprobs,
                use_cache=True,
            )
        finally:
            model.train(was_training)
        new_tokens = out.sequences[:, width:].cpu()
        if not self.logprobs:
            zeros = [0.0] * new_tokens.shape[1]
            return [self._cut(new_tokens[row].tolist(), zeros) for row in range(len(prompts))]
        scale = s.temperature if s.sampled else 1.0
        # One (batch,) gather per position keeps memory at batch x vocab instead of steps x batch x vocab.
        token_logps = torch.stack(
            [
                torch.log_softmax(logits.float().cpu() / scale, dim=-1)
                .gather(1, new_tokens[:, t : t + 1])
                .squeeze(1)
                for t, logits in enumerate(out.logits)
            ],
            dim=1,
        )
        return [self._cut(new_tokens[row].tolist(), token_logps[row].tolist()) for row in range(len(prompts))]

    def _decode(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Generation]:
        was_training = self.model.training
        self.model.eval()
        try:
            options = dict(sampling=self.sampling, pad_token_id=self.pad_token_id, logprobs=self.logprobs)
            with self._precision() as model, attention_implementation(model, register_attention()):
                if self.batch_invariant:
                    rows = decode_invariant(model, self.tokenizer, prompts, max_new_tokens, **options)
                else:
                    # the store's caches are the copy's, valid while the model's weights are (its check)
                    rows = decode(model, self.tokenizer, prompts, max_new_tokens, store=self.store, **options)
        finally:
            self.model.train(was_training)
        return [self._cut(ids, logps) for ids, logps in rows]

    def _cut(self, ids: list[int], logps: list[float]) -> Generation:
        return cut_at_stop(ids, logps, self.tokenizer, self.sampling.stop_strings, self.eos_token_ids)


def cut_at_stop(
    ids: list[int], logps: list[float], tokenizer, stop_strings: Sequence[str], eos_token_ids: frozenset[int]
) -> Generation:
    """Keep tokens up to and including the first EOS or the token that completes a stop string."""
    stop_chars = {s[-1] for s in stop_strings}
    for i, tok in enumerate(ids):
        if tok in eos_token_ids:
            return Generation(ids[: i + 1], logps[: i + 1], "eos")
        if stop_strings:
            piece = tokenizer.decode([tok])
            if any(c in piece for c in stop_chars):
                text = tokenizer.decode(ids[: i + 1])
                if any(s in text for s in stop_strings):
                    return Generation(ids[: i + 1], logps[: i + 1], "stop")
    return Generation(ids, logps, "length")


class VLLMGenerator:
    """The rollout's generator over TRL's ``VLLMGeneration`` (``trainer.vllm_generation``).

    Sampling settings (temperature, top-p) are the trainer's; stop strings reach vLLM through
    ``GRPOConfig.generation_kwargs`` (``stop`` + ``include_stop_str_in_output``), and each row is still cut
    here at its first stop (vLLM ends the text there but may keep the whole last token). Log-probs are
    vLLM's sampled-token log-probs, which TRL's importance-sampling correction expects.
    """

    def __init__(
        self, vllm_generation, tokenizer, *, stop_strings: Sequence[str], eos_token_ids: Sequence[int]
    ):
        self.vllm = vllm_generation
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids if t is not None)
        tp = int(getattr(vllm_generation, "tensor_parallel_size", 1) or 1)
        # server mode gathers every rank's prompts and slices the answer by equal shares; colocate with
        # tensor parallelism does the same within its group: both need every rank, with equal widths
        self.collective = vllm_generation.mode == "server" or tp > 1
        self._dummy = [int(next(iter(self.eos_token_ids), 0))]

    def idle(self, max_new_tokens: int) -> None:
        if self.collective:
            self.generate([], max_new_tokens, width=1)

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, width: int | None = None
    ) -> list[Generation]:
        """Continue each prompt by at most ``max_new_tokens``; a collective call pads to ``width`` rows."""
        rows = [list(p) for p in prompts]
        if self.collective:
            rows += [self._dummy] * max(0, (width or len(rows)) - len(rows))
        if not rows:
            return []
        self.vllm.max_completion_length = max_new_tokens  # read by VLLMGeneration at call time
        _, completion_ids, logprobs, _ = self.vllm.generate(prompts=rows, images=None, num_generations=1)
        out = []
        for ids, lps in zip(completion_ids[: len(prompts)], logprobs[: len(prompts)], strict=True):
            flat = [float(lp[0]) if isinstance(lp, list | tuple) else float(lp) for lp in lps]
            out.append(cut_at_stop(list(ids), flat, self.tokenizer, self.stop_strings, self.eos_token_ids))
        return out

"""bf16 generation on CPU from fp32 weights: a copy of a model whose linear layers multiply in bf16, run under
bf16 autocast.

Each linear weight of the copy is held as two bf16 tensors, ``hi = bf16(w)`` and ``lo = bf16(w - hi)``, and
the layer computes ``x @ hi + x @ lo`` (one matmul, :class:`SplitBf16Linear`): 16 bits of mantissa, not
bf16's 8. One bf16 weight is not enough for a
fine-tuned model. A checkpoint shipped in bf16 (SmolLM2, Qwen2.5, Llama) has every weight on bf16's grid, and
a fine-tune moves a weight by less than half that grid's step for most weights (5 SFT steps at lr 2e-4
leave 38% of the changed weights of SmolLM2-135M rounding back to their starting value, and the rest with 53%
relative error): a bf16 cast rounds most of the fine-tune away, and the generator samples from something
near the checkpoint the run started from. Measured on the v2 recipe's warm start (AMD EPYC, 64 fact-test
questions, BM25): EM 14.1 in fp32, 4.7 from one bf16 weight per layer; the simulator's SFT and DPO went the
same way, and the sim arm trained from it fell from 25 EM to 10-15 (docs/training.md, "bf16 on CPU").

Autocast over the fp32 model computes what one bf16 weight does, and under ``torch.inference_mode`` it casts
every weight again at every forward (its cast cache keeps only tensors that record gradients). The copy casts
once per change of the weights (:func:`zerosim.core.decode.weights_version`: an optimizer step). Every other
tensor of the copy (embeddings, norms, biases of non-linear modules) stays fp32 and every other op runs as
autocast runs it — the residual stream, the norms and the softmax in fp32 — and the attention runs in fp32
(:func:`zerosim.core.decode.gqa_sdpa_attention`). A tied output head gets its own weights; the input
embedding stays fp32.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from zerosim.core.decode import weights_version

# Each linear weight as hi + lo (see the module). False: one bf16 weight (what autocast computes), for
# benchmarks/decode.py and the fidelity test that shows why it is not the default.
SPLIT_WEIGHTS = True


class SplitBf16Linear(torch.nn.Module):
    """A linear layer in bf16 whose weight is ``hi + lo`` (16 bits of mantissa; see the module).

    One matmul computes both: ``[x, x] @ [hi, lo]^T``, the two halves of the doubled inner dimension summed in
    the kernel's fp32 accumulator and rounded to bf16 once. ``split=False``: ``x @ hi`` only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, split: bool):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.split = split
        width = 2 * self.in_features if split else self.in_features
        self.register_buffer(
            "weight", weight.new_empty((self.out_features, width), dtype=torch.bfloat16), persistent=False
        )
        self.register_buffer(
            "bias", None if bias is None else bias.detach().to(torch.bfloat16), persistent=False
        )
        self.load(weight, bias)

    @torch.no_grad()
    def load(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Take ``weight`` (fp32) and ``bias`` as they are now."""
        hi = self.weight[:, : self.in_features]
        hi.copy_(weight)
        if self.split:
            self.weight[:, self.in_features :].copy_(weight - hi.float())
        if bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        if self.split:
            x = torch.cat([x, x], dim=-1)
        return F.linear(x, self.weight, self.bias)


class Bf16Copy:
    """A bf16-matmul copy of ``model`` (see the module), refreshed from it when its weights change."""

    def __init__(self, model, split: bool | None = None):
        self.model = model
        self.split = SPLIT_WEIGHTS if split is None else split
        self._copy = None
        self._linears: list[tuple[SplitBf16Linear, torch.nn.Linear]] = []  # (copy's layer, model's layer)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # other tensors: (copy's, model's)
        self._version: tuple | None = None

    def _build(self) -> None:
        source = dict(self.model.named_modules())
        with torch.no_grad():
            clone = copy.deepcopy(self.model)
            # a forward patched onto the instance (TRL's fused log-prob head, zerosim's compact head) closes over
            # the original model: the copy runs its class's own
            clone.__dict__.pop("forward", None)
            self._linears = []
            for name, module in list(clone.named_modules()):
                if isinstance(module, torch.nn.Linear):
                    twin = source[name]
                    layer = SplitBf16Linear(twin.weight, twin.bias, self.split)
                    parent, _, child = name.rpartition(".")
                    setattr(clone.get_submodule(parent) if parent else clone, child, layer)
                    self._linears.append((layer, twin))
            for param in clone.parameters():
                param.requires_grad_(False)
                param.grad = None
        clone.eval()
        self._pairs = [
            (tensor, getattr(source[name], attr))
            for name, module in clone.named_modules()
            for attr, tensor in module.named_parameters(recurse=False)
        ]
        self._copy = clone

    def current(self):
        """The copy, with the model's weights as they are now (cast again if they changed since the last call)."""
        version = weights_version(self.model)
        if self._copy is None:
            self._build()
        elif version != self._version:
            with torch.no_grad():
                for layer, twin in self._linears:
                    layer.load(twin.weight, twin.bias)
                for mine, theirs in self._pairs:
                    mine.copy_(theirs)
        self._version = version
        return self._copy


def cpu_autocast():
    """bf16 autocast on CPU (what the copy's linear layers need: their inputs cast to bf16)."""
    return torch.autocast("cpu", dtype=torch.bfloat16)

"""bf16 generation on CPU from fp32 weights: a copy of a model whose linear layers hold bf16 weights, run under
bf16 autocast.

Autocast over the fp32 model computes the same thing, but under ``torch.inference_mode`` it casts every weight
again at every forward (its cast cache keeps only tensors that record gradients): for a decode step of
SmolLM2-135M that is 270 MB of casts for ~30 ms of matmuls. The copy casts them once per change of the weights
(:func:`zerosim.core.decode.weights_version`: an optimizer step), so a generation costs its bf16 matmuls only.
Every other tensor of the copy (embeddings, norms, biases of non-linear modules) stays fp32 and every other op
runs as autocast runs it — the residual stream, the norms and the softmax in fp32 — and the attention runs in
fp32 (:func:`zerosim.core.decode.gqa_sdpa_attention`). A tied output head gets its own bf16 weight; the input
embedding stays fp32.
"""

from __future__ import annotations

import copy

import torch

from zerosim.core.decode import weights_version


class Bf16Copy:
    """A bf16-linear copy of ``model`` (see the module), refreshed from it when its weights change."""

    def __init__(self, model):
        self.model = model
        self._copy = None
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (copy's tensor, model's tensor)
        self._version: tuple | None = None

    def _build(self) -> None:
        with torch.no_grad():
            clone = copy.deepcopy(self.model)
            # a forward patched onto the instance (TRL's fused log-prob head, zerosim's compact head) closes over
            # the original model: the copy runs its class's own
            clone.__dict__.pop("forward", None)
            head = clone.get_output_embeddings()
            inputs = clone.get_input_embeddings()
            if head is not None and inputs is not None and head.weight is inputs.weight:
                head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
            for module in clone.modules():
                if isinstance(module, torch.nn.Linear):
                    for name, param in module.named_parameters(recurse=False):
                        setattr(
                            module, name, torch.nn.Parameter(param.detach().bfloat16(), requires_grad=False)
                        )
            for param in clone.parameters():
                param.requires_grad_(False)
                param.grad = None
        clone.eval()
        source = dict(self.model.named_modules())
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
                for mine, theirs in self._pairs:
                    mine.copy_(theirs)
        self._version = version
        return self._copy


def cpu_autocast():
    """bf16 autocast on CPU (what the copy's linear layers need: their inputs cast to bf16)."""
    return torch.autocast("cpu", dtype=torch.bfloat16)

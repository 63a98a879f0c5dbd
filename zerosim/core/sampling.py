"""How a generator samples and where a row ends: :class:`Sampling`, one object from the config to the decoding
loop (:mod:`zerosim.core.generation`, :mod:`zerosim.core.inference`, :mod:`zerosim.core.decode`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sampling:
    """How a generator samples and where a row ends, as one object (the pattern of
    :class:`~zerosim.core.http.retry.RetryPolicy`): what the generators and the decoding loops take, and a config
    section gives through :meth:`of`. The tokens to write (``max_new_tokens``) go with each ``generate`` call
    instead: a rollout's turn budget shrinks as the trajectory grows.

    Args:
        temperature: 0 = greedy; above, sampled from ``softmax(logits / temperature)``.
        top_p: nucleus sampling's mass (unused when greedy).
        stop_strings: a row ends with the token that completes one of these (kept in the row).
        eos_token_ids: a row ends with any of these tokens; ``None`` = the tokenizer's EOS (:meth:`eos_ids`).
        seed: the draws of a generator that takes a seed (vLLM, a served policy); unused when greedy.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    stop_strings: Sequence[str] = ()
    eos_token_ids: Sequence[int] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))

    @classmethod
    def of(cls, settings: Any, **rest: Any) -> Sampling:
        """The sampling a config section's ``temperature`` and ``top_p`` keys give (``rollout``), with ``rest``
        (the stop strings, EOS ids, a seed)."""
        return cls(temperature=settings.temperature, top_p=settings.top_p, **rest)

    @property
    def sampled(self) -> bool:
        """Whether tokens are drawn (temperature > 0) rather than picked greedily."""
        return self.temperature > 0

    def eos_ids(self, tokenizer) -> frozenset[int]:
        """The token ids a row ends at: :attr:`eos_token_ids`, else ``tokenizer``'s EOS."""
        eos = [tokenizer.eos_token_id] if self.eos_token_ids is None else self.eos_token_ids
        return frozenset(int(t) for t in eos if t is not None)


DEFAULT_SAMPLING = (
    Sampling()
)  # the model's own distribution (temperature 1, no top-p cut): the rollout's default
GREEDY = Sampling(temperature=0.0)  # the most likely token at every step: evaluation's default

"""Mixed search (``search.engine=mixed``): each search answered by the simulator or by a real retriever.

The rollout draws each search's source — ``"real"`` with probability ``search.mixed.real_share`` (a constant
or a schedule over training), else ``"sim"`` — as a pure function of (seed, step, trajectory's index in the
global batch, search number) (:func:`curricula.search_source`), like the curriculum's noise, and puts it on
the request (:attr:`zerosim.core.search.SearchRequest.source`). :class:`MixedSearchEngine` routes each request
to the engine its source names: one call per part with that part's requests, results put back in order.
Both parts see the curriculum's noise pattern: the simulator writes noisy documents, the real retriever
fills its noisy slots with corpus negatives (``search.negatives``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from curricula.config import MixedConfig, ShareSchedule
from curricula.noise import search_source
from curricula.schedules import ConstantSchedule, NoiseSchedule, build_schedule
from zerosim.core.search import Document, SearchEngine, SearchError, SearchRequest

SOURCES = ("sim", "real")


def share_schedule(
    real_share: float, real_share_end: float | None, schedule: str, total_steps: int
) -> NoiseSchedule:
    """The real share per step: ``real_share`` throughout when ``real_share_end`` is ``None``, else from
    ``real_share`` at step 0 to ``real_share_end`` at ``total_steps`` along ``schedule`` (the curriculum's
    schedule classes, :func:`curricula.build_schedule`)."""
    if real_share_end is None:
        return ConstantSchedule(p=real_share)
    if schedule not in tuple(ShareSchedule):
        raise ValueError(f"unknown real-share schedule {schedule!r}; valid: {', '.join(ShareSchedule)}")
    return build_schedule(schedule, p_start=real_share, p_end=real_share_end, total_steps=max(1, total_steps))


def mixed_share(m: MixedConfig, max_steps: int | None) -> NoiseSchedule:
    """The real share per step ``search.mixed.*`` describes, over :meth:`MixedConfig.steps` (``max_steps``: the
    run's ``trainer.max_steps``) — what the mixed engine routes by and ``--dry-run`` prints."""
    return share_schedule(m.real_share, m.real_share_end, m.schedule, m.steps(max_steps))


class MixedSearchEngine:
    """Answers each request with ``simulator`` or ``real``, as the request's ``source`` says.

    ``share`` is the real share per training step (a :class:`curricula.NoiseSchedule`, or a constant); the
    rollout reads it (:meth:`real_share`) to draw each search's source. A request without a source (one
    that did not come from :class:`zerosim.agent.rollout.SearchRollout`, e.g. ``zerosim eval --method rag``) is
    drawn here, at the step-0 share, from (seed, the count of such requests so far): reproducible for the
    same sequence of calls. Each part is called exactly once per call, with its requests (possibly none, so
    that in a multi-process rollout every rank calls both parts every turn), and sees them without the
    source. Document ids are those of the part that answered. ``stats`` counts the searches each part
    answered (``search/mixed/*`` in the training metrics).
    """

    metrics_name = "mixed"  # ``stats`` are logged as ``search/mixed/<counter>``

    def __init__(
        self,
        simulator: SearchEngine,
        real: SearchEngine,
        *,
        share: NoiseSchedule | float = 0.5,
        seed: int = 0,
    ):
        self.simulator = simulator
        self.real = real
        self.share = ConstantSchedule(p=float(share)) if isinstance(share, int | float) else share
        self.seed = seed
        self.stats: dict[str, int] = {"sim_searches": 0, "real_searches": 0}
        self._unlabelled = 0

    @property
    def parts(self) -> dict[str, SearchEngine]:
        """The two engines by source name (``engine_counters`` walks both)."""
        return {"sim": self.simulator, "real": self.real}

    def real_share(self, step: int) -> float:
        """The share of searches sent to the real retriever at training step ``step``."""
        return float(self.share.probability(step))

    def draw_source(self, step: int, trajectory: int, search: int) -> str:
        """The rollout's source function (:data:`zerosim.agent.rollout.SourceFn`): who answers that search."""
        return search_source(
            seed=self.seed, step=step, trajectory=trajectory, search=search, real_share=self.real_share(step)
        )

    def _source(self, request: SearchRequest) -> str:
        if request.source is None:
            drawn = search_source(
                seed=self.seed, step=0, trajectory=self._unlabelled, search=0, real_share=self.real_share(0)
            )
            self._unlabelled += 1
            return drawn
        if request.source not in SOURCES:
            raise ValueError(
                f"SearchRequest.source is {request.source!r}; the mixed engine routes 'sim' or 'real' (or None "
                "to draw it)"
            )
        return request.source

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        sources = [self._source(r) for r in requests]
        out: list[list[Document] | None] = [None] * len(requests)
        for name, engine in self.parts.items():
            rows = [i for i, s in enumerate(sources) if s == name]
            results = engine.search([dataclasses.replace(requests[i], source=None) for i in rows], k)
            if len(results) != len(rows):
                raise SearchError(
                    f"the mixed engine's {name} part answered {len(results)} results for {len(rows)} requests"
                )
            for i, docs in zip(rows, results, strict=True):
                out[i] = list(docs)
            self.stats[f"{name}_searches"] += len(rows)
        return out  # type: ignore[return-value]  (every slot filled: each source is sim or real)

    def close(self) -> None:
        """Close both parts (each that has a ``close``)."""
        try:
            _close(self.simulator)
        finally:
            _close(self.real)


def _close(engine: Any) -> None:
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def find_mixed(engine: Any) -> MixedSearchEngine | None:
    """The mixed engine ``engine`` is or wraps (through ``.engine`` / ``.retriever``, e.g. the evaluation's
    ``WithheldAnswers``), or ``None``: duck-typed on a callable ``real_share``."""
    seen: set[int] = set()
    while engine is not None and id(engine) not in seen:
        seen.add(id(engine))
        if callable(getattr(engine, "real_share", None)):
            return engine
        engine = getattr(engine, "engine", None) or getattr(engine, "retriever", None)
    return None

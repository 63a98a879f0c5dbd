"""The noise draw: which search results (or result slots) are noisy, reproducibly from (seed, step, ...)."""

from __future__ import annotations

import numpy as np


def draw_noise(
    *,
    seed: int,
    step: int,
    call: int,
    n_requests: int,
    k: int,
    p: float,
    granularity: str = "call",
    _stream: tuple[int, ...] = (),
) -> list[tuple[bool, ...]]:
    """Per-request noise patterns of ``k`` slots each.

    ``granularity="call"`` (ZeroSearch): one Bernoulli(p) per request, so all k documents are noisy or all
    useful. ``granularity="document"``: one Bernoulli(p) per slot. The generator is seeded from
    ``(seed, step, call)`` — ``call`` numbers the search calls within a step — so a resumed or repeated run
    draws the same pattern.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"noise probability must be in [0, 1], got {p}")
    rng = np.random.default_rng([seed, step, call, *_stream])
    if granularity == "call":
        flags = rng.random(n_requests) < p
        return [(bool(f),) * k for f in flags]
    if granularity == "document":
        grid = rng.random((n_requests, k)) < p
        return [tuple(bool(x) for x in row) for row in grid]
    raise ValueError(f"unknown noise granularity {granularity!r}; valid: call, document")


def trajectory_noise(
    *, seed: int, step: int, trajectory: int, search: int, k: int, p: float, granularity: str = "call"
) -> tuple[bool, ...]:
    """The noise pattern of one search: the ``search``-th of trajectory number ``trajectory`` at ``step``.

    A pure function of its arguments, so with several training processes every rank draws for its own
    trajectories exactly what a single process rolling out the whole batch would (``trajectory`` is the
    index in the global batch), and no two trajectories share a draw. Same granularity rules as
    :func:`draw_noise`.
    """
    return draw_noise(
        seed=seed,
        step=step,
        call=0,
        n_requests=1,
        k=k,
        p=p,
        granularity=granularity,
        _stream=(trajectory, search),
    )[0]


SOURCE_STREAM = 0x5EA2C4  # salts the source draw's generator: a stream apart from the noise draw's


def search_source(*, seed: int, step: int, trajectory: int, search: int, real_share: float) -> str:
    """Which engine answers one search under ``search.engine=mixed``: ``"real"`` with probability
    ``real_share``, else ``"sim"``.

    Like :func:`trajectory_noise`, a pure function of (seed, step, trajectory's index in the global batch,
    search number), so every rank of a multi-process run draws what one process would, and a resumed run
    draws the same. The generator is salted with :data:`SOURCE_STREAM`: the source and the noise of a
    search are independent draws (``real_share`` 0 is all ``"sim"``, 1 all ``"real"``).
    """
    if not 0.0 <= real_share <= 1.0:
        raise ValueError(f"real_share must be in [0, 1], got {real_share}")
    rng = np.random.default_rng([seed, step, SOURCE_STREAM, trajectory, search])
    return "real" if rng.random() < real_share else "sim"


PAGE_STREAM = 0x9A6E5  # salts the page draw's generator: a stream apart from the searches' noise and source


def page_noise(*, seed: int, step: int, trajectory: int, call: int, p: float) -> bool:
    """Whether the ``call``-th page a trajectory opens at ``step`` is noisy under the simulator (the ``read_page``
    tool): Bernoulli(``p``), a pure function of its arguments like :func:`trajectory_noise`, from a stream of its
    own (:data:`PAGE_STREAM`) so opening pages changes no search's draw."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"noise probability must be in [0, 1], got {p}")
    return bool(np.random.default_rng([seed, step, PAGE_STREAM, trajectory, call]).random() < p)


class CurriculumNoise:
    """The rollout's noise function (:data:`zerosim.agent.rollout.NoiseFn`): the noise pattern of a search, drawn
    by :func:`trajectory_noise` at ``schedule``'s probability for the step."""

    def __init__(self, schedule, *, seed: int, k: int, granularity: str = "call"):
        self.schedule = schedule
        self.seed = seed
        self.k = k
        self.granularity = granularity

    def __call__(self, step: int, trajectory: int, search: int) -> tuple[bool, ...]:
        return trajectory_noise(
            seed=self.seed,
            step=step,
            trajectory=trajectory,
            search=search,
            k=self.k,
            p=self.schedule.probability(step),
            granularity=self.granularity,
        )

    def page(self, step: int, trajectory: int, call: int) -> bool:
        """The draw of a trajectory's ``call``-th page (:func:`page_noise`) at the step's probability."""
        return page_noise(
            seed=self.seed, step=step, trajectory=trajectory, call=call, p=self.schedule.probability(step)
        )

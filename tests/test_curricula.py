import math

import pytest

from curricula import (
    AdaptiveSchedule,
    ConstantSchedule,
    CosineSchedule,
    ExponentialSchedule,
    LinearSchedule,
    StepSchedule,
    build_schedule,
    draw_noise,
)
from curricula.config import ScheduleName


def test_zerosearch_schedule_values():
    s = ExponentialSchedule(p_start=0.0, p_end=0.5, base=4.0, total_steps=203)
    assert [round(s.probability(i), 3) for i in (0, 50, 100, 150, 203)] == [0.0, 0.068, 0.163, 0.298, 0.5]


def test_schedule_is_monotone_bounded_and_clamped():
    s = ExponentialSchedule(p_start=0.1, p_end=0.7, base=4.0, total_steps=10)
    values = [s.probability(i) for i in range(-3, 20)]
    assert all(a <= b for a, b in zip(values, values[1:], strict=False))
    assert values[0] == pytest.approx(0.1) and values[-1] == pytest.approx(0.7)


def test_base_one_is_linear_and_constant_is_flat():
    s = ExponentialSchedule(p_start=0.0, p_end=1.0, base=1.0, total_steps=4)
    assert [s.probability(i) for i in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert ConstantSchedule(0.3).probability(999) == 0.3
    assert build_schedule("constant", p_start=0.0, p_end=0.2, base=4, total_steps=5).probability(0) == 0.2
    with pytest.raises(ValueError, match="valid: exponential, linear, cosine, step, constant, adaptive"):
        build_schedule("cosine-ish", p_start=0, p_end=1, base=4, total_steps=5)


def test_draw_is_reproducible_from_seed_and_step():
    a = draw_noise(seed=7, step=3, call=0, n_requests=50, k=5, p=0.5)
    assert a == draw_noise(seed=7, step=3, call=0, n_requests=50, k=5, p=0.5)
    assert a != draw_noise(seed=7, step=4, call=0, n_requests=50, k=5, p=0.5)
    assert a != draw_noise(seed=8, step=3, call=0, n_requests=50, k=5, p=0.5)
    # per call: all k slots share one draw
    assert all(len(set(row)) == 1 and len(row) == 5 for row in a)


def test_draw_shares_follow_p():
    rows = draw_noise(seed=0, step=0, call=0, n_requests=4000, k=3, p=0.3)
    assert abs(sum(r[0] for r in rows) / 4000 - 0.3) < 0.03
    docs = draw_noise(seed=0, step=0, call=0, n_requests=2000, k=5, p=0.3, granularity="document")
    assert abs(sum(sum(r) for r in docs) / 10000 - 0.3) < 0.02
    assert any(len(set(r)) == 2 for r in docs)
    assert draw_noise(seed=0, step=0, call=0, n_requests=10, k=2, p=0.0) == [(False, False)] * 10
    assert draw_noise(seed=0, step=0, call=0, n_requests=10, k=2, p=1.0) == [(True, True)] * 10


def test_linear_cosine_step_values_by_hand():
    lin = LinearSchedule(p_start=0.1, p_end=0.5, total_steps=4)
    assert [lin.probability(i) for i in range(6)] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.5])
    cos = CosineSchedule(p_start=0.0, p_end=0.4, total_steps=4)
    expected = [0.4 * (1 - math.cos(math.pi * i / 4)) / 2 for i in range(5)]
    assert [cos.probability(i) for i in range(5)] == pytest.approx(expected)
    assert cos.probability(2) == pytest.approx(0.2)  # half-way point
    step = StepSchedule(p_start=0.0, p_end=0.6, total_steps=8, stages=4)
    # plateaus of 2 steps: 0, 0.2, 0.4, 0.6 (the last step is in the last stage)
    assert [step.probability(i) for i in range(10)] == pytest.approx(
        [0, 0, 0.2, 0.2, 0.4, 0.4, 0.6, 0.6, 0.6, 0.6]
    )
    assert StepSchedule(p_start=0.0, p_end=0.3, total_steps=5, stages=1).probability(0) == 0.3


@pytest.mark.parametrize("name", [n.value for n in ScheduleName if n != "adaptive"])
@pytest.mark.parametrize("p_start,p_end", [(0.0, 0.5), (0.2, 0.9), (0.6, 0.1)])
def test_every_schedule_is_monotone_and_within_bounds(name, p_start, p_end):
    s = build_schedule(name, p_start=p_start, p_end=p_end, base=4, total_steps=20, stages=3)
    values = [s.probability(i) for i in range(-2, 30)]
    lo, hi = min(p_start, p_end), max(p_start, p_end)
    assert all(lo - 1e-12 <= v <= hi + 1e-12 for v in values)
    sign = 1 if p_end >= p_start else -1
    assert all(sign * (b - a) >= -1e-12 for a, b in zip(values, values[1:], strict=False))
    assert values[-1] == pytest.approx(p_end)
    if name != "constant":
        assert values[0] == pytest.approx(p_start)


def test_adaptive_raises_on_success_lowers_on_collapse_and_stays_in_bounds():
    s = AdaptiveSchedule(p_start=0.0, p_end=0.15, window=2, raise_above=0.5, lower_below=0.1, delta=0.1)
    assert s.probability(0) == 0.0
    s.observe(0, 0.9)
    assert s.probability(1) == 0.0  # window not full yet
    s.observe(0, 0.0)  # the same step again (another micro-batch): ignored
    s.observe(1, 0.7)
    assert s.probability(2) == pytest.approx(0.1)
    s.observe(2, 0.8), s.observe(3, 0.8)
    assert s.probability(4) == pytest.approx(0.15)  # capped at p_end
    s.observe(4, 0.3), s.observe(5, 0.3)
    assert s.probability(6) == pytest.approx(0.15)  # in between: unchanged
    s.observe(6, 0.0)
    assert s.probability(7) == pytest.approx(0.15)  # rolling mean of (0.3, 0.0) = 0.15: above lower_below
    s.observe(7, 0.0)
    assert s.probability(8) == pytest.approx(0.05)  # rolling mean of (0.0, 0.0): lowered
    state = s.state_dict()
    t = AdaptiveSchedule(p_start=0.0, p_end=0.15, window=2, raise_above=0.5, lower_below=0.1, delta=0.1)
    t.load_state_dict(state)
    assert t.probability(0) == s.probability(0) and t.recent == s.recent
    for i in range(8, 12):
        s.observe(i, 0.0)
    assert s.probability(12) == 0.0  # floored at p_start
    with pytest.raises(ValueError, match="lower_below"):
        AdaptiveSchedule(raise_above=0.1, lower_below=0.2)

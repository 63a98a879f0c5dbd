import pytest

from curricula import ConstantSchedule, ExponentialSchedule, build_schedule, draw_noise


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
    with pytest.raises(ValueError, match="valid: exponential, constant"):
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

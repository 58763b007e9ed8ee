"""bench/serve_engine.py: the measured knee, the rates measured past the planned ones until it is crossed, and a
figure over the passes."""

from __future__ import annotations

import pytest

from bench.serve_engine import MORE_RATES, RATE_STEP, knee, median_spread, next_rate


def test_knee_is_read_between_the_rates_that_cross_it():
    assert knee([1.0, 2.0, 3.0], [0.1, 0.2, 0.7]) == pytest.approx(2.4)
    assert knee([1.0, 2.0, 3.0], [0.1, 0.2, 0.3]) is None


def _curve(rate: float, knee_at: float) -> float:
    """A p90 TTFT that stays flat below ``knee_at`` and grows tenfold past it."""
    return 0.05 if rate < knee_at else 0.05 * 10 * rate / knee_at


@pytest.mark.parametrize("knee_at", [12.0, 20.0, 35.0, 60.0])
def test_rates_grow_until_the_measured_knee_is_crossed_and_no_further(knee_at):
    planned = [4.0, 7.0, 10.0, 14.0]
    rates = list(planned)
    while (more := next_rate(rates, [_curve(r, knee_at) for r in rates], len(planned))) is not None:
        assert more == pytest.approx(rates[-1] * RATE_STEP, abs=0.01)
        rates.append(more)
    assert len(rates) - len(planned) <= MORE_RATES
    crossed = knee(rates, [_curve(r, knee_at) for r in rates])
    if knee_at <= planned[-1] * RATE_STEP ** MORE_RATES:  # reachable within the extra rates: found, and one past
        assert crossed is not None and rates[-2] < knee_at <= rates[-1]
    else:  # bounded: the extra rates are spent, the knee is not a number
        assert crossed is None and len(rates) - len(planned) == MORE_RATES


def test_a_knee_crossed_by_the_planned_rates_adds_none():
    assert next_rate([4.0, 7.0, 10.0, 14.0], [0.05, 0.06, 0.3, 0.9], 4) is None


def test_a_figure_over_passes_is_their_median_and_its_spread_their_range_over_it():
    # one pass met the machine's slow speed: the median keeps the two that agree, the spread says how far it was
    assert median_spread([0.020, 0.031, 0.021]) == pytest.approx((0.021, 0.011 / 0.021))
    assert median_spread([0.05]) == (0.05, 0.0)
    assert median_spread([0.0, 0.0]) == (0.0, 0.0)

"""`simulate()`'s bubble and memory against the published formulas (1F1B; ZB-H1, Qi et al. 2023).

`bubble_fraction` is ``idle / (ranks x makespan)``: the idle share of the whole step. The papers' bubble rate
divides the idle time by the compute time instead, so it is ``f / (1 - f)`` of our fraction ``f``.
"""

from __future__ import annotations

import pytest

from lightning_pipe.schedule import COSTS, UNIT, GPipe, OneFOneB, ZeroBubbleH1, bubble_fraction

CASES = sorted({(p, m) for p in (2, 4) for m in (2 * p, 4 * p, 8)})


def paper_rate(fraction: float) -> float:
    """The papers' bubble rate (idle time / compute time) from our idle share of the step."""
    return fraction / (1.0 - fraction)


@pytest.mark.parametrize(("p", "m"), CASES)
def test_1f1b_bubble_is_p_minus_1_over_m(p: int, m: int) -> None:
    for durations in (UNIT, COSTS):  # T_B = T_F, and T_B = 2 T_F: the rate does not depend on it
        fraction = OneFOneB(p, m).bubble(durations)
        assert paper_rate(fraction) == pytest.approx((p - 1) / m, abs=1e-12)
        assert fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)  # the same, as a share of the step
    assert paper_rate(GPipe(p, m).bubble(COSTS)) == pytest.approx((p - 1) / m, abs=1e-12)


@pytest.mark.parametrize(("p", "m"), CASES)
def test_zero_bubble_h1_bubble_is_p_minus_1_over_3m(p: int, m: int) -> None:
    schedule = ZeroBubbleH1(p, m)
    # T_F = T_B(input) = T_W: the paper's setting for (p - 1) / 3m
    assert paper_rate(schedule.bubble(UNIT)) == pytest.approx((p - 1) / (3 * m), abs=1e-12)
    assert paper_rate(bubble_fraction(schedule.actions(), p, UNIT)) < paper_rate(OneFOneB(p, m).bubble(COSTS))


@pytest.mark.parametrize(("p", "m"), CASES)
def test_peak_activations(p: int, m: int) -> None:
    # 1F1B: rank r holds p - r microbatches at its peak
    assert OneFOneB(p, m).peak_activations() == [p - r for r in range(p)]
    # ZB-H1 keeps 1F1B's peak memory (p on the first rank; every rank holds at most p until its W)
    assert max(ZeroBubbleH1(p, m).peak_activations()) == p
    # GPipe holds every microbatch
    assert GPipe(p, m).peak_activations() == [m] * p

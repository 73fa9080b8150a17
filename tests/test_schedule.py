"""A vote every step or every H local steps (:mod:`lioncub.planning.schedule`, ``auto_variant(...,
compute_s=...)``). The oracle is the closed form T(H) = f(H)·(c + m/H), evaluated here in float64 over a
grid, and its break-even ratio m/c = (f − 1)/(1 − f/H) checked on both sides."""

from __future__ import annotations

import math

import pytest

from lioncub.planning import costmodel as cm
from lioncub.planning.auto import choose_local_steps, choose_variant
from lioncub.planning.schedule import STEPS_FACTOR, breakeven_ratio, choose_schedule

FACTORS = {1: 1.0, 4: 1.3, 16: 2.4}


@pytest.mark.parametrize("compute_s", [0.01, 0.19, 2.0])
@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.3, 0.6, 1.0, 2.0, 5.0, 8.0, 40.0])
def test_the_choice_minimises_the_closed_form(compute_s: float, ratio: float) -> None:
    vote_s = ratio * compute_s
    times = {h: f * (compute_s + vote_s / h) for h, f in FACTORS.items()}
    expected = min(sorted(times), key=lambda h: times[h])  # the smaller H on a tie
    choice = choose_schedule(compute_s, vote_s, FACTORS)
    assert choice.local_steps == (None if expected == 1 else expected)
    assert [r.local_steps for r in choice.rows] == [None, 4, 16]
    for row in choice.rows:
        h = row.local_steps or 1
        assert row.relative_time == pytest.approx(times[h], rel=1e-12)


@pytest.mark.parametrize(("h", "f"), [(4, 1.3), (16, 2.4), (8, 1.05), (4, 1.0)])
def test_breakeven_ratio_separates_the_regimes(h: int, f: float) -> None:
    ratio = breakeven_ratio(h, f)
    assert ratio == pytest.approx((f - 1) / (1 - f / h), abs=1e-15)
    c = 0.2
    for side, wins in ((ratio * 0.98, False), (ratio * 1.02 + 1e-9, True)):
        choice = choose_schedule(c, side * c, {1: 1.0, h: f})
        assert (choice.local_steps == h) is wins, (side, choice.reason)


def test_h_never_wins_where_it_needs_h_times_the_steps() -> None:
    assert breakeven_ratio(4, 4.0) == math.inf and breakeven_ratio(4, 5.0) == math.inf
    assert breakeven_ratio(1, 1.0) == math.inf
    assert choose_schedule(0.1, 1e6, {1: 1.0, 4: 4.0}).local_steps is None


def test_the_reason_names_the_choice_and_the_others() -> None:
    choice = choose_schedule(0.186, 0.93, FACTORS)
    assert choice.local_steps == 4
    assert choice.reason.startswith("a vote every 4 steps (one vote 930 ms against 186 ms")
    assert "m/c = 5.00" in choice.reason and "a vote every step 2.05×" in choice.reason


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0.0, 0.1, None), "compute_s=0.0 must be a finite number of seconds > 0"),
        ((math.nan, 0.1, None), "compute_s=nan"),
        ((0.1, -1.0, None), "vote_s=-1.0 must be a finite number of seconds >= 0"),
        ((0.1, 0.1, {4: 0.0}), r"steps_factor=\{4: 0.0\}: give H \(an int >= 1\) -> f\(H\)"),
        ((0.1, 0.1, {0: 1.0}), r"steps_factor=\{0: 1.0\}"),
        ((0.1, 0.1, {1: 0.9, 4: 1.2}), r"f\(1\) is the vote every step itself, 1.0"),
    ],
)
def test_bad_input_names_the_argument(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        choose_schedule(*args)


def test_default_factors_include_the_vote_every_step() -> None:
    assert STEPS_FACTOR[1] == 1.0 and all(f >= 1.0 for f in STEPS_FACTOR.values())
    rows = choose_schedule(0.2, 0.0).rows
    assert [r.local_steps for r in rows] == [None, *sorted(h for h in STEPS_FACTOR if h > 1)]


def test_auto_variant_chooses_h_from_the_cost_models_vote() -> None:
    # no compute costs and no latency: one 1-bit vote of d parameters on N = 4 is 2·(3/4)·d/8 bytes
    d, n, rate = 800_000, 4, 2e6
    net = cm.Network.from_rate(rate, 0.0)
    cal = cm.Calibration(net, cm.Compute(), n)
    vote_s = cm.predict("1bit", d, n, net, cm.Compute()).total_s
    assert vote_s == pytest.approx(2 * 0.75 * d / 8 / (rate / 8 * net.efficiency), rel=1e-3)
    for compute_s in (0.02, 0.2, 2.0):
        expected = choose_schedule(compute_s, vote_s, FACTORS)
        choice = choose_variant(d, n, cal, candidates=["1bit"], compute_s=compute_s, steps_factor=FACTORS)
        assert choice.variant == "1bit" and choice.local_steps == expected.local_steps
        assert choice.schedule == expected and expected.reason in choice.reason
        assert choose_local_steps("1bit", d, n, cal, compute_s=compute_s, steps_factor=FACTORS) == expected
    assert choose_variant(d, n, cal, candidates=["1bit"]).local_steps is None  # no compute given: no H
    with pytest.raises(ValueError, match="variant='4bit': 4-bit lanes cannot hold"):
        choose_local_steps("4bit", d, 16, cal, compute_s=0.1)


def test_auto_measures_the_pilot_after_its_first_step_and_chooses_a_one_bit_run() -> None:
    """``--variant auto`` (:mod:`lioncub.cli.auto`): c and m are the medians of the pilot's steps after the
    first (which holds the one-time costs); the run is 1bit/hH for the H the rule picks, and every run it
    may choose is one the rule can pick."""
    from lioncub.cli.auto import candidates, choose_run, measure

    records = [{"compute_s": 9.0, "comm_s": 9.0}] + [
        {"compute_s": c, "comm_s": m} for c, m in ((0.2, 1.1), (0.1, 0.9), (0.3, 1.0))
    ]
    assert measure(records) == (0.2, 1.0)
    for c, m in ((0.2, 1.0), (0.2, 0.02), (0.2, 0.0)):
        name, reason = choose_run(c, m)
        h = choose_schedule(c, m).local_steps
        assert name == ("1bit" if h is None else f"1bit/h{h}") and "m/c" in reason
    assert choose_run(0.2, 1.0)[0] == "1bit/h16" and choose_run(0.2, 0.0)[0] == "1bit"
    assert candidates() == ["1bit", *(f"1bit/h{h}" for h in sorted(STEPS_FACTOR) if h > 1)]
    with pytest.raises(ValueError, match="logged 1 step"):
        measure(records[:1])
    with pytest.raises(ValueError, match="compute per step"):
        measure([{"compute_s": 0.0, "comm_s": 0.0}] * 3)

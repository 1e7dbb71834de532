"""kvlab.intervals against known answers: t quantiles, coverage over many seeds, n < 3, Welch log ratio
by hand, BCa."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvlab import intervals as I


@pytest.mark.parametrize("df, want", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423),
                                      (math.inf, 1.95996)])
def test_t_quantile_matches_tables(df, want):
    assert I.t_quantile(0.975, df) == pytest.approx(want, abs=1e-4)
    assert I.t_quantile(0.025, df) == pytest.approx(-want, abs=1e-4)


def test_t_cdf_inverts_quantile_at_fractional_df():
    for df in (1.7, 3.3, 8.9):
        assert I.t_cdf(I.t_quantile(0.9, df), df) == pytest.approx(0.9, abs=1e-9)


def test_mean_interval_covers_a_normal_mean_about_95_percent():
    rng = np.random.default_rng(0)
    seeds = 2000
    hits = 0
    for _ in range(seeds):
        iv = I.mean_interval(rng.normal(10.0, 2.0, size=5))
        hits += iv.lo <= 10.0 <= iv.hi
    # binomial SD at p = 0.95 over 2000 draws is 0.5%; the t-interval is exact for normal data
    assert abs(hits / seeds - 0.95) < 0.015


def test_ratio_interval_covers_a_true_ratio_about_95_percent():
    rng = np.random.default_rng(1)
    seeds = 2000
    hits = 0
    for _ in range(seeds):
        x, b = rng.normal(5.0, 0.25, size=5), rng.normal(10.0, 0.8, size=6)
        iv = I.ratio_interval(x, b)
        hits += iv.lo <= 0.5 <= iv.hi
    assert abs(hits / seeds - 0.95) < 0.02


@pytest.mark.parametrize("values", [[], [1.0], [1.0, 2.0], [1.0, float("nan"), 2.0]])
def test_fewer_than_three_values_give_no_interval(values):
    iv = I.mean_interval(values)
    assert math.isnan(iv.lo) and math.isnan(iv.hi) and iv.method == "none"
    if values:
        assert iv.value == pytest.approx(1.5 if len(values) > 1 else 1.0)
        assert iv.text() == f"{iv.value:.3f} (n={iv.n[0]})"


def test_ratio_with_two_runs_a_side_has_no_interval_and_says_n():
    iv = I.ratio_interval([0.49, 0.47], [1.0, 0.98, 1.01])
    assert iv.value == pytest.approx(0.48 / (2.99 / 3))
    assert not iv.has_bounds and iv.method == "none"
    assert iv.text().endswith("(n=2/3)")


def test_welch_log_ratio_against_a_hand_computation():
    x, b = [2.0, 2.2, 1.8], [1.0, 1.1, 0.9]
    # by hand: means 2.0 and 1.0, variances 0.04 and 0.01; delta-method variances of the log means
    # 0.04 / (3 * 4) = 0.01 / (3 * 1) = 1/300; Welch-Satterthwaite df = (2/300)^2 / (2 (1/300)^2 / 2) = 4;
    # t(0.975, 4) = 2.7764 (tables); half-width 2.7764 * sqrt(2/300) = 0.22670;
    # bounds 2 exp(-0.22670) = 1.5943 and 2 exp(0.22670) = 2.5089
    iv = I.ratio_interval(x, b)
    assert iv.method == "welch-log" and iv.n == (3, 3)
    assert iv.value == pytest.approx(2.0)
    assert (iv.lo, iv.hi) == pytest.approx((1.5943, 2.5089), abs=2e-4)
    assert iv.text() == "2.000 [1.594, 2.509] (welch-log, n=3/3)"


def test_product_interval_is_the_ratio_for_two_groups():
    x, b = [2.0, 2.2, 1.8], [1.0, 1.1, 0.9]
    assert I.product_interval([x, b], [1, -1]).as_tuple() == pytest.approx(I.ratio_interval(x, b).as_tuple())
    assert math.isnan(I.product_interval([x, b, [1.0, 1.0]], [1, 1, -1]).lo)  # 2 values in a group


def test_mean_t_interval_by_hand():
    iv = I.mean_interval([1.0, 2.0, 3.0])
    half = 4.3027 * 1.0 / math.sqrt(3)
    assert (iv.lo, iv.hi) == pytest.approx((2.0 - half, 2.0 + half), abs=1e-3)


def test_bca_needs_five_a_side_and_brackets_the_estimate():
    assert I.ratio_interval([1.0, 1.1, 0.9, 1.0], [2.0, 2.1, 1.9, 2.0, 2.0], method="bca").method == "none"
    rng = np.random.default_rng(2)
    x, b = rng.normal(5.0, 0.3, size=8), rng.normal(10.0, 0.5, size=8)
    iv = I.ratio_interval(x, b, method="bca")
    assert iv.method == "bca" and iv.lo < iv.value < iv.hi
    welch = I.ratio_interval(x, b)
    assert iv.hi - iv.lo == pytest.approx(welch.hi - welch.lo, rel=0.5)  # same scale as the t-interval
    assert I.ratio_interval(x, b, method="bca", seed=3).as_tuple() == I.ratio_interval(x, b, method="bca",
                                                                                        seed=3).as_tuple()


def test_bca_mean_coverage_is_near_nominal():
    rng = np.random.default_rng(4)
    seeds = 300
    hits = sum(I.mean_interval(s, method="bca", n_boot=1000, seed=k).lo <= 0.0
               <= I.mean_interval(s, method="bca", n_boot=1000, seed=k).hi
               for k, s in enumerate(rng.normal(0.0, 1.0, size=(seeds, 12))))
    assert 0.86 < hits / seeds < 0.99  # the bootstrap runs a little short at n = 12


def test_unknown_method_and_json_fields():
    with pytest.raises(ValueError, match="interval method"):
        I.mean_interval([1, 2, 3], method="percentile")
    d = I.mean_interval([1.0, 2.0]).to_dict()
    assert d == {"value": 1.5, "lo": None, "hi": None, "n": [2], "method": "none", "level": 0.95}


def test_a_percentile_interval_of_draws_done_elsewhere():
    """Draws 0..1000: the 2.5% and 97.5% quantiles are 25 and 975; below 5 resampled units, none."""
    import math

    from kvlab.intervals import percentile_interval

    draws = [float(i) for i in range(1001)]
    got = percentile_interval(500.0, draws, units=6)
    assert (got.value, got.n, got.method) == (500.0, (6,), "percentile")
    assert (got.lo, got.hi) == pytest.approx((25.0, 975.0))
    few = percentile_interval(500.0, draws, units=4)
    assert math.isnan(few.lo) and few.method == "none" and few.text(0) == "500 (n=4)"
    assert not percentile_interval(1.0, [1.0], units=10).has_bounds  # one draw is no spread

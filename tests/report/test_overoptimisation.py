"""The functional forms of Gao et al. 2023 and their least-squares fits recover known coefficients.

Tolerances. Everything is float64 numpy on synthetic data: no thread count or load moves it. Formulas against hand
values and fits of exact data (kind 1 of tests/bounds.py): a few float64 operations, or a 2-column least-squares
problem of condition number <= 15, rounding ~1e-15 (measured <= 9e-16); ``pytest.approx``'s default rel 1e-6 and
the explicit 1e-9 / 1e-10 are far above it. The peak on a grid of spacing 1e-3 is within one spacing (measured
1.4e-4; abs 2e-3). The noisy fits and the refits are kind 4, each with a fixed seed (deterministic; the
probabilities are those of another seed): noise sd 0.01 on 40 points gives coefficient s.e. 0.001-0.003 (measured
errors <= 0.005), abs 0.03 is >= 10 s.e.; the refits' figures are in their test's docstring.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from prefzoo.report.overoptimisation import fit, observed_peak, peak_verdict, predict


def test_forms_by_hand():
    """bon: d (a - b d) at a=1, b=0.5, d=2 -> 2 (1 - 1) = 0; rl: d (a - b log d) at d=e -> e (1 - 0.5) = e/2;
    rl at d = 0 is 0 (d log d -> 0)."""
    assert predict("bon", 2.0, 1.0, 0.5) == pytest.approx(0.0)
    assert predict("rl", math.e, 1.0, 0.5) == pytest.approx(math.e / 2)
    assert predict("rl", 0.0, 1.0, 0.5) == 0.0
    with pytest.raises(ValueError):
        predict("ppo", 1.0, 1.0, 1.0)


@pytest.mark.parametrize("form, a, b", [("bon", 0.8, 0.3), ("rl", 0.5, 0.4), ("rl", 1.2, 0.2)])
def test_fit_recovers_coefficients_exactly_without_noise(form, a, b):
    d = np.linspace(0.0, 4.0, 12)
    f = fit(form, d, predict(form, d, a, b) + 0.25, baseline=0.25)
    assert (f.a, f.b) == pytest.approx((a, b), abs=1e-10) and f.r2 == pytest.approx(1.0) and f.n == 12
    np.testing.assert_allclose(f(d), predict(form, d, a, b) + 0.25, atol=1e-10)


def test_fit_with_noise_and_the_peaks():
    """With noise (sd 0.01) the coefficients come back to within a few hundredths; the peaks: bon a=0.8, b=0.3 ->
    d* = a/(2b) = 4/3, R* = a^2/(4b) = 0.5333; rl a=0.5, b=0.4 -> d* = exp(a/b - 1) = exp(0.25) = 1.2840, R* = b d*."""
    rng = np.random.default_rng(0)
    d = np.linspace(0.05, 3.0, 40)
    bon = fit("bon", d, predict("bon", d, 0.8, 0.3) + rng.normal(0, 0.01, d.shape))
    assert bon.a == pytest.approx(0.8, abs=0.03) and bon.b == pytest.approx(0.3, abs=0.03)
    exact = fit("bon", d, predict("bon", d, 0.8, 0.3))
    assert exact.peak == pytest.approx((4 / 3, 0.8 ** 2 / 1.2))
    rl = fit("rl", d, predict("rl", d, 0.5, 0.4) + rng.normal(0, 0.01, d.shape))
    assert rl.a == pytest.approx(0.5, abs=0.03) and rl.b == pytest.approx(0.4, abs=0.03)
    exact = fit("rl", d, predict("rl", d, 0.5, 0.4))
    assert exact.peak == pytest.approx((math.exp(0.25), 0.4 * math.exp(0.25)))
    grid = np.linspace(0.01, 3, 3000)  # the peak is the maximum of the fitted curve
    assert grid[np.argmax(exact(grid))] == pytest.approx(math.exp(0.25), abs=2e-3)


def test_no_peak_when_still_rising_and_bad_input():
    d = np.array([0.0, 0.5, 1.0, 2.0])
    rising = fit("bon", d, 0.3 * d + 0.05 * d ** 2)  # b = -0.05 < 0
    assert rising.b == pytest.approx(-0.05) and rising.peak is None
    with pytest.raises(ValueError, match="at least 2 points"):
        fit("rl", [0.0, 1.0], [0.0, 1.0])
    with pytest.raises(ValueError):
        fit("bon", [-1.0, 1.0, 2.0], [0.0, 1.0, 2.0])
    assert observed_peak([0, 1, 2], [0.1, 0.5, 0.3]) == (1.0, 0.5)


@pytest.mark.parametrize("form, a, b", [("bon", 0.8, 0.3), ("rl", 0.5, 0.4)])
def test_standard_errors_match_the_spread_of_refits(form, a, b):
    """The standard errors of (a, b) are those of ordinary least squares, sigma^2 (X'X)^-1 with sigma^2 = RSS / (n - 2).
    Checked two ways on 400 refits of the same 12 points with fresh Gaussian noise (sd 0.05): (1) the exact standard
    error, sd * sqrt(diag((X'X)^-1)) with X = [d, -d^2] (bon) or [d, -d log d] (rl) built here by hand, equals the
    spread (sd) of the 400 fitted a's and b's within 10% (the sd of a sample sd of 400 is 1/sqrt(800) = 3.5%) and the
    mean reported standard error within 10%; (2) the interval +- 1.96 s.e. covers the true value in 88-98% of the
    refits (95% expected; its binomial s.e. on 400 is 1.1%; s.e. from 10 residual degrees of freedom makes it
    slightly under 95%: t(10) at 1.96 covers 92.2%). The fitted peak's s.e. (delta method) matches the refits'
    spread of the peak within 20%. Before: Fit had no a_se / b_se (AttributeError).

    Measured with these seeds (fixed: the test is deterministic): spreads -0.3% to -2.4% from the exact s.e. (10% is
    2.9 s.e. of a sample sd of 400), mean reported s.e. -3.0%, coverage 91.5-92.3% (binomial s.e. 1.35%: 0.88 and
    0.98 are 3.1 and 4.3 s.e. from the expected 92.2%; the bound was 0.90, 1.6 s.e., which another seed would miss
    about 1 time in 20), the peak's s.e. -9.5% and -9.9% (the delta method's own bias at this noise; 20% leaves
    ~3 s.e. of the refits' spread)."""
    rng = np.random.default_rng(1)
    d = np.linspace(0.2, 3.0, 12)
    second = d ** 2 if form == "bon" else d * np.log(d)
    x = np.stack([d, -second], axis=1)
    exact = 0.05 * np.sqrt(np.diag(np.linalg.inv(x.T @ x)))
    fits = [fit(form, d, predict(form, d, a, b) + rng.normal(0, 0.05, d.shape)) for _ in range(400)]
    est = np.array([(f.a, f.b) for f in fits])
    se = np.array([(f.a_se, f.b_se) for f in fits])
    np.testing.assert_allclose(est.std(axis=0, ddof=1), exact, rtol=0.10)
    np.testing.assert_allclose(se.mean(axis=0), exact, rtol=0.10)
    covered = (np.abs(est - np.array([a, b])) <= 1.96 * se).mean(axis=0)
    assert ((covered > 0.88) & (covered < 0.98)).all(), covered
    peaks = np.array([f.peak[0] for f in fits])
    peak_se = np.array([f.peak_se[0] for f in fits])
    assert np.median(peak_se) == pytest.approx(peaks.std(ddof=1), rel=0.20)


def test_standard_errors_need_three_points():
    """Two points fit the two coefficients exactly: no residual degree of freedom, the standard errors are nan."""
    f = fit("bon", [1.0, 2.0], [0.5, 0.4])
    assert math.isnan(f.a_se) and math.isnan(f.b_se) and f.n == 2
    exact = fit("bon", np.linspace(0.5, 2, 5), predict("bon", np.linspace(0.5, 2, 5), 0.8, 0.3))
    assert exact.a_se == pytest.approx(0.0, abs=1e-9) and exact.b_se == pytest.approx(0.0, abs=1e-9)


def test_r2_is_undefined_when_the_reward_does_not_vary():
    """R² = 1 - RSS/TSS has no meaning when every reward equals the baseline (TSS = 0). Float rounding makes TSS a
    ~1e-33 instead of 0 here (0.1 + 0.2 = 0.30000000000000004, minus the baseline 0.3): the fit must still give nan,
    not 1 - RSS/1e-33 (it printed R² = -1.2e31 for the real length design's flat best-of-n gold, 0.021 at n = 1, 2, 4)."""
    f = fit("bon", [0.0, 0.439, 0.798], [0.1 + 0.2, 0.3, 0.3], baseline=0.3)
    assert math.isnan(f.r2)
    assert fit("bon", [0.0, 0.439, 0.798], [0.3, 0.4, 0.45], baseline=0.3).r2 <= 1.0  # a varying reward: defined


def _point(d, gold, proxy, step, se):
    """One RL point as overoptimisation_points builds it: (d, gold, proxy, step, n, gold_se, proxy_se)."""
    return (d, gold, proxy, step, None, se, None)


def test_a_gold_that_falls_from_the_start_is_no_inverted_u():
    """Gao et al.'s inverted U rises to a peak at an intermediate KL and then falls. The real length design's GRPO run
    (gold = verifier accuracy of samples) peaked at the reference itself: 0.042 +- 0.021 at d = 0, then 0.021,
    0.031, 0.031, 0.010, 0, 0 while the proxy rose 1.49 -> 4.12. Its fall, 0.042 +- 0.021 = 2.0 s.e., is real, but
    there is no rise before it: shape "falls", not an inverted U (the table said "yes"). Gold at the start: 1/24 (one
    right answer in 24 prompts' samples), s.e. 0.0205 as the run recorded it (0.021 rounded): the fall is 2.03 s.e."""
    pts = [_point(0.0, 1 / 24, 1.49, 0, 0.0205), _point(0.221, 0.021, 2.12, 2, 0.015), _point(0.751, 0.031, 3.13, 4, 0.018),
           _point(1.183, 0.031, 3.71, 6, 0.018), _point(1.407, 0.010, 4.11, 8, 0.010), _point(1.537, 0.0, 4.00, 10, 0.0),
           _point(1.668, 0.0, 4.12, 12, 0.0)]
    v = peak_verdict(pts)
    assert v["d_peak"] == 0.0 and v["rise"] == 0.0 and v["fall"] == pytest.approx(1 / 24)
    assert v["shape"] == "falls" and v["inverted_u"] is False


def test_an_inverted_u_needs_a_real_rise_and_a_real_fall():
    """Rise = gold at the peak - gold at the start (smallest d), fall = gold at the peak - gold at the end (largest
    d), each against FALL_Z = 2 combined standard errors sqrt(se_1^2 + se_2^2):
    0.30 -> 0.50 -> 0.30 (se 0.01 each): rise 0.20 and fall 0.20, each 14 s.e.: an inverted U.
    0.30 -> 0.32 -> 0.10 (se 0.05, 0.05, 0.01): rise 0.02 = 0.28 s.e., noise: "falls", no inverted U.
    0.30 -> 0.40 -> 0.45 (se 0.01): the peak is the end: "rises". 0.30 -> 0.31 -> 0.30 (se 0.05): "flat"."""
    def verdict(golds, ses):
        return peak_verdict([_point(d, g, 1.0 + d, 5 * i, s) for i, (d, g, s) in enumerate(zip((0.0, 1.0, 2.0), golds, ses))])
    v = verdict((0.30, 0.50, 0.30), (0.01, 0.01, 0.01))
    assert v["shape"] == "inverted U" and v["inverted_u"] is True
    assert v["rise"] == pytest.approx(0.20) and v["rise_se"] == pytest.approx(math.sqrt(2) * 0.01)
    v = verdict((0.30, 0.32, 0.10), (0.05, 0.05, 0.01))
    assert v["shape"] == "falls" and v["inverted_u"] is False
    assert verdict((0.30, 0.40, 0.45), (0.01, 0.01, 0.01))["shape"] == "rises"
    assert verdict((0.30, 0.31, 0.30), (0.05, 0.05, 0.05))["shape"] == "flat"


def test_pooling_runs_point_by_point_by_hand():
    """Two runs evaluated at the same steps 0, 1, 2 pool into one series: at each step the mean d, gold and proxy of
    the runs, and the gold s.e. of a mean of k independent evaluations, sqrt(sum se_i^2) / k.
    Step 1: d (0.2 + 0.4)/2 = 0.3; gold (0.04 + 0.06)/2 = 0.05; se sqrt(0.01^2 + 0.02^2)/2 = sqrt(5e-4)/2 = 0.011180.
    A run without step 2 leaves step 2 out (only steps every run has are pooled)."""
    from prefzoo.report.overoptimisation import pooled_series

    a = [_point(0.0, 0.02, 1.0, 0, 0.01), _point(0.2, 0.04, 2.0, 1, 0.01), _point(0.5, 0.01, 3.0, 2, 0.01)]
    b = [_point(0.0, 0.00, 1.2, 0, 0.00), _point(0.4, 0.06, 2.2, 1, 0.02)]
    pooled = pooled_series({"a": a, "b": b})
    assert [p[3] for p in pooled] == [0, 1]
    d, gold, proxy, step, n, se, _ = pooled[1]
    assert (d, gold, proxy, step, n) == (pytest.approx(0.3), pytest.approx(0.05), pytest.approx(2.1), 1, None)
    assert se == pytest.approx(math.sqrt(0.01 ** 2 + 0.02 ** 2) / 2)
    assert pooled[0][5] == pytest.approx(0.005)  # sqrt(0.01^2 + 0)/2
    assert pooled_series({"a": a}) is None  # one run: nothing to pool


def test_the_preregistered_test_fixes_the_peak_by_d_not_by_gold():
    """The peak is the evaluation whose d is closest to the pre-registered d* (here 0.48), whatever its gold. Points
    (d, gold, se): (0, 0.010, 0.003), (0.30, 0.030, 0.004), (0.50, 0.025, 0.004), (0.90, 0.040, 0.005),
    (1.3, 0.005, 0.002); proxy rising 1 -> 5.
    (gold 0.024 at d 0.50.) Peak: d 0.50 (|0.50 - 0.48| = 0.02; the highest gold, 0.040 at d 0.9, is NOT chosen).
    rise = 0.024 - 0.010 = 0.014, s.e. sqrt(0.004^2 + 0.003^2) = 0.005: 2.8 s.e., not beyond 3; fall = 0.024 - 0.005
    = 0.019, s.e. sqrt(0.004^2 + 0.002^2) = 0.004472: 4.25 s.e. So: not decided (the fall counts, the rise does not).
    With gold 0.026 at the peak: rise 0.016 = 3.2 s.e., fall 0.021 = 4.7 s.e., proxy 5 > 3: established.
    Flat at 0.010 everywhere with s.e. 0.003: |rise| = |fall| = 0 within 3 s.e., and 3 s.e. = 3 sqrt(2) 0.003 =
    0.0127 <= 0.02: refuted with power. With s.e. 0.006: 3 s.e. = 0.0255 > 0.02: not decided (too little power)."""
    from prefzoo.report.overoptimisation import preregistered_verdict

    def pts(golds, ses):
        ds = (0.0, 0.30, 0.50, 0.90, 1.3)
        return [_point(d, g, 1.0 + i, i, s) for i, (d, g, s) in enumerate(zip(ds, golds, ses))]
    ses = (0.003, 0.004, 0.004, 0.005, 0.002)
    v = preregistered_verdict(pts((0.010, 0.030, 0.024, 0.040, 0.005), ses), peak_d=0.48)
    assert v["step_peak"] == 2 and v["rise"] == pytest.approx(0.014) and v["rise_se"] == pytest.approx(0.005)
    assert v["rise_z"] == pytest.approx(2.8) and v["fall_z"] == pytest.approx(0.019 / math.sqrt(2e-5))
    assert v["verdict"] == "not decided"
    v = preregistered_verdict(pts((0.010, 0.030, 0.026, 0.040, 0.005), ses), peak_d=0.48)
    assert v["verdict"] == "established" and v["proxy_end"] > v["proxy_peak"]
    flat = preregistered_verdict(pts((0.010,) * 5, (0.003,) * 5), peak_d=0.48)
    assert flat["verdict"] == "refuted" and flat["detectable"] == pytest.approx(3 * math.sqrt(2) * 0.003)
    assert preregistered_verdict(pts((0.010,) * 5, (0.006,) * 5), peak_d=0.48)["verdict"] == "not decided"


def test_each_rl_run_is_fitted_from_its_own_start():
    """Two RL runs against DIFFERENT proxies (two reward models: their scores of the same reference differ) start
    from proxy 1.0 and 3.0. Each run's proxy rises exactly as d (a - b log d) with a = 2, b = 1 from its own start, so
    its fit must give a = 2, b = 1 and pass through its own start at d = 0 (not through the mean of the two starts,
    2.0, which would bend both fits: the bug the report had). Gold is the same verifier for both: start 0.05."""
    from prefzoo.report.overoptimisation import fit_overoptimisation

    ds = (0.0, 0.2, 0.5, 1.0, 1.5)
    runs = {}
    for name, start in (("low", 1.0), ("high", 3.0)):
        runs[name] = [_point(d, 0.05, start + float(predict("rl", d, 2.0, 1.0)), i, 0.01) for i, d in enumerate(ds)]
    points = {"bon": [], "rl": runs, "gold0": 0.05, "proxy0": 2.0}
    fits = {(f["series"], f["reward"]): f["fit"] for f in fit_overoptimisation(points)}
    for name, start in (("low", 1.0), ("high", 3.0)):
        f = fits[(name, "proxy")]
        assert (f.a, f.b) == pytest.approx((2.0, 1.0), abs=1e-9)
        assert float(f(np.array([0.0]))[0]) == pytest.approx(start)


def test_best_of_n_is_fitted_from_its_own_best_of_1():
    """Best-of-n against one proxy: best-of-1 (the reference, d = 0) scores 4.0 on it; n = 2, 4, 8 sit at the
    analytic d = sqrt(log n - (n-1)/n) on 4 + d (a - b d) with a = 14, b = 5. RL runs against another proxy start at
    -4.7, so the mean of all d = 0 points (-0.35) is no baseline for either: the best-of-n fit must give a = 14,
    b = 5 exactly and pass through 4.0 at d = 0."""
    from prefzoo.report.overoptimisation import fit_overoptimisation

    bon = [(0.0, 0.03, 4.0, None, 1, 0.01, None)]
    for n in (2, 4, 8):
        d = math.sqrt(math.log(n) - (n - 1) / n)
        bon.append((d, 0.05, 4.0 + float(predict("bon", d, 14.0, 5.0)), None, n, 0.01, None))
    rl = {"other proxy": [_point(0.0, 0.05, -4.7, 0, 0.01), _point(0.5, 0.06, -4.0, 1, 0.01),
                          _point(1.0, 0.06, -3.0, 2, 0.01)]}
    points = {"bon": bon, "rl": rl, "gold0": 0.04, "proxy0": -0.35}
    f = {(x["series"], x["reward"]): x["fit"] for x in fit_overoptimisation(points)}[("best-of-n", "proxy")]
    assert (f.a, f.b) == pytest.approx((14.0, 5.0), abs=1e-9)
    assert float(f(np.array([0.0]))[0]) == pytest.approx(4.0)

"""The functional forms of Gao et al. 2023 and their least-squares fits recover known coefficients."""

from __future__ import annotations

import math

import numpy as np
import pytest

from prefzoo.report.overoptimisation import fit, observed_peak, predict


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

"""Tests for prefzoo.objective.odds: the log odds of a completion and ORPO's log odds ratio, stable near P = 1.

Tolerances (tests/bounds.py). log_odds computes in float64 and returns the input's dtype. The hand values are checked
in float64 (kind 1: a few float64 roundings of numbers <= 3 in size, ~1e-15; 1e-12 leaves 1000x); the two tests of
float32 inputs near P = 1, where float32 is the point, allow the one rounding of the output (u32 relative, u32 =
2**-24) and of the input l (u32 relative, which moves log odds ~ -log|l| by u32 and 1/(1 - P) ~ 1/|l| by u32 relative).
"""

import math

import pytest
import torch

from prefzoo.objective import ObjectiveError, log_odds, log_odds_ratio
from tests.bounds import U32


def test_log_odds_hand_values():
    """odds = P / (1 - P): P = 3/4 -> 3 (log odds ln 3), P = 1/2 -> 1 (0), P = 1/4 -> 1/3 (-ln 3). In float64 within
    1e-12 (module docstring); a float32 input gives a float32 output (its float32 log P alone is off by u32 |log P|,
    times dlogodds/dl = 1/(1 - P) = 4: 1.2e-7 measured against the old round 1e-6)."""
    got = log_odds(torch.log(torch.tensor([0.75, 0.5, 0.25], dtype=torch.float64)))
    want = torch.tensor([math.log(3), 0.0, -math.log(3)], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert log_odds(torch.log(torch.tensor([0.75, 0.5, 0.25]))).dtype == torch.float32


def test_log_odds_ratio_hand_value():
    """log OR = log odds(3/4) - log odds(1/4) = ln 3 + ln 3 = ln 9 (Hong et al. 2024, Sec. 4.1)."""
    d = torch.float64
    got = log_odds_ratio(torch.log(torch.tensor([0.75], dtype=d)), torch.log(torch.tensor([0.25], dtype=d)))
    assert float(got) == pytest.approx(math.log(9), abs=1e-12)


def test_log_odds_near_log_prob_zero_is_finite_with_its_gradient():
    """Mean log-prob l = -1e-8 (P = 1 - 1e-8): log odds = l - log(1 - e^l) = -1e-8 - ln(1e-8) = 18.42068073, and
    d/dl = 1 / (1 - P) = 1e8 (1 + 5e-9). The naive float32 form log1p(-exp(l)) gives exp(-1e-8) = 1.0 exactly,
    log1p(-1) = -inf, so log odds = +inf and the gradient NaN -- what this function avoids (log(-expm1(l))).
    Bounds (module docstring): u32 (|log odds| + 1) = 1.2e-6 on the value (measured 2.7e-7; the old 1e-5 held
    the 7-digit hand value), 2 u32 + 5e-9 relative on the gradient (measured: 1e8 to the last bit; the old 1e-4 was
    800x the bound)."""
    naive_l = torch.tensor([-1e-8])
    assert torch.isinf(naive_l - torch.log1p(-torch.exp(naive_l))).all()  # the overflow being avoided
    l = torch.tensor([-1e-8], requires_grad=True)
    out = log_odds(l)
    out.sum().backward()
    want = -1e-8 - math.log(1e-8)
    assert float(out.detach()) == pytest.approx(want, abs=U32 * (want + 1))
    assert float(l.grad) == pytest.approx(1e8, rel=2 * U32 + 5e-9)


def test_log_odds_at_exactly_zero_stays_finite():
    """A float32 mean log-prob of exactly 0 (every token saturated at probability 1) has infinite odds; the value is
    floored at l = -1e-12 (log odds -1e-12 - ln(1e-12) = 27.631021) with a zero gradient beyond the floor. The float64
    value rounded once to float32: within u32 |log odds| = 1.6e-6 (measured 3.8e-7; was 1e-4)."""
    l = torch.tensor([0.0], requires_grad=True)
    out = log_odds(l)
    out.sum().backward()
    want = -1e-12 - math.log(1e-12)
    assert float(out.detach()) == pytest.approx(want, abs=U32 * want)
    assert torch.isfinite(l.grad).all() and float(l.grad) == 0.0


def test_log_odds_refuses_a_non_tensor():
    with pytest.raises(ObjectiveError, match="mean_logps must be a torch.Tensor"):
        log_odds([-0.5])

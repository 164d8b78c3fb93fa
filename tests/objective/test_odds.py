"""Tests for prefzoo.objective.odds: the log odds of a completion and ORPO's log odds ratio, stable near P = 1."""

import math

import pytest
import torch

from prefzoo.objective import ObjectiveError, log_odds, log_odds_ratio


def test_log_odds_hand_values():
    """odds = P / (1 - P): P = 3/4 -> 3 (log odds ln 3), P = 1/2 -> 1 (0), P = 1/4 -> 1/3 (-ln 3)."""
    got = log_odds(torch.log(torch.tensor([0.75, 0.5, 0.25])))
    torch.testing.assert_close(got, torch.tensor([math.log(3), 0.0, -math.log(3)]), rtol=0, atol=1e-6)
    assert got.dtype == torch.float32


def test_log_odds_ratio_hand_value():
    """log OR = log odds(3/4) - log odds(1/4) = ln 3 + ln 3 = ln 9 (Hong et al. 2024, Sec. 4.1)."""
    got = log_odds_ratio(torch.log(torch.tensor([0.75])), torch.log(torch.tensor([0.25])))
    assert float(got) == pytest.approx(math.log(9), abs=1e-6)


def test_log_odds_near_log_prob_zero_is_finite_with_its_gradient():
    """Mean log-prob l = -1e-8 (P = 1 - 1e-8): log odds = l - log(1 - e^l) = -1e-8 - ln(1e-8) = 18.420681, and
    d/dl = 1 / (1 - P) = 1e8. The naive float32 form log1p(-exp(l)) gives exp(-1e-8) = 1.0 exactly, log1p(-1) =
    -inf, so log odds = +inf and the gradient NaN -- what this function avoids (log(-expm1(l)))."""
    naive_l = torch.tensor([-1e-8])
    assert torch.isinf(naive_l - torch.log1p(-torch.exp(naive_l))).all()  # the overflow being avoided
    l = torch.tensor([-1e-8], requires_grad=True)
    out = log_odds(l)
    out.sum().backward()
    assert float(out) == pytest.approx(18.420681, abs=1e-5)
    assert float(l.grad) == pytest.approx(1e8, rel=1e-4)


def test_log_odds_at_exactly_zero_stays_finite():
    """A float32 mean log-prob of exactly 0 (every token saturated at probability 1) has infinite odds; the value is
    floored at l = -1e-12 (log odds ln(1e12) = 27.631021) with a zero gradient beyond the floor."""
    l = torch.tensor([0.0], requires_grad=True)
    out = log_odds(l)
    out.sum().backward()
    assert float(out) == pytest.approx(27.631021, abs=1e-4)
    assert torch.isfinite(l.grad).all()


def test_log_odds_refuses_a_non_tensor():
    with pytest.raises(ObjectiveError, match="mean_logps must be a torch.Tensor"):
        log_odds([-0.5])

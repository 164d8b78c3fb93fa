"""The unclipped importance-weighted policy-gradient loss, -exp(logps - old_logps) A per token (Tinker's
``importance_sampling``; issue 50).

Tolerances (tests/bounds.py, kind 1): float64 throughout; a ratio exp(log x) is within (|ln x| + 2) u64 relative of x,
so values and gradients (one product with A) are checked at rtol 1e-12, 1000x that rounding.
"""

import math

import pytest
import torch

from prefzoo.objective import ObjectiveError, importance_sampling_loss


def test_values_and_gradient_by_hand():
    """Ratios (0.5, 1, 2) with advantages (2, -1, 0.5): losses -(0.5 * 2, 1 * -1, 2 * 0.5) = (-1, 1, -1); the gradient
    in logps is -ratio * A = the same numbers (d exp(l) / dl = exp(l)); old_logps and A get none; a masked position is 0
    with no gradient."""
    logps = torch.log(torch.tensor([[0.5, 1.0, 2.0, 3.0]], dtype=torch.float64)).requires_grad_(True)
    old = torch.zeros(1, 4, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[2.0, -1.0, 0.5, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    loss = importance_sampling_loss(logps, old, adv, mask)
    torch.testing.assert_close(loss, torch.tensor([[-1.0, 1.0, -1.0, 0.0]], dtype=torch.float64), rtol=1e-12, atol=0)
    loss.sum().backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-1.0, 1.0, -1.0, 0.0]], dtype=torch.float64), rtol=1e-12,
                               atol=0)
    assert old.grad is None or torch.all(old.grad == 0)


def test_on_policy_it_is_reinforce():
    """At logps == old_logps every ratio is 1: the value is -A and the gradient -A per token (REINFORCE), with a
    per-sequence advantage (B,) broadcast over the tokens."""
    logps = torch.tensor([[-1.2, -0.3], [-2.0, -0.7]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([0.4, -1.5], dtype=torch.float64)
    loss = importance_sampling_loss(logps, logps.detach(), adv, torch.ones(2, 2, dtype=torch.bool))
    expected = torch.tensor([[-0.4, -0.4], [1.5, 1.5]], dtype=torch.float64)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    loss.sum().backward()
    torch.testing.assert_close(logps.grad, expected, rtol=1e-12, atol=0)
    assert math.isclose(float(loss.sum()), -2 * 0.4 + 2 * 1.5, rel_tol=1e-12)


def test_bad_shapes_are_refused():
    logps = torch.zeros(2, 3)
    with pytest.raises(ObjectiveError, match="advantages has shape"):
        importance_sampling_loss(logps, logps, torch.zeros(3), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ObjectiveError):
        importance_sampling_loss(logps, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool))

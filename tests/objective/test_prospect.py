"""KTO's value function (prefzoo.objective.kto_loss), by hand: loss = lambda_D (1 - sigma(beta (r - z0))) for a
desirable row, lambda_U (1 - sigma(beta (z0 - r))) for an undesirable one (Ethayarajh et al. 2024, sec. 4.1)."""

import math

import pytest
import torch

from prefzoo.objective import ObjectiveError, kto_loss


def test_hand_values_and_that_z0_carries_no_gradient():
    """beta 1, lambda_D 2, lambda_U 3, z0 0.5: r = 0.5 desirable -> 2 (1 - sigma(0)) = 1; r = 2.5 undesirable ->
    3 (1 - sigma(-2)) = 3 * 0.8807971 = 2.6423912; d/dr = -2 * 0.25 = -0.5 and 3 sigma(-2) sigma(2) = 0.3149808.
    z0 given as a tensor with requires_grad gets no gradient (it is detached). kto_loss keeps the input's dtype: in
    float64 against sigma(2) = 1 / (1 + e^-2) from math, within 1e-12 (a few roundings of numbers <= 3, ~1e-15;
    measured 4e-16). The float32 version of this test held the 7-digit values within a round 1e-6."""
    d = torch.float64
    r = torch.tensor([0.5, 2.5], dtype=d, requires_grad=True)
    z0 = torch.tensor(0.5, requires_grad=True)
    loss = kto_loss(r, torch.tensor([True, False]), z0, beta=1.0, desirable_weight=2.0, undesirable_weight=3.0)
    s2 = 1 / (1 + math.exp(-2))
    torch.testing.assert_close(loss.detach(), torch.tensor([1.0, 3 * s2], dtype=d), rtol=0, atol=1e-12)
    loss.sum().backward()
    torch.testing.assert_close(r.grad, torch.tensor([-0.5, 3 * s2 * (1 - s2)], dtype=d), rtol=0, atol=1e-12)
    assert z0.grad is None


@pytest.mark.parametrize("kwargs,needle", [
    (dict(log_ratio=torch.zeros(2, 1), desirable=torch.ones(2, 1, dtype=torch.bool)), "must both be (B,)"),
    (dict(log_ratio=torch.zeros(2), desirable=torch.ones(2)), "must be a bool tensor"),
    (dict(log_ratio=torch.zeros(2), desirable=torch.ones(2, dtype=torch.bool), beta=0.0), "must all be > 0"),
])
def test_bad_inputs_raise(kwargs, needle):
    kwargs = {"z0": 0.0, "beta": 0.1, **kwargs}
    with pytest.raises(ObjectiveError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        kto_loss(**kwargs)

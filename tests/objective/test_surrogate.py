"""Tests for prefzoo.objective.surrogate: PPO clipped surrogate (+ clip-higher) and value loss.

Tolerances (tests/bounds.py, kind 1). The hand values are float64 (the functions keep the input's dtype), each an exp
of a log and a product or a clip of numbers <= 3: rounding ~1e-16 (all hold at 1e-13, checked 2026-12-06).
assert_close's float64 defaults (rtol = atol = 1e-7) are far above that and far below what a wrong branch of the min
or clip moves (0.05 and more). Where no rounding happens (ratio exactly 1 on policy, a broadcast against its
expanded copy, 0.5 (1 - 0)^2) the comparisons are exact.
"""

import math

import pytest
import torch

from prefzoo.objective import ObjectiveError, clipped_surrogate_loss, clipped_value_loss


def _case(ratios, advantages):
    logps = torch.log(torch.tensor([ratios], dtype=torch.float64)).requires_grad_(True)
    old = torch.zeros_like(logps.detach())
    adv = torch.tensor([advantages], dtype=torch.float64)
    mask = torch.ones_like(old, dtype=torch.bool)
    return logps, old, adv, mask


def test_hand_values_symmetric_clip():
    """epsilon = 0.2, clip range [0.8, 1.2]:
    ratio 1.5, A = +1: min(1.5, 1.2) = 1.2      -> loss -1.2, clipped
    ratio 1.5, A = -1: min(-1.5, -1.2) = -1.5   -> loss  1.5, not clipped
    ratio 0.5, A = +1: min(0.5, 0.8) = 0.5      -> loss -0.5, not clipped
    ratio 0.5, A = -1: min(-0.5, -0.8) = -0.8   -> loss  0.8, clipped
    ratio 1.1, A = +2: inside, 2.2              -> loss -2.2, not clipped
    ratio 1.25, A = +1: 1.2                      -> loss -1.2, clipped"""
    logps, old, adv, mask = _case([1.5, 1.5, 0.5, 0.5, 1.1, 1.25], [1, -1, 1, -1, 2, 1])
    loss, clipped = clipped_surrogate_loss(logps, old, adv, mask, 0.2)
    torch.testing.assert_close(loss.detach(), torch.tensor([[-1.2, 1.5, -0.5, 0.8, -2.2, -1.2]],
                                                           dtype=torch.float64))
    assert clipped.tolist() == [[True, False, False, True, False, True]]


def test_clip_higher_asymmetric():
    """clip_eps_low = 0.2, clip_eps_high = 0.28: ratio 1.25 with A = +1 is now inside (1.25 < 1.28)
    -> loss -1.25; ratio 1.3 is clipped at 1.28 -> -1.28; the low side still clips at 0.8."""
    logps, old, adv, mask = _case([1.25, 1.3, 0.5], [1, 1, -1])
    loss, clipped = clipped_surrogate_loss(logps, old, adv, mask, 0.2, 0.28)
    torch.testing.assert_close(loss.detach(), torch.tensor([[-1.25, -1.28, 0.8]],
                                                           dtype=torch.float64))
    assert clipped.tolist() == [[False, True, True]]


def test_gradient_is_zero_exactly_where_clipped_and_the_ratio_gradient_elsewhere():
    """d(-ratio * A)/d logps = -ratio * A where the unclipped branch is active, 0 where clipped;
    masked tokens get 0."""
    ratios = [1.5, 1.5, 0.5, 0.5, 1.1, 0.9, 1.0]
    advs = [1.0, -1.0, 1.0, -1.0, 2.0, -3.0, 0.5]
    logps, old, adv, mask = _case(ratios, advs)
    mask[0, -1] = False
    loss, clipped = clipped_surrogate_loss(logps, old, adv, mask, 0.2)
    loss.sum().backward()
    expected = [0.0 if c else -r * a for r, a, c in zip(ratios, advs, clipped[0].tolist())]
    expected[-1] = 0.0  # masked
    torch.testing.assert_close(logps.grad, torch.tensor([expected], dtype=torch.float64))
    assert (logps.grad[0, [1, 2, 4, 5]] != 0).all()
    assert (logps.grad[0, [0, 3]] == 0).all()


def test_on_policy_ratio_is_exactly_one_and_loss_is_minus_advantage():
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(3, 4, generator=g) * 5
    adv = torch.randn(3, generator=g)
    mask = torch.tensor([[True] * 4, [True, True, False, False], [False] * 4])
    loss, clipped = clipped_surrogate_loss(logps, logps.clone(), adv, mask, 0.2)
    expected = torch.where(mask, -adv[:, None].expand(3, 4), torch.zeros(3, 4))
    assert torch.equal(loss, expected)
    assert not clipped.any()


def test_per_sequence_advantages_broadcast_like_per_token():
    g = torch.Generator().manual_seed(1)
    logps = -torch.rand(2, 5, generator=g)
    old = logps + 0.3 * torch.randn(2, 5, generator=g)
    adv = torch.randn(2, generator=g)
    mask = torch.ones(2, 5, dtype=torch.bool)
    a, ca = clipped_surrogate_loss(logps, old, adv, mask, 0.2)
    b, cb = clipped_surrogate_loss(logps, old, adv[:, None].expand(2, 5), mask, 0.2)
    assert torch.equal(a, b) and torch.equal(ca, cb)


def test_value_loss_hand_values():
    """clip_range 0.2:
    v = 1.0, old = 0.5, R = 2.0: v_clip = 0.7; (1-2)^2 = 1, (0.7-2)^2 = 1.69 -> 0.5 * 1.69
        = 0.845, clipped
    v = 0.6, old = 0.5, R = 2.0: inside; 0.5 * 1.4^2 = 0.98, not clipped
    v = 1.0, old = 0.5, R = 0.0: v_clip = 0.7; max(1, 0.49) = 1 -> 0.5, not clipped"""
    values = torch.tensor([[1.0, 0.6, 1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 2.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, clipped = clipped_value_loss(values, old, returns, mask, value_clip_eps=0.2)
    torch.testing.assert_close(loss.detach(), torch.tensor([[0.845, 0.98, 0.5]],
                                                           dtype=torch.float64))
    assert clipped.tolist() == [[True, False, False]]
    loss.sum().backward()
    # gradient: 0 where clipped, (v - R) elsewhere: (0, -1.4, 1.0)
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -1.4, 1.0]], dtype=torch.float64))


def test_value_loss_masks():
    values = torch.tensor([[1.0, float("nan")]])
    loss, clipped = clipped_value_loss(values, torch.zeros(1, 2), torch.zeros(1, 2),
                                       torch.tensor([[True, False]]), value_clip_eps=10.0)
    assert loss.tolist() == [[0.5, 0.0]] and clipped.tolist() == [[False, False]]


def test_surrogate_errors():
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ObjectiveError, match=r"\(2, 3\).*\(2, 4\)"):
        clipped_surrogate_loss(x, torch.zeros(2, 4), torch.zeros(2), m, 0.2)
    with pytest.raises(ObjectiveError, match="advantages"):
        clipped_surrogate_loss(x, x, torch.zeros(3), m, 0.2)
    with pytest.raises(ObjectiveError, match="clip_eps_low"):
        clipped_surrogate_loss(x, x, torch.zeros(2), m, clip_eps_low=-0.1)
    with pytest.raises(ObjectiveError, match="clip_eps_high"):
        clipped_surrogate_loss(x, x, torch.zeros(2), m, 0.2, clip_eps_high=-0.1)
    with pytest.raises(ObjectiveError, match="value_clip_eps"):
        clipped_value_loss(x, x, x, m, value_clip_eps=-1)
    assert math.isfinite(float(clipped_surrogate_loss(x, x, torch.zeros(2), m, 0.2)[0].sum()))

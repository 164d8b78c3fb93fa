"""CISPO's clipped importance-sampling weight and the weighted policy-gradient loss (MiniMax-M1, 2025).

Tolerances (tests/bounds.py, kind 1): the weight and the loss keep the log-probs' dtype, so the checks run in float64.
A weight exp(log x) is within (|ln x| + 2) u64 < 1e-15 relative of x, checked at rtol 1e-12 (1000x); a clipped weight
is its bound exactly; a gradient against its closed form (sums of 4 terms <= 2.6) within 1e-12 (rounding ~1e-15). The
finite-difference check has its own derived bound (its docstring).
"""

import math

import pytest
import torch

from prefzoo.objective import ObjectiveError, clipped_is_weight, weighted_policy_gradient_loss
from tests.bounds import U64


def _ratios(values):
    logps = torch.log(torch.tensor([values], dtype=torch.float64)).requires_grad_(True)
    return logps, torch.zeros_like(logps.detach()), torch.ones(1, len(values), dtype=torch.bool)


def test_the_weight_is_the_clipped_ratio_detached():
    """eps_low = 0.2, eps_high = 0.28: ratios (0.5, 0.9, 1.0, 1.2, 1.5) -> weights (0.8, 0.9, 1.0, 1.2, 1.28);
    clipped where the ratio left [0.8, 1.28] (first and last); no gradient flows through the weight."""
    logps, old, mask = _ratios([0.5, 0.9, 1.0, 1.2, 1.5])
    w, clipped = clipped_is_weight(logps, old, mask, 0.2, 0.28)
    torch.testing.assert_close(w, torch.tensor([[0.8, 0.9, 1.0, 1.2, 1.28]], dtype=torch.float64), rtol=1e-12, atol=0)
    assert clipped.tolist() == [[True, False, False, False, True]]
    assert not w.requires_grad


def test_eps_low_one_means_no_lower_bound():
    """The paper's choice (no lower bound on the weight): eps_low = 1 gives clip(ratio, 0, 1 + eps_high), so a
    ratio of 0.01 keeps its weight 0.01 and is not counted as clipped."""
    logps, old, mask = _ratios([0.01, 3.0])
    w, clipped = clipped_is_weight(logps, old, mask, 1.0, 0.28)
    torch.testing.assert_close(w, torch.tensor([[0.01, 1.28]], dtype=torch.float64), rtol=1e-12, atol=0)
    assert clipped.tolist() == [[False, True]]


def test_cispo_gradient_is_minus_sg_weight_times_advantage_times_grad_log_pi_by_finite_differences():
    """A toy: pi = softmax(theta) over 3 tokens, theta = (0.2, -0.1, 0.5), one sampled token per row (rows sample
    tokens 0, 2, 2, 1) with advantages (1, -0.5, 2, -1) and old log-probs that make the ratios (1.6, 0.7, 1.1, 0.95).
    With w = clip(ratio, 0.8, 1.28) HELD FIXED (the stop-gradient), the loss -sum_i w_i A_i log pi(y_i) has gradient
    -sum_i w_i A_i (e_{y_i} - pi) in theta; this is checked against central finite differences of the same loss with
    the weights frozen at their values, and against the closed form. Every token keeps a gradient (the first one's
    ratio 1.6 is clipped, yet it contributes w = 1.28 times its own), unlike PPO's clip, which zeroes it.

    The finite differences' bound (kind 1, float64, derived): the truncation h^2/6 |f^(3)| <= h^2 sum|w A| (a
    log-softmax's third derivatives are <= 1); the rounding of f (4 terms w A log pi, ~10 roundings each relative to
    |log pi| + 2) over h; the rounding of theta +- h, |g| u64 (|theta| + h) / h. 1.6e-8 in all; measured 1.8e-10 at 1
    and 2 threads (2026-12-06). (It was atol 1e-8 + rtol 1e-6, 1.5e-6 on these gradients.)"""
    theta = torch.tensor([0.2, -0.1, 0.5], dtype=torch.float64, requires_grad=True)
    tokens = torch.tensor([0, 2, 2, 1])
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0], dtype=torch.float64)
    ratios = torch.tensor([1.6, 0.7, 1.1, 0.95], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.bool)

    def logps_of(t):
        return torch.log_softmax(t, -1)[tokens][:, None]

    old = (logps_of(theta) - ratios.log()[:, None]).detach()
    w, clipped = clipped_is_weight(logps_of(theta), old, mask, 0.2, 0.28)
    torch.testing.assert_close(w[:, 0], torch.tensor([1.28, 0.8, 1.1, 0.95], dtype=torch.float64), rtol=1e-12, atol=0)
    loss = weighted_policy_gradient_loss(logps_of(theta), adv, mask, w).sum()
    loss.backward()

    pi = torch.softmax(theta.detach(), -1)
    closed = -sum(float(w[i, 0] * adv[i]) * (torch.eye(3, dtype=torch.float64)[tokens[i]] - pi) for i in range(4))
    torch.testing.assert_close(theta.grad, closed, rtol=0, atol=1e-12)
    h = 1e-6
    fd = torch.zeros(3, dtype=torch.float64)
    for k in range(3):
        e = torch.zeros(3, dtype=torch.float64)
        e[k] = h
        f = lambda t: float(weighted_policy_gradient_loss(logps_of(t), adv, mask, w).sum())  # noqa: E731
        fd[k] = (f(theta.detach() + e) - f(theta.detach() - e)) / (2 * h)
    wa = (w[:, 0] * adv).abs()
    log_pi = logps_of(theta.detach())[:, 0].abs()
    fd_bound = (h * h * float(wa.sum()) + 10 * U64 * float((wa * (log_pi + 2)).sum()) / h
                + float(closed.abs().max()) * U64 * (float(theta.detach().abs().max()) + h) / h)
    assert float((theta.grad - fd).abs().max()) <= fd_bound
    assert bool(clipped[0, 0]) and float(w[0, 0]) == 1.0 + 0.28  # the clip's bound itself


def test_without_weights_it_is_reinforce_and_pads_are_zero():
    """weights=None: -A log pi per token (REINFORCE, Williams 1992). logps (-1, -2 | -0.5, pad), A per row (2, -1):
    losses (2, 4 | -0.5, 0); the pad's gradient is 0, the others' -A."""
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -30.0]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    loss = weighted_policy_gradient_loss(logps, torch.tensor([2.0, -1.0]), mask)
    assert loss.tolist() == [[2.0, 4.0], [-0.5, 0.0]]
    loss.sum().backward()
    assert logps.grad.tolist() == [[-2.0, -2.0], [1.0, 0.0]]


def test_bad_clip_ranges_say_what_to_fix():
    logps, old, mask = _ratios([1.0])
    with pytest.raises(ObjectiveError, match="clip_eps_low"):
        clipped_is_weight(logps, old, mask, 1.5, 0.2)
    with pytest.raises(ObjectiveError, match="clip_eps_high"):
        clipped_is_weight(logps, old, mask, 0.2, -0.1)
    with pytest.raises(ObjectiveError, match="advantages"):
        weighted_policy_gradient_loss(logps, torch.ones(3), mask)
    assert math.isfinite(float(clipped_is_weight(logps, old, mask, 0.0, 0.0)[0]))

"""The surrogates without PPO's ratio clip (DPPO, SAPO, DRO), MaxRL's advantage and the bias-corrected KL, each
against values derived by hand in the test's docstring (from the papers' formulas, not from the code) or a closed form.

Tolerances (tests/bounds.py, kind 1). Everything is float64 and compared with the hand formula evaluated in Python
(math), not with the docstrings' 7-digit decimals: each value is a handful of operations on numbers <= 25 (a log, an
exp, a product, a sum of <= 4 terms), rounding ~1e-14 at most; 1e-12 leaves 100x. The one check of a docstring decimal
against its formula allows half a unit of its last digit, 5e-8.
"""

from __future__ import annotations

import math

import pytest
import torch

from prefzoo.objective import ObjectiveError, dppo_loss, dro_loss, group_advantages, kl_loss, sapo_loss


def _tokens(p, q):
    """One row of tokens with probabilities p under pi_theta (with grad) and q under pi_old."""
    logps = torch.tensor([[math.log(x) for x in p]], dtype=torch.float64, requires_grad=True)
    return logps, torch.tensor([[math.log(x) for x in q]], dtype=torch.float64)


def test_dppo_tv_masks_by_how_far_the_probability_moved_not_the_ratio():
    """delta = 0.15 both ways, cap 1e4. Tokens (p, q, A):
    1. (0.7, 0.5, +1): p - q = 0.2 > 0.15 and A > 0 -> dropped: loss 0, gradient 0.
    2. (0.6, 0.5, +1): 0.1 <= 0.15 -> kept: loss = -1 * (0.6/0.5) * ln 0.6 = -1.2 * -0.5108256 = 0.6129908;
       d loss / d log p = -A rho = -1.2.
    3. (0.7, 0.5, -1): A < 0 only drops p - q < -0.15 -> kept: loss = 1.4 * ln 0.7 = -0.4993449; gradient +1.4.
    4. (0.3, 0.5, -1): p - q = -0.2 -> dropped.
    5. (0.1, 0.01, +1): ratio 10 (PPO at 0.2 would clip it), p - q = 0.09 -> kept, gradient -10.
    6. a padded position (mask False) with the values of 1: loss 0, not counted as dropped."""
    logps, old = _tokens([0.7, 0.6, 0.7, 0.3, 0.1, 0.7], [0.5, 0.5, 0.5, 0.5, 0.01, 0.5])
    a = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[True] * 5 + [False]])
    loss, dropped = dppo_loss(logps, old, a, mask, "tv", 0.15, 0.15)
    expected = [0.0, -1.2 * math.log(0.6), 1.4 * math.log(0.7), 0.0, -10 * math.log(0.1), 0.0]
    assert loss[0].tolist() == pytest.approx(expected, abs=1e-12)
    assert dropped[0].tolist() == [True, False, False, True, False, False]
    loss.sum().backward()
    assert logps.grad[0].tolist() == pytest.approx([0.0, -1.2, 1.4, 0.0, -10.0, 0.0], abs=1e-12)


def test_dppo_binary_kl_drops_only_a_large_move_in_the_advantages_direction():
    """delta = 0.05. The binary KL of q = 0.5 -> p = 0.7: 0.5 ln(0.5/0.7) + 0.5 ln(0.5/0.3) = 0.0871767 > 0.05:
    dropped for A > 0 (p rose with A), kept for A < 0 (p moved against A: the update pulls it back). q = 0.5 ->
    p = 0.55: 0.5 ln(0.5/0.55) + 0.5 ln(0.5/0.45) = 0.0050252 < 0.05: kept. A per-sequence (B,) advantage is broadcast."""
    d = 0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3)
    assert d == pytest.approx(0.0871767, abs=5e-8)
    logps, old = _tokens([0.7, 0.55], [0.5, 0.5])
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, up = dppo_loss(logps, old, torch.tensor([1.0], dtype=torch.float64), mask, "kl", 0.05, 0.05)
    _, down = dppo_loss(logps, old, torch.tensor([-1.0], dtype=torch.float64), mask, "kl", 0.05, 0.05)
    assert up[0].tolist() == [True, False] and down[0].tolist() == [False, False]
    with pytest.raises(ObjectiveError, match="divergence"):
        dppo_loss(logps, old, torch.tensor([1.0]), mask, "js", 0.05, 0.05)


def test_sapo_gate_values_and_gradient_weight():
    """f(rho) = (4/tau) sigmoid(tau (rho - 1)), loss -f A, tau = 1 for A > 0 and 1.05 for A < 0.
    At rho = 1: loss = -(4/tau) * 0.5 * A; d loss / d log p = -4 s (1 - s) rho A = -A (s = 1/2).
    At rho = 1.5, A = +1: s = sigmoid(0.5) = 0.6224593, loss = -2.4898373; d/d log p = -4 * 0.6224593 * 0.3775407
    * 1.5 = -1.4100223; its gradient weight 4 s (1 - s) = 0.9400148.
    At rho = 1.5, A = -1, tau = 1.05: s = sigmoid(0.525), loss = +(4/1.05) s; gradient +4 s (1 - s) * 1.5."""
    logps, old = _tokens([0.5, 0.75, 0.5, 0.75], [0.5, 0.5, 0.5, 0.5])
    a = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, weight, below = sapo_loss(logps, old, a, mask)
    s_pos, s_neg = 1 / (1 + math.exp(-0.5)), 1 / (1 + math.exp(-0.525))
    assert loss[0].tolist() == pytest.approx([-2.0, -4 * s_pos, 2 / 1.05, 4 / 1.05 * s_neg], abs=1e-12)
    loss.sum().backward()
    want = [-1.0, -4 * s_pos * (1 - s_pos) * 1.5, 1.0, 4 * s_neg * (1 - s_neg) * 1.5]
    assert logps.grad[0].tolist() == pytest.approx(want, abs=1e-12)
    assert weight[0, 1].item() == pytest.approx(4 * s_pos * (1 - s_pos), abs=1e-12) and not below.any()


def test_dro_penalises_the_squared_log_ratio_to_the_sampling_policy():
    """loss = -(A log p - beta/2 (log p - log q)^2), beta = 0.05. p = 0.5, q = 0.4, A = 1: delta = ln 1.25 =
    0.2231436; loss = 0.6931472 + 0.025 * 0.0497930 = 0.6943920; d loss / d log p = -(A - beta delta) = -0.9888428.
    A token 25 nats above its sampling log-prob with A = 1: beta delta = 1.25 > A: past the point where the penalty
    outweighs the advantage (``over``), the gradient pushes it down (+0.25)."""
    logps = torch.tensor([[math.log(0.5), 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[math.log(0.4), -25.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, over = dro_loss(logps, old, torch.tensor([1.0], dtype=torch.float64), mask, 0.05)
    delta = math.log(1.25)
    assert loss[0, 0].item() == pytest.approx(math.log(2) + 0.025 * delta ** 2, abs=1e-12)
    loss.sum().backward()
    assert logps.grad[0].tolist() == pytest.approx([-(1 - 0.05 * delta), 0.25], abs=1e-12)
    assert over[0].tolist() == [False, True]


@pytest.mark.parametrize("loss_fn", ["dppo_tv", "dppo_kl", "sapo", "dro"])
def test_on_the_first_pass_every_surrogate_has_reinforces_gradient(loss_fn):
    """At pi = pi_old (ratio 1) DPPO keeps every token (no move), SAPO's gate slope is 4 * 1/4 = 1 and DRO's penalty's
    gradient is 0: each loss's gradient is -A per token in log p, the policy gradient; 0 on a padded token."""
    logps = torch.log(torch.tensor([[0.2, 0.5, 0.9]], dtype=torch.float64)).requires_grad_()
    a = torch.tensor([[0.7, -1.3, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    old = logps.detach().clone()
    out = {"dppo_tv": lambda: dppo_loss(logps, old, a, mask, "tv", 0.15, 0.15),
           "dppo_kl": lambda: dppo_loss(logps, old, a, mask, "kl", 0.05, 0.05),
           "sapo": lambda: sapo_loss(logps, old, a, mask), "dro": lambda: dro_loss(logps, old, a, mask, 0.05)}[loss_fn]()
    out[0].sum().backward()
    assert logps.grad[0].tolist() == pytest.approx([-0.7, 1.3, 0.0], abs=1e-12)


def test_maxrl_divides_by_the_group_mean():
    """scale="mean", eps 0: group [1, 0, 0, 0] (mean 1/4) -> (r - 1/4) / (1/4) = [3, -1, -1, -1]; [2, 2, 1, 1] (mean
    1.5) -> [1/3, 1/3, -1/3, -1/3]; all zero -> 0 (no division by 0); [-1, 0, -1, 0] (mean -1/2 <= 0) -> 0.
    float64 rewards (the advantages keep their dtype): within 1e-12 (the float32 version held 1e-6 against a rounding
    of u32 / 3 = 2e-8)."""
    r = torch.tensor([1, 0, 0, 0, 2, 2, 1, 1, 0, 0, 0, 0, -1, 0, -1, 0], dtype=torch.float64)
    a = group_advantages(r, 4, "mean", 0.0)
    assert a.tolist() == pytest.approx([3, -1, -1, -1, 1 / 3, 1 / 3, -1 / 3, -1 / 3] + [0] * 8, abs=1e-12)


def test_the_bias_corrected_k3_follows_the_reverse_kl_gradient_off_policy():
    """A categorical policy over 4 tokens, pi_theta = softmax(theta), samples from pi_old != pi_theta. The exact
    expectation over pi_old of the corrected term, sum_y pi_old(y) rho(y) k3(y), is KL(pi_theta || pi_ref) and its
    gradient is the reverse KL's (closed form: autograd of sum_y pi log(pi / pi_ref)). The plain k3 term's expected
    gradient at theta = theta_old is the forward KL's instead, grad of sum_y pi_ref log(pi_ref / pi)."""
    theta = torch.tensor([0.3, -0.2, 0.9, 0.0], dtype=torch.float64, requires_grad=True)
    theta_old = torch.tensor([0.1, 0.4, 0.2, -0.5], dtype=torch.float64)
    log_ref = torch.log_softmax(torch.tensor([0.5, 0.5, -1.0, 0.2], dtype=torch.float64), -1)
    mask = torch.ones(1, 4, dtype=torch.bool)

    def expected_term(old):
        lp = torch.log_softmax(theta, -1)
        lo = torch.log_softmax(old, -1)
        per = kl_loss(lp[None], log_ref[None], mask, "k3", lo[None] if old is not None else None)
        return (lo.exp() * per[0]).sum()

    value = expected_term(theta_old)
    (grad,) = torch.autograd.grad(value, theta)
    lp = torch.log_softmax(theta, -1)
    reverse = (lp.exp() * (lp - log_ref)).sum()
    (want,) = torch.autograd.grad(reverse, theta)
    assert value.item() == pytest.approx(reverse.item(), abs=1e-12)
    assert grad.tolist() == pytest.approx(want.tolist(), abs=1e-12)

    at_old = theta_old.clone().requires_grad_()
    lp_old = torch.log_softmax(at_old, -1)
    plain = (lp_old.exp().detach() * kl_loss(lp_old[None], log_ref[None], mask, "k3")[0]).sum()
    (g_plain,) = torch.autograd.grad(plain, at_old)
    lp2 = torch.log_softmax(at_old, -1)
    (g_forward,) = torch.autograd.grad((log_ref.exp() * (log_ref - lp2)).sum(), at_old)
    assert g_plain.tolist() == pytest.approx(g_forward.tolist(), abs=1e-12)

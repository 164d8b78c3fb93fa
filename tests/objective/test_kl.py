"""Tests for prefzoo.objective.kl: estimator values (Monte Carlo) and, exactly, which gradient
each estimator follows in each placement.

Tolerances (tests/bounds.py). The estimators keep the log-ratio's dtype, so the exact claims run in float64 (kind 1):
a KL or an expected gradient is a sum over 6 outcomes of terms <= ~10 (|rho| <= 2.2, so e^-rho <= 9), whose rounding
is ~1e-14 at worst; the gradient identities are checked within 1e-10 (>= 1e4x; measured <= 1.3e-16, 2026-12-06, 1
and 2 threads), the KLs and k1's zero expected gradient (6 terms <= 1: <= 1e-14) within 1e-12. A value quoted by
hand to 10 decimals (<= 5e-11 off) is checked within 1e-9.
Where no rounding happens (k1 = rho, small binary fractions) the check is exact. The Monte-Carlo tests are kind 4
(their docstrings); the k3 grid has its own derived bound.
"""

import math

import pytest
import torch

from prefzoo.objective import (
    ESTIMATORS,
    ObjectiveError,
    categorical_kl,
    kl_estimate,
    kl_loss,
    kl_penalty_rewards,
)
from tests.bounds import U32, U64

N_OUTCOMES = 6


def _pair(seed, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    p_logits = spread * torch.randn(N_OUTCOMES, generator=g, dtype=torch.float64)
    q_logits = spread * torch.randn(N_OUTCOMES, generator=g, dtype=torch.float64)
    return p_logits, q_logits


def _kl_closed_form(p_logits, q_logits):
    """KL(p||q) = sum p (log p - log q), written out independently of categorical_kl."""
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def _mc_rhos(p_logits, q_logits, n=200_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    y = torch.multinomial(lp.exp(), n, replacement=True, generator=g)
    return lp[y] - lq[y]


def test_categorical_kl_hand_value():
    """p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3) = 0.1438410362."""
    p = torch.log(torch.tensor([0.5, 0.5], dtype=torch.float64))
    q = torch.log(torch.tensor([0.25, 0.75], dtype=torch.float64))
    assert abs(float(categorical_kl(p, q)) - 0.5 * math.log(4 / 3)) < 1e-12
    assert float(categorical_kl(p, p)) == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_unbiased_estimators_mean_equals_exact_kl(seed, estimator):
    """k1 and k3 are unbiased for KL(p||q) on samples from p: the Monte-Carlo mean over 200k
    samples lies within 4 standard errors of the exact value. Kind 4: the seeds are fixed; a correct estimator fails
    4 s.e. for 6e-5 of seeds (normal approximation, n = 200,000 bounded draws). Measured -1.8 to 0.4 s.e. (float64)."""
    p_logits, q_logits = _pair(seed)
    exact = float(_kl_closed_form(p_logits, q_logits))
    k = kl_estimate(_mc_rhos(p_logits, q_logits, seed=seed), estimator)
    se = float(k.std()) / math.sqrt(k.numel())
    assert abs(float(k.mean()) - exact) < 4 * se, (float(k.mean()), exact, se)


def test_k2_is_biased_when_distributions_are_far_apart():
    """On a far-apart pair E_p[rho^2/2] != KL(p||q): the MC mean of k2 is > 6 standard errors
    away from the exact KL (while k3 on the same samples is within 4). Kind 4, seed fixed: the exact bias,
    E_p[k2] - KL = 2.64, is 246 s.e. (0.011), so the first claim fails only if the mean is 240 s.e. off its own
    expectation (measured 0.3); k3 is 0.6 s.e. off."""
    p_logits, q_logits = _pair(3, spread=3.0)
    exact = float(_kl_closed_form(p_logits, q_logits))
    rho = _mc_rhos(p_logits, q_logits, seed=3)
    k2 = kl_estimate(rho, "k2")
    se2 = float(k2.std()) / math.sqrt(k2.numel())
    assert abs(float(k2.mean()) - exact) > 6 * se2
    k3 = kl_estimate(rho, "k3")
    se3 = float(k3.std()) / math.sqrt(k3.numel())
    assert abs(float(k3.mean()) - exact) < 4 * se3


def test_estimator_formulas_on_hand_values():
    """rho = ln 2: k1 = 0.6931471806, k2 = (ln 2)^2 / 2 = 0.2402265070,
    k3 = 1/2 - 1 + ln 2 = 0.1931471806. rho = -ln 2: k3 = 2 - 1 - ln 2 = 0.3068528194."""
    rho = torch.tensor([math.log(2.0), -math.log(2.0)], dtype=torch.float64)
    assert torch.equal(kl_estimate(rho, "k1"), rho)
    assert abs(float(kl_estimate(rho, "k2")[0]) - 0.2402265070) < 1e-9
    torch.testing.assert_close(kl_estimate(rho, "k3"),
                               torch.tensor([0.1931471806, 0.3068528194], dtype=torch.float64), rtol=0, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_k3_nonnegative_accurate_and_finite_on_a_grid(dtype):
    """The relative error of k3 against a float64 reference (exact to ~1e-15 relative), bound derived (kind 1):
    * float32, outside the series (|r| >= 0.1): expm1(-r) + r cancels; expm1 is within 1 ulp (2 u32) of |expm1(-r)| <=
      C k3, C = expm1(0.1) / k3(-0.1) = 20.3 at the switch (less further out), and the sum rounds once (u32): (2 C + 1)
      u32 = 2.5e-6. The series (|r| < 0.1, ~16 roundings) stays within that. It was 1e-5.
    * float64: the series' truncation, its first omitted term r^9/9! over k3 >= r^2/2 (1 - |r|/3), is <= 2 (0.1)^7 / 9!
      x 1.012 / (1 - 0.1/3) = 5.8e-13 at |r| -> 0.1; plus (2 C + 31) u64 of rounding (the code's and the reference's).
      It was 1e-10, which a series one term shorter (error 5e-11) would have passed.
    Measured (2026-12-06, 1 and 2 threads): 8.8e-7 (14.7 u32, at r = -0.12) and 5.5e-13 (the truncation, r = 0.0996)."""
    tiny = torch.tensor([0.0, 1e-12, -1e-12, 1e-8, -1e-8, 1e-6, -1e-6, 9.99e-4, 1.001e-3,
                         -1e-3, 1e-2, -1e-2])
    grid = torch.cat([torch.linspace(-30.0, 30.0, 100_001), tiny]).to(dtype)
    k3 = kl_estimate(grid, "k3")
    assert torch.isfinite(k3).all()
    assert (k3 >= 0).all()
    # accuracy against a float64 reference: exp(-r) - 1 + r where that is itself accurate
    # (|r| >= 1), else 25 terms of sum_{n>=2} (-r)^n / n!; inside the non-saturated |r| <= 20
    r = grid.double()
    inside = r.abs() <= 20
    series = sum((-r) ** n / float(math.factorial(n)) for n in range(2, 27))
    reference = torch.where(r.abs() >= 1, torch.exp(-r) - 1 + r, series)
    rel = ((k3.double() - reference).abs() / reference.clamp(min=1e-300))[inside & (r != 0)]
    c = math.expm1(0.1) / (math.expm1(0.1) - 0.1)
    if dtype == torch.float32:
        bound = (2 * c + 1) * U32
    else:
        bound = 2 * 0.1 ** 7 / math.factorial(9) * 1.012 / (1 - 0.1 / 3) + (2 * c + 31) * U64
    assert float(rel.max()) < bound, (float(rel.max()), bound)


def test_k3_saturates_without_overflow_and_without_wrong_sign_gradient():
    rho = torch.tensor([-100.0, -25.0, 25.0, 100.0], requires_grad=True)
    k3 = kl_estimate(rho, "k3")
    assert torch.isfinite(k3).all()
    k3.sum().backward()
    assert (rho.grad == 0).all()  # saturated: no gradient, never one pointing the wrong way


# ---------------------------------------------------------------------------------------------
# Expected gradients, computed EXACTLY by summing over the finite outcomes of a softmax policy.


def _policy(seed):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(N_OUTCOMES, generator=g, dtype=torch.float64)
    ref_logits = torch.randn(N_OUTCOMES, generator=g, dtype=torch.float64)
    return theta, ref_logits


def _grad(fn, theta):
    theta = theta.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(theta), theta)
    return g


def reverse_kl_grad(theta, ref_logits):
    """d/dtheta KL(pi_theta || pi_ref), autograd on the closed form."""
    return _grad(lambda th: _kl_closed_form(th, ref_logits), theta)


def forward_kl_grad(theta, ref_logits):
    """d/dtheta KL(pi_ref || pi_theta), autograd on the closed form."""
    return _grad(lambda th: _kl_closed_form(ref_logits, th), theta)


def expected_k_grad(theta, ref_logits, estimator):
    """d/dtheta E_{y~pi_theta}[k(rho_theta(y))] (sampling distribution AND integrand vary)."""
    def f(th):
        lp, lq = torch.log_softmax(th, -1), torch.log_softmax(ref_logits, -1)
        return (lp.exp() * kl_estimate(lp - lq, estimator)).sum()
    return _grad(f, theta)


def in_reward_grad(theta, ref_logits, estimator):
    """Gradient of the penalty used "in reward": the REINFORCE gradient with the penalty as a
    detached reward. The objective term is E_pi[-beta k], its score-function gradient is
    E_pi[(-beta k).detach() grad log pi]; the loss is its negative. With beta = 1 we return the
    expected LOSS gradient sum_y pi(y) k(rho_y) grad log pi(y), built from kl_penalty_rewards."""
    def loss(th):
        logps = torch.log_softmax(th, -1)[None, :]  # B = 1, T = outcomes (one "token" each)
        ref = torch.log_softmax(ref_logits, -1)[None, :]
        mask = torch.ones_like(logps, dtype=torch.bool)
        rewards = kl_penalty_rewards(logps, ref, mask, beta=1.0, estimator=estimator)
        assert not rewards.requires_grad
        weights = logps.exp().detach()  # the exact expectation over y ~ pi
        return -(weights * rewards * logps).sum()
    return _grad(loss, theta)


def as_loss_grad(theta, ref_logits, estimator):
    """Gradient of the penalty used "as loss": E_pi[grad_theta k(rho_theta(y))] with the
    sampled y fixed, i.e. sum_y pi(y).detach() * grad k, built from kl_loss."""
    def loss(th):
        logps = torch.log_softmax(th, -1)[None, :]
        ref = torch.log_softmax(ref_logits, -1)[None, :]
        mask = torch.ones_like(logps, dtype=torch.bool)
        per_sample = kl_loss(logps, ref, mask, estimator=estimator)
        return (logps.exp().detach() * per_sample).sum()
    return _grad(loss, theta)


SEEDS = [0, 1, 2, 3]


@pytest.mark.parametrize("seed", SEEDS)
def test_k1_in_reward_is_the_exact_reverse_kl_gradient(seed):
    theta, ref = _policy(seed)
    torch.testing.assert_close(in_reward_grad(theta, ref, "k1"), reverse_kl_grad(theta, ref),
                               atol=1e-10, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_k2_as_loss_is_the_exact_reverse_kl_gradient_on_policy(seed):
    theta, ref = _policy(seed)
    torch.testing.assert_close(as_loss_grad(theta, ref, "k2"), reverse_kl_grad(theta, ref),
                               atol=1e-10, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_k3_as_loss_is_the_forward_kl_gradient_not_the_reverse(seed):
    """E_pi[grad k3] = E_pi[(1 - pi_ref/pi) grad log pi] = sum_y (pi - pi_ref) grad log pi
    = -sum_y pi_ref grad log pi = grad KL(pi_ref || pi): the FORWARD KL."""
    theta, ref = _policy(seed)
    g = as_loss_grad(theta, ref, "k3")
    torch.testing.assert_close(g, forward_kl_grad(theta, ref), atol=1e-10, rtol=0)
    assert float((g - reverse_kl_grad(theta, ref)).norm()) > 1e-2


@pytest.mark.parametrize("seed", SEEDS)
def test_k1_as_loss_has_zero_expected_gradient(seed):
    theta, ref = _policy(seed)
    g = as_loss_grad(theta, ref, "k1")
    assert float(g.abs().max()) < 1e-12
    assert float(reverse_kl_grad(theta, ref).abs().max()) > 1e-2  # there was something to find


@pytest.mark.parametrize("seed", SEEDS)
def test_remaining_placements_and_the_sum_identity(seed):
    """For every k: in_reward + as_loss = grad E_pi[k] (product rule). Hence
    k3 in reward = grad KL_rev - grad KL_fwd and k2 in reward = grad E[k2] - grad KL_rev."""
    theta, ref = _policy(seed)
    for est in ESTIMATORS:
        torch.testing.assert_close(in_reward_grad(theta, ref, est) + as_loss_grad(theta, ref, est),
                                   expected_k_grad(theta, ref, est), atol=1e-10, rtol=0)
    torch.testing.assert_close(in_reward_grad(theta, ref, "k3"),
                               reverse_kl_grad(theta, ref) - forward_kl_grad(theta, ref),
                               atol=1e-10, rtol=0)
    torch.testing.assert_close(in_reward_grad(theta, ref, "k2"),
                               expected_k_grad(theta, ref, "k2") - reverse_kl_grad(theta, ref),
                               atol=1e-10, rtol=0)


def test_k3_as_loss_is_a_first_order_approximation_near_the_reference():
    """With pi_theta = softmax(ref_logits + t d): the reverse and forward KL gradients are both
    O(t) and differ by O(t^2), so the relative error of k3-as-loss shrinks linearly in t."""
    _, ref = _policy(5)
    d = torch.randn(N_OUTCOMES, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    rel = []
    for t in (1e-1, 1e-2, 1e-3):
        theta = ref + t * d
        g_rev = reverse_kl_grad(theta, ref)
        rel.append(float((as_loss_grad(theta, ref, "k3") - g_rev).norm() / g_rev.norm()))
    assert rel[1] < rel[0] / 5 and rel[2] < rel[1] / 5
    assert rel[2] < 1e-2


def test_kl_penalty_rewards_masks_detaches_and_scales():
    """Exact in float32: rho = 0.5 and -1 (differences of binary fractions) and -beta rho scales float32's 0.1 by a
    power of two, as the expected values -0.05 and 0.1 are rounded."""
    logps = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    mask = torch.tensor([[True, True, False]])
    out = kl_penalty_rewards(logps, ref, mask, beta=0.1)
    # k1: rho = (0.5, -1.0, 0) -> -0.1 * rho = (-0.05, 0.1), then 0 (masked)
    assert torch.equal(out, torch.tensor([[-0.05, 0.1, 0.0]]))
    assert not out.requires_grad


def test_kl_loss_gradient_flows_through_logps_only_and_masks():
    logps = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    out = kl_loss(logps, ref, mask, estimator="k2")
    # k2 = rho^2/2 with rho = (0.5, -1): (0.125, 0.5); masked -> 0; d/dlogps = rho = (0.5, -1, 0); exact (powers of 2)
    assert torch.equal(out, torch.tensor([[0.125, 0.5, 0.0]]))
    out.sum().backward()
    assert torch.equal(logps.grad, torch.tensor([[0.5, -1.0, 0.0]]))
    assert ref.grad is None


def test_kl_errors():
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ObjectiveError, match="'k1', 'k2', 'k3'"):
        kl_estimate(x, "k4")
    with pytest.raises(ObjectiveError, match="beta"):
        kl_penalty_rewards(x, x, m, beta=-0.1)
    with pytest.raises(ObjectiveError, match=r"\(2, 3\).*\(2, 4\)"):
        kl_loss(x, torch.zeros(2, 4), m)
    assert issubclass(ObjectiveError, ValueError)


def _exact_variance(probs, ref_probs, estimator):
    """Var_{y~pi}[k(y)] exactly, summing over every response of a categorical pi."""
    values = kl_estimate(probs.log() - ref_probs.log(), estimator)
    mean = (probs * values).sum()
    return float((probs * (values - mean) ** 2).sum())


def test_k3_has_less_variance_than_k1_near_the_reference_but_not_far_from_it():
    """Note 004 (estimators): k3 is k1 plus a control variate, "with less variance". Exactly, by hand, on two responses.

    Near: pi = (1/2, 1/2), pi_ref = (0.6, 0.4). rho = ln(5/6) = -0.1823216, ln(5/4) = 0.2231436.
    k1 = rho: mean 0.0204110 (the KL), variance ((0.2231436 + 0.1823216)/2)^2 = 0.0411005.
    k3 = e^-rho - 1 + rho: 1.2 - 1 - 0.1823216 = 0.0176784 and 0.8 - 1 + 0.2231436 = 0.0231436, the same mean,
    variance ((0.02314355 - 0.01767844)/2)^2 = 7.4669e-6 (7.4671e-6 from the 7-decimal values: too few digits for a
    difference): about 5,500 times less.
    Far: pi = (0.9, 0.1), pi_ref = (0.1, 0.9). rho = +-ln 9 = +-2.1972246. k1: variance 0.9 * 0.1 * (2 ln 9)^2 = 1.7380.
    k3: 1/9 - 1 + ln 9 = 1.3083357 and 9 - 1 - ln 9 = 5.8027754, variance 0.09 * (5.8027754 - 1.3083357)^2 = 1.8180:
    more than k1's. The control variate e^-rho - 1 has mean 0, and its coefficient 1 is near the variance-minimising
    one only while rho is small (Schulman 2020). Each check is within a unit of the quoted value's last digit (the
    quote is at most half a unit off; the float64 rounding is ~1e-16)."""
    d = torch.float64
    near, near_ref = torch.tensor([0.5, 0.5], dtype=d), torch.tensor([0.6, 0.4], dtype=d)
    assert abs(_exact_variance(near, near_ref, "k1") - 0.0411005) < 1e-7
    assert abs(_exact_variance(near, near_ref, "k3") - 7.4669e-6) < 1e-10
    far, far_ref = torch.tensor([0.9, 0.1], dtype=d), torch.tensor([0.1, 0.9], dtype=d)
    assert abs(_exact_variance(far, far_ref, "k1") - 1.7380) < 1e-4
    assert abs(_exact_variance(far, far_ref, "k3") - 1.8180) < 1e-4

"""Tests for prefzoo.objective.optimum: the closed-form optimum of the KL-regularised objective.

Tolerances (tests/bounds.py, kind 1). Everything is float64 but one test of float32 inputs: a value here is a sum of
<= 5 terms of size <= 15 (r / beta) and a few exps and logs, rounding ~1e-15 at most (measured 1e-16 to 7e-16), and
the bisection of beta_for_kl_budget meets a budget to ~1e-16. Identities are checked within 1e-12 (1000 times the
worst rounding); inequalities against the optimum get the same 1e-12 of slack; assert_close's float64 defaults
(1e-7) where kept are far above the rounding and far below what a wrong beta or a missing normalisation moves (1e-2).
The limits of beta, the convergence of gradient ascent and the finite differences have their own bounds, derived
in their docstrings.
"""

import math

import pytest
import torch

from prefzoo.objective import (
    ObjectiveError,
    beta_for_kl_budget,
    log_partition,
    optimal_policy,
    optimal_value,
    regularised_objective,
)
from tests.bounds import U32


def _problem(seed, n=5):
    g = torch.Generator().manual_seed(seed)
    ref = torch.softmax(torch.randn(n, generator=g, dtype=torch.float64), -1)
    rewards = torch.randn(n, generator=g, dtype=torch.float64)
    return ref, rewards


def test_hand_example():
    """pi_ref = (1/2, 1/2), r = (0, ln 3), beta = 1: Z = 1/2 * 1 + 1/2 * 3 = 2, so
    pi* = (1/4, 3/4), log Z = ln 2, J* = ln 2 = 0.6931471806. Check J directly:
    E[r] = 3/4 ln 3 = 0.8239592165; KL = 1/4 ln(1/2) + 3/4 ln(3/2) = 0.1308120359;
    J = 0.8239592165 - 0.1308120359 = 0.6931471806.
    Within 1e-12 of ln 2 (module docstring): about ten float64 roundings of numbers <= 1.1 can reach 1.2e-15, so the
    1e-15 of the first version sat inside the rounding (it held on this libm: measured 1.1e-16)."""
    ref = torch.tensor([0.5, 0.5], dtype=torch.float64)
    r = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64)
    torch.testing.assert_close(optimal_policy(ref, r, 1.0),
                               torch.tensor([0.25, 0.75], dtype=torch.float64))
    assert abs(float(log_partition(ref, r, 1.0)) - math.log(2)) < 1e-12
    assert abs(float(optimal_value(ref, r, 1.0)) - math.log(2)) < 1e-12
    pi = torch.tensor([0.25, 0.75], dtype=torch.float64)
    assert abs(float(regularised_objective(pi, ref, r, 1.0)) - math.log(2)) < 1e-12


@pytest.mark.parametrize("beta", [0.1, 0.7, 5.0])
def test_value_of_optimum_is_beta_log_z(beta):
    """J(pi*) = beta log Z, within 1e-12 (module docstring; measured 7e-16; was 1e-9)."""
    ref, r = _problem(0)
    pi = optimal_policy(ref, r, beta)
    assert abs(float(regularised_objective(pi, ref, r, beta) - optimal_value(ref, r, beta))) < 1e-12
    assert abs(float(pi.sum()) - 1) < 1e-12


def test_optimum_beats_random_policies():
    ref, r = _problem(1)
    beta = 0.5
    best = float(optimal_value(ref, r, beta))
    g = torch.Generator().manual_seed(2)
    gamma = torch._standard_gamma(torch.full((2000, 5), 0.7, dtype=torch.float64), generator=g)
    points = gamma / gamma.sum(-1, keepdim=True)
    values = regularised_objective(points, ref.expand_as(points), r.expand_as(points), beta)
    assert float(values.max()) <= best + 1e-12
    assert float(regularised_objective(ref, ref, r, beta)) < best  # pi_ref itself is worse


def test_gradient_ascent_on_a_softmax_policy_converges_to_pi_star():
    """Maximise J(softmax(theta)) by plain gradient ascent from theta = 0; it must reach pi*
    (total variation < 1e-9) and never exceed J*. Not a rounding bound: the ascent converges linearly, TV 4.9e-5,
    5.5e-11 and 1.3e-16 (the float64 floor) after 250, 1000 and 2000 of its 3000 steps (measured 2026-12-06); the
    old 1e-4 was met at step ~250 and let a pi* off by anything below 1e-4 pass."""
    ref, r = _problem(3)
    beta = 0.8
    theta = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    for _ in range(3000):
        j = regularised_objective(torch.softmax(theta, -1), ref, r, beta)
        (grad,) = torch.autograd.grad(j, theta)
        with torch.no_grad():
            theta += 2.0 * grad
    pi = torch.softmax(theta.detach(), -1)
    star = optimal_policy(ref, r, beta)
    assert 0.5 * float((pi - star).abs().sum()) < 1e-9
    best = float(optimal_value(ref, r, beta))
    assert float(regularised_objective(pi, ref, r, beta)) <= best + 1e-12


def test_limits_of_beta():
    """beta -> infinity: pi*_i / pi_ref_i = e^(r_i / beta) / Z with Z between e^(min r / beta) and e^(max r / beta), so
    |pi*_i - pi_ref_i| <= pi_ref_i (e^(span / beta) - 1), span = max r - min r = 2.3: an inequality, not a rounding
    bound (to first order the gap is pi_ref_i |r_i - E r| / beta; the closest element sits at 0.9 of the bound), plus
    1e-15 of rounding. At most 1.3e-6; measured 1.6e-7 (the old round atol was 1e-5). beta -> 0: pi* on the argmax
    to within 1e-6 (the next reward is 0.048 lower: the rest has e^(-48) of the mass)."""
    ref, r = _problem(4)
    # beta -> infinity: the penalty dominates, pi* -> pi_ref
    span = float(r.max() - r.min())
    gap = (optimal_policy(ref, r, 1e6) - ref).abs()
    assert bool((gap <= ref * math.expm1(span / 1e6) + 1e-15).all()), float(gap.max())
    # beta -> 0: pi* concentrates on the argmax of the reward; large r/beta stays finite
    pi = optimal_policy(ref, r, 1e-3)
    assert float(pi[r.argmax()]) > 1 - 1e-6
    assert torch.isfinite(optimal_policy(ref, 1000 * r, 1e-4)).all()
    assert torch.isfinite(log_partition(ref, 1000 * r, 1e-4))


@pytest.mark.numerics
def test_batched_prompts_and_zero_reference_mass():
    """A batched row equals the same row alone within 1e-12 (its sums may run in another order; module docstring;
    measured: bitwise equal)."""
    ref, r = _problem(5)
    ref2, r2 = _problem(6)
    both = optimal_policy(torch.stack([ref, ref2]), torch.stack([r, r2]), 0.3)
    torch.testing.assert_close(both[0], optimal_policy(ref, r, 0.3), rtol=0, atol=1e-12)
    ref0 = torch.tensor([0.0, 0.4, 0.6], dtype=torch.float64)
    pi = optimal_policy(ref0, torch.tensor([50.0, 0.0, 1.0], dtype=torch.float64), 0.1)
    assert float(pi[0]) == 0.0  # no mass where pi_ref has none, whatever the reward


def test_errors():
    ref, r = _problem(7)
    with pytest.raises(ObjectiveError, match="argmax"):
        optimal_policy(ref, r, 0.0)
    with pytest.raises(ObjectiveError, match="beta"):
        optimal_value(ref, r, -1.0)
    with pytest.raises(ObjectiveError, match=r"\(5,\).*\(4,\)"):
        optimal_policy(ref, r[:4], 1.0)
    with pytest.raises(ObjectiveError, match="sum to 1"):
        log_partition(2 * ref, r, 1.0)


# --- the Lagrangian view (note 000 sec. 4.3, exercise e): beta is the multiplier of a KL budget ---------------------

def test_lagrangian_hand_example():
    """max_pi E_pi[r] subject to KL(pi || pi_ref) <= eps, solved by hand on two responses.

    pi_ref = (1/2, 1/2), r = (0, 1), pi = (1 - p, p). E[r] = p grows with p, and
    KL(p) = (1 - p) ln(2(1 - p)) + p ln(2p) grows with p on p > 1/2, so the constrained maximiser is the p with
    KL(p) = eps. Take eps = KL(3/4) = 1/4 ln(1/2) + 3/4 ln(3/2) = 0.1308120359. The Gibbs policy
    pi* = pi_ref exp(r/beta)/Z has p/(1 - p) = exp(1/beta), so p = 3/4 needs exp(1/beta) = 3:
    beta = 1/ln 3 = 0.9102392266. The multiplier is also the price of the budget: V(eps) = p(eps), and
    dV/deps = (dKL/dp)^-1 = 1/ln(p/(1 - p)) = 1/ln 3 at p = 3/4, the same number.
    The 10-decimal eps within one unit of its last digit (1e-10); beta against 1/ln 3 within 1e-12: the bisection's
    KL is good to ~1e-16 and dKL/dbeta = -0.25 here, so beta to ~1e-15 (measured 2.2e-16; was 1e-9 against 10
    printed decimals)."""
    ref = torch.tensor([0.5, 0.5], dtype=torch.float64)
    r = torch.tensor([0.0, 1.0], dtype=torch.float64)
    eps = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert abs(eps - 0.1308120359) < 1e-10
    beta = float(beta_for_kl_budget(ref, r, eps))
    assert abs(beta - 1 / math.log(3)) < 1e-12
    torch.testing.assert_close(optimal_policy(ref, r, beta), torch.tensor([0.25, 0.75], dtype=torch.float64))


def _kl(p, q):
    return float((p * (p / q).log()).sum())


@pytest.mark.parametrize("seed", [3, 4])
def test_the_budgeted_optimum_beats_every_feasible_policy(seed):
    """The constrained problem max E r s.t. KL <= eps, checked without the Lagrangian: 20,000 random policies on the
    simplex (Dirichlet, and mixtures of them with pi_ref so that many lie inside a small budget). None of those with
    KL <= eps has more expected reward than pi*_beta at beta = beta_for_kl_budget(eps), and pi*_beta spends exactly
    eps (the constraint is active): within 1e-12 (module docstring; measured 3.3e-16; was 1e-9)."""
    ref, r = _problem(seed)
    eps = 0.3
    beta = float(beta_for_kl_budget(ref, r, eps))
    star = optimal_policy(ref, r, beta)
    assert abs(_kl(star, ref) - eps) < 1e-12
    g = torch.Generator().manual_seed(seed + 10)
    gamma = torch._standard_gamma(torch.full((20000, 5), 0.5, dtype=torch.float64), generator=g)
    dirichlet = gamma / gamma.sum(-1, keepdim=True)
    weight = torch.rand(20000, 1, generator=g, dtype=torch.float64)
    points = weight * dirichlet + (1 - weight) * ref
    kls = (points * (points / ref).log()).sum(-1)
    feasible = points[kls <= eps]
    assert len(feasible) > 1000  # the check has teeth: many policies inside the budget
    best_random = float((feasible * r).sum(-1).max())
    assert best_random < float((star * r).sum())


def test_beta_is_the_price_of_a_nat():
    """The envelope theorem: with V(eps) = E_{pi*_beta(eps)}[r] the best reward inside a budget eps, dV/deps = beta(eps).
    Central finite differences (h = 1e-4) on a random 5-response problem, at three budgets. The error is the
    difference's truncation h^2/6 |V^(3)| (V^(3) = beta''(eps) = 1.1e3, 12 and 1.0 at the three budgets, from a 5-point
    stencil at h = 1e-2: 1.9e-6, 2.0e-8, 1.7e-9; measured 1.7e-6, 2.0e-8, 1.7e-9) plus the rounding of V (float64,
    ~1e-15, / h: 1e-11). The bound 1e-5 max(1, beta) is 3.4e-5, 1.3e-5, 1e-5: 18 times the largest."""
    ref, r = _problem(5)
    for eps in (0.05, 0.3, 0.8):
        def value(e):
            return float((optimal_policy(ref, r, float(beta_for_kl_budget(ref, r, e))) * r).sum())
        h = 1e-4
        slope = (value(eps + h) - value(eps - h)) / (2 * h)
        beta = float(beta_for_kl_budget(ref, r, eps))
        assert abs(slope - beta) < 1e-5 * max(1.0, beta)


@pytest.mark.numerics
def test_a_budget_that_does_not_bind_has_multiplier_zero():
    """The most KL any policy can spend while maximising r is -ln pi_ref(argmax r) (all mass on the best response).
    With pi_ref = (1/2, 1/4, 1/4) and r = (0, 0, 1) that is ln 4 = 1.386: a budget of 2 nats does not bind, so its
    multiplier is 0 (beta = 0: maximise the reward). Batched rows are independent: the relabelled row sums its terms
    in another order, within 1e-12 (module docstring; measured: equal)."""
    ref = torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.25, 0.25]], dtype=torch.float64)
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    assert beta_for_kl_budget(ref, r, 2.0).tolist() == [0.0, 0.0]
    b = beta_for_kl_budget(ref, r, 0.1)
    assert b[0] > 0 and abs(float(b[0]) - float(b[1])) < 1e-12  # the same problem, arms relabelled


def test_lagrangian_errors():
    ref = torch.tensor([0.5, 0.5], dtype=torch.float64)
    r = torch.tensor([0.0, 1.0], dtype=torch.float64)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ObjectiveError, match="kl_budget"):
            beta_for_kl_budget(ref, r, bad)


def _exact_kl_of_optimum(ref, r, beta):
    """KL(pi*_beta || pi_ref) in float64 against the normalised reference, computed independently of the bisection."""
    ref = ref.double() / ref.double().sum(-1, keepdim=True)
    pi = optimal_policy(ref, r.double(), float(beta))
    return float(torch.where(pi > 0, pi * (pi / ref).log(), torch.zeros_like(pi)).sum())


def test_small_budgets_on_a_float32_softmax_reference():
    """A float32 softmax sums to 1 only to ~1e-8. Measured against the unnormalised vector, every KL would be at least
    -log(sum) ~ 2e-8, so a budget of 1e-10 gave beta ~ 1e31 (review of this function). The budget is met to 1e-6
    relative against the normalised reference, and a tiny budget keeps its precision (1e-14: the tilt's small-t form;
    before it, 1e-14 was met to 2e-3). The returned beta is float32: rounded to u32 relative, it moves the KL by
    |d ln KL / d ln beta| u32, 1.55 u32 at 0.3 (measured) and 2 u32 as t -> 0 (KL ~ t^2): within 2 u32 = 1.2e-7
    relative (measured 5e-9 at 0.3; the old 1e-6 was 8x the bound)."""
    g = torch.Generator().manual_seed(0)
    ref = torch.softmax(torch.randn(50, generator=g), -1)
    r = torch.randn(50, generator=g)
    assert abs(_exact_kl_of_optimum(ref, r, float(beta_for_kl_budget(ref, r, 0.3))) - 0.3) <= 2 * U32 * 0.3
    # small budgets: the direct sum of pi log(pi / pi_ref) is not precise enough at 1e-10, so KL = t^2 k2 / 2 +
    # t^3 k3 / 3 + t^4 k4c / 8 + ... (the cumulant expansion, KL = t K'(t) - K(t), t = 1/beta) with k2, k3 the central
    # moments of r under the normalised pi_ref and k4c = m4 - 3 k2^2 its fourth cumulant. The check drops the t^4
    # term: k4c t^2 / (4 k2) relative (2e-11 and 2e-8 at the two budgets), doubled for the terms after it; the float32
    # beta adds 2 u32 (above). Measured 3.8e-8 and 6.8e-8, bounds 1.2e-7 and 1.6e-7 (was a round 1e-6).
    p = ref.double() / ref.double().sum()
    c = r.double() - (p * r.double()).sum()
    k2, k3 = float((p * c ** 2).sum()), float((p * c ** 3).sum())
    k4c = float((p * c ** 4).sum()) - 3 * k2 * k2
    for eps in (1e-10, 1e-7):
        t = 1.0 / float(beta_for_kl_budget(ref, r, eps))
        bound = 2 * U32 + 2 * abs(k4c) * t * t / (4 * k2)
        assert abs((t * t * k2 / 2 + t ** 3 * k3 / 3) / eps - 1) <= bound
    # eps = 1e-14 is below what a direct sum of pi log(pi / pi_ref) resolves (~1e-16 per term), so the check is the
    # cumulant expansion of the tilt: KL(pi_t) = t K'(t) - K(t) = t^2 k2 / 2 + t^3 k3 / 3 + ... with t = 1/beta and
    # k2, k3 the variance and third central moment of r under pi_ref. pi_ref = (0.2, 0.3, 0.5), r = (1, 0, -1):
    # mean -0.3, k2 = 0.7 - 0.09 = 0.61, k3 = 0.2 * 1.3^3 + 0.3 * 0.3^3 - 0.5 * 0.7^3 = 0.276. So
    # beta0 = 1 / sqrt(2 eps / k2) = 5522680.5086, and the t^3 term raises it by a relative t0 k3 / (3 k2) = 2.73e-8:
    # beta = 5522680.6594, to O(t0^2) = 3e-14. The function meets this budget to ~2.5e-9 relative in the KL (its
    # small-t form takes the difference of two terms of t |E r| = 5.4e-8 each, 5e6 times the KL, each good to a few
    # u64), 1.25e-9 in beta (measured against the root found with mpmath); 1e-8 allows 8x that. (The first version
    # compared with beta0 within 1e-7: 3.7 times the 2.7e-8 it left out.)
    ref64 = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    r64 = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
    beta = float(beta_for_kl_budget(ref64, r64, 1e-14))
    assert abs(beta / 5522680.6594 - 1) < 1e-8


def test_non_finite_rewards_where_pi_ref_has_mass_are_refused():
    """NaN or +-inf on a response pi_ref covers returned 2.5e30 (the bisection's floor) or inf, silently. They are
    refused; on a response pi_ref gives no mass they do not matter."""
    ref = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ObjectiveError, match="rewards.*finite"):
            beta_for_kl_budget(ref, torch.tensor([bad, 0.0, 1.0], dtype=torch.float64), 0.3)
    masked = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)
    beta = float(beta_for_kl_budget(masked, torch.tensor([float("nan"), 0.0, 1.0], dtype=torch.float64), 0.1))
    assert abs(_exact_kl_of_optimum(masked, torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64), beta) - 0.1) < 1e-12
    with pytest.raises(ObjectiveError, match="kl_budget"):
        beta_for_kl_budget(ref, torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64), 10 ** 400)


@pytest.mark.numerics
def test_a_response_without_reference_mass_does_not_change_the_multiplier():
    """pi_ref = (0, 1/2, 1/2) is the two-response problem (1/2, 1/2) with an extra response pi* can never reach, whatever
    its reward; all rewards negative, so the shift by the best one makes the unreachable reward positive (5), which
    must not enter the tilt. Same beta as the two-response problem, at two budgets below its ln 2 ceiling (sums of 3
    and of 2 terms: within 1e-12, module docstring; measured equal)."""
    d = torch.float64
    for eps in (0.6, 0.69):
        three = beta_for_kl_budget(torch.tensor([0.0, 0.5, 0.5], dtype=d), torch.tensor([0.0, -5.0, -6.0], dtype=d), eps)
        two = beta_for_kl_budget(torch.tensor([0.5, 0.5], dtype=d), torch.tensor([-5.0, -6.0], dtype=d), eps)
        assert abs(float(three) - float(two)) < 1e-12 and float(two) > 0

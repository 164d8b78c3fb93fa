"""Tests for prefzoo.objective.divergences: generators, links, exact D_f, implicit rewards and
the regularised optimum (checked by brute force)."""

import math

import pytest
import torch

from prefzoo.objective import (
    DIVERGENCES,
    ObjectiveError,
    f_divergence,
    get_divergence,
    implicit_reward,
    regularised_optimum,
)

CASES = [("reverse_kl", 0.5), ("forward_kl", 0.5), ("js", 0.5), ("alpha", 0.3), ("alpha", 0.5),
         ("alpha", 0.8)]
IDS = [f"{n}-{a}" if n == "alpha" else n for n, a in CASES]
U = torch.tensor([0.05, 0.3, 0.9, 1.0, 1.7, 4.0, 25.0], dtype=torch.float64)


@pytest.mark.parametrize("name,alpha", CASES, ids=IDS)
def test_generator_vanishes_at_one_and_is_convex(name, alpha):
    div = get_divergence(name, alpha)
    assert abs(float(div.f(torch.tensor(1.0, dtype=torch.float64)))) < 1e-15
    # convexity via second differences on a grid
    u = torch.linspace(0.05, 10, 400, dtype=torch.float64)
    fu = div.f(u)
    assert (fu[:-2] - 2 * fu[1:-1] + fu[2:] > 0).all()


@pytest.mark.parametrize("name,alpha", CASES, ids=IDS)
def test_f_prime_matches_finite_differences_of_f(name, alpha):
    div = get_divergence(name, alpha)
    h = 1e-6 * U
    fd = (div.f(U + h) - div.f(U - h)) / (2 * h)
    torch.testing.assert_close(div.f_prime(U), fd, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name,alpha", CASES, ids=IDS)
def test_link_from_log_and_inverse_are_consistent(name, alpha):
    div = get_divergence(name, alpha)
    torch.testing.assert_close(div.f_prime_from_log(torch.log(U)), div.f_prime(U), atol=1e-12,
                               rtol=1e-12)
    v = div.f_prime(U)
    assert div.is_valid_link(v).all()
    torch.testing.assert_close(div.f_prime_inverse(v), U, atol=0, rtol=1e-10)
    # the valid set is exactly the range of f': sup = v_max (approached as u -> inf)
    grid = torch.logspace(-12, 12, 49, dtype=torch.float64)
    links = div.f_prime(grid)
    assert (links < div.v_max).all() and (links[1:] > links[:-1]).all()
    assert float(links[-1]) > (div.v_max - 1e-3 if math.isfinite(div.v_max) else 25.0)
    # stable from extreme log-ratios
    extreme = div.f_prime_from_log(torch.tensor([-60.0, 60.0], dtype=torch.float64))
    assert not torch.isnan(extreme).any()


def test_alpha_link_interpolates_between_reverse_and_forward_kl():
    """f'_alpha(u) = (1 - u^-a)/a -> log u as a -> 0 and -> 1 - 1/u as a -> 1 (the KL links up
    to additive constants, which cancel in f-DPO)."""
    torch.testing.assert_close(get_divergence("alpha", 1e-6).f_prime(U), torch.log(U),
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(get_divergence("alpha", 1 - 1e-6).f_prime(U), 1 - 1 / U,
                               atol=1e-4, rtol=0)


P = torch.tensor([0.5, 0.5], dtype=torch.float64)
Q = torch.tensor([0.25, 0.75], dtype=torch.float64)


def test_f_divergence_hand_values():
    """p = (1/2, 1/2), q = (1/4, 3/4), D_f(p||q) = sum q f(p/q) with u = p/q = (2, 2/3):
    reverse KL = KL(p||q) = 1/2 ln(4/3)                                  = 0.1438410362
    forward KL = KL(q||p) = 1/4 ln(1/2) + 3/4 ln(3/2)                     = 0.1308120359
    js: with m = (p+q)/2 = (3/8, 5/8), sum q f(p/q) = KL(p||m) + KL(q||m)
        = [1/2 ln(4/3) + 1/2 ln(4/5)] + [1/4 ln(2/3) + 3/4 ln(6/5)]       = 0.0676441511
    alpha = 1/2: f(u) = 2 (sqrt(u) - 1)^2, so D = 2 sum (sqrt p - sqrt q)^2
        = 2 [(0.7071067812 - 0.5)^2 + (0.7071067812 - 0.8660254038)^2]   = 0.1362966948
    """
    expected = {
        "reverse_kl": 0.5 * math.log(4 / 3),
        "forward_kl": 0.25 * math.log(0.5) + 0.75 * math.log(1.5),
        "js": 0.5 * math.log(4 / 3) + 0.5 * math.log(0.8) + 0.25 * math.log(2 / 3)
        + 0.75 * math.log(1.2),
        "alpha": 2 * ((math.sqrt(0.5) - 0.5) ** 2 + (math.sqrt(0.5) - math.sqrt(0.75)) ** 2),
    }
    assert abs(expected["reverse_kl"] - 0.1438410362) < 1e-9
    assert abs(expected["forward_kl"] - 0.1308120359) < 1e-9
    assert abs(expected["js"] - 0.0676441511) < 1e-9
    assert abs(expected["alpha"] - 0.1362966948) < 1e-9
    for name, value in expected.items():
        assert abs(float(f_divergence(P, Q, get_divergence(name, 0.5))) - value) < 1e-12, name
    assert float(f_divergence(P, P, "js")) == 0.0


def test_implicit_reward_reverse_kl_is_dpo():
    """reverse KL: beta f'(e^lr) = beta lr + beta; the chosen-minus-rejected difference is
    beta (lr_c - lr_r) (the DPO logit). lr_c = (0.3, -1.2), lr_r = (-0.4, 0.5), beta = 0.1:
    differences 0.1 * (0.7, -1.7) = (0.07, -0.17)."""
    lr_c = torch.tensor([0.3, -1.2], dtype=torch.float64)
    lr_r = torch.tensor([-0.4, 0.5], dtype=torch.float64)
    rc = implicit_reward(lr_c, 0.1, "reverse_kl")
    rr = implicit_reward(lr_r, 0.1, get_divergence("reverse_kl"))
    torch.testing.assert_close(rc - rr, torch.tensor([0.07, -0.17], dtype=torch.float64))
    torch.testing.assert_close(rc, 0.1 * lr_c + 0.1)
    # another divergence gives another link: forward KL, beta * (-1/u) = -beta e^{-lr}
    torch.testing.assert_close(implicit_reward(lr_c, 0.1, "forward_kl"), -0.1 * torch.exp(-lr_c))


def _objective(pi, ref, r, beta, div):
    return (pi * r).sum(-1) - beta * f_divergence(pi, ref, div)


def _problem(seed, n=5):
    g = torch.Generator().manual_seed(seed)
    ref = torch.softmax(torch.randn(n, generator=g, dtype=torch.float64), -1)
    r = 2.0 * torch.randn(n, generator=g, dtype=torch.float64)
    return ref, r


def test_regularised_optimum_reverse_kl_equals_closed_form():
    ref, r = _problem(0)
    for beta in (0.05, 0.5, 3.0):
        w = ref * torch.exp(r / beta)
        torch.testing.assert_close(regularised_optimum(ref, r, beta, "reverse_kl"), w / w.sum(),
                                   atol=1e-10, rtol=0)


@pytest.mark.parametrize("name,alpha", CASES, ids=IDS)
@pytest.mark.parametrize("beta", [0.3, 2.0])
def test_regularised_optimum_beats_brute_force(name, alpha, beta):
    """The result is a probability vector and no random point of the simplex (2000 Dirichlet
    draws) nor any small feasible perturbation of it has a higher objective."""
    div = get_divergence(name, alpha)
    ref, r = _problem(1)
    pi = regularised_optimum(ref, r, beta, div)
    assert (pi >= 0).all() and abs(float(pi.sum()) - 1) < 1e-12
    best = float(_objective(pi, ref, r, beta, div))

    g = torch.Generator().manual_seed(2)
    gamma = torch._standard_gamma(torch.ones(2000, 5, dtype=torch.float64) * 0.7, generator=g)
    points = gamma / gamma.sum(-1, keepdim=True)
    values = _objective(points, ref.expand_as(points), r.expand_as(points), beta, div)
    assert float(values.max()) <= best + 1e-12

    delta = 1e-3 * torch.randn(500, 5, generator=g, dtype=torch.float64)
    delta = delta - delta.mean(-1, keepdim=True)  # stay on the simplex
    moved = (pi + delta).clamp(min=1e-300)
    moved = moved / moved.sum(-1, keepdim=True)
    moved_values = _objective(moved, ref.expand_as(moved), r.expand_as(moved), beta, div)
    assert float(moved_values.max()) <= best + 1e-12
    assert float(moved_values.max()) > best - 1e-3  # perturbations really were small


def test_regularised_optimum_batched_and_zero_reference_mass():
    ref, r = _problem(3)
    ref2, r2 = _problem(4)
    both = regularised_optimum(torch.stack([ref, ref2]), torch.stack([r, r2]), 0.7, "js")
    torch.testing.assert_close(both[1], regularised_optimum(ref2, r2, 0.7, "js"), atol=1e-12,
                               rtol=0)
    ref0 = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)
    pi = regularised_optimum(ref0, torch.tensor([100.0, 0.0, 1.0], dtype=torch.float64), 1.0,
                             "forward_kl")
    assert float(pi[0]) == 0.0 and abs(float(pi.sum()) - 1) < 1e-12


def test_divergence_errors():
    with pytest.raises(ObjectiveError, match="'reverse_kl', 'forward_kl', 'js', 'alpha'"):
        get_divergence("hellinger")
    for bad in (0.0, 1.0, -0.2, 1.5):
        with pytest.raises(ObjectiveError, match="alpha"):
            get_divergence("alpha", bad)
    with pytest.raises(ObjectiveError, match="beta"):
        implicit_reward(torch.zeros(2), -1.0, "js")
    with pytest.raises(ObjectiveError, match="sum to 1"):
        regularised_optimum(torch.tensor([0.5, 0.6]), torch.zeros(2), 1.0, "js")
    assert set(DIVERGENCES) == {"reverse_kl", "forward_kl", "js", "alpha"}

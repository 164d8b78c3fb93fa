"""Tests for prefzoo.objective.optimum: the closed-form optimum of the KL-regularised objective."""

import math

import pytest
import torch

from prefzoo.objective import (
    ObjectiveError,
    log_partition,
    optimal_policy,
    optimal_value,
    regularised_objective,
)


def _problem(seed, n=5):
    g = torch.Generator().manual_seed(seed)
    ref = torch.softmax(torch.randn(n, generator=g, dtype=torch.float64), -1)
    rewards = torch.randn(n, generator=g, dtype=torch.float64)
    return ref, rewards


def test_hand_example():
    """pi_ref = (1/2, 1/2), r = (0, ln 3), beta = 1: Z = 1/2 * 1 + 1/2 * 3 = 2, so
    pi* = (1/4, 3/4), log Z = ln 2, J* = ln 2 = 0.6931471806. Check J directly:
    E[r] = 3/4 ln 3 = 0.8239592165; KL = 1/4 ln(1/2) + 3/4 ln(3/2) = 0.1308120359;
    J = 0.8239592165 - 0.1308120359 = 0.6931471806."""
    ref = torch.tensor([0.5, 0.5], dtype=torch.float64)
    r = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64)
    torch.testing.assert_close(optimal_policy(ref, r, 1.0),
                               torch.tensor([0.25, 0.75], dtype=torch.float64))
    assert abs(float(log_partition(ref, r, 1.0)) - math.log(2)) < 1e-15
    assert abs(float(optimal_value(ref, r, 1.0)) - math.log(2)) < 1e-15
    pi = torch.tensor([0.25, 0.75], dtype=torch.float64)
    assert abs(float(regularised_objective(pi, ref, r, 1.0)) - 0.6931471806) < 1e-9


@pytest.mark.parametrize("beta", [0.1, 0.7, 5.0])
def test_value_of_optimum_is_beta_log_z(beta):
    ref, r = _problem(0)
    pi = optimal_policy(ref, r, beta)
    assert abs(float(regularised_objective(pi, ref, r, beta) - optimal_value(ref, r, beta))) < 1e-9
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
    (total variation < 1e-4) and never exceed J*."""
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
    assert 0.5 * float((pi - star).abs().sum()) < 1e-4
    best = float(optimal_value(ref, r, beta))
    assert float(regularised_objective(pi, ref, r, beta)) <= best + 1e-12


def test_limits_of_beta():
    ref, r = _problem(4)
    # beta -> infinity: the penalty dominates, pi* -> pi_ref
    torch.testing.assert_close(optimal_policy(ref, r, 1e6), ref, atol=1e-5, rtol=0)
    # beta -> 0: pi* concentrates on the argmax of the reward; large r/beta stays finite
    pi = optimal_policy(ref, r, 1e-3)
    assert float(pi[r.argmax()]) > 1 - 1e-6
    assert torch.isfinite(optimal_policy(ref, 1000 * r, 1e-4)).all()
    assert torch.isfinite(log_partition(ref, 1000 * r, 1e-4))


def test_batched_prompts_and_zero_reference_mass():
    ref, r = _problem(5)
    ref2, r2 = _problem(6)
    both = optimal_policy(torch.stack([ref, ref2]), torch.stack([r, r2]), 0.3)
    torch.testing.assert_close(both[0], optimal_policy(ref, r, 0.3))
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

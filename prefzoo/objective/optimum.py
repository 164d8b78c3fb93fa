"""The closed-form optimum of the KL-regularised objective on a finite set of responses.

For one prompt with responses y = 1..N, reference probabilities pi_ref and rewards r,

    J(pi) = E_{y~pi}[r(y)] - beta * KL(pi || pi_ref)

is maximised over the simplex by the Gibbs policy

    pi*(y) = pi_ref(y) exp(r(y)/beta) / Z,   Z = sum_y pi_ref(y) exp(r(y)/beta),

and the optimal value is J(pi*) = beta log Z (substitute log(pi*/pi_ref) = r/beta - log Z).
This is the target every algorithm of the zoo approaches; the tabular conformance tests compare
trained policies with it. Everything is computed in log space (logsumexp), so large r/beta is
safe. Leading axes are independent prompts; the last axis holds the N responses.

The same pi* solves the constrained problem max_pi E_pi[r] subject to KL(pi || pi_ref) <= eps, with beta the
Lagrange multiplier of the budget (:func:`beta_for_kl_budget` finds it): the penalised objective is the
Lagrangian, and beta is what one more nat of KL buys in reward.
"""

from __future__ import annotations

import torch

from .errors import ObjectiveError, check_number, check_same_shape

__all__ = ["optimal_policy", "log_partition", "optimal_value", "regularised_objective", "beta_for_kl_budget"]


def _check_inputs(ref_probs: torch.Tensor, rewards: torch.Tensor) -> None:
    check_same_shape("ref_probs", ref_probs, "rewards", rewards)
    if not ref_probs.is_floating_point() or not rewards.is_floating_point():
        raise ObjectiveError("ref_probs and rewards must be floating-point tensors")
    if bool((ref_probs < 0).any()):
        raise ObjectiveError("ref_probs has negative entries; it must be a probability vector")
    total = ref_probs.sum(-1)
    if not torch.allclose(total, torch.ones_like(total), atol=1e-5, rtol=0.0):
        raise ObjectiveError(
            "ref_probs must sum to 1 over the last dimension (responses); normalise it first"
        )


def _positive_beta(beta: float) -> float:
    return check_number(
        "beta", beta, low=0.0, strict_low=True,
        hint="the regularised optimum needs beta > 0; beta = 0 means no regularisation, whose "
             "maximiser is the argmax of the reward (rewards.argmax(-1))",
    )


def _tilted_logits(ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float) -> torch.Tensor:
    return torch.log(ref_probs) + rewards / beta  # log 0 = -inf: no mass where pi_ref = 0


def log_partition(ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """log Z = log sum_y pi_ref(y) exp(r(y)/beta), by logsumexp.

    Shape: ref_probs (..., N), rewards (..., N) -> (...); N = responses per prompt.
    Units: nats (dimensionless log).

    Raises:
        ObjectiveError: shape mismatch; ref_probs not a probability vector; beta <= 0 (the
            message explains that beta = 0 is the argmax of the reward).

    Source: Rafailov et al. 2023, eq. 4 (the partition function Z(x)); Korbak et al. 2022,
    "RL with KL penalties is better viewed as Bayesian inference".
    """
    _check_inputs(ref_probs, rewards)
    beta = _positive_beta(beta)
    return torch.logsumexp(_tilted_logits(ref_probs, rewards, beta), dim=-1)


def optimal_policy(ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """pi*(y) = pi_ref(y) exp(r(y)/beta) / Z, the maximiser of E_pi[r] - beta KL(pi||pi_ref).

    Computed as softmax(log pi_ref + r/beta) so that r/beta of any size is stable.

    Shape: ref_probs (..., N), rewards (..., N) -> (..., N); N = responses per prompt.
    Units: probabilities.

    Raises:
        ObjectiveError: shape mismatch; ref_probs not a probability vector; beta <= 0 (the
            message explains that beta = 0 is the argmax of the reward).

    Source: Peters & Schaal 2007 (reward-weighted regression); Korbak et al. 2022;
    Rafailov et al. 2023, eq. 4.
    """
    _check_inputs(ref_probs, rewards)
    beta = _positive_beta(beta)
    return torch.softmax(_tilted_logits(ref_probs, rewards, beta), dim=-1)


def optimal_value(ref_probs: torch.Tensor, rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """J* = max_pi E_pi[r] - beta KL(pi||pi_ref) = beta log Z.

    Shape: ref_probs (..., N), rewards (..., N) -> (...); N = responses per prompt.
    Units: reward units.

    Raises:
        ObjectiveError: as :func:`log_partition`.

    Source: Rafailov et al. 2023, eq. 4 substituted into the objective of eq. 3; Korbak et al.
    2022.
    """
    return _positive_beta(beta) * log_partition(ref_probs, rewards, beta)


def regularised_objective(probs: torch.Tensor, ref_probs: torch.Tensor, rewards: torch.Tensor,
                          beta: float) -> torch.Tensor:
    """J(pi) = E_{y~pi}[r(y)] - beta * KL(pi || pi_ref), exactly, for a tabular policy.

    Responses with pi = 0 contribute 0 to the KL; pi > 0 where pi_ref = 0 gives -inf.
    beta = 0 is allowed (J is then the expected reward). Differentiable in ``probs``.

    Shape: probs, ref_probs, rewards (..., N) -> (...); N = responses per prompt.
    Units: reward units.

    Raises:
        ObjectiveError: shape mismatch; ref_probs or probs not a probability vector; beta < 0.

    Source: Rafailov et al. 2023, eq. 3; Ziegler et al. 2019, eq. 2 (in expectation).
    """
    _check_inputs(ref_probs, rewards)
    check_same_shape("probs", probs, "rewards", rewards)
    if bool((probs < 0).any()):
        raise ObjectiveError("probs has negative entries; it must be a probability vector")
    beta = check_number("beta", beta, low=0.0, hint="beta weights the KL penalty")
    log_ratio = torch.log(probs) - torch.log(ref_probs)
    kl_terms = torch.where(probs > 0, probs * log_ratio, torch.zeros_like(probs))
    return (probs * rewards).sum(-1) - beta * kl_terms.sum(-1)


def _kl_of_tilt(ref: torch.Tensor, rewards: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """KL(pi_t || pi_ref) for pi_t proportional to pi_ref exp(t r), t = 1/beta >= 0 of shape (...).

    ``ref`` sums to 1 and ``rewards`` <= 0 (shifted by their maximum; 0 where ref = 0). With e = expm1(t r) and
    s = sum ref e (both in [-1, 0]), log Z = log1p(s) and pi_t = ref (1 + e) / (1 + s), so a small t r is never
    added to log ref and loses no digits: a budget of 1e-14 nats is met to 1e-9 relative. Where Z is small
    (1 + s < 1/2) the log-space form is the exact one and is used instead."""
    tr = t.unsqueeze(-1) * rewards
    e = torch.expm1(tr)
    s = (ref * e).sum(-1)
    small = t * (ref * rewards * (1 + e)).sum(-1) / (1 + s) - torch.log1p(s)
    logits = torch.log(ref) + tr
    probs = torch.softmax(logits, dim=-1)
    large = t * (probs * rewards).sum(-1) - torch.logsumexp(logits, dim=-1)
    return torch.where(1 + s > 0.5, small, large)


def beta_for_kl_budget(ref_probs: torch.Tensor, rewards: torch.Tensor, kl_budget: float) -> torch.Tensor:
    """The beta whose optimum pi*_beta spends exactly ``kl_budget`` nats: the Lagrange multiplier of the budget.

    The constrained problem max_pi E_pi[r] subject to KL(pi || pi_ref) <= eps has the Lagrangian
    E_pi[r] - beta (KL - eps), maximised over pi by the Gibbs policy pi*_beta of :func:`optimal_policy`. By the KKT
    conditions the solution is pi*_beta with KL(pi*_beta || pi_ref) = eps when the budget binds, and the reward's
    maximiser (beta = 0) when it does not, i.e. when eps >= -log pi_ref(argmax r), the KL of putting all mass on the
    best responses. beta is also the price of the budget: dV/deps = beta for V(eps) the best reward inside it
    (the envelope theorem). KL(pi*_beta) falls monotonically as beta grows, so beta is found by bisection on
    t = 1/beta: doubling until the KL passes eps, then 100 halvings (relative precision far below float64's).

    Shape: ref_probs (..., N), rewards (..., N) -> (...); N = responses per prompt.
    Units: reward units per nat (beta's); kl_budget in nats.

    ref_probs is renormalised (in float64) before use: the input check allows a sum off 1 by 1e-5, and a float32
    softmax is off by ~1e-8, which alone would be a KL larger than a small budget.

    Raises:
        ObjectiveError: shape mismatch; ref_probs not a probability vector; a NaN or inf reward where
            ref_probs > 0; kl_budget not a finite number > 0 (a budget of 0 means pi = pi_ref, beta = infinity).

    Source: note 000 sec. 4.3 and exercise (e) (the KL penalty as the Lagrangian of a KL-constrained problem);
    Boyd & Vandenberghe 2004, sec. 5.5.3 (KKT) and 5.6 (the multiplier as the sensitivity of the optimal value).
    """
    _check_inputs(ref_probs, rewards)
    eps = check_number("kl_budget", kl_budget, low=0.0, strict_low=True,
                       hint="a budget of 0 nats keeps pi = pi_ref (beta = infinity)")
    ref = ref_probs.to(torch.float64)
    ref = ref / ref.sum(-1, keepdim=True)  # a float32 softmax is off 1 by ~1e-8: more than a small budget
    r = rewards.to(torch.float64)
    support = ref > 0
    if bool((support & ~torch.isfinite(r)).any()):
        raise ObjectiveError("rewards must be finite wherever ref_probs > 0 (found NaN or inf); a response to "
                             "exclude should get ref_probs 0")
    top = torch.where(support, r, torch.full_like(r, -torch.inf)).max(-1, keepdim=True).values
    best_mass = torch.where(support & (r == top), ref, torch.zeros_like(ref)).sum(-1)
    slack = eps >= -torch.log(best_mass)  # the budget does not bind: beta = 0
    r = torch.where(support, r - top, torch.zeros_like(r))  # a shift leaves pi_t unchanged; keeps t * r <= 0
    spread = (-r).max(-1).values
    hi = 1.0 / torch.where(spread > 0, spread, torch.ones_like(spread))
    lo = torch.zeros_like(hi)
    for _ in range(1000):
        short = (_kl_of_tilt(ref, r, hi) < eps) & ~slack
        if not bool(short.any()):
            break
        lo = torch.where(short, hi, lo)
        hi = torch.where(short, 2 * hi, hi)
    for _ in range(100):
        mid = (lo + hi) / 2
        below = _kl_of_tilt(ref, r, mid) < eps
        lo = torch.where(below, mid, lo)
        hi = torch.where(below, hi, mid)
    t = (lo + hi) / 2
    beta = torch.where(slack, torch.zeros_like(t), 1.0 / t)
    return beta.to(rewards.dtype)

"""The closed-form optimum of the KL-regularised objective on a finite set of responses.

For one prompt with responses y = 1..N, reference probabilities pi_ref and rewards r,

    J(pi) = E_{y~pi}[r(y)] - beta * KL(pi || pi_ref)

is maximised over the simplex by the Gibbs policy

    pi*(y) = pi_ref(y) exp(r(y)/beta) / Z,   Z = sum_y pi_ref(y) exp(r(y)/beta),

and the optimal value is J(pi*) = beta log Z (substitute log(pi*/pi_ref) = r/beta - log Z).
This is the target every algorithm of the zoo approaches; the tabular conformance tests compare
trained policies with it. Everything is computed in log space (logsumexp), so large r/beta is
safe. Leading axes are independent prompts; the last axis holds the N responses.
"""

from __future__ import annotations

import torch

from .errors import ObjectiveError, check_number, check_same_shape

__all__ = ["optimal_policy", "log_partition", "optimal_value", "regularised_objective"]


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

"""Per-token KL estimators and where to put them (in the reward or as a loss).

Direction. With pi = pi_theta (the policy being trained) and pi_ref (the frozen reference),
the regulariser of RLHF is the *reverse* KL

    KL(pi || pi_ref) = E_{y~pi}[ log pi(y) - log pi_ref(y) ],

estimated from tokens sampled from pi itself. The *forward* KL is KL(pi_ref || pi) =
E_{y~pi_ref}[ log pi_ref(y) - log pi(y) ]. (DESIGN.md uses the two words in exactly this sense.)

Estimators (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html).
On a token y ~ pi with ``log_ratio`` rho = log pi(y) - log pi_ref(y):

    k1 = rho                      unbiased for KL(pi||pi_ref), high variance, can be < 0
    k2 = rho^2 / 2                biased (E[k2] != KL in general), >= 0, low variance
    k3 = exp(-rho) - 1 + rho      unbiased (because E_pi[exp(-rho)] = E_pi[pi_ref/pi] = 1),
                                  >= 0 (since e^x >= 1 + x), low variance

Placement. An estimator k can enter training in two ways (Liu et al. 2025, "Rethinking KL
Regularization in RLHF: From Value Estimation to Gradient Optimization", arXiv:2510.01555):

- ``"in_reward"``: -beta * k(rho) is added to the per-token reward as a *detached* number; the
  policy gradient then differentiates it only through the score function, so the expected
  gradient of the penalty is  g_in(k) = E_pi[ k(rho) * grad log pi(y) ].
- ``"as_loss"``: beta * k(rho) is added to the loss and differentiated pathwise through
  log pi(y) with the sampled y held fixed:  g_as(k) = E_pi[ grad_theta k(rho_theta(y)) ].

Since E_pi[k] is a function of theta, g_in(k) + g_as(k) = grad E_pi[k(rho)] for every k.
Working out each case exactly (all expectations over y ~ pi, d = grad_theta):

    k1 in reward:  E[rho d log pi]                       = d KL(pi||pi_ref)   exact (reverse)
    k1 as loss:    E[d log pi]                           = 0                  useless
    k2 as loss:    E[rho d log pi]                       = d KL(pi||pi_ref)   exact, on-policy
    k2 in reward:  E[(rho^2/2) d log pi]                 = d E[k2] - d KL(pi||pi_ref)   biased
    k3 as loss:    E[(1 - pi_ref/pi) d log pi]
                     = sum_y (pi - pi_ref) d log pi = -sum_y pi_ref d log pi
                                                         = d KL(pi_ref||pi)   the FORWARD KL
    k3 in reward:  d KL(pi||pi_ref) - d KL(pi_ref||pi)   (identity above, E[k3] = KL(pi||pi_ref))

(The k1-in-reward line uses d KL(pi||pi_ref) = sum_y d pi (rho + 1) = E[rho d log pi] because
sum_y d pi = 0.) So "k3 as loss", the GRPO choice (Shao et al. 2024, eq. 4), follows the
gradient of the forward KL, not of the reverse KL it estimates. The two divergences agree to
second order around pi = pi_ref (both are chi^2/2 + O(delta^3)), so their gradients agree to
first order: this is the "biased first-order approximation" of Liu et al. 2025. All six lines
are checked exactly, by summing over a finite set of outcomes, in tests/objective/test_kl.py.
The statements hold on-policy (samples from the current pi); with samples from an older policy
an importance weight is needed.

Public functions: :func:`kl_estimate` (the formulas), :func:`kl_penalty_rewards` ("in_reward",
PPO style), :func:`kl_loss` ("as_loss", GRPO style), :func:`categorical_kl` (exact KL between
categoricals, for tests and the toy bandit).
"""

from __future__ import annotations

import math

import torch

from .errors import (
    check_choice,
    check_floating,
    check_mask,
    check_number,
    check_same_shape,
    check_tensor,
)

__all__ = [
    "ESTIMATORS",
    "PLACEMENTS",
    "kl_estimate",
    "kl_penalty_rewards",
    "kl_loss",
    "categorical_kl",
    "sequence_kl",
]

ESTIMATORS = ("k1", "k2", "k3")
PLACEMENTS = ("in_reward", "as_loss")

# |rho| beyond which k3 is saturated: exp(20) ~ 4.9e8 is already an enormous per-token penalty,
# and exp(-rho) overflows float32 at rho ~ -88. Outside the range the value is constant and the
# gradient is 0 (never of the wrong sign).
_K3_RHO_LIMIT = 20.0
# Below this |rho|, k3 is computed from its Taylor series: exp(-r) - 1 + r loses digits to
# cancellation for small r (in float32, all of them near r ~ 1e-4).
_K3_SERIES_BELOW = 0.1
# 1/n! for n = 2..8: exp(-r) - 1 + r = sum_{n>=2} (-r)^n / n!
_K3_SERIES = tuple(1.0 / math.factorial(n) for n in range(2, 9))


def _k1(rho: torch.Tensor) -> torch.Tensor:
    return rho


def _k2(rho: torch.Tensor) -> torch.Tensor:
    return 0.5 * rho * rho


def _k3(rho: torch.Tensor) -> torch.Tensor:
    r = rho.clamp(-_K3_RHO_LIMIT, _K3_RHO_LIMIT)
    direct = torch.expm1(-r) + r
    # Horner: r^2 (1/2! - r/3! + r^2/4! - ... + r^6/8!). Truncation error < |r|^9/9!, i.e.
    # relative < 6e-13 for |r| < 0.1; and the series is > 0 for r != 0, whereas the direct form
    # could round to a tiny negative number.
    small = r.clamp(-_K3_SERIES_BELOW, _K3_SERIES_BELOW)
    poly = torch.full_like(small, _K3_SERIES[-1])
    for c in reversed(_K3_SERIES[:-1]):
        poly = c - small * poly
    series = small * small * poly
    return torch.where(r.abs() < _K3_SERIES_BELOW, series, direct)


_ESTIMATOR_FNS = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-sample estimate of KL(pi || pi_ref) from the log-ratio of a sample y ~ pi.

    With rho = ``log_ratio`` = log pi(y) - log pi_ref(y):
    k1 = rho; k2 = rho^2 / 2; k3 = exp(-rho) - 1 + rho. k1 and k3 are unbiased for the reverse
    KL when y ~ pi; k2 is biased; k2, k3 >= 0. k3 is computed stably (Taylor series for
    |rho| < 0.1, ``expm1`` otherwise) and saturates for |rho| > 20 (value constant, gradient 0
    there) so that it never overflows. Differentiable in ``log_ratio``.

    Shape: log_ratio (...) -> same shape; typically (B, T) with B = sequences, T = tokens.
    Units: nats (per token).

    Raises:
        ObjectiveError: ``estimator`` not in ESTIMATORS (the message lists them); log_ratio not
            a floating-point tensor.

    Source: Schulman 2020, "Approximating KL Divergence" (k1, k2, k3).
    """
    check_tensor("log_ratio", log_ratio)
    check_choice("estimator", estimator, ESTIMATORS)
    check_floating("log_ratio", log_ratio)
    return _ESTIMATOR_FNS[estimator](log_ratio)


def kl_penalty_rewards(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    estimator: str = "k1",
) -> torch.Tensor:
    """Per-token KL penalty to add to the reward ("in_reward" placement, PPO style).

    ``token_rewards_kl[b, t] = -beta * k(logps[b, t] - ref_logps[b, t])``, DETACHED (it is a
    reward: the policy gradient reaches it only through the score function), and exactly 0 at
    masked positions. With the default k1 its expected policy gradient is exactly the gradient
    of -beta * KL(pi||pi_ref) (see the module docstring). The caller adds the sequence reward
    r(x, y) at the last completion token.

    Shape: logps (B, T), ref_logps (B, T), mask (B, T) bool -> (B, T); B = sequences,
    T = completion token positions.
    Units: nats (reward units when the task reward is also in nats-comparable units).

    Raises:
        ObjectiveError: shape mismatch (both shapes named); mask not bool; beta < 0 or not
            finite; unknown estimator (valid names listed).

    Source: Ziegler et al. 2019, eq. 2 (R(x, y) = r(x, y) - beta log(pi(y|x)/rho(y|x))), applied
    per token as in Ouyang et al. 2022, eq. 2; estimators from Schulman 2020.
    """
    check_same_shape("logps", logps, "ref_logps", ref_logps)
    check_mask(mask, logps, "logps")
    beta = check_number("beta", beta, low=0.0, hint="beta is a penalty weight; use 0 for none")
    check_choice("estimator", estimator, ESTIMATORS)
    with torch.no_grad():
        penalty = -beta * kl_estimate(logps - ref_logps, estimator)
        return torch.where(mask, penalty, torch.zeros_like(penalty))


def kl_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    mask: torch.Tensor,
    estimator: str = "k3",
    old_logps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL term to add to the loss ("as_loss" placement, GRPO style).

    ``k(logps - ref_logps)`` per token, with the gradient flowing through ``logps`` only
    (``ref_logps`` is detached), exactly 0 (and no gradient) at masked positions. The caller
    multiplies by beta and reduces with ``reduce.aggregate_loss``. Beware the placement
    subtlety (module docstring): on-policy, k2 here has the exact reverse-KL gradient, the
    default k3 (GRPO's choice) has the gradient of the forward KL KL(pi_ref||pi), and k1 has
    zero expected gradient.

    The bias correction (``old_logps`` given: ``objective.kl_bias_correction``): the term is multiplied by the
    importance ratio rho = pi_theta / pi_old = exp(logps - old_logps), WITH its gradient. The samples come from
    pi_old, so E_old[rho k] = E_theta[k], and

        grad E_old[rho k3] = E_old[rho (k3 grad log pi + grad k3)] = E_theta[k3 grad log pi + grad k3]
                           = grad E_theta[k3] = grad KL(pi_theta || pi_ref)

    (the score-function identity; k3 is unbiased for the reverse KL under pi_theta), on-policy (rho = 1) and off
    it, where the plain k3 loss follows E_theta[grad k3] = grad KL(pi_ref || pi_theta), the forward KL's. So k3 as a loss with the correction reaches the reverse-KL
    optimum pi* (the conformance table's row), the property TRL 1.16 turns on by default
    (``use_bias_correction_kl=True``; DeepSeek-V3.2's unbiased KL estimate). It changes the gradient even on-policy
    (rho's gradient), not the value there (rho = 1).

    Shape: logps (B, T), ref_logps (B, T), mask (B, T) bool, old_logps (B, T) or None -> (B, T); B = sequences,
    T = completion token positions.
    Units: nats.

    Raises:
        ObjectiveError: shape mismatch (both shapes named); mask not bool; unknown estimator.

    Source: Shao et al. 2024 (DeepSeekMath), eq. 4 (the k3 term in the GRPO loss); estimators
    from Schulman 2020; placement analysis from Liu et al. 2025 (arXiv:2510.01555); the bias correction from
    DeepSeek-AI 2025 (DeepSeek-V3.2, the unbiased KL estimate) as TRL 1.16 implements it.
    """
    check_same_shape("logps", logps, "ref_logps", ref_logps)
    check_mask(mask, logps, "logps")
    check_choice("estimator", estimator, ESTIMATORS)
    per_token = kl_estimate(logps - ref_logps.detach(), estimator)
    if old_logps is not None:
        check_same_shape("logps", logps, "old_logps", old_logps)
        per_token = per_token * torch.exp(logps - old_logps.detach())
    return torch.where(mask, per_token, torch.zeros_like(per_token))


def categorical_kl(
    p_logits: torch.Tensor, q_logits: torch.Tensor, dim: int = -1
) -> torch.Tensor:
    """Exact KL(p || q) between categorical distributions given by (unnormalised) logits.

    ``sum_v p_v (log p_v - log q_v)`` with p = softmax(p_logits), q = softmax(q_logits) along
    ``dim``. Outcomes with p_v = 0 contribute 0; an outcome with p_v > 0 and q_v = 0 gives inf.
    Differentiable in both arguments.

    Shape: p_logits (..., V), q_logits (..., V) (broadcastable) -> (...) with ``dim`` removed;
    V = number of outcomes (e.g. vocabulary or responses).
    Units: nats.

    Raises:
        ObjectiveError: inputs not floating-point tensors.

    Source: definition of the Kullback-Leibler divergence (Kullback & Leibler 1951).
    """
    check_tensor("p_logits", p_logits)
    check_tensor("q_logits", q_logits)
    check_floating("p_logits", p_logits)
    check_floating("q_logits", q_logits)
    log_p = torch.log_softmax(p_logits, dim=dim)
    log_q = torch.log_softmax(q_logits, dim=dim)
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    return terms.sum(dim=dim)


def sequence_kl(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    mask: torch.Tensor,
    estimator: str = "k1",
) -> torch.Tensor:
    """Per-sequence estimate of KL(pi || pi_ref): the token estimates k(rho_t) summed over each row's
    counted tokens, for completions sampled from pi. DETACHED (a measurement, not a loss).

        kl[b] = sum_{t: mask[b, t]} k(logps[b, t] - ref_logps[b, t])

    By the chain rule of KL over tokens, with k1 or k3 this is an unbiased estimate of the sequence-level
    KL(pi(.|x) || pi_ref(.|x)) when the rows are samples of pi (Schulman 2020). Masked positions contribute
    exactly 0 whatever they hold.

    Shape: logps (B, T), ref_logps (B, T), mask (B, T) bool -> (B,); B = sequences, T = completion positions.
    Units: nats per sequence.

    Raises:
        ObjectiveError: shape mismatch (both shapes named); mask not bool; unknown estimator (valid ones listed).

    Source: Schulman 2020, "Approximating KL Divergence"; the per-sequence KL of Ziegler et al. 2019 (the
    quantity the adaptive controller targets) and of Gao et al. 2023 (d = sqrt(KL)).
    """
    check_same_shape("logps", logps, "ref_logps", ref_logps)
    check_mask(mask, logps, "logps")
    check_choice("estimator", estimator, ESTIMATORS)
    with torch.no_grad():
        log_ratio = torch.where(mask, logps.float() - ref_logps.float(), torch.zeros((), device=logps.device))
        k = kl_estimate(log_ratio, estimator)
        return torch.where(mask, k, torch.zeros_like(k)).sum(dim=-1)

"""f-divergences for the DPO family (f-DPO).

For a convex f with f(1) = 0, the f-divergence of the policy from the reference is

    D_f(pi || pi_ref) = E_{y~pi_ref}[ f(pi(y) / pi_ref(y)) ].

Maximising E_pi[r] - beta * D_f(pi || pi_ref) over the simplex gives, by the KKT conditions,
beta * f'(pi(y)/pi_ref(y)) = r(y) - lambda wherever pi(y) > 0 (lambda: the normalisation
multiplier). Hence the reward implied by a policy is r(y) = beta * f'(pi(y)/pi_ref(y)) + const,
and in a Bradley-Terry likelihood the constant cancels between chosen and rejected responses:
this is f-DPO (Wang et al. 2024, "Beyond Reverse KL: Generalizing Direct Preference Optimization
with Diverse Divergence Constraints", ICLR 2024, sec. 4, Theorem 1). With f(u) = u log u
(reverse KL) the link is beta * log(pi/pi_ref) + beta, i.e. exactly DPO.

The four divergences here (u = pi/pi_ref > 0):

    name         f(u)                                   f'(u)                  f' ranges over
    reverse_kl   u log u                                log u + 1              (-inf, inf)
    forward_kl   -log u                                 -1/u                   (-inf, 0)
    js           u log u - (u+1) log((u+1)/2)           log(2u/(1+u))          (-inf, log 2)
    alpha        (u^(1-a) - (1-a)u - a) / (a(a-1))      (1 - u^(-a)) / a       (-inf, 1/a)

("reverse_kl" gives KL(pi||pi_ref), "forward_kl" gives KL(pi_ref||pi); "js" is twice the
Jensen-Shannon divergence; "alpha" with a in (0, 1) interpolates: a -> 0 gives f' -> log u,
a -> 1 gives f' -> 1 - 1/u.) In all four f'(0+) = -inf, so the optimum keeps pi > 0 wherever
pi_ref > 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .errors import ObjectiveError, check_choice, check_number, check_same_shape, check_tensor

__all__ = [
    "DIVERGENCES",
    "FDivergence",
    "get_divergence",
    "implicit_reward",
    "f_divergence",
    "regularised_optimum",
]

DIVERGENCES = ("reverse_kl", "forward_kl", "js", "alpha")

_Fn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class FDivergence:
    """One f-divergence: its generator f, the link f', and the inverse of the link.

    Fields (all functions act element-wise on tensors):
        name: one of DIVERGENCES.
        alpha: the alpha of the "alpha" divergence, None for the others.
        f(u): the convex generator, f(1) = 0; u = pi/pi_ref >= 0.
        f_prime(u): its derivative (the f-DPO link) for u > 0.
        f_prime_from_log(log_u): f'(u) evaluated from log u without forming u where that
            would overflow; this is how implicit rewards are computed from log-ratios.
        f_prime_inverse(v): the u > 0 with f'(u) = v, for v in the valid set (v_min, v_max).
        v_min, v_max: the open interval f'((0, inf)) of valid link values. For v <= v_min the
            optimum puts no mass (u = 0); v -> v_max means u -> inf.

    Use :func:`get_divergence` to build one.

    Shape: element-wise, any shape in -> same shape out.
    Units: D_f in nats for the KL cases (f uses natural logs).

    Raises:
        nothing itself (arguments are validated by :func:`get_divergence`).

    Source: Csiszar 1967 (f-divergences); the link f' and the four generators as in
    Wang et al. 2024, sec. 4.
    """

    name: str
    alpha: float | None
    f: _Fn = field(repr=False, compare=False)
    f_prime: _Fn = field(repr=False, compare=False)
    f_prime_from_log: _Fn = field(repr=False, compare=False)
    f_prime_inverse: _Fn = field(repr=False, compare=False)
    v_min: float = field(default=-math.inf)
    v_max: float = field(default=math.inf)

    def is_valid_link(self, v: torch.Tensor) -> torch.Tensor:
        """Bool tensor: True where ``v`` lies in (v_min, v_max), the range of f' on u > 0."""
        return (v > self.v_min) & (v < self.v_max)


_LOG2 = math.log(2.0)


def _reverse_kl() -> FDivergence:
    return FDivergence(
        name="reverse_kl",
        alpha=None,
        f=lambda u: torch.xlogy(u, u),
        f_prime=lambda u: torch.log(u) + 1.0,
        f_prime_from_log=lambda log_u: log_u + 1.0,
        f_prime_inverse=lambda v: torch.exp(v - 1.0),
        v_max=math.inf,
    )


def _forward_kl() -> FDivergence:
    return FDivergence(
        name="forward_kl",
        alpha=None,
        f=lambda u: -torch.log(u),
        f_prime=lambda u: -1.0 / u,
        f_prime_from_log=lambda log_u: -torch.exp(-log_u),
        f_prime_inverse=lambda v: -1.0 / v,
        v_max=0.0,
    )


def _js() -> FDivergence:
    return FDivergence(
        name="js",
        alpha=None,
        f=lambda u: torch.xlogy(u, u) - (u + 1.0) * torch.log((u + 1.0) / 2.0),
        f_prime=lambda u: torch.log(2.0 * u / (1.0 + u)),
        # log(2u/(1+u)) = log 2 - log(1 + 1/u) = log 2 - softplus(-log u)
        f_prime_from_log=lambda log_u: _LOG2 - torch.nn.functional.softplus(-log_u),
        # e^v = 2u/(1+u)  <=>  u = e^v / (2 - e^v)
        f_prime_inverse=lambda v: torch.exp(v) / (2.0 - torch.exp(v)),
        v_max=_LOG2,
    )


def _alpha(a: float) -> FDivergence:
    return FDivergence(
        name="alpha",
        alpha=a,
        f=lambda u: (u.pow(1.0 - a) - (1.0 - a) * u - a) / (a * (a - 1.0)),
        f_prime=lambda u: (1.0 - u.pow(-a)) / a,
        # (1 - e^{-a log u}) / a = -expm1(-a log u) / a
        f_prime_from_log=lambda log_u: -torch.expm1(-a * log_u) / a,
        # u^{-a} = 1 - a v  <=>  u = (1 - a v)^{-1/a}
        f_prime_inverse=lambda v: (1.0 - a * v).pow(-1.0 / a),
        v_max=1.0 / a,
    )


def get_divergence(name: str, alpha: float = 0.5) -> FDivergence:
    """Build the :class:`FDivergence` called ``name``.

    ``alpha`` is used only by the "alpha" divergence and must lie in the open interval (0, 1).

    Shape: not a tensor function.
    Units: -

    Raises:
        ObjectiveError: unknown name (the message lists DIVERGENCES); for "alpha", alpha not in
            (0, 1).

    Source: Wang et al. 2024, sec. 4 (reverse KL, forward KL, JS, alpha-divergence).
    """
    check_choice("divergence", name, DIVERGENCES)
    if name == "alpha":
        a = check_number(
            "alpha", alpha, low=0.0, strict_low=True, high=1.0, strict_high=True,
            hint="the alpha-divergence needs 0 < alpha < 1 (alpha -> 0 is reverse KL, "
                 "alpha -> 1 forward KL; use those names for the limits)",
        )
        return _alpha(a)
    return {"reverse_kl": _reverse_kl, "forward_kl": _forward_kl, "js": _js}[name]()


def _as_divergence(divergence: FDivergence | str) -> FDivergence:
    if isinstance(divergence, FDivergence):
        return divergence
    if isinstance(divergence, str):
        return get_divergence(divergence)
    raise ObjectiveError(
        f"divergence must be an FDivergence (see get_divergence) or one of {DIVERGENCES}, "
        f"got {type(divergence).__name__}"
    )


def implicit_reward(
    log_ratio: torch.Tensor, beta: float, divergence: FDivergence | str
) -> torch.Tensor:
    """The reward implied by a policy under an f-divergence constraint: beta * f'(pi/pi_ref).

    Computed from ``log_ratio`` = log pi(y|x) - log pi_ref(y|x) (sequence level, usually
    ``seq_logps - ref_seq_logps``) with the numerically stable ``f_prime_from_log``. It equals
    the true reward up to a per-prompt constant, which cancels in chosen-minus-rejected
    differences. For reverse KL it is beta * log_ratio + beta, so f-DPO with reverse KL is
    exactly DPO. A string ``divergence`` uses the default alpha=0.5 for "alpha".

    Shape: log_ratio (...) -> same shape; typically (B,) with B = sequences (or pairs).
    Units: reward units (nats for reverse KL: beta * nats + beta).

    Raises:
        ObjectiveError: beta <= 0; unknown divergence name; log_ratio not a tensor.

    Source: Wang et al. 2024, sec. 4, Theorem 1 (r = beta f'(pi/pi_ref) + const) and the
    f-DPO loss that follows; Rafailov et al. 2023, eq. 5 for the reverse-KL case.
    """
    check_tensor("log_ratio", log_ratio)
    beta = check_number("beta", beta, low=0.0, strict_low=True,
                        hint="beta scales the divergence; it must be positive")
    div = _as_divergence(divergence)
    return beta * div.f_prime_from_log(log_ratio)


def _check_probs(name: str, probs: torch.Tensor, strictly_positive: bool = False) -> None:
    check_tensor(name, probs)
    if not probs.is_floating_point():
        raise ObjectiveError(f"{name} must be floating point, got {probs.dtype}")
    if strictly_positive and bool((probs <= 0).any()):
        raise ObjectiveError(f"{name} must be > 0 everywhere (it is the reference measure)")
    if bool((probs < 0).any()):
        raise ObjectiveError(f"{name} has negative entries; it must be a probability vector")
    total = probs.sum(dim=-1)
    if not torch.allclose(total, torch.ones_like(total), atol=1e-5, rtol=0.0):
        raise ObjectiveError(
            f"{name} must sum to 1 over the last dimension (responses); sums are "
            f"{total.flatten()[:4].tolist()}... — normalise it first"
        )


def f_divergence(
    p: torch.Tensor, q: torch.Tensor, divergence: FDivergence | str
) -> torch.Tensor:
    """Exact D_f(p || q) = sum_y q(y) f(p(y)/q(y)) between categorical distributions.

    Used for tests, conformance checks and tabular toys. ``q`` must be strictly positive.

    Shape: p (..., N), q (..., N) -> (...); N = number of outcomes (responses).
    Units: nats for the KL cases.

    Raises:
        ObjectiveError: shape mismatch; p or q negative or not summing to 1; q not > 0;
            unknown divergence name.

    Source: Csiszar 1967; Wang et al. 2024, sec. 4 (D_f(pi||pi_ref) = E_pi_ref[f(pi/pi_ref)]).
    """
    check_same_shape("p", p, "q", q)
    _check_probs("p", p)
    _check_probs("q", q, strictly_positive=True)
    div = _as_divergence(divergence)
    return (q * div.f(p / q)).sum(dim=-1)


def regularised_optimum(
    ref_probs: torch.Tensor,
    rewards: torch.Tensor,
    beta: float,
    divergence: FDivergence | str,
    tol: float = 1e-10,
    max_iter: int = 400,
) -> torch.Tensor:
    """The maximiser over the simplex of E_pi[r] - beta * D_f(pi || pi_ref).

    KKT: pi(y) = pi_ref(y) * (f')^{-1}((r(y) - lambda) / beta), with 0 where the argument is at
    or below v_min (no such case for the four built-in divergences, whose f'(0+) = -inf) and
    lambda the unique value making sum_y pi(y) = 1 (the sum decreases in lambda). lambda is
    found by bisection in float64 on the bracket [max(min r - beta f'(1), max r - beta v_max),
    max r - beta f'(1)], where the sum is >= 1 at the left end and <= 1 at the right end, until
    the bracket is narrower than ``tol`` (relative to the reward scale) or ``max_iter``
    halvings; the result is then renormalised (a relative change of order ``tol``). Responses
    with pi_ref = 0 get pi = 0. For reverse KL the result equals pi_ref exp(r/beta) / Z.

    Shape: ref_probs (..., N), rewards (..., N) -> (..., N) float64 probabilities;
    N = responses per prompt, leading axes = independent prompts.
    Units: probabilities.

    Raises:
        ObjectiveError: shape mismatch; ref_probs negative / not summing to 1; beta <= 0;
            unknown divergence; tol <= 0.

    Source: Wang et al. 2024, sec. 4 (KKT conditions of the f-constrained problem); for reverse
    KL, Rafailov et al. 2023, eq. 4.
    """
    check_same_shape("ref_probs", ref_probs, "rewards", rewards)
    _check_probs("ref_probs", ref_probs)
    beta = check_number("beta", beta, low=0.0, strict_low=True,
                        hint="beta = 0 means the unregularised argmax of the reward")
    tol = check_number("tol", tol, low=0.0, strict_low=True)
    div = _as_divergence(divergence)

    ref = ref_probs.double()
    r = rewards.double()
    support = ref > 0
    r_sup_max = torch.where(support, r, torch.full_like(r, -math.inf)).amax(-1, keepdim=True)
    r_sup_min = torch.where(support, r, torch.full_like(r, math.inf)).amin(-1, keepdim=True)
    f1 = float(div.f_prime(torch.tensor(1.0, dtype=torch.float64)))

    def mass(lam: torch.Tensor) -> torch.Tensor:
        v = (r - lam) / beta
        inside = div.is_valid_link(v)
        u = div.f_prime_inverse(torch.where(inside, v, torch.full_like(v, f1)))
        u = torch.where(inside, u, torch.where(v >= div.v_max, math.inf, 0.0))
        return torch.where(support, ref * u, torch.zeros_like(u))

    hi = r_sup_max - beta * f1  # every u <= 1: total <= 1
    lo = r_sup_min - beta * f1  # every u >= 1: total >= 1
    if math.isfinite(div.v_max):
        lo = torch.maximum(lo, r_sup_max - beta * div.v_max)  # u(argmax) = inf: total = inf
    scale = max(1.0, float((r_sup_max - r_sup_min).abs().max()), beta)
    for _ in range(max_iter):
        mid = 0.5 * (lo + hi)
        too_much = mass(mid).sum(-1, keepdim=True) > 1.0
        lo = torch.where(too_much, mid, lo)
        hi = torch.where(too_much, hi, mid)
        if float((hi - lo).max()) <= tol * scale:
            break
    probs = mass(hi)  # at hi the total is <= 1, hence finite
    return probs / probs.sum(-1, keepdim=True)

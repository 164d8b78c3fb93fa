"""Derived numeric bounds for the tests: how far two floating-point computations of one quantity may differ.

Every numeric tolerance in ``tests/`` is one of four kinds (issue 46), and its docstring says which:

1. **Exact in float64.** The claim is an identity (a formula against its hand-derived value, one implementation
   against another of the same expression): both sides are computed in float64 and compared within
   :func:`sum_bound` with ``u = U64`` (a few 1e-15 relative), or exactly where no rounding happens at all.
2. **Two float32 computations that sum in different orders** (a fused pass and a plain one, sharded and whole, a
   decode loop and a full pass): the bound is derived from the number of terms summed and their magnitudes,
   :func:`sum_bound` (the worst case, for short sums) or :func:`probable_sum_bound` (the probabilistic bound, for long
   ones, where the worst case is useless), with the terms and the magnitude named in the docstring.
3. **A measured spread with a stated safety factor**, where the computation is too long to follow term by term (a
   training run of several steps through a network and Adam): the spread measured between thread counts and process
   counts, the factor, and why the comparison is made at the scale that matters (an update relative to the update's
   own size, not one weight element at 1e-6).
4. **Statistical** (a Monte-Carlo estimate against its expectation): a multiple of the estimate's standard error,
   with the probability of a false failure stated.

The constants and the two summation bounds (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed. 2002,
eq. 4.4 and Lemma 3.1; Higham & Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput.
41(5), 2019, Theorem 3.1):

* the unit roundoff u: ``U32 = 2**-24`` (float32), ``U64 = 2**-53`` (float64), ``UBF16 = 2**-8`` (bfloat16); machine
  epsilon is 2u. Rounding one number x gives x(1 + d), |d| <= u.
* recursive summation of n terms, IN ANY ORDER (so it covers a sum split over threads or processes, and a blocked or
  pairwise sum): |computed - exact| <= gamma_{n-1} sum |x_i|, gamma_k = k u / (1 - k u).
  The difference of two such computations is at most twice that.
* the probabilistic bound: if the rounding errors are independent and mean zero, |computed - exact| <=
  lambda sqrt(n) u sum |x_i| (to first order) fails with probability at most 2 n exp(-lambda^2 / 2). With lambda = 10
  that is below 1e-17 for any n here: a bound that holds on every machine, thread count and load for all practical
  purposes, and is sqrt(n) times tighter than the worst case.
"""

from __future__ import annotations

import math

#: unit roundoff of float32, float64 and bfloat16 (half the machine epsilon)
U32 = 2.0 ** -24
U64 = 2.0 ** -53
UBF16 = 2.0 ** -8
#: the probabilistic bound's lambda: failure probability <= 2 n exp(-lambda^2 / 2) (< 1e-17 for n < 1e4, lambda = 10)
LAMBDA = 10.0


def gamma(k: int, u: float = U32) -> float:
    """Higham's gamma_k = k u / (1 - k u): the relative error bound of k roundings in a row (eq. 3.8)."""
    k = max(int(k), 0)
    if k * u >= 1:
        raise ValueError(f"gamma_{k} undefined for u = {u}: k u >= 1")
    return k * u / (1 - k * u)


def sum_bound(n: int, abs_sum: float, u: float = U32) -> float:
    """The worst-case error of a sum of ``n`` terms whose absolute values add up to ``abs_sum``, in any order:
    gamma_{n-1} * abs_sum (Higham 2002, eq. 4.4). Twice it bounds two such sums taken in different orders."""
    return gamma(max(n - 1, 1), u) * abs_sum


def probable_sum_bound(n: int, abs_sum: float, u: float = U32, lam: float = LAMBDA) -> float:
    """The probabilistic error bound of a sum of ``n`` terms (Higham & Mary 2019, Theorem 3.1):
    lambda sqrt(n) u * abs_sum, failing with probability at most 2 n exp(-lambda^2 / 2)."""
    return lam * math.sqrt(max(n, 1)) * u * abs_sum


def failure_probability(n: int, lam: float = LAMBDA) -> float:
    """An upper bound on the probability that :func:`probable_sum_bound` fails for a sum of ``n`` terms."""
    return min(1.0, 2 * n * math.exp(-lam * lam / 2))


def relative_difference(a, b) -> float:
    """||a - b|| / ||b|| of two tensors (float64 norms; 0 when both are zero)."""
    import torch

    a64, b64 = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    scale = float(b64.norm())
    diff = float((a64 - b64).norm())
    return diff / scale if scale else diff

"""The odds of a completion and ORPO's log odds ratio, computed without overflow near P = 1.

ORPO (Hong et al. 2024) compares two completions by the odds of their length-normalised likelihood:

    P(y|x)    = exp(l),  l = (1/|y|) sum_t log pi(y_t | x, y_<t)     the mean token log-prob (Sec. 4.1)
    odds(y|x) = P / (1 - P)                                          (Sec. 4.1)
    log OR    = log odds(y_w|x) - log odds(y_l|x)                    (Sec. 4.1)

log odds = l - log(1 - e^l). The naive log1p(-exp(l)) fails exactly where a trained model lives: for l > -6e-8
float32 rounds exp(l) to 1 and log1p(-1) = -inf. Here log(1 - e^l) = log(-expm1(l)), in float64, which is exact
to ~1e-16 relative for every l < 0; l is floored at -1e-12 (P = 1 - 1e-12, log odds 27.63) so that a completion
whose every token has probability exactly 1 in float32 (l = 0, odds infinite) still gives a finite loss.
d(log odds)/dl = 1 / (1 - P): ORPO's gradient weight (Sec. 4.3), huge but finite near P = 1.
"""

from __future__ import annotations

import torch

from .errors import check_same_shape, check_tensor

__all__ = ["LOG_PROB_FLOOR", "log_odds", "log_odds_ratio"]

#: the largest mean log-prob :func:`log_odds` uses (closer to 0, the odds are capped at ~1e12)
LOG_PROB_FLOOR = -1e-12


def log_odds(mean_logps: torch.Tensor) -> torch.Tensor:
    """log(P / (1 - P)) with P = exp(mean_logps), stable for mean_logps near 0.

    Computed in float64 as l - log(-expm1(l)) with l = min(mean_logps, -1e-12) (module docstring), returned in
    the input's dtype; the gradient is 1 / (1 - P), and 0 above the floor.

    Shape: mean_logps (B,) -> (B,); B = completions (any shape works elementwise).
    Units: nats (a log of odds); mean_logps in nats per token.

    Raises:
        ObjectiveError: mean_logps is not a tensor.

    Source: Hong et al. 2024 (ORPO), Sec. 4.1: odds with the length-normalised likelihood P.
    """
    check_tensor("mean_logps", mean_logps)
    l = mean_logps.double().clamp(max=LOG_PROB_FLOOR)
    return (l - torch.log(-torch.expm1(l))).to(mean_logps.dtype)


def log_odds_ratio(chosen_mean_logps: torch.Tensor, rejected_mean_logps: torch.Tensor) -> torch.Tensor:
    """log OR = log odds(y_w) - log odds(y_l) of each pair (ORPO's margin).

    Shape: chosen_mean_logps (B,), rejected_mean_logps (B,) -> (B,); B = pairs.
    Units: nats.

    Raises:
        ObjectiveError: the shapes differ, or an input is not a tensor.

    Source: Hong et al. 2024 (ORPO), Sec. 4.1 (the odds ratio); the loss term is -log sigma(log OR), eq. 7
    (:func:`prefzoo.objective.pairwise_loss` with ``sigmoid``).
    """
    check_same_shape("chosen_mean_logps", chosen_mean_logps, "rejected_mean_logps", rejected_mean_logps)
    return log_odds(chosen_mean_logps) - log_odds(rejected_mean_logps)

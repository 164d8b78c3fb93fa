"""Best-of-n: keep the highest-reward of n samples of the reference, and its KL to the reference.

Best-of-n (rejection sampling; Stiennon et al. 2020, Nakano et al. 2021) draws n completions y_1..y_n
i.i.d. from pi_ref for a prompt x and returns the one with the highest reward. It needs no training; its
distribution pi_bon sits on the reward-KL frontier and is the baseline of Gao et al. 2023.

Its KL to the reference has a closed form when the reward has no ties (a continuous reward over
distinct completions): the kept sample's reward quantile U = F(r(y)) is the maximum of n uniforms, with
density n u^(n-1), so pi_bon(y) / pi_ref(y) = n F(r(y))^(n-1) and

    KL(pi_bon || pi_ref) = E[log(n U^(n-1))] = log n + (n-1) E[log U] = log n - (n-1)/n

(Stiennon et al. 2020, appendix; Gao et al. 2023, sec. 2; the derivation above). With ties or a finite
response set the true KL is SMALLER (the formula is an upper bound; Beirami et al. 2024), e.g. a 0/1
verifier reward; ``docs/conformance.md`` shows exact values on a tabular bed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .errors import ObjectiveError


def best_of_n_kl(n: int) -> float:
    """KL(pi_bon || pi_ref) = log n - (n-1)/n, the analytic KL of best-of-n to its reference.

    Shape: a scalar (per prompt; the same for every prompt).
    Units: nats per completion (a sequence-level KL). 0 for n = 1 (best-of-1 is the reference).

    Exact for a reward without ties; an upper bound otherwise (see the module docstring).

    Raises:
        ObjectiveError: n is not an integer >= 1.

    Source: Stiennon et al. 2020 (Learning to summarize), appendix; Gao et al. 2023 (Scaling laws for reward
    model overoptimization), sec. 2; Beirami et al. 2024 (the bound).
    """
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise ObjectiveError(f"best-of-n needs an integer n >= 1, got {n!r}")
    n = int(n)
    return math.log(n) - (n - 1) / n


def best_of_n_indices(rewards: Tensor, n: int) -> Tensor:
    """Which of each group's n samples best-of-n keeps: the first one with the highest reward.

    ``rewards`` holds groups of n consecutive samples (rows [g*n, (g+1)*n) are group g, as a policy's
    ``sample(prompts, n, ...)`` returns them). Keeping the FIRST maximum of i.i.d. samples is the same as
    breaking ties uniformly at random, so tied responses share their level's mass in proportion to pi_ref.

    Shape: rewards (G * n,) -> (G,) long, the row index (into the G * n rows) of each group's kept sample.
    Units: row indices.

    Raises:
        ObjectiveError: rewards is not 1-D, its length is not a multiple of n, or a reward is not finite.

    Source: Stiennon et al. 2020; Gao et al. 2023 (best-of-n sampling).
    """
    if rewards.dim() != 1 or n < 1 or rewards.numel() % n:
        raise ObjectiveError(f"best_of_n_indices: rewards {tuple(rewards.shape)} must be 1-D with a length that is "
                             f"a multiple of n={n} (groups of n samples)")
    if not bool(torch.isfinite(rewards).all()):
        raise ObjectiveError("best_of_n_indices: every reward must be finite")
    grouped = rewards.view(-1, n)
    first_max = grouped.argmax(dim=1)  # torch.argmax returns the first maximal index
    return torch.arange(grouped.shape[0], device=rewards.device) * n + first_max

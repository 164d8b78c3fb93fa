"""Reward shaping before the advantages: DAPO's overlong penalty and GDPO's decoupled normalisation of several rewards.

* :func:`overlong_penalty` (Yu et al. 2025, DAPO, sec. 3.4, eq. 13, "soft overlong punishment"): with the length cap
  L_max and a buffer L_cache, a completion of |y| tokens gets

      R_length(y) = 0                                   |y| <= L_max - L_cache
                  = ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                  = -1                                  L_max < |y|

  times a penalty factor (verl's ``overlong_buffer.penalty_factor``; 1 in the paper), added to its reward. The floor
  is -factor, reached at |y| = L_max (a completion cut by the cap: the linear branch meets the last one there).
* :func:`decoupled_group_rewards` (GDPO, Liu et al. 2026, "Group reward-Decoupled Normalization Policy Optimization",
  arXiv:2601.05242, sec. 3): with K reward functions, each is normalised within its prompt's group first,

      A_k,i = (r_k,i - mean_g r_k) / (std_g r_k + eps),     then  A_i = sum_k w_k A_k,i

  and the paper whitens A over the batch. Summing first (GRPO on sum_k w_k r_k) lets one reward's scale or spread drown
  another's, and maps distinct reward combinations to the same advantage; normalising each first keeps them apart.
  Here the decoupled sum is the reward the plugin then normalises: every group of it has mean 0, so GRPO's
  ``scale_rewards=batch`` (group centring: a no-op; division by the batch std) completes GDPO exactly, and
  ``scale_rewards=group`` divides each group by its own std instead (a departure from the paper, offered as GRPO's).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import ObjectiveError, check_ndim, check_number

__all__ = ["overlong_penalty", "decoupled_group_rewards"]


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (module docstring, eq. 13) of completions of ``lengths`` tokens.

    Shape: (B,) integer or float -> (B,) float32, in [-factor, 0]. Units: reward units (factor's).

    Raises:
        ObjectiveError: buffer not in [1, max_length], factor < 0, lengths not 1-D.

    Source: Yu et al. 2025 (DAPO), sec. 3.4, eq. 13; the factor as verl's ``overlong_buffer.penalty_factor``.
    """
    check_ndim("lengths", lengths, 1, "(B,)")
    if not 1 <= buffer <= max_length:
        raise ObjectiveError(f"the overlong buffer must be in [1, max_length={max_length}] tokens, got {buffer}")
    check_number("factor", factor, low=0.0)
    length = lengths.to(torch.float32)
    start = float(max_length - buffer)
    linear = (start - length) / float(buffer)
    out = torch.where(length <= start, torch.zeros_like(length), linear)
    return factor * torch.where(length > max_length, torch.full_like(length, -1.0), out)


def decoupled_group_rewards(components: Tensor, weights: Tensor, num_samples: int, eps: float = 1e-4) -> Tensor:
    """GDPO's decoupled sum (module docstring): each reward normalised within its group of ``num_samples`` consecutive
    completions (mean and unbiased std of the group's given scores), weighted, summed. A missing score (NaN: the
    function returned None for that sample) contributes 0 and is left out of its group's statistics; a group with
    fewer than 2 given scores of a function, or whose given scores are all equal, gets 0 from it.

    Shape: components (K, B), weights (K,) -> (B,) float32; B = prompts x num_samples. Units: standard deviations.

    Raises:
        ObjectiveError: shapes that do not fit, B not a multiple of num_samples, eps < 0.

    Source: Liu et al. 2026 (GDPO), arXiv:2601.05242, sec. 3; the missing scores as TRL 1.16's ``normalize_then_sum``
    (nanmean / nanstd, eps 1e-4).
    """
    check_ndim("components", components, 2, "(K, B)")
    check_ndim("weights", weights, 1, "(K,)")
    k, b = components.shape
    if weights.shape[0] != k:
        raise ObjectiveError(f"weights has {weights.shape[0]} entries for {k} reward components")
    if num_samples < 1 or b % num_samples:
        raise ObjectiveError(f"{b} completions are not groups of num_samples={num_samples}")
    check_number("eps", eps, low=0.0)
    x = components.to(torch.float64).view(k, -1, num_samples)  # (K, groups, G)
    given = ~torch.isnan(x)
    n = given.sum(-1, keepdim=True)
    filled = torch.where(given, x, torch.zeros_like(x))
    mean = filled.sum(-1, keepdim=True) / n.clamp(min=1)
    dev = torch.where(given, x - mean, torch.zeros_like(x))
    std = ((dev ** 2).sum(-1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
    spread = (torch.where(given, x, torch.full_like(x, -torch.inf)).amax(-1, keepdim=True)
              - torch.where(given, x, torch.full_like(x, torch.inf)).amin(-1, keepdim=True))
    informative = (n >= 2) & (spread > 0)
    normalised = torch.where(informative & given, dev / (std + eps), torch.zeros_like(x))
    return (weights.to(torch.float64)[:, None, None] * normalised).sum(0).reshape(b).to(torch.float32)

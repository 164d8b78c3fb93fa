"""PPO's clipped surrogate objective (with DAPO's asymmetric clip) and clipped value loss.

Both functions return the per-token LOSS (= -objective for the policy) with zeros at masked
positions, plus a bool tensor saying where clipping was active; reduce them with
``reduce.aggregate_loss``.
"""

from __future__ import annotations

import torch

from .errors import ObjectiveError, check_mask, check_ndim, check_number, check_same_shape

__all__ = ["clipped_surrogate_loss", "clipped_value_loss"]


def clipped_surrogate_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped surrogate loss, with an optional higher upper clip (clip-higher).

        ratio     = exp(logps - old_logps)                 (old_logps is detached)
        objective = min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A)
        loss      = -objective, 0 at masked positions

    ``clipped`` is True where the clipped term is strictly smaller than the unclipped one, so
    the min picks it: there the token's gradient is exactly 0 (ratio > 1 + epsilon_high with
    A > 0, or ratio < 1 - epsilon_low with A < 0). Elsewhere the gradient is that of
    -ratio * A. ``epsilon_high=None`` means the symmetric clip of PPO (epsilon_high =
    epsilon_low). With logps == old_logps (first epoch) ratio is exactly 1 and loss = -A.

    Shape: logps (B, T), old_logps (B, T), advantages (B,) (broadcast over T) or (B, T),
    mask (B, T) bool -> (per_token_loss (B, T), clipped (B, T) bool); B = sequences,
    T = completion token positions.
    Units: advantage units per token.

    Raises:
        ObjectiveError: shape mismatch (both shapes named); mask not bool; epsilon_low not in
            [0, 1); epsilon_high < 0.

    Source: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7 (L^CLIP);
    Yu et al. 2025, "DAPO", sec. 3.1 (Clip-Higher: decoupled epsilon_low, epsilon_high).
    """
    check_ndim("logps", logps, 2, "(B, T)")
    check_same_shape("logps", logps, "old_logps", old_logps)
    check_mask(mask, logps, "logps")
    epsilon_low = check_number("epsilon_low", epsilon_low, low=0.0, high=1.0, strict_high=True)
    epsilon_high = (epsilon_low if epsilon_high is None
                    else check_number("epsilon_high", epsilon_high, low=0.0))
    if advantages.dim() == 1 and advantages.shape[0] == logps.shape[0]:
        advantages = advantages[:, None]
    elif advantages.shape != logps.shape:
        raise ObjectiveError(
            f"advantages has shape {tuple(advantages.shape)} but logps has shape "
            f"{tuple(logps.shape)}; advantages must be (B,) per sequence or (B, T) per token"
        )
    advantages = advantages.detach()

    ratio = torch.exp(logps - old_logps.detach())
    unclipped = ratio * advantages
    clipped_obj = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high).detach() * advantages
    clipped = clipped_obj < unclipped
    objective = torch.where(clipped, clipped_obj, unclipped)
    loss = torch.where(mask, -objective, torch.zeros_like(objective))
    return loss, clipped & mask


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss of PPO2.

        v_clipped = old_values + clip(values - old_values, -clip_range, clip_range)
        loss      = 0.5 * max((values - returns)^2, (v_clipped - returns)^2), 0 where masked

    ``clipped`` is True where the clipped branch is strictly larger (the max picks it); the
    gradient there is 0 (the clipped value is outside the trust region, a constant).

    Shape: values, old_values, returns (B, T), mask (B, T) bool -> (per_token_loss (B, T),
    clipped (B, T) bool); B = sequences, T = completion token positions.
    Units: squared reward units.

    Raises:
        ObjectiveError: shape mismatch (both shapes named); mask not bool; clip_range < 0.

    Source: OpenAI Baselines PPO2 (Dhariwal et al. 2017) value clipping, as described in
    Huang et al. 2022, "The 37 Implementation Details of PPO", detail "Value Function Loss
    Clipping".
    """
    check_ndim("values", values, 2, "(B, T)")
    check_same_shape("values", values, "old_values", old_values)
    check_same_shape("values", values, "returns", returns)
    check_mask(mask, values, "values")
    clip_range = check_number("clip_range", clip_range, low=0.0)
    old_values, returns = old_values.detach(), returns.detach()
    v_clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (v_clipped - returns) ** 2
    clipped = loss_clipped > loss_unclipped
    loss = 0.5 * torch.where(clipped, loss_clipped, loss_unclipped)
    return torch.where(mask, loss, torch.zeros_like(loss)), clipped & mask

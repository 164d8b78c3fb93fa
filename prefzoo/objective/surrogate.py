"""PPO's clipped surrogate objective (with DAPO's asymmetric clip) and clipped value loss.

Both functions return the per-token LOSS (= -objective for the policy) with zeros at masked
positions, plus a bool tensor saying where clipping was active; reduce them with
``reduce.aggregate_loss``.
"""

from __future__ import annotations

import torch

from .errors import ObjectiveError, check_mask, check_ndim, check_number, check_same_shape

__all__ = ["clipped_surrogate_loss", "clipped_value_loss", "explained_variance", "ratio_statistics"]


def clipped_surrogate_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped surrogate loss, with an optional higher upper clip (clip-higher).

        ratio     = exp(logps - old_logps)                 (old_logps is detached)
        objective = min(ratio * A, clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * A)
        loss      = -objective, 0 at masked positions

    ``clipped`` is True where the clipped term is strictly smaller than the unclipped one, so
    the min picks it: there the token's gradient is exactly 0 (ratio > 1 + clip_eps_high with
    A > 0, or ratio < 1 - clip_eps_low with A < 0). Elsewhere the gradient is that of
    -ratio * A. ``clip_eps_high=None`` means the symmetric clip of PPO (clip_eps_high =
    clip_eps_low). With logps == old_logps (first epoch) ratio is exactly 1 and loss = -A.

    Shape: logps (B, T), old_logps (B, T), advantages (B,) (broadcast over T) or (B, T),
    mask (B, T) bool -> (per_token_loss (B, T), clipped (B, T) bool); B = sequences,
    T = completion token positions.
    Units: advantage units per token.

    Raises:
        ObjectiveError: shape mismatch (both shapes named); mask not bool; clip_eps_low not in
            [0, 1); clip_eps_high < 0.

    Source: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7 (L^CLIP);
    Yu et al. 2025, "DAPO", sec. 3.1 (Clip-Higher: decoupled clip_eps_low, clip_eps_high).
    """
    check_ndim("logps", logps, 2, "(B, T)")
    check_same_shape("logps", logps, "old_logps", old_logps)
    check_mask(mask, logps, "logps")
    clip_eps_low = check_number("clip_eps_low", clip_eps_low, low=0.0, high=1.0, strict_high=True)
    clip_eps_high = (clip_eps_low if clip_eps_high is None
                    else check_number("clip_eps_high", clip_eps_high, low=0.0))
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
    clipped_obj = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high).detach() * advantages
    clipped = clipped_obj < unclipped
    objective = torch.where(clipped, clipped_obj, unclipped)
    loss = torch.where(mask, -objective, torch.zeros_like(objective))
    return loss, clipped & mask


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss of PPO2.

        v_clipped = old_values + clip(values - old_values, -value_clip_eps, value_clip_eps)
        loss      = 0.5 * max((values - returns)^2, (v_clipped - returns)^2), 0 where masked

    ``clipped`` is True where the clipped branch is strictly larger (the max picks it); the
    gradient there is 0 (the clipped value is outside the trust region, a constant).

    Shape: values, old_values, returns (B, T), mask (B, T) bool -> (per_token_loss (B, T),
    clipped (B, T) bool); B = sequences, T = completion token positions.
    Units: squared reward units.

    Raises:
        ObjectiveError: shape mismatch (both shapes named); mask not bool; value_clip_eps < 0.

    Source: OpenAI Baselines PPO2 (Dhariwal et al. 2017) value clipping, as described in
    Huang et al. 2022, "The 37 Implementation Details of PPO", detail "Value Function Loss
    Clipping".
    """
    check_ndim("values", values, 2, "(B, T)")
    check_same_shape("values", values, "old_values", old_values)
    check_same_shape("values", values, "returns", returns)
    check_mask(mask, values, "values")
    value_clip_eps = check_number("value_clip_eps", value_clip_eps, low=0.0)
    old_values, returns = old_values.detach(), returns.detach()
    v_clipped = old_values + (values - old_values).clamp(-value_clip_eps, value_clip_eps)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (v_clipped - returns) ** 2
    clipped = loss_clipped > loss_unclipped
    loss = 0.5 * torch.where(clipped, loss_clipped, loss_unclipped)
    return torch.where(mask, loss, torch.zeros_like(loss)), clipped & mask


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """How much of the returns' variance the value function explains: 1 - Var[R - V] / Var[R] over the True
    positions (NaN when Var[R] = 0: nothing to explain).

    1 is a perfect value function, 0 one no better than a constant, < 0 worse than a constant.

    Shape: values (B, T), returns (B, T), mask (B, T) bool -> a Python float; B = sequences, T = positions.
    Units: dimensionless.

    Raises:
        ObjectiveError: shapes differ; mask not bool; no True position.

    Source: the diagnostic of OpenAI Baselines' PPO2 (``explained_variance``), standard in PPO implementations.
    """
    from .logprobs import masked_var

    check_same_shape("values", values, "returns", returns)
    var_returns = float(masked_var(returns, mask))
    if var_returns == 0:
        return float("nan")
    return 1.0 - float(masked_var(returns - values, mask)) / var_returns


def ratio_statistics(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, clipped: torch.Tensor
                     ) -> dict[str, tuple[float, float]]:
    """The clip and drift statistics of a policy update, as (sum over tokens, token count) pairs.

    With is_log_ratio_t = logps_t - old_logps_t on the counted tokens of a rollout sampled from pi_old:

        clip_fraction  share of tokens where the clipped surrogate was active (``clipped``)
        ratio_mean     mean importance ratio exp(is_log_ratio) (1 on the first pass)
        approx_kl      mean k3 estimate of KL(pi_old || pi_theta) per token, from samples of pi_old:
                       k3(rho) with rho = old_logps - logps (Schulman 2020)

    The pairs are summed over micro-batches and processes and divided once, so the logged value is the
    token mean of the whole batch whatever the micro-batch size or process count. DETACHED.

    Shape: logps, old_logps (B, T) float, mask, clipped (B, T) bool -> {name: (sum, count)}.
    Units: dimensionless (fractions, ratios); approx_kl in nats per token.

    Raises:
        ObjectiveError: shapes differ; masks not bool.

    Source: Schulman 2020 ("Approximating KL Divergence", k3); the PPO diagnostics of Schulman et al. 2017.
    """
    from .kl import kl_estimate
    from .logprobs import masked_sum

    check_same_shape("logps", logps, "old_logps", old_logps)
    check_mask(mask, logps, "logps")
    check_mask(clipped, logps, "logps")
    with torch.no_grad():
        is_log_ratio = (logps - old_logps).float()
        count = float(mask.sum())
        return {
            "clip_fraction": (float((clipped & mask).sum()), count),
            "ratio_mean": (float(masked_sum(is_log_ratio.exp(), mask)), count),
            "approx_kl": (float(masked_sum(kl_estimate(-is_log_ratio, "k3"), mask)), count),
        }

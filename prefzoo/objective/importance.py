"""Importance ratios and weights beyond PPO's per-token ratio: GSPO's sequence ratio, CISPO's clipped weight.

- :func:`sequence_log_ratio`: log of GSPO's length-normalised sequence ratio s_i (Zheng et al. 2025), or of the
  whole sequence's ratio pi(y)/pi_old(y) (``length_normalised=False``).
- :func:`gspo_token_log_ratio`: GSPO-token's per-token ratio, the value of s_i with a per-token gradient.
- :func:`sequence_clipped_surrogate_loss`: PPO's clipped surrogate on a sequence ratio, one clip decision per
  sequence (GSPO; TRL 1.16's RLOO on the whole sequence's ratio).
- :func:`clipped_is_weight`: CISPO's clipped importance-sampling weight, detached (MiniMax-M1 2025).
- :func:`weighted_policy_gradient_loss`: -sg(w) A log pi per token (CISPO; REINFORCE when w = 1).
- :func:`sampler_mismatch` / :func:`truncated_is_weights`: how far a rollout engine's log-probs are from the
  trainer's, and the truncated importance-sampling weights that correct for it (Yao et al. 2025).

Both ratios are LOG-ratios against a zero "old" log-prob, so PPO's clipped surrogate
(:func:`prefzoo.objective.clipped_surrogate_loss` with ``old_logps = 0``) clips them unchanged.
"""

from __future__ import annotations

import torch

from .errors import ObjectiveError, check_mask, check_ndim, check_number, check_same_shape

__all__ = ["sequence_log_ratio", "gspo_token_log_ratio", "sequence_clipped_surrogate_loss", "clipped_is_weight",
           "weighted_policy_gradient_loss", "sampler_mismatch", "truncated_is_weights"]


def _is_log_ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    check_ndim("logps", logps, 2, "(B, T)")
    check_same_shape("logps", logps, "old_logps", old_logps)
    check_mask(mask, logps, "logps")
    diff = logps - old_logps.detach()
    return torch.where(mask, diff, torch.zeros((), dtype=diff.dtype, device=diff.device))


def sequence_log_ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor,
                       length_normalised: bool = True) -> torch.Tensor:
    """log s_i, GSPO's sequence-level importance ratio: the MEAN over the row's valid tokens of log(pi/pi_old).

        s_i = (pi(y_i | x) / pi_old(y_i | x))^(1/|y_i|) = exp( (1/|y_i|) sum_{t valid} (logps - old_logps)_t )

    With ``length_normalised=False`` the SUM instead: log of the whole sequence's ratio pi(y_i | x) / pi_old(y_i | x)
    (the ratio of REINFORCE-style methods that treat the completion as one action, TRL 1.16's RLOO).

    Only positions where ``mask`` is True enter, in value and in gradient (pads may hold anything, NaN
    included); a row with no valid token has log s = 0 (ratio 1). Differentiable in ``logps``
    (d log s_i / d logps_{i,t} = 1/|y_i|, or 1 unnormalised, on valid tokens); ``old_logps`` is detached.

    Shape: logps (B, T), old_logps (B, T), mask (B, T) bool -> (B,); B = sequences, T = completion positions.
    Units: nats per token (normalised) or nats (the log of a dimensionless ratio).

    Raises:
        ObjectiveError: shapes differ or not 2-D; mask not bool.

    Source: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071), sec. 4.1: the
    length-normalised s_i(theta) of the GSPO objective; Ahmadian et al. 2024 ("Back to Basics", sec. 3.2: the
    whole completion as one action) for the unnormalised ratio.
    """
    diff = _is_log_ratio(logps, old_logps, mask)
    if not length_normalised:
        return diff.sum(-1)
    counts = mask.sum(-1).clamp(min=1).to(diff.dtype)
    return diff.sum(-1) / counts


def gspo_token_log_ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_{i,t} of GSPO-token: s_{i,t} = sg[s_i] * pi(y_{i,t}) / sg[pi(y_{i,t})].

    Its VALUE is the sequence ratio s_i on every valid token; its GRADIENT is that of the token's own
    log-prob, scaled by s_i (d s_{i,t} / d logps_{i,t} = s_i). With an advantage that is the same on every
    token of a row, GSPO-token and GSPO have the same value and gradient (Zheng et al. 2025, sec. 4.3);
    per-token advantages make them differ. 0 at masked positions.

    Shape: logps (B, T), old_logps (B, T), mask (B, T) bool -> (B, T).
    Units: nats (log of a dimensionless ratio).

    Raises:
        ObjectiveError: shapes differ or not 2-D; mask not bool.

    Source: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071), sec. 4.3 (GSPO-token).
    """
    log_s = sequence_log_ratio(logps, old_logps, mask).detach()
    per_token = log_s[:, None] + logps - logps.detach()
    return torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))


def sequence_clipped_surrogate_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                                    mask: torch.Tensor, clip_eps_low: float, clip_eps_high: float,
                                    length_normalised: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate on a SEQUENCE ratio: a whole sequence is clipped or kept.

        s_i      = exp(sequence_log_ratio(logps, old_logps, mask, length_normalised))      (B,)
        loss_i   = -min( s_i A_i, clip(s_i, 1 - clip_eps_low, 1 + clip_eps_high) A_i )

    loss_i is put on every valid token of row i (0 on padding), so the per-sequence mean of the returned tensor is
    loss_i exactly (``loss_aggregation=grpo``: the mean over sequences of loss_i, as the papers reduce it). A_i is
    the row's advantage: ``advantages`` (B,), or (B, T) read at the row's last valid token. ``clipped`` marks every
    valid token of a clipped sequence (where the min picks the clipped term: the sequence's gradient is 0).

    With ``length_normalised`` (GSPO) the gradient of an unclipped row is -s_i A_i (1/|y_i|) sum_t grad log pi; without
    it (the whole sequence's ratio, TRL 1.16's RLOO) -s_i A_i sum_t grad log pi: REINFORCE on the completion as one
    action, importance-weighted.

    Shape: logps, old_logps (B, T), advantages (B,) or (B, T), mask (B, T) bool -> (per_token_loss (B, T),
    clipped (B, T) bool); B = sequences, T = completion positions.
    Units: advantage units.

    Raises:
        ObjectiveError: shapes disagree or not 2-D; mask not bool; clip_eps_low not in [0, 1); clip_eps_high < 0.

    Source: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071), sec. 4.1 (the GSPO
    objective, eq. 5 and the sequence clip); Schulman et al. 2017, eq. 7 (the clipped surrogate it applies).
    """
    from .logprobs import last_token_index
    from .surrogate import clipped_surrogate_loss

    log_s = sequence_log_ratio(logps, old_logps, mask, length_normalised)  # (B,)
    if advantages.dim() == 2:
        check_same_shape("advantages", advantages, "logps", logps)
        advantages = advantages.gather(1, last_token_index(mask).clamp(min=0)[:, None])[:, 0]
    elif advantages.shape != log_s.shape:
        raise ObjectiveError(f"advantages has shape {tuple(advantages.shape)} but logps has shape "
                             f"{tuple(logps.shape)}; advantages must be (B,) per sequence or (B, T) per token")
    has_tokens = mask.any(-1, keepdim=True)
    seq_loss, seq_clipped = clipped_surrogate_loss(log_s[:, None], torch.zeros_like(log_s[:, None]),
                                                   advantages[:, None], has_tokens, clip_eps_low, clip_eps_high)
    per_token = torch.where(mask, seq_loss.expand_as(logps), torch.zeros((), dtype=seq_loss.dtype, device=logps.device))
    return per_token, seq_clipped & mask


def clipped_is_weight(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, clip_eps_low: float,
                      clip_eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO's importance-sampling weight: the clipped ratio, DETACHED (a stop-gradient).

        w_t = sg( clip( exp(logps_t - old_logps_t), 1 - clip_eps_low, 1 + clip_eps_high ) )

    ``clipped`` marks the valid tokens whose ratio fell outside the range (their weight is the bound). Unlike
    PPO's clip, a clipped token is NOT dropped: the loss -w A log pi (:func:`weighted_policy_gradient_loss`)
    still gives it the gradient -w A grad log pi. ``clip_eps_low = 1`` means no lower bound (weights in
    [0, 1 + clip_eps_high]: the paper's choice). w = 0 at masked positions.

    Shape: logps (B, T), old_logps (B, T), mask (B, T) bool -> (weights (B, T), clipped (B, T) bool).
    Units: dimensionless.

    Raises:
        ObjectiveError: shapes differ or not 2-D; mask not bool; clip_eps_low outside [0, 1]; clip_eps_high < 0.

    Source: MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention"
    (arXiv:2506.13585), sec. 3 (CISPO: r_hat = clip(r, 1 - eps_low^IS, 1 + eps_high^IS) under sg).
    """
    low = check_number("clip_eps_low", clip_eps_low, low=0.0, high=1.0,
                       hint="1 - clip_eps_low is the weight's lower bound; 1 means none")
    high = check_number("clip_eps_high", clip_eps_high, low=0.0)
    with torch.no_grad():
        ratio = _is_log_ratio(logps, old_logps, mask).exp()
        weight = ratio.clamp(1.0 - low, 1.0 + high)
        clipped = (weight != ratio) & mask
        return torch.where(mask, weight, torch.zeros_like(weight)), clipped


def weighted_policy_gradient_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                                  weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token policy-gradient loss with a detached weight: loss_t = -sg(w_t) * A_t * logps_t.

    Its gradient is exactly -w_t A_t grad log pi(y_t) on every valid token (no token is ever zeroed).
    ``weights=None`` is w = 1: the REINFORCE loss (Williams 1992), whose expected gradient on-policy is
    -A grad log pi. Advantages are detached. The VALUE is not an objective estimate (only the gradient is
    meaningful). 0 at masked positions.

    Shape: logps (B, T), advantages (B,) (broadcast over T) or (B, T), mask (B, T) bool, weights (B, T) or
    None -> (B, T).
    Units: advantage units x nats per token.

    Raises:
        ObjectiveError: shapes disagree; mask not bool.

    Source: Williams 1992, "Simple Statistical Gradient-Following Algorithms for Connectionist Reinforcement
    Learning" (REINFORCE); MiniMax 2025 (MiniMax-M1, arXiv:2506.13585), sec. 3 (the CISPO objective
    sg(r_hat) A log pi per token).
    """
    check_ndim("logps", logps, 2, "(B, T)")
    check_mask(mask, logps, "logps")
    if advantages.dim() == 1 and advantages.shape[0] == logps.shape[0]:
        advantages = advantages[:, None]
    elif advantages.shape != logps.shape:
        raise ObjectiveError(f"advantages has shape {tuple(advantages.shape)} but logps has shape "
                             f"{tuple(logps.shape)}; advantages must be (B,) per sequence or (B, T) per token")
    coeff = advantages.detach().to(logps.dtype)
    if weights is not None:
        check_same_shape("weights", weights, "logps", logps)
        coeff = coeff * weights.detach().to(logps.dtype)
    loss = -coeff * logps
    return torch.where(mask, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))


def sampler_mismatch(old_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the log-probs a rollout engine reported are from the trainer's recomputation, per token.

        delta_t = old_logps_t - sampler_logps_t        (log pi_trainer_old - log pi_engine, on counted tokens)

    Returns ``logp_diff_mean`` (mean |delta| over the counted tokens), ``logp_diff_max`` (max |delta|) and
    ``logp_diff_signed`` (mean delta), in nats per token; all 0 when no token counts. DETACHED.

    Shape: old_logps, sampler_logps (B, T) float, mask (B, T) bool -> {name: float}.

    Units: inputs nats per token; outputs nats per token.

    Raises:
        ObjectiveError: shapes differ or not 2-D; mask not bool.

    Source: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (the
    sampler/trainer gap); TRL's ``sampling/sampling_logp_difference/{mean,max}``.
    """
    with torch.no_grad():
        delta = _is_log_ratio(old_logps.float(), sampler_logps.float(), mask)
        n = int(mask.sum())
        if n == 0:
            return {"logp_diff_mean": 0.0, "logp_diff_max": 0.0, "logp_diff_signed": 0.0}
        return {"logp_diff_mean": float(delta.abs().sum() / n), "logp_diff_max": float(delta.abs().max()),
                "logp_diff_signed": float(delta.sum() / n)}


def truncated_is_weights(old_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, cap: float
                         ) -> torch.Tensor:
    """Truncated importance-sampling weights of a rollout drawn by an engine other than the trainer, DETACHED.

        w_t = min( pi_trainer_old(y_t) / pi_engine(y_t), C ) = min( exp(old_logps_t - sampler_logps_t), C )

    The samples come from pi_engine, while the update's surrogate assumes pi_trainer_old; weighting each token's
    loss by w_t corrects the expectation, and the cap C bounds the variance. Because w_t >= 0, weighting a
    per-token loss linear in the advantage (PPO's clipped surrogate: -min(rho A, clip(rho) A), REINFORCE, CISPO's
    -sg(r) A log pi) equals multiplying the advantage by w_t: min(rho w A, clip(rho) w A) = w min(rho A, clip(rho) A).
    w = 1 at masked positions.

    Shape: old_logps, sampler_logps (B, T) float, mask (B, T) bool -> (B, T) float32.
    Units: dimensionless.

    Raises:
        ObjectiveError: shapes differ or not 2-D; mask not bool; cap not > 0.

    Source: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (truncated
    importance sampling, TIS); TRL's ``vllm_importance_sampling_correction`` / ``vllm_importance_sampling_cap``.
    """
    c = check_number("cap", cap, low=0.0, strict_low=True, hint="the largest weight a token may get, e.g. 2.0")
    with torch.no_grad():
        delta = _is_log_ratio(old_logps.float(), sampler_logps.float(), mask)
        weights = delta.exp().clamp(max=c)
        return torch.where(mask, weights, torch.ones_like(weights))

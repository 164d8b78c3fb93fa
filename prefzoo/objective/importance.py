"""Importance ratios and weights beyond PPO's per-token ratio: GSPO's sequence ratio, CISPO's clipped weight.

- :func:`sequence_log_ratio`: log of GSPO's length-normalised sequence ratio s_i (Zheng et al. 2025), or of the
  whole sequence's ratio pi(y)/pi_old(y) (``length_normalised=False``).
- :func:`gspo_token_log_ratio`: GSPO-token's per-token ratio, the value of s_i with a per-token gradient.
- :func:`sequence_clipped_surrogate_loss`: PPO's clipped surrogate on a sequence ratio, one clip decision per
  sequence (GSPO; TRL 1.16's RLOO on the whole sequence's ratio).
- :func:`clipped_is_weight`: CISPO's clipped importance-sampling weight, detached (MiniMax-M1 2025).
- :func:`weighted_policy_gradient_loss`: -sg(w) A log pi per token (CISPO; REINFORCE when w = 1).
- :func:`importance_sampling_loss`: -ratio A per token, the unclipped importance-weighted policy gradient (Tinker's
  ``importance_sampling`` loss).
- :func:`sampler_mismatch`, :func:`correction_metrics`: how far a sampler's log-probs (a rollout engine's, a stale
  policy's) are from the trainer's; :func:`correction_weights`: the importance weights that correct for it, truncated
  (TIS) or masked (MIS, IcePop), per token or per sequence (Yao et al. 2025; Liu et al. 2025).

Both ratios are LOG-ratios against a zero "old" log-prob, so PPO's clipped surrogate
(:func:`prefzoo.objective.clipped_surrogate_loss` with ``old_logps = 0``) clips them unchanged.
"""

from __future__ import annotations

import torch

from .errors import ObjectiveError, check_mask, check_ndim, check_number, check_same_shape

__all__ = ["sequence_log_ratio", "gspo_token_log_ratio", "sequence_clipped_surrogate_loss", "clipped_is_weight",
           "weighted_policy_gradient_loss", "importance_sampling_loss", "sampler_mismatch", "CORRECTION_MODES", "correction_log_ratio",
           "correction_weights", "correction_metrics"]


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


def importance_sampling_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                             mask: torch.Tensor) -> torch.Tensor:
    """Per-token importance-weighted policy-gradient loss, no clip: loss_t = -exp(logps_t - old_logps_t) * A_t.

    Its gradient is -ratio_t A_t grad log pi(y_t): REINFORCE on samples drawn from pi_old, corrected by the
    importance ratio (unbiased for the on-policy gradient, unbounded variance: PPO's clip is what bounds it). At
    logps == old_logps (the first pass on fresh samples) the value is -A_t and the gradient REINFORCE's. old_logps
    and advantages are detached. 0 at masked positions.

    Shape: logps (B, T), old_logps (B, T), advantages (B,) (broadcast over T) or (B, T), mask (B, T) bool -> (B, T).
    Units: advantage units per token.

    Raises:
        ObjectiveError: shapes disagree or not 2-D; mask not bool.

    Source: the policy gradient theorem with importance sampling (Sutton & Barto 2018, sec. 13.2 and 5.5; Degris et
    al. 2012, "Off-Policy Actor-Critic", eq. 4, per token); the ``importance_sampling`` loss of Tinker (Thinking
    Machines, loss functions docs: -sum exp(lp - lp_sampler) A).
    """
    log_ratio = _is_log_ratio(logps, old_logps, mask)
    if advantages.dim() == 1 and advantages.shape[0] == logps.shape[0]:
        advantages = advantages[:, None]
    elif advantages.shape != logps.shape:
        raise ObjectiveError(f"advantages has shape {tuple(advantages.shape)} but logps has shape "
                             f"{tuple(logps.shape)}; advantages must be (B,) per sequence or (B, T) per token")
    loss = -log_ratio.exp() * advantages.detach().to(logps.dtype)
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


CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def correction_log_ratio(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor
                         ) -> torch.Tensor:
    """delta_t = log pi_trainer(y_t) - log pi_sampler(y_t) on counted tokens, 0 elsewhere, DETACHED.

    A counted token whose sampler log-prob is NaN (an engine that could not score it) gets delta = 0: weight 1, no
    correction, rather than a NaN in the loss (TRL 1.16's convention). Computed in float32.

    Shape: trainer_logps, sampler_logps (B, T) float, mask (B, T) bool -> (B, T) float32. Units: nats.

    Raises:
        ObjectiveError: shapes differ or not 2-D; mask not bool.

    Source: the log of the importance weight pi_target / pi_behaviour (Kahn & Marshall 1953; Precup et al. 2000 for
    per-decision weights in RL); the NaN convention is TRL 1.16's (``GRPOTrainer``'s importance-sampling block).
    """
    with torch.no_grad():
        delta = _is_log_ratio(trainer_logps.float(), sampler_logps.float(), mask)
        return torch.nan_to_num(delta, nan=0.0)


def correction_weights(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                       clip_min: float | None = None, clip_max: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The importance weights that correct a rollout drawn by a sampler other than the trainer, DETACHED.

    With w = pi_trainer / pi_sampler, the ratio that turns an expectation under the sampler into one under the
    trainer's policy, per token (``token_*``) or per sequence (``sequence_*``):

        token:     w_t = exp(delta_t)                       delta_t = log pi_trainer(y_t) - log pi_sampler(y_t)
        sequence:  w_t = W = exp( sum_{s counted} delta_s )  on every token of the row (the whole completion's ratio)

    and then, with the band [C_min, C_max] (either end None: unbounded),

        truncate (TIS):  w <- clamp(w, C_min, C_max)                 the bias of the cap traded for bounded variance
        mask (MIS):      w <- w if C_min <= w <= C_max, else 0       tokens (or whole sequences) too far off dropped

    Masking at token level with a band [lo, hi] is IcePop's token masking. The weight multiplies each counted token's
    policy-gradient loss (:func:`prefzoo.algos.online_sampling.corrected_advantages`: for a loss linear in the advantage with
    w >= 0 that equals weighting the advantage); a weight of 0 removes the token's gradient but the token still
    counts in the loss normaliser, as in TRL. Only ``mask``'s tokens (the policy's own: an environment's tokens are
    not actions) enter the sequence sum; w = 1 at the others.

    ``rejected`` marks the counted tokens whose weight the band changed (truncated or masked): the share of them is
    the ``correction/frac_*`` metric.

    Shape: trainer_logps, sampler_logps (B, T) float, mask (B, T) bool -> (weights (B, T) float32, rejected (B, T)
    bool); B = sequences, T = completion positions. Units: dimensionless.

    Raises:
        ObjectiveError: shapes differ or not 2-D; mask not bool; mode not one of :data:`CORRECTION_MODES`; a bound
            not > 0; clip_min > clip_max.

    Source: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (truncated
    importance sampling, TIS, per token); Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse
    from the Training-Inference Mismatch" (sequence-level TIS and masked IS, MIS); Ling Team 2025, "Every Step Evolves:
    Scaling Reinforcement Learning for Trillion-Scale Thinking Model" (Ring-1T, IcePop: token masking outside a
    band). Conventions (sequence weight from the SUM of log-ratios, masked weight 0, NaN sampler log-prob -> weight 1)
    are TRL 1.16's ``vllm_importance_sampling_mode`` / ``_clip_min`` / ``_clip_max``, checked against its code in
    ``bench/compare_trl_correction.py``.
    """
    from .errors import check_choice

    check_choice("mode", mode, CORRECTION_MODES)
    low = None if clip_min is None else check_number("clip_min", clip_min, low=0.0, strict_low=True)
    high = None if clip_max is None else check_number("clip_max", clip_max, low=0.0, strict_low=True)
    if low is not None and high is not None and low > high:
        raise ObjectiveError(f"clip_min={low} > clip_max={high}: the band [clip_min, clip_max] is empty")
    with torch.no_grad():
        delta = correction_log_ratio(trainer_logps, sampler_logps, mask)
        if mode.startswith("sequence"):
            delta = delta.sum(-1, keepdim=True).expand_as(delta)
        ratio = delta.exp()
        if mode.endswith("truncate"):
            weights = ratio.clamp(min=low, max=high) if (low, high) != (None, None) else ratio
            changed = weights != ratio
        else:
            changed = torch.zeros_like(mask)
            if low is not None:
                changed = changed | (ratio < low)
            if high is not None:
                changed = changed | (ratio > high)
            weights = ratio.masked_fill(changed, 0.0)
        rejected = changed & mask
        return torch.where(mask, weights, torch.ones_like(weights)), rejected


def correction_metrics(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                       weights: torch.Tensor | None = None, rejected: torch.Tensor | None = None,
                       sequence_level: bool = False) -> dict[str, float]:
    """How far the sampler is from the trainer, and what the correction did, over the counted tokens. DETACHED.

    With delta_t = log pi_trainer(y_t) - log pi_sampler(y_t) and r_t = exp(delta_t), y_t drawn by the SAMPLER:

        mismatch_k1  = mean_t(-delta_t)                  an unbiased estimate of KL(pi_sampler || pi_trainer) per token
        mismatch_k3  = mean_t(r_t - 1 - delta_t)         the same KL, unbiased and >= 0 per sample (Schulman 2020)
        ratio_mean   = mean_t(r_t)                       1 in expectation for a sampler and trainer with one support

    and, given the correction's ``weights`` (:func:`correction_weights`): ``weight_mean``, ``weight_min``,
    ``weight_max``; ``frac_rejected``, the share of tokens (``sequence_level``: of sequences) whose weight the band
    truncated or masked; ``ess``, the normalised effective sample size (sum w)^2 / (n sum w^2) in (0, 1] over the
    n tokens (sequences), 1 when every weight is equal (Kong 1992). Without a counted token every value is 0 but
    ``ess`` (1).

    Shape: trainer_logps, sampler_logps, weights (B, T), mask, rejected (B, T) bool -> {name: float}.
    Units: mismatch in nats per token; the rest dimensionless.

    Raises:
        ObjectiveError: shapes differ or not 2-D; mask not bool.

    Source: Schulman 2020, "Approximating KL Divergence" (k1, k3); Kong 1992 / Liu 1996 (the effective sample size
    of importance weights); TRL 1.16's ``sampling/importance_sampling_ratio/{min,mean,max}``.
    """
    with torch.no_grad():
        delta = correction_log_ratio(trainer_logps, sampler_logps, mask)
        n = int(mask.sum())
        out = {"mismatch_k1": 0.0, "mismatch_k3": 0.0, "ratio_mean": 0.0}
        if n:
            d = delta[mask]
            out.update(mismatch_k1=float(-d.mean()), mismatch_k3=float((d.exp() - 1 - d).mean()),
                       ratio_mean=float(d.exp().mean()))
        if weights is None:
            return out
        check_same_shape("weights", weights, "trainer_logps", trainer_logps)
        if sequence_level:
            rows = mask.any(-1)
            first = mask.float().argmax(-1)
            w = weights.float().gather(1, first[:, None])[:, 0][rows]
            hit = (rejected.any(-1) if rejected is not None else torch.zeros_like(rows))[rows]
        else:
            w = weights.float()[mask]
            hit = rejected[mask] if rejected is not None else torch.zeros_like(w, dtype=torch.bool)
        if w.numel() == 0:
            out.update(weight_mean=0.0, weight_min=0.0, weight_max=0.0, frac_rejected=0.0, ess=1.0)
            return out
        square = float((w * w).sum())
        out.update(weight_mean=float(w.mean()), weight_min=float(w.min()), weight_max=float(w.max()),
                   frac_rejected=float(hit.float().mean()),
                   ess=min(1.0, float(w.sum()) ** 2 / (w.numel() * square)) if square > 0 else 0.0)  # (<= 1: C-S)
        return out

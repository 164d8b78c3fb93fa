"""PPO's clipped surrogate objective (with DAPO's asymmetric clip and INTELLECT-2's two-sided clip) and clipped value
loss; the surrogates that replace the ratio clip (DPPO's divergence mask, SAPO's soft gate, DRO's quadratic penalty,
VESPO's sequence-level gamma kernel).

Both functions return the per-token LOSS (= -objective for the policy) with zeros at masked
positions, plus a bool tensor saying where clipping was active; reduce them with
``reduce.aggregate_loss``.
"""

from __future__ import annotations

import math

import torch

from .errors import ObjectiveError, check_choice, check_mask, check_ndim, check_number, check_same_shape

__all__ = ["clipped_surrogate_loss", "clipped_value_loss", "explained_variance", "ratio_statistics",
           "TRUST_REGION_LOSSES", "dppo_loss", "sapo_loss", "dro_loss", "vespo_loss"]


def clipped_surrogate_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float | None = None,
    ratio_max: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped surrogate loss, with an optional higher upper clip (clip-higher) and an optional cap on
    the unclipped branch's ratio (the two-sided clip).

        ratio     = exp(logps - old_logps)                 (old_logps is detached)
        objective = min(min(ratio, ratio_max) * A, clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * A)
        loss      = -objective, 0 at masked positions

    ``ratio_max`` (None: no cap, PPO) is INTELLECT-2's delta: PPO's min leaves the ratio unbounded for A < 0 (the
    unclipped branch is the smaller one there once ratio > 1 + clip_eps_high), so a token the update made much more
    likely keeps a gradient -A grad ratio that grows with the ratio; capped at delta, the branch is the constant
    delta * A past delta and the token's gradient is 0. For A > 0 the cap changes nothing when delta >
    1 + clip_eps_high (the clipped branch is already the smaller one there). The ratio_max = delta > 1 + clip_eps_high
    that the report recommends is checked by the config (``algo.clip_delta``), not here.

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
            [0, 1); clip_eps_high < 0; ratio_max <= 1.

    Source: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7 (L^CLIP);
    Yu et al. 2025, "DAPO", sec. 3.1 (Clip-Higher: decoupled clip_eps_low, clip_eps_high); Prime Intellect 2025,
    "INTELLECT-2" (arXiv 2505.07291), sec. 3.2, two-sided clipping (delta; TRL 1.16's ``GRPOConfig.delta``). The
    dual-clip of Ye et al. 2020 (verl's ``clip_ratio_c``) bounds the same A < 0 branch by -c * A from below, the same
    value with c = delta.
    """
    check_ndim("logps", logps, 2, "(B, T)")
    check_same_shape("logps", logps, "old_logps", old_logps)
    check_mask(mask, logps, "logps")
    clip_eps_low = check_number("clip_eps_low", clip_eps_low, low=0.0, high=1.0, strict_high=True)
    clip_eps_high = (clip_eps_low if clip_eps_high is None
                    else check_number("clip_eps_high", clip_eps_high, low=0.0))
    if ratio_max is not None:
        ratio_max = check_number("ratio_max", ratio_max, low=1.0, strict_low=True)
    if advantages.dim() == 1 and advantages.shape[0] == logps.shape[0]:
        advantages = advantages[:, None]
    elif advantages.shape != logps.shape:
        raise ObjectiveError(
            f"advantages has shape {tuple(advantages.shape)} but logps has shape "
            f"{tuple(logps.shape)}; advantages must be (B,) per sequence or (B, T) per token"
        )
    advantages = advantages.detach()

    ratio = torch.exp(logps - old_logps.detach())
    unclipped = (ratio if ratio_max is None else ratio.clamp(max=ratio_max)) * advantages
    clipped_obj = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high).detach() * advantages
    clipped = clipped_obj < unclipped
    objective = torch.where(clipped, clipped_obj, unclipped)
    if ratio_max is not None:  # past delta both branches are constants: no gradient either way
        clipped = clipped | ((ratio.detach() > ratio_max) & (advantages != 0))
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


# ------------------------------------------------------------------------ surrogates without PPO's ratio clip
#: the per-token policy losses a group-sampling plugin can choose with ``algo.policy_loss`` besides PPO's clip
TRUST_REGION_LOSSES = ("dppo_tv", "dppo_kl", "sapo", "dro", "vespo")


def _token_advantages(advantages: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    if advantages.dim() == 1 and advantages.shape[0] == logps.shape[0]:
        return advantages.detach()[:, None].expand_as(logps)
    if advantages.shape != logps.shape:
        raise ObjectiveError(f"advantages has shape {tuple(advantages.shape)} but logps has shape "
                             f"{tuple(logps.shape)}; advantages must be (B,) per sequence or (B, T) per token")
    return advantages.detach()


def _checked(logps, old_logps, mask):
    check_ndim("logps", logps, 2, "(B, T)")
    check_same_shape("logps", logps, "old_logps", old_logps)
    check_mask(mask, logps, "logps")


def dppo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              divergence: str, delta_low: float, delta_high: float, ratio_cap: float = 1e4
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss of DPPO (Divergence Proximal Policy Optimization): a policy gradient whose trust region is a
    mask on a divergence between pi_old and pi_theta at the sampled token, in place of PPO's ratio clip.

    With p = pi_theta(y_t), q = pi_old(y_t) (the token's probabilities; the "binary" approximation treats each
    position's distribution as {y_t, not y_t}), rho = p / q and A the advantage:

        divergence="tv":  the signed binary total variation p - q; a token is dropped when
                          A > 0 and p - q > delta_high, or A < 0 and p - q < -delta_low
        divergence="kl":  the binary KL  D = q log(q/p) + (1-q) log((1-q)/(1-p)); a token is dropped when
                          D > delta (delta_high for A > 0, delta_low for A < 0) and p moved in A's direction
                          (p > q for A > 0, p < q for A < 0)
        loss = -A * sg(min(rho, ratio_cap)) * log p * keep,   keep = 0 on a dropped token, else 1

    The gradient of a kept token is -A min(rho, C) grad log p, which for rho < C is PPO's unclipped gradient
    -A grad rho; a dropped token gives none (as a clipped one in PPO), but the mask depends on how far the
    PROBABILITY moved, not the ratio, so rare tokens (small q) may move by large ratios and common ones are held
    close (the paper's argument against ratio clipping). At the first pass (p = q) nothing is dropped and the loss's
    gradient is REINFORCE's: -A grad log p. A (B,) advantage is broadcast over T. 0 where masked; ``dropped`` is the
    mask (reported as ``clip_fraction``).

    Shape: logps, old_logps (B, T) float, advantages (B,) or (B, T), mask (B, T) bool -> (per_token (B, T),
    dropped (B, T) bool). Units: advantage units x nats per token (the value is -A rho log p, not -A rho).

    Raises:
        ObjectiveError: shapes; mask not bool; unknown divergence; delta_low / delta_high < 0; ratio_cap <= 0.

    Source: "Rethinking the Trust Region in LLM Reinforcement Learning" (arXiv 2602.04879), DPPO-Binary-TV and
    DPPO-Binary-KL. Departures: the anchor is pi_old (the log-probs at sampling time recomputed by the trainer, the
    paper's "recompute" variant, as verl's ``dppo_tv``/``dppo_kl``); with ``rollout.correction.bypass`` it is the
    sampler's, the paper's main variant. The 1e-8 in verl's binary KL is not needed here: p, q < 1 are clamped to
    1 - 1e-7 before log(1 - p). The truncation cap defaults to 1e4 (the paper's recipe; verl's actor default 3.0).
    """
    _checked(logps, old_logps, mask)
    check_choice("divergence", divergence, ("tv", "kl"))
    delta_low = check_number("delta_low", delta_low, low=0.0)
    delta_high = check_number("delta_high", delta_high, low=0.0)
    ratio_cap = check_number("ratio_cap", ratio_cap, low=0.0, strict_low=True)
    a = _token_advantages(advantages, logps)
    with torch.no_grad():
        dtype = torch.promote_types(logps.dtype, torch.float32)
        lp, lq = logps.detach().to(dtype), old_logps.detach().to(dtype)
        p, q = lp.exp(), lq.exp()
        positive = a > 0
        if divergence == "tv":
            dropped = torch.where(positive, p - q > delta_high, p - q < -delta_low)
        else:
            one = 1.0 - 1e-7
            d = q * (lq - lp) + (1 - q) * (torch.log1p(-q.clamp(max=one)) - torch.log1p(-p.clamp(max=one)))
            dropped = torch.where(positive, (d > delta_high) & (p > q), (d > delta_low) & (p < q))
        dropped = dropped & (a != 0) & mask
        weight = torch.exp(lp - lq).clamp(max=ratio_cap) * (~dropped)
    loss = -a * weight * logps
    return torch.where(mask, loss, torch.zeros_like(loss)), dropped


def sapo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              temperature_pos: float = 1.0, temperature_neg: float = 1.05
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss of SAPO (Soft Adaptive Policy Optimization): a smooth gate on the token's ratio in place of the
    clip.

        rho = exp(logps - old_logps),  tau = temperature_pos if A > 0 else temperature_neg
        f(rho) = (4 / tau) * sigmoid(tau * (rho - 1))
        loss = -f(rho) * A,  0 where masked

    d f / d rho = 4 sigma (1 - sigma) = 1 at rho = 1, so on the first pass the gradient is the policy gradient
    -A grad rho = -A grad log pi; away from rho = 1 the weight 4 sigma(1 - sigma) decays smoothly (faster for the
    negative advantages, tau_neg > tau_pos: the paper's asymmetry), where PPO's clip cuts it to 0 at a fixed band.
    Also returns that gradient weight (detached), which the plugin reports as ``gate_weight_mean``; nothing is
    "clipped" (the plugin's ``clip_fraction`` counts the tokens whose weight fell below 1/2).

    Shape: logps, old_logps (B, T), advantages (B,) or (B, T), mask (B, T) bool -> (per_token (B, T), weight (B, T),
    below_half (B, T) bool). Units: advantage units per token.

    Raises:
        ObjectiveError: shapes; mask not bool; a temperature <= 0.

    Source: Gao et al. 2025, "Soft Adaptive Policy Optimization" (arXiv 2511.20347), the token-level gate (eq. of
    f_{i,t}); defaults tau_pos 1.0, tau_neg 1.05 (the paper's, TRL 1.16's ``sapo_temperature_pos/neg``). The
    reduction is the plugin's ``loss_aggregation`` (the paper's and TRL's: the sequence mean, then the batch mean,
    which is ``grpo``).
    """
    _checked(logps, old_logps, mask)
    tau_pos = check_number("temperature_pos", temperature_pos, low=0.0, strict_low=True)
    tau_neg = check_number("temperature_neg", temperature_neg, low=0.0, strict_low=True)
    a = _token_advantages(advantages, logps)
    tau = torch.where(a > 0, torch.full_like(a, tau_pos), torch.full_like(a, tau_neg))
    ratio = torch.exp(logps - old_logps.detach())
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * gate * a
    with torch.no_grad():
        weight = 4.0 * gate * (1.0 - gate)
    return torch.where(mask, loss, torch.zeros_like(loss)), weight * mask, (weight < 0.5) & mask


def dro_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss of DRO as Tinker and verl ship it: the policy gradient with a quadratic penalty on the log-ratio
    to the sampling policy, no clip and no ratio.

        delta = logps - old_logps
        loss = -(A * logps - (beta / 2) * delta^2),   0 where masked

    gradient -(A - beta * delta) grad log pi: a token's update shrinks as its log-prob moves away from the one it was
    sampled with, and reverses past delta = A / beta (a soft trust region in log space). On the first pass
    (delta = 0) it is REINFORCE's gradient. ``over`` marks the tokens past that point (|beta delta| > |A| with
    the same sign as A: the penalty outweighs the advantage), reported as ``clip_fraction``.

    Shape: logps, old_logps (B, T), advantages (B,) or (B, T), mask (B, T) bool -> (per_token (B, T), over (B, T)
    bool). Units: advantage units x nats per token.

    Raises:
        ObjectiveError: shapes; mask not bool; beta < 0.

    Source: the "dro" loss of Tinker (Thinking Machines, loss functions docs: -sum[lp A - beta/2 (lp - lp_sampler)^2])
    and verl's ``policy_loss.loss_mode=dro`` (``dro_beta``, no default there); the surrogate is Kimi k1.5's (Kimi Team
    2025, sec. 2.3.3), not Richemond et al. 2024's squared-residual DRO with a learned value. The penalty is to pi_old
    (the sampling policy), not to pi_ref: the KL to pi_ref is still ``objective.beta``'s.
    """
    _checked(logps, old_logps, mask)
    beta = check_number("beta", beta, low=0.0)
    a = _token_advantages(advantages, logps)
    delta = logps - old_logps.detach()
    loss = -(a * logps - 0.5 * beta * delta ** 2)
    with torch.no_grad():
        push = beta * delta.detach()
        over = ((a > 0) & (push > a)) | ((a < 0) & (push < a))
    return torch.where(mask, loss, torch.zeros_like(loss)), over & mask


#: the bounds on a VESPO sequence's log weight: TRL 1.16's and the authors' (log 1e-8 below, 20 above; each token's
#: log-ratio is also clamped to [-20, 20] before the sum)
VESPO_LOG_WEIGHT_MIN, VESPO_LOG_WEIGHT_MAX = math.log(1e-8), 20.0


def vespo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0,
               is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss of VESPO (Variational sEquence-level Soft Policy Optimization): REINFORCE weighted by a smooth,
    asymmetric kernel of the sequence's importance weight, in place of a clip.

        log w_i = clamp( sum_t clamp(logps - old_logps, -20, 20)_{i,t} + sum_t log is_weights_{i,t},  ln 1e-8, 20 )
        phi(w)  = w^k exp(lambda (1 - w)) = exp(lambda + k log w - lambda w)       (phi(1) = 1, detached)
        loss    = -phi(w_i) * A * logps,   (k, lambda) = (k_pos, lambda_pos) where A >= 0, else (k_neg, lambda_neg)

    w_i is the PRODUCT of the token ratios of sequence i (no 1/|y| root, unlike GSPO), times the sampler correction's
    token weights when given (``is_weights``: pi_old / pi_sampler, so that w = pi_theta / pi_sampler; then they must
    not also multiply the advantages). phi is a gamma-shaped kernel: it rises as w^k from 0, peaks at w = k / lambda
    and decays as exp(-lambda w), so a sequence far off-policy either way gets a small weight, smoothly (no hard
    clip). The gradient of a token is -phi(w_i) A grad log pi: at the first pass (w = 1) it is REINFORCE's. A (B,)
    advantage is broadcast over T; with per-token advantages the sign (hence k, lambda) is read per token, as TRL's.
    Also returns phi per token (detached; the plugin reports its token mean as ``vespo_phi_mean``) and the tokens
    whose phi fell below 1/2 (reported as ``clip_fraction``, as SAPO's). NaN from exp over/underflow becomes 0 (as
    TRL). 0 where masked.

    Shape: logps, old_logps (B, T) float, advantages (B,) or (B, T), mask (B, T) bool, is_weights (B, T) > 0 or None
    -> (per_token (B, T), phi (B, T), below_half (B, T) bool). Units: advantage units x nats per token.

    Raises:
        ObjectiveError: shapes; mask not bool; k_pos / k_neg < 0; lambda_pos / lambda_neg <= 0.

    Source: Shen et al. 2026, "VESPO: Variational Sequence-Level Soft Policy Optimization" (arXiv 2602.10693), the
    reshaping kernel phi(w) = w^k e^{lambda (1 - w)} on the sequence-level weight; the defaults (k, lambda) = (2, 3)
    for A >= 0 and (3, 2) for A < 0 and the clamps are TRL 1.16's ``loss_type="vespo"`` (``vespo_k_pos`` ...).
    Departure: TRL clamps lambda below at 1e-4; lambda <= 0 is refused here (the kernel has no peak then).
    """
    _checked(logps, old_logps, mask)
    k_pos, k_neg = (check_number(n, v, low=0.0) for n, v in (("k_pos", k_pos), ("k_neg", k_neg)))
    lambda_pos, lambda_neg = (check_number(n, v, low=0.0, strict_low=True)
                              for n, v in (("lambda_pos", lambda_pos), ("lambda_neg", lambda_neg)))
    a = _token_advantages(advantages, logps)
    with torch.no_grad():
        dtype = torch.promote_types(logps.dtype, torch.float32)
        log_ratio = (logps.detach().to(dtype) - old_logps.detach().to(dtype)).clamp(-20.0, 20.0)
        log_w = torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).sum(-1, keepdim=True)
        if is_weights is not None:
            check_same_shape("logps", logps, "is_weights", is_weights)
            log_is = is_weights.detach().to(dtype).log().clamp(VESPO_LOG_WEIGHT_MIN, VESPO_LOG_WEIGHT_MAX)
            log_w = log_w + torch.where(mask, log_is, torch.zeros_like(log_is)).sum(-1, keepdim=True)
        log_w = log_w.clamp(VESPO_LOG_WEIGHT_MIN, VESPO_LOG_WEIGHT_MAX)
        nonneg = a >= 0
        k = torch.where(nonneg, torch.full_like(a, k_pos, dtype=dtype), torch.full_like(a, k_neg, dtype=dtype))
        lam = torch.where(nonneg, torch.full_like(a, lambda_pos, dtype=dtype),
                          torch.full_like(a, lambda_neg, dtype=dtype))
        phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    loss = -phi.to(logps.dtype) * a * logps
    return torch.where(mask, loss, torch.zeros_like(loss)), phi * mask, (phi < 0.5) & mask

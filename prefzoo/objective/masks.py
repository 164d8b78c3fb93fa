"""Masks on the policy term: which tokens or sequences carry the policy-gradient loss at all.

Both return a (B, T) bool "keep" mask (True = this token's policy term counts, DESIGN.md's convention) that the
online family applies to the member's per-token loss BEFORE the KL-as-loss term is added: a dropped token still
pays its KL, as in TRL 1.16, where both masks multiply ``per_token_loss`` before ``beta * per_token_kl``.

    off_policy_sequence_mask   DeepSeek-V3.2's off-policy sequence mask (a negative-advantage sequence the sampler
                               drew far from the current policy teaches nothing reliable: drop it)
    high_entropy_mask          Wang et al. 2025's "80/20" mask (only the highest-entropy "forking" tokens learn)
"""

from __future__ import annotations

import torch

from .errors import check_mask, check_ndim, check_number, check_same_shape

__all__ = ["off_policy_sequence_mask", "high_entropy_mask"]


def off_policy_sequence_mask(logps: torch.Tensor, sampling_logps: torch.Tensor, advantages: torch.Tensor,
                             mask: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3.2's off-policy sequence mask: drop a sequence with a negative advantage whose mean per-token
    log(pi_sampling / pi_theta) exceeds ``threshold``.

        d_i  = (1 / |y_i|) sum_t (sampling_logps - sg(logps))_{i,t}        (over the counted tokens of row i)
        keep = (A >= 0) or (d_i <= threshold)

    d_i is a sample estimate (k1, with samples from pi_sampling) of KL(pi_sampling || pi_theta) per token. A
    positive-advantage sequence is always kept: pushing up what was sampled is safe whatever the policy has become;
    pushing down a sequence the current policy no longer produces is what destabilises training (the report's
    argument). ``sampling_logps`` are the log-probs the sequence was drawn with: the rollout engine's when it reports
    them, else log pi_old, so the mask catches both the drift of the update's own mini-batches and a sampler/trainer
    mismatch. On a rollout's first pass with the trainer as sampler d_i = 0 and nothing is dropped. NaN in
    ``sampling_logps`` (a token an engine could not score) counts as 0, as in TRL. Rows with no counted token:
    d = 0. A (B,) advantage is broadcast; with per-token advantages the sign is read per token (TRL's convention).

    Shape: logps, sampling_logps (B, T) float, advantages (B,) or (B, T), mask (B, T) bool -> (keep (B, T) bool,
    False where masked; d (B,) float, nats per token). Units: d in nats per token; threshold in nats per token.

    Raises:
        ObjectiveError: shapes; mask not bool; threshold not a finite number.

    Source: DeepSeek-AI 2025, "DeepSeek-V3.2" (arXiv 2512.02556), eq. 9 (Off-Policy Sequence Masking, delta); TRL
    1.16's ``GRPOConfig.off_policy_mask_threshold`` (the same mean over counted tokens and NaN handling).
    """
    check_ndim("logps", logps, 2, "(B, T)")
    check_same_shape("logps", logps, "sampling_logps", sampling_logps)
    check_mask(mask, logps, "logps")
    threshold = check_number("threshold", threshold)
    with torch.no_grad():
        dtype = torch.promote_types(logps.dtype, torch.float32)
        diff = (sampling_logps.detach().to(dtype) - logps.detach().to(dtype)).nan_to_num(nan=0.0)
        diff = torch.where(mask, diff, torch.zeros_like(diff))
        d = diff.sum(-1) / mask.sum(-1).clamp(min=1).to(dtype)
        a = advantages.detach()
        a = a[:, None] if a.dim() == 1 else a
        check_same_shape("logps", logps, "advantages", a.expand_as(logps))
        keep = (a >= 0) | (d[:, None] <= threshold)
    return keep.expand_as(mask) & mask, d


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """Keep only the tokens whose entropy is in the top ``quantile`` (rho) of the counted tokens' entropies.

        tau  = the (1 - rho) quantile of {H_t : mask_t}  (linear interpolation between order statistics)
        keep = mask and H >= tau

    rho = 1 keeps every counted token (the mask itself); rho = 0 keeps the highest-entropy token(s) only; the paper
    recommends 0.2. The argument: in chain-of-thought, the few high-entropy "forking" tokens decide the path, and a
    policy gradient on them alone matches or beats one on all tokens. The quantile is over the tokens given (one
    micro-batch of one process, see the plugin's note), detached. No counted token: nothing kept.

    Shape: entropy (B, T) float (nats), mask (B, T) bool -> keep (B, T) bool. Units: nats (entropy, tau).

    Raises:
        ObjectiveError: shapes; mask not bool; quantile not in [0, 1].

    Source: Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective Reinforcement
    Learning for LLM Reasoning" (arXiv 2506.01939), eq. 7 (the token mask with the batch's top-rho entropy quantile);
    TRL 1.16's ``GRPOConfig.top_entropy_quantile`` (``torch.quantile`` at 1 - rho, kept where H >= tau). Departure:
    TRL gathers the tokens of every process before taking the quantile; here it is each process's micro-batch.
    """
    check_ndim("entropy", entropy, 2, "(B, T)")
    check_mask(mask, entropy, "entropy")
    quantile = check_number("quantile", quantile, low=0.0, high=1.0)
    if quantile >= 1.0:
        return mask.clone()
    with torch.no_grad():
        values = entropy.detach()[mask].float()
        if values.numel() == 0:
            return torch.zeros_like(mask)
        tau = torch.quantile(values, 1.0 - quantile)
        return (entropy.detach().float() >= tau) & mask

"""Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071), and GSPO-token.

GRPO's rollout and group advantages (sec. 4.1), with the importance ratio and the clip moved from tokens to
sequences:

    J_GSPO = E[ (1/G) sum_i min( s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i ) ]
    s_i    = (pi(y_i | x) / pi_old(y_i | x))^(1/|y_i|) = exp( (1/|y_i|) sum_t log(pi / pi_old)_{i,t} )
    A_i    = (r_i - mean(r_1..r_G)) / std(r_1..r_G)

so the gradient (unclipped) is (1/G) sum_i s_i A_i (1/|y_i|) sum_t grad log pi(y_{i,t}): every token of a
sequence gets the same weight s_i, and a whole sequence is clipped or kept. GSPO-token (sec. 4.3) uses
s_{i,t} = sg[s_i] pi(y_{i,t}) / sg[pi(y_{i,t})] per token, (1/G) sum_i (1/|y_i|) sum_t min(s_{i,t} A_{i,t}, ...):
the same value and, with A_{i,t} = A_i (here always), the same gradient; it exists for per-token advantages.

Settings (``importance_sampling_level``: ``sequence`` = GSPO, ``sequence_token`` = GSPO-token, TRL's names):
the paper's clip range is tiny, eps_low = 3e-4 and eps_high = 4e-4 (sec. 5.1, the defaults here), because
a sequence ratio is a geometric mean over hundreds of tokens; each rollout is split into 4 mini-batches
(sec. 5.1: ``num_minibatches=4``), so the ratio moves away from 1 after the first optimizer step. The log-probs
at sampling time are stored as ``old_logps`` whenever there is more than one optimizer step per rollout.

Departures and choices:

* Everything but the loss is GRPO's (:class:`prefzoo.algos.grpo.GRPO`): ``scale_rewards``, the KL (the paper
  has none, beta = 0 by default; with beta > 0 the estimator and placement come from ``objective``, a KL loss
  is added per token), ``mask_truncated``, ``loss_aggregation``. The paper's reduction is the mean over
  sequences (``loss_aggregation=grpo``): the sequence loss is put on each of its tokens and averaged per
  sequence, which is exactly (1/G) sum_i. ``dapo`` / ``dr_grpo`` weight sequences by length (a departure).
* Length. The 1/|y_i| inside s_i weights each sequence's gradient by 1/|y_i|, as GRPO's per-sequence mean does.
  With k1 in the reward the fixed point is still pi* (at pi* every shaped reward of a group is equal, so every
  advantage is 0, whatever the weights); with a KL loss it depends on the lengths. The conformance bed
  (single-token responses, ``docs/conformance.md``) cannot show the length effect: there s_i is the token
  ratio and the rows measure the clip and the mini-batches only.

Metrics: GRPO's schema; ``clip_fraction`` counts the tokens of clipped sequences, ``ratio_mean`` is the token
mean of the ratio the loss used (s_i on every token of sequence i), ``approx_kl`` the per-token
KL(pi_old || pi_theta) (k3), ``sequence_clip_fraction`` the share of sequences clipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefzoo.algos import register
from prefzoo.algos.grpo import GRPO, GRPOConfig, drift_metrics
from prefzoo.errors import ConfigError
from prefzoo.objective import (clipped_surrogate_loss, gspo_token_log_ratio, kl_loss, last_token_index, masked_sum,
                               ratio_statistics, sequence_log_ratio)
from prefzoo.types import Experience, LossOutput, ObjectiveSettings, Policy

LEVELS = ("sequence", "sequence_token")


@dataclass
class GSPOConfig(GRPOConfig):
    name: str = "gspo"
    importance_sampling_level: str = "sequence"  # sequence (GSPO) | sequence_token (GSPO-token)
    clip_eps_low: float = 3e-4  # Zheng et al. 2025, sec. 5.1
    clip_eps_high: float = 4e-4
    num_minibatches: int = 4  # sec. 5.1: each rollout is split into four mini-batches


@register
class GSPO(GRPO):
    """GSPO plugin: GRPO's rollout and advantages, sequence-level importance ratio and clip."""

    name = "gspo"
    config_class = GSPOConfig

    @staticmethod
    def validate_settings(cfg: GSPOConfig, objective: ObjectiveSettings) -> None:
        if cfg.importance_sampling_level not in LEVELS:
            raise ConfigError(f"algo.importance_sampling_level={cfg.importance_sampling_level!r}; choose one of "
                              f"{', '.join(LEVELS)} (GSPO, GSPO-token).")
        GRPO.validate_settings(cfg, objective)

    def stores_old_logps(self) -> bool:
        return self.cfg.epochs * self.cfg.num_minibatches > 1

    def loss(self, policy: Policy, batch: Experience) -> LossOutput:
        c = self.cfg
        logps, entropy = policy.logps(batch, self.sampling.temperature, with_entropy=True)
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        mask = batch.loss_mask
        if c.importance_sampling_level == "sequence":
            log_s = sequence_log_ratio(logps, old, mask)  # (B,)
            has_tokens = mask.any(-1, keepdim=True)
            adv = batch.advantages.gather(1, last_token_index(mask).clamp(min=0)[:, None])  # A_i, (B, 1)
            seq_loss, seq_clipped = clipped_surrogate_loss(log_s[:, None], torch.zeros_like(adv), adv, has_tokens,
                                                           c.clip_eps_low, c.clip_eps_high)
            per_token = torch.where(mask, seq_loss.expand_as(logps), torch.zeros((), device=logps.device))
            clipped = seq_clipped & mask
        else:
            log_st = gspo_token_log_ratio(logps, old, mask)
            per_token, clipped = clipped_surrogate_loss(log_st, torch.zeros_like(log_st), batch.advantages, mask,
                                                        c.clip_eps_low, c.clip_eps_high)
        metrics = {"sequence_clip_fraction": float(clipped.any(-1).float().mean())}
        if batch.old_logps is None and batch.ref_logps is not None:  # one optimizer step: logps are pi_old's
            metrics.update(drift_metrics(logps, batch.ref_logps, batch.completion_mask))
        tokens = ratio_statistics(logps, old, mask, clipped)
        n = float(mask.sum())
        used = sequence_log_ratio(logps, old, mask).detach().exp()[:, None].expand_as(logps)
        tokens["ratio_mean"] = (float(masked_sum(used, mask)), n)
        tokens["entropy"] = (float(masked_sum(entropy, mask)), n)
        if self.beta > 0 and self.objective.kl_placement == "as_loss":
            kl_tokens = kl_loss(logps, batch.ref_logps, mask, self.objective.kl_estimator)
            per_token = per_token + self.beta * kl_tokens
            tokens["kl_loss"] = (float(masked_sum(kl_tokens.detach(), mask)), n)
        return LossOutput(per_token, mask, metrics, tokens)

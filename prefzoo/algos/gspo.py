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
at sampling time are stored as ``old_logps`` whenever there is more than one optimizer step per rollout. The
sequence ratio and its clip are :func:`prefzoo.objective.sequence_clipped_surrogate_loss` (GSPO) and
:func:`prefzoo.objective.gspo_token_log_ratio` (GSPO-token).

Departures and choices:

* Everything but the loss is GRPO's: its advantages (:func:`prefzoo.algos.online.group_relative_advantages`,
  ``scale_rewards``), and the online family's rollout, KL and metrics (:mod:`prefzoo.algos.online`; the paper has
  no KL, beta = 0 by default; with beta > 0 the estimator and placement come from ``objective``, a KL loss is
  added per token), ``mask_truncated``, ``loss_aggregation``. The paper's reduction is the mean over
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
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.online import OnlinePolicyGradient, group_relative_advantages
from prefzoo.algos.online_settings import GroupRelativeConfig, check_group_relative_settings, check_policy_clip
from prefzoo.algos.trust_region import TokenLoss
from prefzoo.errors import ConfigError
from prefzoo.objective import (clipped_surrogate_loss, gspo_token_log_ratio, masked_sum, sequence_clipped_surrogate_loss,
                               sequence_log_ratio)
from prefzoo.types import Experience, ObjectiveSettings

LEVELS = ("sequence", "sequence_token")


@dataclass
class GSPOConfig(GroupRelativeConfig):
    name: str = "gspo"
    importance_sampling_level: str = "sequence"  # sequence (GSPO) | sequence_token (GSPO-token)
    clip_eps_low: float = 3e-4  # Zheng et al. 2025, sec. 5.1
    clip_eps_high: float = 4e-4
    num_minibatches: int = 4  # sec. 5.1: each rollout is split into four mini-batches


@register
class GSPO(OnlinePolicyGradient):
    """GSPO plugin: GRPO's rollout and advantages, sequence-level importance ratio and clip."""

    config_class = GSPOConfig
    advantages = group_relative_advantages

    @staticmethod
    def validate_settings(cfg: GSPOConfig, objective: ObjectiveSettings) -> None:
        if cfg.importance_sampling_level not in LEVELS:
            raise ConfigError(f"algo.importance_sampling_level={cfg.importance_sampling_level!r}; choose one of "
                              f"{', '.join(LEVELS)} (GSPO, GSPO-token).")
        check_group_relative_settings(cfg, objective)
        check_policy_clip(cfg)

    def token_loss(self, logps: Tensor, old_logps: Tensor, batch: Experience) -> TokenLoss:
        """The clip on s_i (GSPO) or on s_{i,t} (GSPO-token); ``ratio_mean`` is s_i's token mean."""
        c, mask = self.cfg, batch.loss_mask
        if c.importance_sampling_level == "sequence":
            per_token, clipped = sequence_clipped_surrogate_loss(logps, old_logps, batch.advantages, mask,
                                                                 c.clip_eps_low, c.clip_eps_high)
        else:
            log_st = gspo_token_log_ratio(logps, old_logps, mask)
            per_token, clipped = clipped_surrogate_loss(log_st, torch.zeros_like(log_st), batch.advantages, mask,
                                                        c.clip_eps_low, c.clip_eps_high)
        used = sequence_log_ratio(logps, old_logps, mask).detach().exp()[:, None].expand_as(logps)
        return TokenLoss(per_token, clipped, {"sequence_clip_fraction": float(clipped.any(-1).float().mean())},
                          {"ratio_mean": (float(masked_sum(used, mask)), float(mask.sum()))})

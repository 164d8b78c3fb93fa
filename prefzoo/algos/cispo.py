"""CISPO: Clipped IS-weight Policy Optimization (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585, sec. 3).

GRPO's rollout and group-relative advantages; instead of PPO's clipped surrogate, which ZEROES the gradient of
a token whose ratio left the trust region (rare "fork" tokens such as "However" or "Wait" are dropped after the
first update), CISPO clips the importance-sampling weight and keeps every token's gradient:

    J_CISPO = E[ 1/(sum_i |o_i|) sum_i sum_t sg(r_hat_{i,t}) A_{i,t} log pi(o_{i,t} | q, o_{i,<t}) ]
    r_hat_{i,t} = clip( r_{i,t}, 1 - eps_low^IS, 1 + eps_high^IS ),   r_{i,t} = pi(o_{i,t}) / pi_old(o_{i,t})

with sg the stop-gradient, so the gradient is sum_t sg(r_hat) A grad log pi: a truncated importance weight times
the REINFORCE gradient (:func:`prefzoo.objective.clipped_is_weight`,
:func:`prefzoo.objective.weighted_policy_gradient_loss`). The reduction is over all tokens of the batch
(DAPO's ``loss_aggregation=dapo``, the default here).

Settings: the paper imposes no lower bound on the weight (a large eps_low^IS) and tunes only eps_high^IS; here
``is_clip_eps_low=1.0`` (weights in [0, 1 + eps_high]: no lower bound) and ``is_clip_eps_high=0.28`` (DAPO's
clip-higher, Trinity-RFT's CISPO default; not a number from the paper). They bound a WEIGHT, not PPO's ratio, so
they are keys of their own (``algo.clip_eps_low`` / ``clip_eps_high`` are refused for CISPO, naming these). With a single optimizer step per rollout
the ratio is exactly 1 and CISPO is REINFORCE with GRPO's advantages; the weight matters only off-policy, so the
rollout is split into ``num_minibatches=4`` (as GSPO's paper does) and the log-probs at sampling time are stored
as ``old_logps`` whenever there is more than one optimizer step per rollout.

Departures and choices: everything but the loss is GRPO's: its advantages
(:func:`prefzoo.algos.online.group_relative_advantages`: ``scale_rewards``, ``advantage_eps``) and the online
family's rollout, ``mask_truncated`` and KL (:mod:`prefzoo.algos.online`; the paper uses none: beta = 0 by
default; with beta > 0 the estimator and placement come from ``objective``, a KL loss is added per token).

Where it converges (``docs/conformance.md``): the weight changes only how far each optimizer step moves, never
which policies are stationary. At ratio 1 (the first mini-batch) the update is GRPO's; with k1 in the reward
every advantage is exactly 0 at pi*, so pi* is a fixed point for any clip range, and the measured runs reach it.

Metrics: GRPO's schema; ``clip_fraction`` is the share of tokens whose WEIGHT was clipped (they still have a
gradient, unlike PPO's clipped tokens), ``ratio_mean`` the unclipped ratio, ``weight_mean`` the clipped weight.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.online import OnlinePolicyGradient, group_relative_advantages
from prefzoo.algos.online_settings import GroupRelativeConfig, check_group_relative_settings
from prefzoo.algos.trust_region import TokenLoss
from prefzoo.errors import ConfigError
from prefzoo.objective import clipped_is_weight, masked_sum, weighted_policy_gradient_loss
from prefzoo.types import Experience, ObjectiveSettings


@dataclass
class CISPOConfig(GroupRelativeConfig):
    name: str = "cispo"
    is_clip_eps_low: float = 1.0  # the weight's lower bound is 1 - is_clip_eps_low: none (the paper's choice)
    is_clip_eps_high: float = 0.28  # the weight's upper bound 1 + is_clip_eps_high
    loss_aggregation: str = "dapo"  # 1 / sum_i |o_i|: the mean over all tokens of the batch
    num_minibatches: int = 4


@register
class CISPO(OnlinePolicyGradient):
    """CISPO plugin: GRPO's rollout and advantages, loss -sg(clip(ratio)) A log pi on every token."""

    config_class = CISPOConfig
    advantages = group_relative_advantages

    @staticmethod
    def validate_settings(cfg: CISPOConfig, objective: ObjectiveSettings) -> None:
        if not 0 <= cfg.is_clip_eps_low <= 1 or cfg.is_clip_eps_high < 0:
            raise ConfigError(f"algo.is_clip_eps_low={cfg.is_clip_eps_low} must be in [0, 1] (1: no lower bound on the "
                              f"weight) and algo.is_clip_eps_high={cfg.is_clip_eps_high} >= 0.")
        check_group_relative_settings(cfg, objective)

    def token_loss(self, logps: Tensor, old_logps: Tensor, batch: Experience) -> TokenLoss:
        """-sg(w) A log pi on every loss token, w the clipped importance weight; ``weight_mean`` its token mean."""
        mask = batch.loss_mask
        weights, clipped = clipped_is_weight(logps, old_logps, mask, self.cfg.is_clip_eps_low, self.cfg.is_clip_eps_high)
        per_token = weighted_policy_gradient_loss(logps, batch.advantages, mask, weights)
        return TokenLoss(per_token, clipped, tokens={"weight_mean": (float(masked_sum(weights, mask)), float(mask.sum()))})

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
``clip_eps_low=1.0`` (weights in [0, 1 + eps_high]: no lower bound) and ``clip_eps_high=0.28`` (DAPO's
clip-higher, Trinity-RFT's CISPO default; not a number from the paper). With a single optimizer step per rollout
the ratio is exactly 1 and CISPO is REINFORCE with GRPO's advantages; the weight matters only off-policy, so the
rollout is split into ``num_minibatches=4`` (as GSPO's paper does) and the log-probs at sampling time are stored
as ``old_logps`` whenever there is more than one optimizer step per rollout.

Departures and choices: everything but the loss is GRPO's (:class:`prefzoo.algos.grpo.GRPO`): ``scale_rewards``,
``advantage_eps``, ``mask_truncated``, the KL (the paper uses none: beta = 0 by default; with beta > 0 the
estimator and placement come from ``objective``, a KL loss is added per token).

Where it converges (``docs/conformance.md``): the weight changes only how far each optimizer step moves, never
which policies are stationary. At ratio 1 (the first mini-batch) the update is GRPO's; with k1 in the reward
every advantage is exactly 0 at pi*, so pi* is a fixed point for any clip range, and the measured runs reach it.

Metrics: GRPO's schema; ``clip_fraction`` is the share of tokens whose WEIGHT was clipped (they still have a
gradient, unlike PPO's clipped tokens), ``ratio_mean`` the unclipped ratio, ``weight_mean`` the clipped weight.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from prefzoo.algos import register
from prefzoo.algos.grpo import GRPO, GRPOConfig, drift_metrics
from prefzoo.errors import ConfigError
from prefzoo.objective import clipped_is_weight, kl_loss, masked_sum, ratio_statistics, weighted_policy_gradient_loss
from prefzoo.types import Experience, LossOutput, ObjectiveSettings, Policy


@dataclass
class CISPOConfig(GRPOConfig):
    name: str = "cispo"
    clip_eps_low: float = 1.0  # no lower bound on the weight (the paper's choice)
    clip_eps_high: float = 0.28
    loss_aggregation: str = "dapo"  # 1 / sum_i |o_i|: the mean over all tokens of the batch
    num_minibatches: int = 4


@register
class CISPO(GRPO):
    """CISPO plugin: GRPO's rollout and advantages, loss -sg(clip(ratio)) A log pi on every token."""

    name = "cispo"
    config_class = CISPOConfig

    @staticmethod
    def validate_settings(cfg: CISPOConfig, objective: ObjectiveSettings) -> None:
        if not 0 <= cfg.clip_eps_low <= 1 or cfg.clip_eps_high < 0:
            raise ConfigError(f"algo.clip_eps_low={cfg.clip_eps_low} must be in [0, 1] (1: no lower bound on the "
                              f"weight) and algo.clip_eps_high={cfg.clip_eps_high} >= 0.")
        # GRPO's other checks (its clip check wants clip_eps_low < 1, a PPO ratio bound, not a weight's)
        GRPO.validate_settings(dataclasses.replace(cfg, clip_eps_low=0.0), objective)

    def stores_old_logps(self) -> bool:
        return self.cfg.epochs * self.cfg.num_minibatches > 1

    def loss(self, policy: Policy, batch: Experience) -> LossOutput:
        logps, entropy = policy.logps(batch, self.sampling.temperature, with_entropy=True)
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        mask = batch.loss_mask
        weights, clipped = clipped_is_weight(logps, old, mask, self.cfg.clip_eps_low, self.cfg.clip_eps_high)
        per_token = weighted_policy_gradient_loss(logps, batch.advantages, mask, weights)
        metrics = {}
        if batch.old_logps is None and batch.ref_logps is not None:  # one optimizer step: logps are pi_old's
            metrics.update(drift_metrics(logps, batch.ref_logps, batch.completion_mask))
        tokens = ratio_statistics(logps, old, mask, clipped)
        n = float(mask.sum())
        tokens["weight_mean"] = (float(masked_sum(weights, mask)), n)
        tokens["entropy"] = (float(masked_sum(entropy, mask)), n)
        if self.beta > 0 and self.objective.kl_placement == "as_loss":
            kl_tokens = kl_loss(logps, batch.ref_logps, mask, self.objective.kl_estimator)
            per_token = per_token + self.beta * kl_tokens
            tokens["kl_loss"] = (float(masked_sum(kl_tokens.detach(), mask)), n)
        return LossOutput(per_token, mask, metrics, tokens)

"""REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019).

For each prompt x sample k = ``num_samples`` completions y_1..y_k from the current policy; each one's baseline
is the mean reward of the OTHER k - 1 (Kool et al. 2019), and the whole completion is one action:

    grad J = (1/k) sum_i [ R(y_i, x) - 1/(k-1) sum_{j != i} R(y_j, x) ] grad log pi(y_i | x)
    R(y, x) = r(x, y) - beta log( pi(y | x) / pi_ref(y | x) )          (the KL-shaped sequence reward)

Here: R = r + sum_t (-beta k(rho_t)) with the estimator of ``objective`` (default k1, "in_reward": the sequence
KL of Ahmadian et al.), A_i = R_i - b_i (:func:`prefzoo.objective.leave_one_out_advantages`) repeated over the
tokens of y_i, and the loss ``policy_loss``:

* ``reinforce`` (the paper, default): -A_i log pi(y_{i,t}) per token (:func:`weighted_policy_gradient_loss`
  with no weight); only with one optimizer step per rollout (it has no importance correction);
* ``clipped``: PPO's clipped surrogate on each TOKEN's ratio to the sampling policy, pi(y_t)/pi_old(y_t), clipped
  token by token (:func:`prefzoo.objective.clipped_surrogate_loss`: the completion is one action for the
  advantage, but the trust region is per token, as PPO's);
* ``clipped_sequence``: the clipped surrogate on the whole SEQUENCE's ratio pi(y)/pi_old(y) = exp(sum_t log ratio),
  one clip decision per completion (:func:`prefzoo.objective.sequence_clipped_surrogate_loss`, unnormalised):
  TRL 1.16's RLOOTrainer. With ``loss_aggregation=grpo`` the loss is TRL's, the mean over completions of
  -min(s A, clip(s) A).

``dppo_tv``, ``dppo_kl``, ``sapo``, ``dro``: the surrogates without the ratio clip
(:func:`prefzoo.algos.trust_region.trust_region_token_loss`, GRPO's choices too).

Both clipped losses (and those four) allow ``epochs`` / ``num_minibatches`` > 1 (the log-probs at sampling time are then stored as
``old_logps``). With one optimizer step per rollout all three have the same gradient direction per completion (the
ratio is exactly 1); ``clipped_sequence``'s is sum_t grad log pi(y_t) per completion (the paper's sequence-level
estimator) where the other two, under ``loss_aggregation=grpo``, average it over the tokens.

``loss_aggregation`` as GRPO's (``grpo``: mean over each sequence's tokens then over sequences, the default, so
that a learning rate tuned for GRPO carries over; ``dr_grpo``: sum over tokens / (B x max_new_tokens), which is
the paper's sequence-level estimator sum_t grad log pi(y_t) up to the constant 1/max_new_tokens; ``dapo``: mean
over all tokens). With ``objective.kl_placement=as_loss`` the KL leaves the reward and becomes a per-token loss.

Where it converges (``docs/conformance.md``): b_i does not depend on y_i, so E[A_i grad log pi(y_i)] is exactly
the gradient of E[R]. With k1 in the reward the fixed point is pi* = pi_ref exp(r/beta)/Z; with k2 as a loss it
is pi* at beta itself, where GRPO's group mean (which contains r_i) lands at beta G/(G-1).

Metrics: the online family's schema (:mod:`prefzoo.algos.online`); ``clip_fraction`` is 0 for ``reinforce``;
``ratio_mean`` is the token mean of the ratio the loss used (the sequence ratio under ``clipped_sequence``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.online import OnlinePolicyGradient
from prefzoo.algos.online_sampling import ScoredSamples
from prefzoo.algos.online_settings import check_online_settings, check_policy_clip
from prefzoo.algos.trust_region import (TokenLoss, TrustRegionConfig, check_trust_region, takes_is_weights,
                                         trust_region_token_loss)
from prefzoo.errors import ConfigError
from prefzoo.objective import (TRUST_REGION_LOSSES, leave_one_out_advantages, masked_sum,
                               sequence_clipped_surrogate_loss, sequence_log_ratio, weighted_policy_gradient_loss)
from prefzoo.types import Experience, ObjectiveSettings, StepContext

POLICY_LOSSES = ("reinforce", "clipped", "clipped_sequence", *TRUST_REGION_LOSSES)


@dataclass
class RLOOConfig(TrustRegionConfig):
    name: str = "rloo"
    default_beta: float = 0.05  # TRL's RLOOConfig kl_coef
    num_samples: int = 4  # k, completions per prompt
    policy_loss: str = "reinforce"  # reinforce | clipped (per-token ratio) | clipped_sequence (TRL 1.16's) | dppo_tv
    # | dppo_kl | sapo | dro (online.trust_region_token_loss)
    clip_eps_low: float = 0.2  # policy_loss=clipped / clipped_sequence only
    clip_eps_high: float = 0.2


@register
class RLOO(OnlinePolicyGradient):
    """RLOO plugin: k samples per prompt, leave-one-out baseline, REINFORCE or a clipped surrogate."""

    config_class = RLOOConfig
    progress_keys = ("reward", "kl", "entropy")

    @staticmethod
    def validate_settings(cfg: RLOOConfig, objective: ObjectiveSettings) -> None:
        check_online_settings(cfg, objective, min_samples=2, why="the others are each one's baseline")
        check_trust_region(cfg, POLICY_LOSSES)
        if cfg.policy_loss == "reinforce" and cfg.epochs * cfg.num_minibatches > 1:
            raise ConfigError(f"algo.policy_loss=reinforce with algo.epochs={cfg.epochs} and algo.num_minibatches="
                              f"{cfg.num_minibatches}: REINFORCE has no importance correction, so it takes one "
                              "optimizer step per rollout; use algo.policy_loss=clipped for several.")
        check_policy_clip(cfg)

    def advantages(self, scored: ScoredSamples, penalty: Tensor, step: StepContext) -> tuple[Tensor, dict[str, float]]:
        """A_i = R_i - mean of the other k - 1 R_j of its prompt, R = r + sum_t penalty_t. Shape (B,)."""
        return leave_one_out_advantages(scored.rewards + penalty.sum(-1), self.cfg.num_samples), {}

    def loss_takes_is_weights(self) -> bool:
        return takes_is_weights(self.cfg)

    def token_loss(self, logps: Tensor, old_logps: Tensor, batch: Experience) -> TokenLoss:
        c, mask = self.cfg, batch.loss_mask
        if c.policy_loss == "reinforce":
            return TokenLoss(weighted_policy_gradient_loss(logps, batch.advantages, mask), torch.zeros_like(mask))
        if c.policy_loss != "clipped_sequence":
            return trust_region_token_loss(c, logps, old_logps, batch)
        per_token, clipped = sequence_clipped_surrogate_loss(logps, old_logps, batch.advantages, mask, c.clip_eps_low,
                                                             c.clip_eps_high, length_normalised=False)
        used = sequence_log_ratio(logps, old_logps, mask, length_normalised=False).detach().exp()[:, None]
        return TokenLoss(per_token, clipped,
                          tokens={"ratio_mean": (float(masked_sum(used.expand_as(logps), mask)), float(mask.sum()))})

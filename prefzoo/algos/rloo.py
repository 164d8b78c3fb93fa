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
* ``clipped``: PPO's clipped surrogate on the ratio to the sampling policy (TRL's RLOO), which allows
  ``epochs`` / ``num_minibatches`` > 1 (the log-probs at sampling time are then stored as ``old_logps``).

With one optimizer step per rollout the two have the same gradient (the ratio is exactly 1).

``loss_aggregation`` as GRPO's (``grpo``: mean over each sequence's tokens then over sequences, the default, so
that a learning rate tuned for GRPO carries over; ``dr_grpo``: sum over tokens / (B x max_new_tokens), which is
the paper's sequence-level estimator sum_t grad log pi(y_t) up to the constant 1/max_new_tokens; ``dapo``: mean
over all tokens). With ``objective.kl_placement=as_loss`` the KL leaves the reward and becomes a per-token loss.

Where it converges (``docs/conformance.md``): b_i does not depend on y_i, so E[A_i grad log pi(y_i)] is exactly
the gradient of E[R]. With k1 in the reward the fixed point is pi* = pi_ref exp(r/beta)/Z; with k2 as a loss it
is pi* at beta itself, where GRPO's group mean (which contains r_i) lands at beta G/(G-1).

Metrics (the online schema): ``reward``, ``reward_std``, ``kl`` / ``kl_k3`` (KL(pi || pi_ref) per sequence,
nats), ``non_score_reward`` (mean of the summed KL penalty in the reward), ``kl_loss``, ``clip_fraction`` (0 for
``reinforce``), ``ratio_mean``, ``approx_kl`` (KL(pi_old || pi_theta) per token, k3), ``entropy``,
``frac_zero_std_groups``, ``completion_length``, ``frac_truncated``; timings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.base import AlgoConfig, Algorithm, Declaration
from prefzoo.algos.sampled import (add_kl_loss, check_rollout_settings, corrected_advantages, rollout_declaration,
                                   sample_and_score, update_metrics)
from prefzoo.errors import ConfigError
from prefzoo.objective import (clipped_surrogate_loss, kl_penalty_rewards, leave_one_out_advantages,
                               weighted_policy_gradient_loss)
from prefzoo.types import Experience, LossOutput, ObjectiveSettings, Policy, PromptBatch, Scorer

POLICY_LOSSES = ("reinforce", "clipped")


@dataclass
class RLOOConfig(AlgoConfig):
    name: str = "rloo"
    default_beta: float = 0.05  # TRL's RLOOConfig kl_coef
    default_kl_estimator: str = "k1"
    default_kl_placement: str = "in_reward"
    default_temperature: float = 0.7  # as GRPO: informative groups on the arithmetic task
    default_batch_size: int = 8
    num_samples: int = 4  # k, completions per prompt
    policy_loss: str = "reinforce"  # reinforce | clipped
    clip_eps_low: float = 0.2  # policy_loss=clipped only
    clip_eps_high: float = 0.2
    loss_aggregation: str = "grpo"  # grpo | dr_grpo | dapo
    epochs: int = 1
    num_minibatches: int = 1
    mask_truncated: bool = False  # completions without EOS contribute no loss


@register
class RLOO(Algorithm):
    """RLOO plugin: k samples per prompt, leave-one-out baseline, REINFORCE or the clipped surrogate."""

    name = "rloo"
    config_class = RLOOConfig

    @staticmethod
    def validate_settings(cfg: RLOOConfig, objective: ObjectiveSettings) -> None:
        if cfg.num_samples < 2:
            raise ConfigError(f"algo.num_samples={cfg.num_samples}: RLOO needs at least 2 completions per prompt "
                              "(the others are each one's baseline).")
        if cfg.policy_loss not in POLICY_LOSSES:
            raise ConfigError(f"algo.policy_loss={cfg.policy_loss!r}; choose one of {', '.join(POLICY_LOSSES)}.")
        if cfg.policy_loss == "reinforce" and cfg.epochs * cfg.num_minibatches > 1:
            raise ConfigError(f"algo.policy_loss=reinforce with algo.epochs={cfg.epochs} and algo.num_minibatches="
                              f"{cfg.num_minibatches}: REINFORCE has no importance correction, so it takes one "
                              "optimizer step per rollout; use algo.policy_loss=clipped for several.")
        check_rollout_settings(cfg, objective)

    def declare(self) -> Declaration:
        return rollout_declaration(self, ("reward", "kl", "entropy"))

    def loss_mask(self, batch: Experience) -> Tensor:
        return batch.loss_mask

    @torch.no_grad()
    def make_experience(self, policy: Policy, prompts: PromptBatch, score: Scorer) -> tuple[Experience, dict[str, float]]:
        c, o = self.cfg, self.objective
        in_reward = self.beta > 0 and o.kl_placement == "in_reward"
        several = c.epochs * c.num_minibatches > 1
        r = sample_and_score(policy, prompts, score, c.num_samples, self.sampling, need_logps=in_reward or several)
        mask = r.samples.completion_mask
        shaped = r.rewards
        if in_reward:
            shaped = r.rewards + kl_penalty_rewards(r.logps, r.ref_logps, mask, self.beta, o.kl_estimator).sum(-1)
        advantages = leave_one_out_advantages(shaped, c.num_samples)
        loss_mask = mask & ~r.samples.truncated[:, None] if c.mask_truncated else mask
        metrics = dict(r.metrics, non_score_reward=(shaped - r.rewards).mean().item())
        token_advantages = torch.where(mask, advantages[:, None], torch.zeros((), device=mask.device))
        token_advantages = corrected_advantages(token_advantages, r.is_weights)  # rollout.is_correction_cap
        return Experience.from_samples(r.samples, rewards=r.rewards, advantages=token_advantages, loss_mask=loss_mask,
                                       old_logps=r.logps if several else None, ref_logps=r.ref_logps), metrics

    def loss(self, policy: Policy, batch: Experience) -> LossOutput:
        c = self.cfg
        logps, entropy = policy.logps(batch, self.sampling.temperature, with_entropy=True)
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        mask = batch.loss_mask
        if c.policy_loss == "reinforce":
            per_token, clipped = weighted_policy_gradient_loss(logps, batch.advantages, mask), torch.zeros_like(mask)
        else:
            per_token, clipped = clipped_surrogate_loss(logps, old, batch.advantages, mask, c.clip_eps_low,
                                                        c.clip_eps_high)
        metrics, tokens = update_metrics(logps, old, mask, clipped, entropy, batch.ref_logps, batch.old_logps is None,
                                         batch.completion_mask)
        per_token = add_kl_loss(per_token, logps, batch.ref_logps, mask, self.beta, self.objective, tokens)
        return LossOutput(per_token, mask, metrics, tokens)

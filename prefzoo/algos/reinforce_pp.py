"""REINFORCE++ (Hu et al. 2025, arXiv:2501.03262) and its group-baseline variant, as OpenRLHF ships them.

No critic: the per-token reward carries the KL penalty and the sequence reward lands on the last token,

    r_t = [t = |y|] r(x, y) - beta k(rho_t),       rho_t = log pi_old(y_t) - log pi_ref(y_t)   (k1 by default)
    A_t = sum_{s >= t} r_s = r(x, y) - beta sum_{s >= t} k(rho_s)                                (gamma = 1)
    A_t <- (A_t - mean_batch A) / std_batch A                  (over every valid token of the whole batch)

then PPO's clipped surrogate on the ratio to the sampling policy (``clip_eps_low`` / ``clip_eps_high``).
The reward-to-go is :func:`prefzoo.objective.gae` with V = 0 and gamma = lambda = 1; the global normalisation is
:func:`prefzoo.objective.masked_whiten`, exact under data parallelism (its all-reduce, as PPO's whitening).

``baseline=group`` (REINFORCE++-baseline, OpenRLHF ``reinforce_baseline``): r(x, y) is first replaced by
r(x, y) - mean of its prompt's group (the KL penalty is not), then the same returns and batch normalisation
(which divides by the batch std; its centring is then almost a no-op). It needs ``num_samples`` >= 2.

Departures and choices: beta = 0.01 by default (OpenRLHF's ``init_kl_coef``); G = 4 samples per prompt by default
so that both baselines run on the same budget as GRPO (the paper's REINFORCE++ samples one per prompt:
``algo.num_samples=1``); loss over all tokens of the batch (``loss_aggregation=dapo``, OpenRLHF's token-level
loss; ``grpo`` and ``dr_grpo`` as GRPO's). With ``objective.kl_placement=as_loss`` the KL leaves the reward and
becomes a per-token loss. With more than one optimizer step per rollout the log-probs at sampling time are stored.

Where it converges (``docs/conformance.md``): with k1 in the reward the update is the gradient of
E r - beta KL(pi || pi_ref) times 1/std (centring by the batch mean is a baseline), so the fixed point is pi*.
With ``baseline=group`` the group mean contains r_i itself, which shrinks the REWARD's gradient by (G-1)/G but
not the penalty's: the fixed point is pi* at beta G/(G-1), the same shift as GRPO's KL loss.

Metrics (the online schema): ``reward``, ``reward_std``, ``kl`` / ``kl_k3`` (KL(pi || pi_ref) per sequence,
nats), ``non_score_reward`` (mean summed KL penalty), ``kl_loss``, ``clip_fraction``, ``ratio_mean``,
``approx_kl`` (KL(pi_old || pi_theta) per token, k3), ``entropy``, ``return_std`` (std of the returns over this
process's valid tokens; the advantages are divided by the global one), ``frac_zero_std_groups``, ``completion_length``, ``frac_truncated``; timings.
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
from prefzoo.objective import (add_sequence_reward, clipped_surrogate_loss, gae, group_advantages, kl_penalty_rewards,
                               masked_var, masked_whiten)
from prefzoo.types import Experience, LossOutput, ObjectiveSettings, Policy, PromptBatch, Scorer

BASELINES = ("none", "group")


@dataclass
class ReinforcePPConfig(AlgoConfig):
    name: str = "reinforce_pp"
    default_beta: float = 0.01  # OpenRLHF's init_kl_coef
    default_kl_estimator: str = "k1"
    default_kl_placement: str = "in_reward"
    default_temperature: float = 0.7  # as GRPO: informative groups on the arithmetic task
    default_batch_size: int = 8
    num_samples: int = 4  # completions per prompt
    baseline: str = "none"  # none (REINFORCE++) | group (REINFORCE++-baseline)
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    loss_aggregation: str = "dapo"  # grpo | dr_grpo | dapo
    epochs: int = 1
    num_minibatches: int = 1
    mask_truncated: bool = False  # completions without EOS contribute no loss


@register
class ReinforcePP(Algorithm):
    """REINFORCE++ plugin: token-level KL in the reward, reward-to-go, global batch normalisation, clipped surrogate."""

    name = "reinforce_pp"
    config_class = ReinforcePPConfig

    @staticmethod
    def validate_settings(cfg: ReinforcePPConfig, objective: ObjectiveSettings) -> None:
        if cfg.baseline not in BASELINES:
            raise ConfigError(f"algo.baseline={cfg.baseline!r}; choose one of {', '.join(BASELINES)}.")
        if cfg.num_samples < (2 if cfg.baseline == "group" else 1):
            raise ConfigError(f"algo.num_samples={cfg.num_samples}: must be >= 1, and >= 2 with algo.baseline=group "
                              "(the group mean is the baseline).")
        check_rollout_settings(cfg, objective)

    def declare(self) -> Declaration:
        # only the group baseline makes a group of equal rewards a zero advantage (the batch baseline whitens all rows)
        return rollout_declaration(self, ("reward", "kl", "clip_fraction"), group_baseline=self.cfg.baseline == "group")

    def loss_mask(self, batch: Experience) -> Tensor:
        return batch.loss_mask

    @torch.no_grad()
    def make_experience(self, policy: Policy, prompts: PromptBatch, score: Scorer) -> tuple[Experience, dict[str, float]]:
        c, o = self.cfg, self.objective
        in_reward = self.beta > 0 and o.kl_placement == "in_reward"
        several = c.epochs * c.num_minibatches > 1
        r = sample_and_score(policy, prompts, score, c.num_samples, self.sampling, need_logps=in_reward or several)
        mask = r.samples.completion_mask
        scores = group_advantages(r.rewards, c.num_samples, "none", 0.0) if c.baseline == "group" else r.rewards
        penalty = (kl_penalty_rewards(r.logps, r.ref_logps, mask, self.beta, o.kl_estimator) if in_reward
                   else torch.zeros(mask.shape, device=mask.device))
        token_rewards = add_sequence_reward(penalty, scores, mask)
        returns, _ = gae(token_rewards, torch.zeros_like(token_rewards), mask, 1.0, 1.0)  # reward-to-go
        advantages = masked_whiten(returns, mask, all_reduce=self.all_reduce)  # global batch statistics under DP
        loss_mask = mask & ~r.samples.truncated[:, None] if c.mask_truncated else mask
        metrics = dict(r.metrics, non_score_reward=penalty.sum(-1).mean().item(),
                       return_std=float(masked_var(returns, mask)) ** 0.5)
        advantages = corrected_advantages(advantages.float(), r.is_weights)  # rollout.is_correction_cap
        return Experience.from_samples(r.samples, rewards=r.rewards, advantages=advantages, loss_mask=loss_mask,
                                       old_logps=r.logps if several else None, ref_logps=r.ref_logps), metrics

    def loss(self, policy: Policy, batch: Experience) -> LossOutput:
        c = self.cfg
        logps, entropy = policy.logps(batch, self.sampling.temperature, with_entropy=True)
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        mask = batch.loss_mask
        per_token, clipped = clipped_surrogate_loss(logps, old, batch.advantages, mask, c.clip_eps_low, c.clip_eps_high)
        metrics, tokens = update_metrics(logps, old, mask, clipped, entropy, batch.ref_logps, batch.old_logps is None,
                                         batch.completion_mask)
        per_token = add_kl_loss(per_token, logps, batch.ref_logps, mask, self.beta, self.objective, tokens)
        return LossOutput(per_token, mask, metrics, tokens)

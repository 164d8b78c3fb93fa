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

Multi-turn episodes (``env=...``): with ``env.reward_placement=turn`` an environment's step rewards land on the last
token of the turn each rewards (:func:`~prefzoo.algos.online_sampling.place_rewards`), so a turn's reward-to-go holds only the
rewards from that turn on; the group baseline is the mean of the whole episodes' rewards.

Metrics: the online family's schema (:mod:`prefzoo.algos.online`), and ``return_std`` (std of the returns over
this process's valid tokens; the advantages are divided by the global one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.online import OnlinePolicyGradient
from prefzoo.algos.online_sampling import ScoredSamples, place_rewards
from prefzoo.algos.online_settings import (check_dynamic_sampling, check_online_settings,
                                           check_policy_clip, online_declaration)
from prefzoo.algos.trust_region import (TokenLoss, TrustRegionConfig, check_trust_region, takes_is_weights,
                                         trust_region_token_loss)
from prefzoo.errors import ConfigError
from prefzoo.objective import TRUST_REGION_LOSSES, gae, group_advantages, masked_var, masked_whiten
from prefzoo.types import Experience, ObjectiveSettings, StepContext

BASELINES = ("none", "group")


@dataclass
class ReinforcePPConfig(TrustRegionConfig):
    name: str = "reinforce_pp"
    default_beta: float = 0.01  # OpenRLHF's init_kl_coef
    num_samples: int = 4  # completions per prompt
    baseline: str = "none"  # none (REINFORCE++) | group (REINFORCE++-baseline)
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    loss_aggregation: str = "dapo"  # grpo | dr_grpo | dapo
    policy_loss: str = "clipped"  # clipped | dppo_tv | dppo_kl | sapo | dro (online.trust_region_token_loss)


@register
class ReinforcePP(OnlinePolicyGradient):
    """REINFORCE++ plugin: token-level KL in the reward, reward-to-go, global batch normalisation, clipped surrogate."""

    config_class = ReinforcePPConfig

    @staticmethod
    def validate_settings(cfg: ReinforcePPConfig, objective: ObjectiveSettings) -> None:
        if cfg.baseline not in BASELINES:
            raise ConfigError(f"algo.baseline={cfg.baseline!r}; choose one of {', '.join(BASELINES)}.")
        if cfg.num_samples < (2 if cfg.baseline == "group" else 1):
            raise ConfigError(f"algo.num_samples={cfg.num_samples}: must be >= 1, and >= 2 with algo.baseline=group "
                              "(the group mean is the baseline).")
        check_dynamic_sampling(cfg, "its advantages are whitened over the whole batch (either baseline), so a group of "
                                    "equal rewards still carries advantages")
        check_online_settings(cfg, objective)
        check_policy_clip(cfg)
        check_trust_region(cfg, ("clipped", *TRUST_REGION_LOSSES))

    def declare(self):
        # only the group baseline makes a group of equal rewards a zero advantage (the batch baseline whitens all rows)
        return online_declaration(self, ("reward", "kl", "clip_fraction"), group_baseline=self.cfg.baseline == "group",
                                  capabilities=frozenset({"turn_rewards"}))  # per-token returns: step rewards per turn

    def advantages(self, scored: ScoredSamples, penalty: Tensor, step: StepContext) -> tuple[Tensor, dict[str, float]]:
        """The whitened reward-to-go A_t = sum_{s >= t} r_s of r_s = penalty_s + [s = last] score, score = r (or r minus
        its group mean, ``baseline=group``). Shape (B, T); the whitening's statistics are the global batch's."""
        mask = scored.samples.completion_mask
        scores = (group_advantages(scored.rewards, self.cfg.num_samples, "none", 0.0) if self.cfg.baseline == "group"
                  else scored.rewards)
        # an environment's step rewards land on their turns (env.reward_placement=turn): later turns' reward-to-go
        returns, _ = gae(place_rewards(penalty, scores, scored.samples), torch.zeros_like(penalty), mask, 1.0, 1.0)
        advantages = masked_whiten(returns, mask, all_reduce=step.all_reduce)  # global batch statistics under DP
        return advantages, {"return_std": float(masked_var(returns, mask)) ** 0.5}

    def loss_takes_is_weights(self) -> bool:
        return takes_is_weights(self.cfg)

    def token_loss(self, logps: Tensor, old_logps: Tensor, batch: Experience) -> TokenLoss:
        return trust_region_token_loss(self.cfg, logps, old_logps, batch)

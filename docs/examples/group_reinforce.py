"""REINFORCE with a group baseline, a new member of prefzoo's online family in 40 lines:
``python train.py algo=custom algo.target=group_reinforce:GroupReinforce`` with this folder on ``PYTHONPATH``.

Each prompt gets G = ``algo.num_samples`` completions; a completion's advantage is its reward minus the mean reward of
its group (the group baseline of Shao et al. 2024, without their division by the std), and the loss is REINFORCE's
-A log pi on each of its tokens (Williams 1992). Sampling, scoring, the KL penalty or KL loss of ``objective``, log
pi_old, the loss reduction and the metrics are the online family's (``prefzoo.algos.online``): a member gives its
config, its checks, its advantage function and its per-token loss, nothing else.
"""

from dataclasses import dataclass

import torch

from prefzoo.algos.online import OnlinePolicyGradient
from prefzoo.algos.online_settings import OnlineConfig, check_online_settings
from prefzoo.algos.trust_region import TokenLoss
from prefzoo.errors import ConfigError
from prefzoo.objective import group_advantages, weighted_policy_gradient_loss


@dataclass
class GroupReinforceConfig(OnlineConfig):
    name: str = "group_reinforce"


class GroupReinforce(OnlinePolicyGradient):
    config_class = GroupReinforceConfig
    progress_keys = ("reward", "kl", "entropy")

    @staticmethod
    def validate_settings(cfg, objective):
        check_online_settings(cfg, objective, min_samples=2, why="the group mean is the baseline")
        if cfg.epochs * cfg.num_minibatches > 1:
            raise ConfigError("algo.epochs and algo.num_minibatches must be 1: REINFORCE has no importance ratio.")

    def advantages(self, scored, penalty, step):
        """A_i = R_i - mean of R over its group, R = r + the summed KL penalty (0 unless in the reward). Shape (B,)."""
        return group_advantages(scored.rewards + penalty.sum(-1), self.cfg.num_samples, "none", 0.0), {}

    def token_loss(self, logps, old_logps, batch):
        """-A log pi on each loss token; nothing is clipped (one optimizer step per rollout)."""
        per_token = weighted_policy_gradient_loss(logps, batch.advantages, batch.loss_mask)
        return TokenLoss(per_token, torch.zeros_like(batch.loss_mask))

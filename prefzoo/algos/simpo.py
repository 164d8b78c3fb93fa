"""SimPO: reference-free preference optimisation with a length-normalised reward (Meng et al. 2024).

The implicit reward is the policy's average per-token log-probability of the completion, scaled by
beta (Meng et al. 2024, eq. 4), and the Bradley-Terry objective asks chosen to beat rejected by a target
margin gamma (eq. 6):

    r(x, y) = beta / |y| * log pi(y|x)            (|y| = completion tokens only, EOS included)
    loss    = -log sigmoid(r(x, y_w) - r(x, y_l) - gamma)

No reference model is used or loaded. Defaults: beta = 2.0 and gamma / beta = 0.5 (gamma = 1.0), inside
the ranges of the paper's setups (beta 2-2.5, gamma/beta 0.3-0.6). Optionally a CPO-style SFT term adds
``sft_weight`` times the chosen completion's mean negative log-likelihood (Xu et al. 2024, eq. 5).

Departure from the paper: none in the loss; ``label_smoothing`` applies the conservative-DPO smoothing
to the same margin (0 by default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.base import AlgoConfig, Algorithm, Declaration, check_beta
from prefzoo.algos.pairwise import forward_pairs
from prefzoo.errors import ConfigError
from prefzoo.objective import pairwise_loss
from prefzoo.types import NO_STEP, LossOutput, ObjectiveSettings, Policy, PreferenceBatch, StepContext


@dataclass
class SimPOConfig(AlgoConfig):
    name: str = "simpo"
    default_beta: float = 2.0  # the reward scale (the paper: 2.0-2.5)
    gamma_beta_ratio: float = 0.5  # gamma = gamma_beta_ratio * beta
    sft_weight: float = 0.0  # CPO-style NLL on chosen
    label_smoothing: float = 0.0


@register
class SimPO(Algorithm):
    """SimPO plugin: offline pairs, no reference, length-normalised implicit reward with a margin."""

    config_class = SimPOConfig

    @staticmethod
    def validate_settings(cfg: SimPOConfig, objective: ObjectiveSettings) -> None:
        check_beta(objective, "SimPO", "the reward scale; the paper uses 2.0-2.5")
        if cfg.sft_weight < 0:
            raise ConfigError(f"algo.sft_weight={cfg.sft_weight} must be >= 0.")
        if not 0 <= cfg.label_smoothing < 0.5:
            raise ConfigError(f"algo.label_smoothing={cfg.label_smoothing} must be in [0, 0.5).")
        if cfg.gamma_beta_ratio < 0:  # a negative target margin rewards a chosen answer for scoring BELOW the rejected
            raise ConfigError(f"algo.gamma_beta_ratio={cfg.gamma_beta_ratio}: SimPO's target margin gamma = "
                              "gamma_beta_ratio x beta must be >= 0 (eq. 6: the chosen reward should exceed the "
                              "rejected one by gamma; the paper uses gamma/beta 0.3-0.6, 0 is its ablation).")

    def declare(self) -> Declaration:
        return Declaration(reference=False, aggregation="example_mean", capabilities=frozenset({"implicit_rewards"}),
                           progress_keys=("loss", "rewards/accuracies", "rewards/margins"))

    @property
    def gamma(self) -> float:
        return self.cfg.gamma_beta_ratio * self.beta

    def loss(self, policy: Policy, batch: PreferenceBatch, step: StepContext = NO_STEP) -> LossOutput:
        f = forward_pairs(policy, batch)
        chosen_rewards, rejected_rewards = self.beta * f.chosen_mean, self.beta * f.rejected_mean
        margin = chosen_rewards - rejected_rewards - self.gamma
        losses = pairwise_loss(margin, "sigmoid", self.beta, self.cfg.label_smoothing)
        if self.cfg.sft_weight:
            losses = losses - self.cfg.sft_weight * f.chosen_mean
        with torch.no_grad():
            gap = chosen_rewards - rejected_rewards
            metrics = {
                "rewards/chosen": chosen_rewards.mean().item(), "rewards/rejected": rejected_rewards.mean().item(),
                "rewards/margins": gap.mean().item(), "rewards/accuracies": (gap > 0).float().mean().item(),
                "logps/chosen": f.chosen_logps.mean().item(), "logps/rejected": f.rejected_logps.mean().item(),
            }
        return LossOutput(losses, None, metrics)

    @torch.no_grad()
    def implicit_rewards(self, policy: Policy, batch: PreferenceBatch) -> tuple[Tensor, Tensor]:
        """Held-out ranking: beta times the mean log-prob of chosen and of rejected, Shape (B,) each."""
        f = forward_pairs(policy, batch)
        return self.beta * f.chosen_mean, self.beta * f.rejected_mean

"""Direct Preference Optimisation (Rafailov et al. 2023) and its f-divergence family (Wang et al. 2024).

The KL-regularised objective's optimum pi* = pi_ref exp(r/beta) / Z rearranges to
r(x, y) = beta log(pi*(y|x) / pi_ref(y|x)) + beta log Z(x); substituting it into the Bradley-Terry model
of preferences cancels Z and leaves a classification loss on log-ratios (Rafailov et al. 2023, eq. 7):

    margin = beta log(pi(y_w)/pi_ref(y_w)) - beta log(pi(y_l)/pi_ref(y_l))
    loss   = -log sigmoid(margin)

With a general f-divergence the implicit reward becomes beta f'(pi/pi_ref) (Wang et al. 2024, Thm. 1);
:func:`prefzoo.objective.implicit_reward` supplies it, so ``objective=forward_kl|js|alpha`` changes only
the link, and reverse KL gives exactly the loss above. Loss types on the margin m:

* ``sigmoid``  -(1-eps) log sigma(m) - eps log sigma(-m)  (eps = label_smoothing: conservative DPO,
  Mitchell 2023; eps = 0 is eq. 7 of Rafailov et al.);
* ``ipo``      (m / beta - 1 / (2 beta))^2  (Azar et al. 2023, eq. 17: the log-ratio difference is
  regressed to 1/(2 tau), tau = beta);
* ``hinge``    max(0, 1 - m)  (SLiC, Zhao et al. 2023, with the log-ratio scaled by beta).

Chosen and rejected go through the policy in one concatenated forward pass. Reference log-probs are
computed per batch under no_grad, or once before training (``precompute_ref_logps``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.base import AlgoConfig, Algorithm, LossOutput, Policy, SequenceBatch
from prefzoo.objective import get_divergence, implicit_reward, sequence_logps

LOSS_TYPES = ("sigmoid", "ipo", "hinge")


@dataclass
class DPOConfig(AlgoConfig):
    name: str = "dpo"
    loss_type: str = "sigmoid"  # sigmoid | ipo | hinge
    label_smoothing: float = 0.0  # conservative DPO: probability that a label is flipped, in [0, 0.5)
    precompute_ref_logps: bool = False


def preference_loss(margin: Tensor, beta: float, loss_type: str, label_smoothing: float = 0.0) -> Tensor:
    """Per-pair loss from the implicit-reward margin.

    Args:
        margin: Shape (B,), r(chosen) - r(rejected) where r is the implicit reward (nats, scaled by beta).
        beta: the divergence coefficient (> 0).
        loss_type: ``sigmoid`` | ``ipo`` | ``hinge`` (see the module docstring for the formulas).
        label_smoothing: eps of conservative DPO (sigmoid only).
    Returns:
        Shape (B,) losses.
    Raises:
        ValueError: unknown loss type.
    """
    if loss_type == "sigmoid":
        if not label_smoothing:  # (0 * logsigmoid(-margin) would be NaN for an infinite margin)
            return -F.logsigmoid(margin)
        return -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    if loss_type == "ipo":
        return (margin / beta - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1 - margin)
    raise ValueError(f"algo.loss_type={loss_type!r} is unknown; choose one of {LOSS_TYPES}")


def concatenated_logps(policy: Policy, chosen: SequenceBatch, rejected: SequenceBatch, pad_id: int = 0
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Summed log-probs of chosen and rejected from ONE forward pass over the 2B stacked rows.

    Returns:
        (chosen_logps, rejected_logps, chosen_tokens, rejected_tokens): sequence log-probs (B,) in nats and
        per-token log-probs (B, C) of each side.
    """
    both = SequenceBatch.cat([chosen, rejected], pad_id)
    logps, _ = policy.logps(both)
    b = len(chosen)
    seq = sequence_logps(logps, both.completion_mask)
    return seq[:b], seq[b:], logps[:b], logps[b:]


@register
class DPO(Algorithm):
    """DPO plugin: offline pairs, frozen reference, loss on the implicit-reward margin."""

    name = "dpo"
    config_class = DPOConfig
    default_beta: ClassVar[float] = 0.1
    online = False
    aggregation = "example_mean"
    progress_keys = ("loss", "rewards/accuracies", "rewards/margins")

    def __init__(self, cfg, objective):
        super().__init__(cfg, objective)
        self.divergence = get_divergence(objective.divergence, alpha=objective.alpha)

    @staticmethod
    def validate_config(cfg) -> None:
        from prefzoo.errors import ConfigError

        if cfg.algo.loss_type not in LOSS_TYPES:
            raise ConfigError(f"algo.loss_type={cfg.algo.loss_type!r} is unknown; choose one of {', '.join(LOSS_TYPES)}.")
        if not 0 <= cfg.algo.label_smoothing < 0.5:
            raise ConfigError(f"algo.label_smoothing={cfg.algo.label_smoothing} must be in [0, 0.5).")
        if cfg.objective.beta is not None and cfg.objective.beta == 0:
            raise ConfigError("DPO needs objective.beta > 0: beta scales the implicit reward (beta=0 has no optimum).")

    def reference_logps(self, policy: Policy, batch) -> tuple[Tensor, Tensor]:
        """Summed reference log-probs (B,) of chosen and rejected (precomputed if the batch carries them)."""
        if batch.ref_chosen_logps is not None:
            return batch.ref_chosen_logps, batch.ref_rejected_logps
        both = SequenceBatch.cat([batch.chosen, batch.rejected])
        seq = sequence_logps(policy.ref_logps(both), both.completion_mask)
        return seq[: len(batch)], seq[len(batch):]

    def rewards(self, chosen_logps, rejected_logps, ref_chosen, ref_rejected) -> tuple[Tensor, Tensor]:
        """Implicit rewards beta f'(pi/pi_ref) of chosen and rejected, Shape (B,) each, float64.

        In float64 because the links of forward KL (-1/u = -exp(-log_ratio)) and alpha overflow float32 once a
        sequence log-ratio falls below about -88 nats (a rejected answer DPO has pushed down): the loss and
        its gradient would then be NaN. (float64 overflows below -709 nats.)
        """
        return (implicit_reward((chosen_logps - ref_chosen).double(), self.beta, self.divergence),
                implicit_reward((rejected_logps - ref_rejected).double(), self.beta, self.divergence))

    def loss(self, policy: Policy, batch) -> LossOutput:
        ref_chosen, ref_rejected = self.reference_logps(policy, batch)
        chosen_logps, rejected_logps, _, _ = concatenated_logps(policy, batch.chosen, batch.rejected)
        chosen_rewards, rejected_rewards = self.rewards(chosen_logps, rejected_logps, ref_chosen, ref_rejected)
        margin = chosen_rewards - rejected_rewards
        losses = preference_loss(margin, self.beta, self.cfg.loss_type, self.cfg.label_smoothing).float()
        with torch.no_grad():
            metrics = {
                "rewards/chosen": chosen_rewards.mean().item(), "rewards/rejected": rejected_rewards.mean().item(),
                "rewards/margins": margin.mean().item(), "rewards/accuracies": (margin > 0).float().mean().item(),
                "logps/chosen": chosen_logps.mean().item(), "logps/rejected": rejected_logps.mean().item(),
                "log_ratio/chosen": (chosen_logps - ref_chosen).mean().item(),
                "log_ratio/rejected": (rejected_logps - ref_rejected).mean().item(),
            }
        return LossOutput(losses, None, metrics)

    @torch.no_grad()
    def implicit_rewards(self, policy: Policy, batch) -> tuple[Tensor, Tensor]:
        """Held-out ranking: the implicit rewards of chosen and rejected, Shape (B,) each."""
        ref_chosen, ref_rejected = self.reference_logps(policy, batch)
        chosen_logps, rejected_logps, _, _ = concatenated_logps(policy, batch.chosen, batch.rejected)
        return self.rewards(chosen_logps, rejected_logps, ref_chosen, ref_rejected)

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
  regressed to 1/(2 tau), tau = beta). Each side's log-ratio is AVERAGED over its completion tokens first
  (``ipo_average_log_ratio=true``, the default, as the IPO authors' code and TRL do): the target margin
  1/(2 beta) then does not depend on the completions' lengths. ``false`` keeps eq. 17 on summed log-ratios;
* ``hinge``    max(0, 1 - m)  (SLiC, Zhao et al. 2023, with the log-ratio scaled by beta).

Chosen and rejected go through the policy in one concatenated forward pass. Reference log-probs are
computed per batch under no_grad, or once before training (``precompute_ref_logps``: the capability
``precomputed_reference``).

Metrics (TRL's names and meanings): ``rewards/chosen`` / ``rewards/rejected`` = beta * log(pi/pi_ref) of the
chosen / rejected completion (0 at step 0; averaged log-ratios under IPO), ``rewards/margins`` and
``rewards/accuracies`` from the margin m the loss sees; with a divergence other than reverse KL also
``implicit_rewards/chosen|rejected`` = beta f'(pi/pi_ref), the f-DPO link's reward; ``logps/chosen|rejected``
(summed, nats), ``log_ratio/chosen|rejected`` (nats; as the loss sees them: summed, or averaged under IPO).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.base import AlgoConfig, Algorithm, Declaration
from prefzoo.errors import ConfigError
from prefzoo.objective import PAIRWISE_LOSSES, get_divergence, implicit_reward, pairwise_loss, sequence_logps
from prefzoo.types import LossOutput, ObjectiveSettings, Policy, PreferenceBatch


@dataclass
class DPOConfig(AlgoConfig):
    name: str = "dpo"
    loss_type: str = "sigmoid"  # sigmoid | ipo | hinge (prefzoo.objective.PAIRWISE_LOSSES)
    label_smoothing: float = 0.0  # conservative DPO: probability that a label is flipped, in [0, 0.5)
    ipo_average_log_ratio: bool = True  # ipo: each side's log-ratio averaged over its tokens (false: summed, eq. 17)
    precompute_ref_logps: bool = False


@register
class DPO(Algorithm):
    """DPO plugin: offline pairs, frozen reference, loss on the implicit-reward margin."""

    name = "dpo"
    config_class = DPOConfig

    def __init__(self, cfg: DPOConfig, objective: ObjectiveSettings, sampling=None):
        super().__init__(cfg, objective, sampling)
        self.divergence = get_divergence(objective.divergence, alpha=objective.alpha)

    @staticmethod
    def validate_settings(cfg: DPOConfig, objective: ObjectiveSettings) -> None:
        if cfg.loss_type not in PAIRWISE_LOSSES:
            raise ConfigError(f"algo.loss_type={cfg.loss_type!r} is unknown; choose one of {', '.join(PAIRWISE_LOSSES)}.")
        if not 0 <= cfg.label_smoothing < 0.5:
            raise ConfigError(f"algo.label_smoothing={cfg.label_smoothing} must be in [0, 0.5).")
        if not objective.beta > 0:
            raise ConfigError(f"objective.beta={objective.beta}: DPO needs beta > 0 (beta scales the implicit reward; "
                              "beta=0 has no optimum).")

    def declare(self) -> Declaration:
        return Declaration(reference=True, aggregation="example_mean",
                           capabilities=frozenset({"implicit_rewards", "precomputed_reference"}),
                           precompute_reference=self.cfg.precompute_ref_logps,
                           progress_keys=("loss", "rewards/accuracies", "rewards/margins"))

    @property
    def averages_log_ratio(self) -> bool:
        return self.cfg.loss_type == "ipo" and self.cfg.ipo_average_log_ratio

    def reference_logps(self, policy: Policy, batch: PreferenceBatch) -> tuple[Tensor, Tensor]:
        """Summed reference log-probs (B,) of chosen and rejected (precomputed if the batch carries them)."""
        if batch.ref_chosen_logps is not None:
            return batch.ref_chosen_logps, batch.ref_rejected_logps
        both = batch.stacked()
        seq = sequence_logps(policy.ref_logps(both), both.completion_mask)
        return seq[: len(batch)], seq[len(batch):]

    def log_ratios(self, policy: Policy, batch: PreferenceBatch) -> dict[str, Tensor]:
        """Sequence log-probs of both sides (one forward pass over the 2B rows) and their log-ratios
        log(pi/pi_ref) (B,) each: summed over the completion tokens, or averaged under IPO."""
        ref_chosen, ref_rejected = self.reference_logps(policy, batch)
        both = batch.stacked()
        logps, _ = policy.logps(both)
        seq = sequence_logps(logps, both.completion_mask)
        b = len(batch)
        chosen_ratio, rejected_ratio = seq[:b] - ref_chosen, seq[b:] - ref_rejected
        if self.averages_log_ratio:
            lengths = both.completion_mask.sum(-1).clamp(min=1).to(seq.dtype)
            chosen_ratio, rejected_ratio = chosen_ratio / lengths[:b], rejected_ratio / lengths[b:]
        return {"chosen_logps": seq[:b], "rejected_logps": seq[b:], "chosen": chosen_ratio, "rejected": rejected_ratio}

    def rewards(self, chosen_ratio: Tensor, rejected_ratio: Tensor) -> tuple[Tensor, Tensor]:
        """Implicit rewards beta f'(pi/pi_ref) of chosen and rejected, Shape (B,) each, float64.

        In float64 because the links of forward KL (-1/u = -exp(-log_ratio)) and alpha overflow float32 once a
        sequence log-ratio falls below about -88 nats (a rejected answer DPO has pushed down): the loss and
        its gradient would then be NaN. (float64 overflows below -709 nats.)
        """
        return (implicit_reward(chosen_ratio.double(), self.beta, self.divergence),
                implicit_reward(rejected_ratio.double(), self.beta, self.divergence))

    def loss(self, policy: Policy, batch: PreferenceBatch) -> LossOutput:
        r = self.log_ratios(policy, batch)
        chosen_rewards, rejected_rewards = self.rewards(r["chosen"], r["rejected"])
        margin = chosen_rewards - rejected_rewards
        losses = pairwise_loss(margin, self.cfg.loss_type, self.beta, self.cfg.label_smoothing).float()
        with torch.no_grad():
            metrics = {
                "rewards/chosen": (self.beta * r["chosen"]).mean().item(),
                "rewards/rejected": (self.beta * r["rejected"]).mean().item(),
                "rewards/margins": margin.mean().item(), "rewards/accuracies": (margin > 0).float().mean().item(),
                "logps/chosen": r["chosen_logps"].mean().item(), "logps/rejected": r["rejected_logps"].mean().item(),
                "log_ratio/chosen": r["chosen"].mean().item(), "log_ratio/rejected": r["rejected"].mean().item(),
            }
            if self.objective.divergence != "reverse_kl":
                metrics["implicit_rewards/chosen"] = chosen_rewards.mean().item()
                metrics["implicit_rewards/rejected"] = rejected_rewards.mean().item()
        return LossOutput(losses, None, metrics)

    @torch.no_grad()
    def implicit_rewards(self, policy: Policy, batch: PreferenceBatch) -> tuple[Tensor, Tensor]:
        """Held-out ranking: the implicit rewards of chosen and rejected, Shape (B,) each."""
        r = self.log_ratios(policy, batch)
        return self.rewards(r["chosen"], r["rejected"])

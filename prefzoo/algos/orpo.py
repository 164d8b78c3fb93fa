"""ORPO: monolithic preference optimisation without a reference model (Hong et al. 2024).

ORPO adds to supervised fine-tuning on the chosen completion a penalty that favours it over the rejected one in
odds (Hong et al. 2024, eq. 6-7; odds and odds ratio, Sec. 4.1):

    P(y|x)  = exp( (1/|y|) sum_t log pi(y_t | x, y_<t) )           the length-normalised likelihood
    odds(y) = P / (1 - P)
    L_SFT   = -(1/|y_w|) sum_t log pi(y_w,t | x, y_w,<t)           the chosen's mean NLL
    L_OR    = -log sigma( log odds(y_w) - log odds(y_l) )
    loss    = L_SFT + lambda L_OR,      lambda = objective.beta    (the paper's and TRL's 0.1)

No reference model is used or loaded. The log odds come from :func:`prefzoo.objective.log_odds`
(log P - log(-expm1(log P)), finite as P -> 1); the -log sigma link is the shared ``sigmoid`` one.

Pseudo-code, per micro-batch of pairs: one forward pass over chosen and rejected; l_w, l_l = mean token
log-probs; loss_b = -l_w + lambda * softplus(-(log_odds(l_w) - log_odds(l_l))); mean over pairs.

Departures: none in the loss. lambda is ``objective.beta`` (TRL calls it ``beta`` too; ORPO has no divergence
term). TRL averages the NLL over all chosen tokens of the batch; here each chosen's token mean, averaged over
pairs, as eq. 6 (equal when the completions have one length).

Metrics (TRL's names and meanings): ``rewards/chosen`` / ``rewards/rejected`` = lambda * mean token log-prob,
``rewards/margins``, ``rewards/accuracies``; ``nll_loss`` (L_SFT, nats per token); ``log_odds_ratio`` = the mean of
log sigma(log OR) (= -L_OR, nats); ``log_odds_chosen`` = the mean log OR (nats); ``logps/chosen|rejected``
summed over the completion (nats; TRL logs them averaged -- prefzoo keeps one meaning for every plugin).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.base import AlgoConfig, Algorithm, Declaration, check_beta
from prefzoo.algos.pairwise import forward_pairs
from prefzoo.objective import log_odds, log_odds_ratio, pairwise_loss
from prefzoo.types import NO_STEP, LossOutput, ObjectiveSettings, Policy, PreferenceBatch, StepContext


@dataclass
class ORPOConfig(AlgoConfig):
    name: str = "orpo"
    default_beta: float = 0.1  # lambda, the weight of the odds-ratio term (the paper and TRL: 0.1)


@register
class ORPO(Algorithm):
    """ORPO plugin: offline pairs, no reference, chosen NLL + lambda x the log odds-ratio loss."""

    config_class = ORPOConfig

    @staticmethod
    def validate_settings(cfg: ORPOConfig, objective: ObjectiveSettings) -> None:
        check_beta(objective, "ORPO", "objective.beta is lambda, the odds-ratio term's weight: at 0 ORPO is algo=sft; "
                   "the paper and TRL use 0.1")

    def declare(self) -> Declaration:
        return Declaration(reference=False, aggregation="example_mean", capabilities=frozenset({"implicit_rewards"}),
                           progress_keys=("loss", "rewards/accuracies", "log_odds_chosen"))

    def loss(self, policy: Policy, batch: PreferenceBatch, step: StepContext = NO_STEP) -> LossOutput:
        f = forward_pairs(policy, batch)
        nll = -f.chosen_mean
        ratio = log_odds_ratio(f.chosen_mean, f.rejected_mean)
        losses = nll + self.beta * pairwise_loss(ratio, "sigmoid")
        with torch.no_grad():
            chosen_rewards, rejected_rewards = self.beta * f.chosen_mean, self.beta * f.rejected_mean
            gap = chosen_rewards - rejected_rewards
            metrics = {
                "rewards/chosen": chosen_rewards.mean().item(), "rewards/rejected": rejected_rewards.mean().item(),
                "rewards/margins": gap.mean().item(), "rewards/accuracies": (gap > 0).float().mean().item(),
                "nll_loss": nll.mean().item(), "log_odds_ratio": F.logsigmoid(ratio).mean().item(),
                "log_odds_chosen": ratio.mean().item(),
                "logps/chosen": f.chosen_logps.mean().item(), "logps/rejected": f.rejected_logps.mean().item(),
            }
        return LossOutput(losses, None, metrics)

    @torch.no_grad()
    def implicit_rewards(self, policy: Policy, batch: PreferenceBatch) -> tuple[Tensor, Tensor]:
        """Held-out ranking: the log odds of chosen and of rejected, Shape (B,) each (what L_OR compares; the
        ranking of the mean log-probs, whatever lambda)."""
        f = forward_pairs(policy, batch)
        return log_odds(f.chosen_mean), log_odds(f.rejected_mean)

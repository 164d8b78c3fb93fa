"""SFT on the chosen completions: the baseline every preference method is compared with.

Supervised fine-tuning maximises the likelihood of the preferred completion and ignores the rejected one:

    loss = -(1 / N) sum_{pairs b} sum_{t in y_w,b} log pi(y_w,b,t | x_b, y_w,b,<t),   N = chosen tokens in the batch

(the token mean over the whole batch, as TRL's SFTTrainer; per-token losses reduced by the loop's one global
normaliser, so micro-batches and processes give the update of one big batch). Its population optimum on
Bradley-Terry pairs is the distribution of the chosen completion, P(y_w = y) (``docs/conformance.md``).
No reference model is used or loaded; ``objective.beta`` is unused (default 0).

Metrics: ``logps/chosen`` (summed over the completion, nats); the loss is the NLL in nats per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.base import AlgoConfig, Algorithm, Declaration
from prefzoo.algos.pairwise import forward_pairs
from prefzoo.objective import sequence_logps
from prefzoo.types import NO_STEP, LossOutput, Policy, PreferenceBatch, StepContext


@dataclass
class SFTConfig(AlgoConfig):
    name: str = "sft"
    default_beta: float = 0.0  # no divergence term


@register
class SFT(Algorithm):
    """SFT plugin: offline pairs, no reference, per-token NLL of the chosen completions (token mean)."""

    config_class = SFTConfig

    def declare(self) -> Declaration:
        return Declaration(reference=False, aggregation="token_mean", capabilities=frozenset({"implicit_rewards"}),
                           progress_keys=("loss",), uses_beta=False)

    def loss_mask(self, batch: PreferenceBatch) -> Tensor:
        return batch.chosen.completion_mask

    def loss(self, policy: Policy, batch: PreferenceBatch, step: StepContext = NO_STEP) -> LossOutput:
        logps, _ = policy.logps(batch.chosen)
        with torch.no_grad():
            metrics = {"logps/chosen": sequence_logps(logps, batch.chosen.completion_mask).mean().item()}
        return LossOutput(-logps, batch.chosen.completion_mask, metrics)

    @torch.no_grad()
    def implicit_rewards(self, policy: Policy, batch: PreferenceBatch) -> tuple[Tensor, Tensor]:
        """Held-out ranking: the mean token log-prob of chosen and of rejected, Shape (B,) each."""
        f = forward_pairs(policy, batch)
        return f.chosen_mean, f.rejected_mean

"""SFT: the likelihood of demonstrations, the baseline every preference method is compared with.

Supervised fine-tuning maximises the log-likelihood of the tokens that carry the loss:

    loss = -(1 / N) sum_{rows b} sum_{t counted in b} log pi(y_b,t | y_b,<t),   N = counted tokens in the batch

(the token mean over the whole batch, as TRL's SFTTrainer; per-token losses reduced by the loop's one global
normaliser, so micro-batches and processes give the update of one big batch). Which tokens count is the data's
(:mod:`prefzoo.data.sft`, TRL's four formats and a preference file's chosen side), chosen by two keys with TRL's names:

* ``algo.completion_only_loss`` (default true, as TRL's default for these rows): a prompt/completion row (and a
  preference pair's prompt + chosen) counts its completion only; false: every token after the first.
* ``algo.assistant_only_loss`` (default TRUE; TRL's default is false): a ``messages`` row counts the assistant turns
  only; false: every token after the first, the system, user and tool messages and the template's headers too. Why
  prefzoo departs from TRL here: a conversation trains the policy, whose tokens are the assistant's (the rule of
  prefzoo's multi-turn rollouts, where only the policy's own tokens have a loss, and the one TRL applies to a
  prompt/completion row by default); counting the user's turns teaches the model to write the user's questions and
  the system prompt, and makes a one-turn conversation train on something else than the same turn written as
  prompt/completion (with the default, the two give the same loss: ``tests/algos/test_sft.py``).
  ``text`` rows count every token.

Its population optimum on Bradley-Terry pairs is the distribution of the chosen completion, P(y_w = y)
(``docs/conformance.md``). No reference model is used or loaded; ``objective.beta`` is unused (default 0).

Metrics: ``logps/completion`` (the counted tokens' log-probs summed per row, the mean over rows, nats); the loss is
the NLL in nats per counted token. Held out (a preference file, the built-in pairs): the preference accuracy of the
mean token log-probs of chosen and rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.base import AlgoConfig, Algorithm, Declaration
from prefzoo.algos.pairwise import forward_pairs
from prefzoo.objective import sequence_logps
from prefzoo.types import NO_STEP, LossOutput, LossTokens, Policy, PreferenceBatch, SequenceBatch, StepContext


@dataclass
class SFTConfig(AlgoConfig):
    name: str = "sft"
    default_beta: float = 0.0  # no divergence term
    completion_only_loss: bool = True  # prompt/completion (and pair) rows: the loss on the completion only
    assistant_only_loss: bool = True  # messages rows: the loss on the assistant turns only (TRL's default: false)


@register
class SFT(Algorithm):
    """SFT plugin: supervised rows, no reference, per-token NLL of the counted tokens (token mean)."""

    config_class = SFTConfig

    def declare(self) -> Declaration:
        return Declaration(reference=False, aggregation="token_mean", capabilities=frozenset({"implicit_rewards"}),
                           progress_keys=("loss",), uses_beta=False, data="sequences",
                           loss_tokens=LossTokens(completion_only_loss=bool(self.cfg.completion_only_loss),
                                                  assistant_only_loss=bool(self.cfg.assistant_only_loss)))

    def loss_mask(self, batch: SequenceBatch) -> Tensor:
        return batch.completion_mask

    def loss(self, policy: Policy, batch: SequenceBatch, step: StepContext = NO_STEP) -> LossOutput:
        logps, _ = policy.logps(batch)
        with torch.no_grad():
            metrics = {"logps/completion": sequence_logps(logps, batch.completion_mask).mean().item()}
        return LossOutput(-logps, batch.completion_mask, metrics)

    @torch.no_grad()
    def implicit_rewards(self, policy: Policy, batch: PreferenceBatch) -> tuple[Tensor, Tensor]:
        """Held-out ranking: the mean token log-prob of chosen and of rejected, Shape (B,) each."""
        f = forward_pairs(policy, batch)
        return f.chosen_mean, f.rejected_mean

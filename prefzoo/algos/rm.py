"""A Bradley-Terry reward model trained on preference pairs (Ouyang et al. 2022, eq. 1; Stiennon et al. 2020).

The Bradley-Terry model (Bradley & Terry 1952) says a labeller prefers y_w to y_l with probability
sigma(r(x, y_w) - r(x, y_l)). Fitting a scalar r_theta by maximum likelihood on pairs gives the loss

    loss = -log sigma(r_theta(x, y_w) - r_theta(x, y_l))                 (Ouyang et al. 2022, eq. 1)

(eq. 1 averages it over the K-choose-2 pairs of a prompt; here every row of the set is one pair). With
``center_rewards_coef`` > 0 the auxiliary term coef * (r_w + r_l)^2 keeps the rewards centred on 0 (Eisenstein
et al. 2023, "Helping or Herding?"), which pins down the offset that the Bradley-Terry likelihood leaves free.

The model: the backbone with its LoRA adapter and a scalar head on the final hidden state, read at the LAST
token of the completion (the state after the whole reply, EOS included when there is one). It is the value
model of :mod:`prefzoo.models.value` (``algo.value_adapter=shared``: the head on the run's own adapter) read at
the terminal state: ``policy.values`` gives V of the state before each completion token, so the plugin asks for
the values of the batch with one more completion column and reads column L (the state after token L-1), see
:func:`prefzoo.types.sequence_rewards`. The same scalar-head module therefore serves as PPO's value function and as the reward
model (InstructGPT initialises one from the other).

Offline, like DPO: batches are :class:`~prefzoo.types.PreferenceBatch`; no reference model is loaded.
Held-out pair accuracy comes from :meth:`RewardModelling.implicit_rewards` through the shared evaluator
(``preference_accuracy``). At the end of the run :meth:`RewardModelling.save_artifacts` writes the reward model into the
run folder (``adapter/``, ``value_head.safetensors``, ``value_model.json`` with the run's data settings);
``reward=model reward.path=<run folder>`` then scores text with it, and ``data=model`` (the default data for
that reward) gives PPO the prompts of the reward model's own task.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.base import AlgoConfig, Algorithm, Declaration
from prefzoo.errors import ConfigError
from prefzoo.objective import bradley_terry_loss
from prefzoo.types import (NO_STEP, LossOutput, ObjectiveSettings, PreferenceBatch, sequence_rewards, StepContext,
                           ValueHeadSpec, ValuePolicy)


@dataclass
class RMConfig(AlgoConfig):
    name: str = "rm"
    default_beta: float = 0.0  # no KL term: this trains a reward, not a policy
    center_rewards_coef: float = 0.0  # weight of (r_w + r_l)^2 (Eisenstein et al. 2023); 0: plain Bradley-Terry
    value_adapter: str = "shared"  # the head on the run's own LoRA adapter (see prefzoo.models.value)
    head_init: str = "normal"  # N(0, 1/(hidden+1)): an untrained model ranks pairs at chance instead of all ties


@register
class RewardModelling(Algorithm):
    """``algo=rm``: fit a scalar reward model to preference pairs (Bradley-Terry)."""

    config_class = RMConfig

    @staticmethod
    def validate_settings(cfg: RMConfig, objective: ObjectiveSettings) -> None:
        if cfg.center_rewards_coef < 0:
            raise ConfigError(f"algo.center_rewards_coef={cfg.center_rewards_coef} must be >= 0.")
        if cfg.value_adapter not in ("shared", "separate"):
            raise ConfigError(f"algo.value_adapter={cfg.value_adapter!r}; choose shared or separate.")
        if cfg.head_init not in ("normal", "zeros"):
            raise ConfigError(f"algo.head_init={cfg.head_init!r}; choose normal or zeros.")

    def declare(self) -> Declaration:
        return Declaration(reference=False, value_head=ValueHeadSpec(self.cfg.value_adapter, self.cfg.head_init),
                           aggregation="example_mean",
                           capabilities=frozenset({"implicit_rewards", "saves_artifacts"}),
                           progress_keys=("loss", "accuracy", "margin"), uses_beta=False)

    def pair_rewards(self, policy: ValuePolicy, batch: PreferenceBatch) -> tuple[Tensor, Tensor]:
        """Rewards of chosen and rejected, Shape (B,) each, from ONE forward pass over the 2B rows."""
        rewards = sequence_rewards(policy.values, batch.stacked())
        return rewards[: len(batch)], rewards[len(batch):]

    def loss(self, policy: ValuePolicy, batch: PreferenceBatch, step: StepContext = NO_STEP) -> LossOutput:
        chosen, rejected = self.pair_rewards(policy, batch)
        losses = bradley_terry_loss(chosen, rejected)
        if self.cfg.center_rewards_coef:
            losses = losses + self.cfg.center_rewards_coef * (chosen + rejected) ** 2
        with torch.no_grad():
            margin = chosen - rejected
            metrics = {"accuracy": (margin > 0).float().mean().item(), "margin": margin.mean().item(),
                       "rewards/chosen": chosen.mean().item(), "rewards/rejected": rejected.mean().item()}
        return LossOutput(losses, None, metrics)

    @torch.no_grad()
    def implicit_rewards(self, policy: ValuePolicy, batch: PreferenceBatch) -> tuple[Tensor, Tensor]:
        """Held-out ranking for the evaluator: the rewards of chosen and rejected, Shape (B,) each."""
        return self.pair_rewards(policy, batch)

    def save_artifacts(self, run_dir: Path, policy: ValuePolicy) -> None:
        """Write the reward model in a loadable form into ``run_dir`` (called by the loop after training).

        ``adapter/`` (peft format), ``value_head.safetensors`` and ``value_model.json`` (base model, the run's
        data settings); :func:`prefzoo.rewards.model.reward_model_function` reads them back.
        """
        policy.save_value_head(Path(run_dir), extra={"kind": "reward_model", "read_out": "terminal_state"})

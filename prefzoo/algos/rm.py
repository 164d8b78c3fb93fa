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
:func:`sequence_rewards`. The same scalar-head module therefore serves as PPO's value function and as the reward
model (InstructGPT initialises one from the other).

Offline, like DPO: batches are :class:`~prefzoo.data.preference.PreferenceBatch`; no reference model is loaded.
Held-out pair accuracy comes from :meth:`RewardModelling.implicit_rewards` through the shared evaluator
(``preference_accuracy``). At the end of the run :meth:`RewardModelling.save` writes the reward model into the
run folder (``adapter/``, ``value_head.safetensors``, ``value_model.json`` with the run's data settings);
``reward=model reward.path=<run folder>`` then scores text with it, and ``data=model`` (the default data for
that reward) gives PPO the prompts of the reward model's own task.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.base import AlgoConfig, Algorithm, LossOutput, Policy, SequenceBatch


@dataclass
class RMConfig(AlgoConfig):
    name: str = "rm"
    center_rewards_coef: float = 0.0  # weight of (r_w + r_l)^2 (Eisenstein et al. 2023); 0: plain Bradley-Terry
    value_adapter: str = "shared"  # the head on the run's own LoRA adapter (see prefzoo.models.value)
    head_init: str = "normal"  # N(0, 1/(hidden+1)): an untrained model ranks pairs at chance instead of all ties


def bradley_terry_loss(chosen_rewards: Tensor, rejected_rewards: Tensor) -> Tensor:
    """Per-pair negative log-likelihood of the preference under Bradley-Terry.

        loss = -log sigma(r_w - r_l) = log(1 + exp(-(r_w - r_l)))   (computed stably with logsigmoid)

    Shape: chosen_rewards (B,), rejected_rewards (B,) -> (B,); B = pairs.
    Units: nats.

    Raises:
        ValueError: the shapes differ.

    Source: Bradley & Terry 1952; Ouyang et al. 2022, eq. 1.
    """
    if chosen_rewards.shape != rejected_rewards.shape:
        raise ValueError(f"chosen_rewards {tuple(chosen_rewards.shape)} and rejected_rewards "
                         f"{tuple(rejected_rewards.shape)} must have the same shape (B,)")
    return -F.logsigmoid(chosen_rewards - rejected_rewards)


def with_terminal_column(batch: SequenceBatch, fill_id: int = 0) -> SequenceBatch:
    """The batch with one more completion column, counted in each row right after its last token.

    Column L_b of row b (L_b = its number of completion tokens) becomes a counted filler token, so that
    ``values[b, L_b]`` -- the value of the state before that column -- is the value of the state after the whole
    completion. The filler never influences it (causal attention: a position sees only earlier ones).

    Shape: (B, P) prompts and (B, C) completions -> (B, C + 1) completions. Completions must be right-padded.
    """
    b, c = batch.completion_ids.shape
    lengths = batch.completion_mask.sum(-1)
    ids = torch.cat([batch.completion_ids, torch.full((b, 1), fill_id, dtype=batch.completion_ids.dtype,
                                                      device=batch.completion_ids.device)], dim=1)
    mask = torch.arange(c + 1, device=lengths.device)[None, :] <= lengths[:, None]
    return SequenceBatch(batch.prompt_ids, batch.prompt_mask, ids, mask)


def sequence_rewards(values_fn, batch: SequenceBatch) -> Tensor:
    """r(x, y): the scalar head read at the state after the last completion token.

    Args:
        values_fn: ``batch -> values`` Shape (B, C) (``policy.values`` or a value model), values of the state
            before each completion token.
        batch: prompts and right-padded completions.
    Returns:
        Shape (B,) float32 rewards, with the gradient of ``values_fn``.
    """
    lengths = batch.completion_mask.sum(-1)
    values = values_fn(with_terminal_column(batch))
    return values.gather(1, lengths[:, None].long())[:, 0]


@register
class RewardModelling(Algorithm):
    """``algo=rm``: fit a scalar reward model to preference pairs (Bradley-Terry)."""

    name = "rm"
    config_class = RMConfig
    default_beta: ClassVar[float] = 0.0  # no KL term: this trains a reward, not a policy
    online = False
    needs_value_head = True
    aggregation = "example_mean"
    progress_keys = ("loss", "accuracy", "margin")

    @staticmethod
    def validate_config(cfg) -> None:
        from prefzoo.errors import ConfigError

        if cfg.algo.center_rewards_coef < 0:
            raise ConfigError(f"algo.center_rewards_coef={cfg.algo.center_rewards_coef} must be >= 0.")
        if cfg.algo.value_adapter not in ("shared", "separate"):
            raise ConfigError(f"algo.value_adapter={cfg.algo.value_adapter!r}; choose shared or separate.")
        if cfg.algo.head_init not in ("normal", "zeros"):
            raise ConfigError(f"algo.head_init={cfg.algo.head_init!r}; choose normal or zeros.")

    @property
    def needs_reference(self) -> bool:
        return False

    def pair_rewards(self, policy: Policy, batch) -> tuple[Tensor, Tensor]:
        """Rewards of chosen and rejected, Shape (B,) each, from ONE forward pass over the 2B rows."""
        both = SequenceBatch.cat([batch.chosen, batch.rejected], getattr(policy, "pad_id", 0) or 0)
        rewards = sequence_rewards(policy.values, both)
        return rewards[: len(batch)], rewards[len(batch):]

    def loss(self, policy: Policy, batch) -> LossOutput:
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
    def implicit_rewards(self, policy: Policy, batch) -> tuple[Tensor, Tensor]:
        """Held-out ranking for the evaluator: the rewards of chosen and rejected, Shape (B,) each."""
        return self.pair_rewards(policy, batch)

    # ---------------------------------------------------------------- saving
    def save(self, run_dir: Path, policy) -> None:
        """Write the reward model in a loadable form into ``run_dir`` (called by the loop after training).

        ``adapter/`` (peft format), ``value_head.safetensors`` and ``value_model.json`` (base model, the run's
        data settings); :func:`prefzoo.rewards.model.reward_model_function` reads them back.
        """
        value_model = getattr(policy, "value_model", None)
        if value_model is None or not hasattr(value_model, "save_pretrained"):
            raise RuntimeError("algo=rm needs a policy whose value model can save itself (prefzoo.models.value).")
        value_model.save_pretrained(Path(run_dir), extra={"kind": "reward_model", "read_out": "terminal_state"})

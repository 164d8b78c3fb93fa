"""Group Relative Policy Optimisation (Shao et al. 2024, DeepSeekMath; DeepSeek-R1 2025).

For each prompt q, sample a group of G completions o_1..o_G from the current policy, score them with a
verifiable reward, and use the group as its own baseline (Shao et al. 2024, sec. 4.1.2):

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)        every token of o_i gets A_i

then maximise the clipped surrogate (eq. 3) with an optional KL term:

    loss = -(1/G) sum_i (1/|o_i|) sum_t [ min(rho_t A_i, clip(rho_t, 1-eps_low, 1+eps_high) A_i)
                                          - beta * k(log pi/pi_ref)_t ]

Choices exposed (and where they come from):

* ``scale_rewards``: ``group`` (the paper), ``batch`` (std over the whole batch), ``none`` (Dr. GRPO,
  Liu et al. 2025: no division by the std);
* ``loss_aggregation``: ``grpo`` (mean over each sequence's tokens, then over sequences: eq. 3),
  ``dr_grpo`` (sum over tokens / a constant = max_new_tokens), ``dapo`` (mean over all tokens of the
  batch, Yu et al. 2025 eq. 8);
* ``clip_eps_low`` / ``clip_eps_high``: DAPO's decoupled clip ("clip-higher");
* ``policy_loss``: ``clipped`` (PPO's clip, eq. 3; ``clip_delta``: INTELLECT-2's two-sided clip) or a surrogate
  without it: ``dppo_tv`` / ``dppo_kl`` (DPPO's divergence mask), ``sapo`` (SAPO's soft gate), ``dro`` (DRO's
  quadratic penalty), ``vespo`` (VESPO's kernel of the sequence's importance weight), with their settings
  (:class:`~prefzoo.algos.trust_region.TrustRegionConfig`, :func:`~prefzoo.algos.trust_region.trust_region_token_loss`);
  ``scale_rewards=mean`` is MaxRL's advantage (r - mean) / mean;
* the masks on the policy term every member has (:func:`~prefzoo.algos.online.mask_policy_term`):
  ``off_policy_mask_threshold`` (DeepSeek-V3.2's off-policy sequence mask) and ``top_entropy_quantile`` (only the
  highest-entropy tokens learn, Wang et al. 2025);
* ``epochs`` (mu in the paper, TRL's ``num_iterations``): passes over each rollout, each split into
  ``num_minibatches`` optimizer steps; with more than one optimizer step per rollout, the policy's log-probs at
  sampling time are stored as ``old_logps`` (with one, old_logps = logps.detach(), so the ratio is exactly 1);
* beta = 0 by default (DeepSeek-R1, Dr. GRPO, DAPO drop the KL term): then no reference model is
  loaded. With beta > 0 the estimator and its placement come from ``objective`` (default k3 as a loss,
  as in the paper; see :mod:`prefzoo.objective.kl` for what each combination really optimises). "In
  reward" subtracts beta * sum_t k_t from each completion's reward before the group normalisation.

Where the KL as a loss leads (measured in ``docs/conformance.md``, ``python -m prefzoo.lab.conformance``): the group
mean includes the sample itself, so E[(r_i - mean_j r_j) grad log pi(o_i)] = ((G-1)/G) grad E[r], while the KL
loss's gradient is not scaled. With ``scale_rewards=none`` the fixed point of k2 as a loss is therefore
pi* = pi_ref exp(r/beta')/Z at beta' = beta * G/(G-1) (not beta), and k3 as a loss reaches the forward-KL
optimum at the same beta'; k1 in the reward reaches pi* at beta exactly (the penalty enters the reward, and so
the same baseline).

Advantages are stored per token, (B, T): A_i repeated over the tokens of o_i (0 on padding). Log-probs are
recomputed with the sampling temperature (``self.sampling``, set once). Drift metrics (KL k1/k3 to the starting policy)
are reported whenever a reference is available for free (LoRA: the adapter switched off), even with
beta = 0: from the update's forward pass when there is one optimizer step per rollout (no extra pass of the
policy), else from the no-grad pass that stores ``old_logps``.

Everything but the config, the checks, the advantages and the per-token loss is the online family's
(:mod:`prefzoo.algos.online`: the rollout, log pi_old, the KL term, the metrics of its schema).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.online import OnlinePolicyGradient, group_relative_advantages
from prefzoo.algos.online_settings import GroupRelativeConfig, check_group_relative_settings, check_policy_clip
from prefzoo.algos.trust_region import (TokenLoss, TrustRegionConfig, check_trust_region, takes_is_weights,
                                         trust_region_token_loss)
from prefzoo.objective import TRUST_REGION_LOSSES
from prefzoo.types import Experience, ObjectiveSettings


@dataclass
class GRPOConfig(GroupRelativeConfig, TrustRegionConfig):
    name: str = "grpo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2  # DAPO uses 0.28
    policy_loss: str = "clipped"  # clipped | dppo_tv | dppo_kl | sapo | dro | vespo


@register
class GRPO(OnlinePolicyGradient):
    """GRPO plugin: online groups, verifiable rewards, group-relative advantages, clipped surrogate."""

    config_class = GRPOConfig
    advantages = group_relative_advantages

    @staticmethod
    def validate_settings(cfg: GRPOConfig, objective: ObjectiveSettings) -> None:
        check_group_relative_settings(cfg, objective)
        check_policy_clip(cfg)
        check_trust_region(cfg, ("clipped", *TRUST_REGION_LOSSES))

    def loss_takes_is_weights(self) -> bool:
        return takes_is_weights(self.cfg)

    def token_loss(self, logps: Tensor, old_logps: Tensor, batch: Experience) -> TokenLoss:
        """PPO's clipped surrogate per token (eq. 3), with DAPO's decoupled clip; or ``algo.policy_loss``'s."""
        return trust_region_token_loss(self.cfg, logps, old_logps, batch)

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
* ``epochs`` (mu in the paper, TRL's ``num_iterations``): passes over each rollout; for more than one, the
  policy's log-probs at sampling time are stored as ``old_logps`` (with one pass old_logps = logps.detach(), so
  the ratio is exactly 1);
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
beta = 0: from the update's forward pass when there is one iteration (no extra pass of the policy), else from
the no-grad pass that stores ``old_logps``.

Metrics (the schema every online plugin shares): ``reward``, ``reward_std``, ``kl`` / ``kl_k3`` (KL(pi || pi_ref)
per sequence, k1 / k3, nats), ``kl_loss`` (the KL loss term's token mean), ``clip_fraction``, ``ratio_mean``,
``approx_kl`` (KL(pi_old || pi_theta) per token, k3), ``entropy`` (nats per token), ``frac_zero_std_groups``,
``completion_length``, ``frac_truncated``; timings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.base import AlgoConfig, Algorithm, Declaration
from prefzoo.algos.sampled import (AGGREGATION_OF, check_rollout_settings, corrected_advantages,  # noqa: F401
                                   drift_metrics, rollout_declaration, sample_and_score)  # (AGGREGATION_OF re-exported)
from prefzoo.errors import ConfigError
from prefzoo.objective import (ADVANTAGE_SCALES, clipped_surrogate_loss, group_advantages, kl_loss, kl_penalty_rewards,
                               masked_sum, ratio_statistics)
from prefzoo.types import Experience, LossOutput, ObjectiveSettings, Policy, PromptBatch, Scorer

@dataclass
class GRPOConfig(AlgoConfig):
    name: str = "grpo"
    default_beta: float = 0.0  # DeepSeek-R1, Dr. GRPO and DAPO drop the KL term
    default_kl_estimator: str = "k3"
    default_kl_placement: str = "as_loss"
    # With the arithmetic task's exact-match reward, G = 4 and SmolLM2-135M: at temperature 1.0 only ~4% of samples
    # are right and most groups are all-wrong (zero advantage, no gradient); at 0.7 ~15% are. 8 prompts per step
    # double the informative groups per step.
    default_temperature: float = 0.7
    default_batch_size: int = 8
    num_samples: int = 4  # G, completions per prompt
    scale_rewards: str = "group"  # group | batch | none
    advantage_eps: float = 1e-4
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2  # DAPO uses 0.28
    loss_aggregation: str = "grpo"  # grpo | dr_grpo | dapo
    epochs: int = 1  # passes over each rollout (mu in the paper)
    num_minibatches: int = 1
    mask_truncated: bool = False  # completions without EOS contribute no loss


@register
class GRPO(Algorithm):
    """GRPO plugin: online groups, verifiable rewards, group-relative advantages, clipped surrogate."""

    name = "grpo"
    config_class = GRPOConfig

    @staticmethod
    def validate_settings(cfg: GRPOConfig, objective: ObjectiveSettings) -> None:
        if cfg.num_samples < 2:
            raise ConfigError(f"algo.num_samples={cfg.num_samples}: GRPO needs at least 2 completions per prompt (the "
                              "group is the baseline).")
        if cfg.scale_rewards not in ADVANTAGE_SCALES:
            raise ConfigError(f"algo.scale_rewards={cfg.scale_rewards!r}; choose one of {', '.join(ADVANTAGE_SCALES)}.")
        check_rollout_settings(cfg, objective)

    def declare(self) -> Declaration:
        return rollout_declaration(self, ("reward", "kl_k3", "clip_fraction"))

    def loss_mask(self, batch: Experience) -> Tensor:
        return batch.loss_mask

    def stores_old_logps(self) -> bool:
        """Whether the rollout keeps log pi_old (a no-grad pass): several epochs (GSPO and CISPO, which derive
        from GRPO, also for several mini-batches of one epoch)."""
        return self.cfg.epochs > 1

    @torch.no_grad()
    def make_experience(self, policy: Policy, prompts: PromptBatch, score: Scorer) -> tuple[Experience, dict[str, float]]:
        g, o = self.cfg.num_samples, self.objective
        # A no-grad pass of the policy only where the log-probs at sampling time are needed before the update
        # (several epochs, or the KL in the reward). With one epoch the drift metrics come from the update's own
        # forward pass (see loss), which computes these very log-probs.
        in_reward = self.beta > 0 and o.kl_placement == "in_reward"
        r = sample_and_score(policy, prompts, score, g, self.sampling, need_logps=self.stores_old_logps() or in_reward)
        samples, rewards, mask = r.samples, r.rewards, r.samples.completion_mask
        shaped = rewards
        if in_reward:
            shaped = rewards + kl_penalty_rewards(r.logps, r.ref_logps, mask, self.beta, o.kl_estimator).sum(-1)
        advantages = group_advantages(shaped, g, self.cfg.scale_rewards, self.cfg.advantage_eps,
                                      all_reduce=self.all_reduce)  # data parallel: scale_rewards=batch's std is global
        loss_mask = mask & ~samples.truncated[:, None] if self.cfg.mask_truncated else mask
        old_logps = r.logps if self.stores_old_logps() else None
        ref_logps, metrics = r.ref_logps, r.metrics
        token_advantages = torch.where(mask, advantages[:, None].float(), torch.zeros((), device=mask.device))
        token_advantages = corrected_advantages(token_advantages, r.is_weights)  # rollout.is_correction_cap
        return Experience.from_samples(samples, rewards=rewards, advantages=token_advantages, loss_mask=loss_mask,
                                       old_logps=old_logps, ref_logps=ref_logps), metrics

    def loss(self, policy: Policy, batch: Experience) -> LossOutput:
        logps, entropy = policy.logps(batch, self.sampling.temperature, with_entropy=True)
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        mask = batch.loss_mask
        per_token, clipped = clipped_surrogate_loss(logps, old, batch.advantages, mask, self.cfg.clip_eps_low,
                                                    self.cfg.clip_eps_high)
        metrics = {}
        if batch.old_logps is None and batch.ref_logps is not None:  # one epoch: logps ARE the sampling policy's
            metrics.update(drift_metrics(logps, batch.ref_logps, batch.completion_mask))
        tokens = ratio_statistics(logps, old, mask, clipped)
        n = float(mask.sum())
        tokens["entropy"] = (float(masked_sum(entropy, mask)), n)
        if self.beta > 0 and self.objective.kl_placement == "as_loss":
            kl_tokens = kl_loss(logps, batch.ref_logps, mask, self.objective.kl_estimator)
            per_token = per_token + self.beta * kl_tokens
            tokens["kl_loss"] = (float(masked_sum(kl_tokens.detach(), mask)), n)
        return LossOutput(per_token, mask, metrics, tokens)

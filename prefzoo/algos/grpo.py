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
* ``epsilon_low`` / ``epsilon_high``: DAPO's decoupled clip ("clip-higher");
* ``num_iterations``: passes over each rollout; for more than one, the policy's log-probs at sampling
  time are stored as ``old_logps`` (with one pass old_logps = logps.detach(), so the ratio is exactly 1);
* beta = 0 by default (DeepSeek-R1, Dr. GRPO, DAPO drop the KL term): then no reference model is
  loaded. With beta > 0 the estimator and its placement come from ``objective`` (default k3 as a loss,
  as in the paper; see :mod:`prefzoo.objective.kl` for what each combination really optimises). "In
  reward" subtracts beta * sum_t k_t from each completion's reward before the group normalisation.

Where the KL as a loss leads (measured in ``docs/conformance.md``, ``python -m prefzoo.conformance``): the group
mean includes the sample itself, so E[(r_i - mean_j r_j) grad log pi(o_i)] = ((G-1)/G) grad E[r], while the KL
loss's gradient is not scaled. With ``scale_rewards=none`` the fixed point of k2 as a loss is therefore
pi* = pi_ref exp(r/beta')/Z at beta' = beta * G/(G-1) (not beta), and k3 as a loss reaches the forward-KL
optimum at the same beta'; k1 in the reward reaches pi* at beta exactly (the penalty enters the reward, and so
the same baseline).

Log-probs are recomputed with the sampling temperature. Drift metrics (KL k1/k3 to the starting policy)
are reported whenever a reference is available for free (LoRA: the adapter switched off), even with
beta = 0: from the update's forward pass when there is one iteration (no extra pass of the policy), else from
the no-grad pass that stores ``old_logps``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.base import AlgoConfig, Algorithm, LossOutput, Policy, PromptBatch, SamplingParams, Scorer, SequenceBatch
from prefzoo.objective import (clipped_surrogate_loss, group_advantages, kl_estimate, kl_loss, kl_penalty_rewards,
                               masked_sum)

AGGREGATION_OF = {"grpo": "sequence_mean", "dr_grpo": "constant", "dapo": "token_mean"}


@dataclass
class GRPOConfig(AlgoConfig):
    name: str = "grpo"
    num_generations: int = 4  # G, completions per prompt
    scale_rewards: str = "group"  # group | batch | none
    advantage_eps: float = 1e-4
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2  # DAPO uses 0.28
    loss_aggregation: str = "grpo"  # grpo | dr_grpo | dapo
    num_iterations: int = 1  # passes over each rollout (mu in the paper)
    num_minibatches: int = 1
    mask_truncated: bool = False  # completions without EOS contribute no loss


@dataclass
class GRPOExperience(SequenceBatch):
    """Sampled completions with what the loss needs. B = prompts x G, C = completion length.

    Attributes:
        advantages: Shape (B,), the group-relative advantage of each completion.
        loss_mask: Shape (B, C) bool, tokens that enter the loss (completion_mask minus truncated rows if asked).
        old_logps: Shape (B, C) float32, log-probs at sampling time (num_iterations > 1), else None.
        ref_logps: Shape (B, C) float32 reference log-probs, or None without a reference.
        temperature: the sampling temperature (log-probs in the loss are recomputed with it).
    """

    advantages: Tensor | None = None
    loss_mask: Tensor | None = None
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None
    temperature: float = 1.0

    def num_tokens(self) -> int:
        return int(self.prompt_mask.sum() + self.completion_mask.sum())


@register
class GRPO(Algorithm):
    """GRPO plugin: online groups, verifiable rewards, group-relative advantages, clipped surrogate."""

    name = "grpo"
    config_class = GRPOConfig
    default_beta: ClassVar[float] = 0.0
    default_kl_estimator: ClassVar[str] = "k3"
    default_kl_placement: ClassVar[str] = "as_loss"
    online = True
    progress_keys = ("reward", "kl_k3", "clip_fraction")

    def __init__(self, cfg: GRPOConfig, objective):
        super().__init__(cfg, objective)
        self.aggregation = AGGREGATION_OF[cfg.loss_aggregation]
        self.max_length_for_aggregation = None

    @staticmethod
    def validate_config(cfg) -> None:
        from prefzoo.errors import ConfigError

        a = cfg.algo
        if a.num_generations < 2:
            raise ConfigError(f"algo.num_generations={a.num_generations}: GRPO needs at least 2 completions per "
                              "prompt (the group is the baseline).")
        if a.scale_rewards not in ("group", "batch", "none"):
            raise ConfigError(f"algo.scale_rewards={a.scale_rewards!r}; choose one of group, batch, none.")
        if a.loss_aggregation not in AGGREGATION_OF:
            raise ConfigError(f"algo.loss_aggregation={a.loss_aggregation!r}; choose one of {', '.join(AGGREGATION_OF)}.")
        if a.num_iterations < 1 or a.num_minibatches < 1:
            raise ConfigError("algo.num_iterations and algo.num_minibatches must be >= 1.")
        if cfg.objective.kl_controller == "adaptive" and not (cfg.objective.beta or 0) > 0:
            raise ConfigError("the adaptive KL controller needs a starting objective.beta > 0.")

    @property
    def epochs(self) -> int:
        return self.cfg.num_iterations

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0 or self.objective.kl_controller == "adaptive"

    def loss_mask(self, batch: GRPOExperience) -> Tensor:
        return batch.loss_mask

    @torch.no_grad()
    def make_experience(self, policy: Policy, prompts: PromptBatch, score: Scorer, sampling: SamplingParams
                        ) -> tuple[GRPOExperience, dict[str, float]]:
        g = self.cfg.num_generations
        self.max_length_for_aggregation = sampling.max_new_tokens
        t0 = time.perf_counter()
        samples = policy.sample(prompts, g, sampling)
        t1 = time.perf_counter()
        rewards = score(samples, prompts)
        mask = samples.completion_mask
        ref_logps = old_logps = logps = None
        metrics: dict[str, float] = {}
        has_ref = getattr(policy, "reference", None) is not None
        # A no-grad pass of the policy only where the log-probs at sampling time are needed before the update
        # (several iterations, or the KL in the reward). With one iteration the drift metrics come from the
        # update's own forward pass (see loss), which computes these very log-probs.
        in_reward = self.beta > 0 and self.objective.kl_placement == "in_reward"
        if self.cfg.num_iterations > 1 or in_reward:
            logps, _ = policy.logps(samples, sampling.temperature)
            if self.cfg.num_iterations > 1:
                old_logps = logps
        if has_ref:
            ref_logps = policy.ref_logps(samples, sampling.temperature)
            if logps is not None:
                metrics.update(self.drift_metrics(logps, ref_logps, mask))
        shaped = rewards
        if self.beta > 0 and self.objective.kl_placement == "in_reward":
            penalty = kl_penalty_rewards(logps, ref_logps, mask, self.beta, self.objective.kl_estimator)
            shaped = rewards + penalty.sum(-1)
        advantages = group_advantages(shaped, g, self.cfg.scale_rewards, self.cfg.advantage_eps,
                                      all_reduce=self.all_reduce)  # data parallel: scale_rewards=batch's std is global
        loss_mask = mask & ~samples.truncated[:, None] if self.cfg.mask_truncated else mask
        t2 = time.perf_counter()
        lengths = mask.sum(-1).float()
        grouped = rewards.view(-1, g)
        new_tokens = int(mask.sum())
        metrics.update({
            "reward": rewards.mean().item(), "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "frac_zero_std_groups": (grouped.max(-1).values == grouped.min(-1).values).float().mean().item(),
            "completion_length": lengths.mean().item(), "completion_length_max": lengths.max().item(),
            "frac_truncated": samples.truncated.float().mean().item(),
            "generated_tokens_per_second": new_tokens / max(t1 - t0, 1e-9),
            "time/generation": t1 - t0, "time/scoring_and_ref": t2 - t1,
        })
        exp = GRPOExperience(**{f: getattr(samples, f) for f in ("prompt_ids", "prompt_mask", "completion_ids",
                                                                  "completion_mask", "prompt_index", "truncated")},
                             advantages=advantages, loss_mask=loss_mask, old_logps=old_logps, ref_logps=ref_logps,
                             temperature=sampling.temperature)
        return exp, metrics

    @staticmethod
    def drift_metrics(logps: Tensor, ref_logps: Tensor, mask: Tensor) -> dict[str, float]:
        """KL(pi || pi_ref) per sequence (k1 and k3 estimates, nats, mean over rows) of sampled completions."""
        log_ratio = (logps.detach() - ref_logps).masked_fill(~mask, 0.0)
        out = {f"kl_{k}": masked_sum(kl_estimate(log_ratio, k), mask, dim=-1).mean().item() for k in ("k1", "k3")}
        out["kl"] = out["kl_k1"]
        return out

    def loss(self, policy: Policy, batch: GRPOExperience) -> LossOutput:
        logps, entropy = policy.logps(batch, batch.temperature, with_entropy=True)
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        mask = batch.loss_mask
        per_token, clipped = clipped_surrogate_loss(logps, old, batch.advantages, mask, self.cfg.epsilon_low,
                                                    self.cfg.epsilon_high)
        metrics = {}
        if batch.old_logps is None and batch.ref_logps is not None:  # one iteration: logps ARE the sampling policy's
            metrics.update(self.drift_metrics(logps, batch.ref_logps, batch.completion_mask))
        if self.beta > 0 and self.objective.kl_placement == "as_loss":
            kl_tokens = kl_loss(logps, batch.ref_logps, mask, self.objective.kl_estimator)
            per_token = per_token + self.beta * kl_tokens
            metrics["kl_loss"] = (masked_sum(kl_tokens.detach(), mask) / mask.sum().clamp(min=1)).item()
        n = mask.sum().clamp(min=1)
        with torch.no_grad():
            ratio = torch.exp(logps - old)
            metrics.update({
                "clip_fraction": (clipped.sum() / n).item(),
                "entropy": (masked_sum(entropy, mask) / n).item(),
                "ratio_mean": (masked_sum(ratio, mask) / n).item(),
                "approx_kl_old": (masked_sum(kl_estimate((logps - old).detach(), "k3"), mask) / n).item(),
            })
        return LossOutput(per_token, mask, metrics)

"""On-policy distillation by the teacher's log-ratio as a reward (Thinking Machines, "On-Policy Distillation", 2025;
Tinker's cookbook): the student samples its own completions, a frozen teacher scores each sampled token, and the
student is trained by plain RL on the per-token reward r_t = log pi_T(y_t) - log pi_old(y_t). Its sibling
``algo=distill`` (:mod:`prefzoo.algos.distill`, GKD) compares the two whole next-token distributions instead.

On prefzoo's objective: the reward beta log pi_T / pi_ref with the k1 penalty in the reward, over beta (pi_ref cancels,
so no reference is needed), whose optimum pi* = pi_ref exp(r / beta) / Z IS the teacher for every beta > 0
(:mod:`prefzoo.objective.distillation`; the conformance rows ``distill teacher_reward``: TV(pi, pi_T) = 0 on the
tabular bed).

The advantage: the reward-to-go of r_t with ``algo.discount`` (gamma: 1, the default, is the exact policy gradient of
-KL(pi || pi_T) over whole sequences; Tinker's cookbook uses 0, each token's own log-ratio, lower variance and biased),
no baseline, no whitening; then the family's per-token surrogate (``algo.policy_loss``: PPO's clip by default, ratio 1
with one optimizer step per rollout). One sample of the teacher's log-prob per token instead of its whole
distribution: cheaper than the JSD (one teacher pass at sampling time, no vocabulary-sized work in the loss) and
noisier.

``objective.beta`` (0 by default) adds the family's KL to pi_ref on top (as a loss, or in the reward,
``objective.kl_placement``), which moves the fixed point to pi ~ pi_T^(1/(1+beta)) pi_ref^(beta/(1+beta)).

The teacher (``algo.teacher``) is what ``algo=distill`` takes: a prefzoo run folder, a LoRA adapter folder over this
run's base model, or a model path or id sharing the student's tokenizer, loaded frozen beside the policy.

Metrics: the online family's schema; ``teacher_kl`` (KL(pi_old || pi_T) per token from the samples, k1),
``teacher_logp`` (the teacher's mean log-prob per token of the student's samples).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.online import OnlinePolicyGradient
from prefzoo.algos.online_sampling import ScoredSamples
from prefzoo.algos.online_settings import (check_dynamic_sampling, check_online_settings, check_policy_clip,
                                           check_teacher, online_declaration)
from prefzoo.algos.trust_region import (TokenLoss, TrustRegionConfig, check_trust_region, takes_is_weights,
                                         trust_region_token_loss)
from prefzoo.errors import ConfigError
from prefzoo.objective import TRUST_REGION_LOSSES, gae, masked_sum, teacher_log_ratio_rewards
from prefzoo.types import Experience, ObjectiveSettings, StepContext


@dataclass
class TeacherRewardConfig(TrustRegionConfig):
    """``algo=teacher_reward``'s settings (module docstring).

    Attributes:
        teacher: the teacher (required): a prefzoo run folder, a LoRA adapter folder, or a model path or id.
        discount: gamma of the reward-to-go, in [0, 1].
        policy_loss: the per-token surrogate (``clipped`` or one of :data:`prefzoo.objective.TRUST_REGION_LOSSES`).
    """

    name: str = "teacher_reward"
    default_beta: float = 0.0  # as algo=distill: no reference-model KL penalty
    default_kl_estimator: str = "k3"
    default_kl_placement: str = "as_loss"
    default_temperature: float = 1.0
    teacher: Optional[str] = None  # required: check_teacher says what to give
    discount: float = 1.0
    num_samples: int = 1  # one completion per prompt; no group baseline is used
    loss_aggregation: str = "dapo"  # the token mean over the batch
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    policy_loss: str = "clipped"  # clipped | dppo_tv | dppo_kl | sapo | dro


@register
class TeacherReward(OnlinePolicyGradient):
    """The teacher's per-token log-ratio as the reward of the family's surrogate."""

    config_class = TeacherRewardConfig
    progress_keys = ("teacher_kl", "reward")
    rollout_logps = True  # the per-token reward needs log pi_old at sampling time
    rollout_teacher_logps = True

    @staticmethod
    def validate_settings(cfg: TeacherRewardConfig, objective: ObjectiveSettings) -> None:
        check_teacher(cfg)
        if not 0.0 <= cfg.discount <= 1.0:
            raise ConfigError(f"algo.discount={cfg.discount} must be in [0, 1] (1: the exact policy gradient of the "
                              "sequence's reverse KL; 0: each token's own log-ratio).")
        # (before the group-size check, whose message would not say why)
        check_dynamic_sampling(cfg, "its baseline is none (the teacher's log-ratio is the reward)")
        check_online_settings(cfg, objective)
        check_policy_clip(cfg)
        check_trust_region(cfg, ("clipped", *TRUST_REGION_LOSSES))

    def declare(self):
        return replace(online_declaration(self, self.progress_keys, group_baseline=False), teacher=self.cfg.teacher)

    def advantages(self, scored: ScoredSamples, penalty: Tensor, step: StepContext) -> tuple[Tensor, dict[str, float]]:
        """The reward-to-go of r_t = log pi_T - log pi_old (plus the KL penalty to pi_ref, 0 unless ``objective.beta``
        > 0 in the reward) with gamma = ``algo.discount``. Shape (B, T)."""
        mask = scored.samples.completion_mask
        rewards = teacher_log_ratio_rewards(scored.teacher_logps, scored.logps, mask)
        count = float(mask.sum().clamp(min=1))
        returns, _ = gae(rewards + penalty, torch.zeros_like(penalty), mask, self.cfg.discount, 1.0)
        return returns, {"teacher_kl": float(-masked_sum(rewards, mask)) / count,
                         "teacher_logp": float(masked_sum(scored.teacher_logps, mask)) / count}

    def loss_takes_is_weights(self) -> bool:
        return takes_is_weights(self.cfg)

    def token_loss(self, logps: Tensor, old_logps: Tensor, batch: Experience) -> TokenLoss:
        return trust_region_token_loss(self.cfg, logps, old_logps, batch)

"""On-policy distillation (Agarwal et al. 2024, GKD, arXiv:2306.13649; TRL 1.16's ``DistillationTrainer``; Thinking
Machines' "On-Policy Distillation", 2025): the student samples its own completions and is trained toward a frozen
teacher's next-token distributions on them.

On prefzoo's objective it is not a special case: with the reward r(x, y) = beta log pi_T(y|x) / pi_ref(y|x) the optimum
pi* = pi_ref exp(r / beta) / Z IS the teacher (Z = 1), for every beta > 0 (:mod:`prefzoo.objective.distillation`). Both
losses below reach it when the student can represent the teacher (the conformance rows: TV(pi, pi_T) = 0 on the
tabular bed).

``algo.loss_type``:

* ``jsd`` (the default; GKD, TRL): per token of the student's sample, the generalised JSD between the student's and
  the teacher's whole next-token distributions, :func:`prefzoo.objective.chunked_generalized_jsd` with
  ``algo.jsd_beta`` (TRL's ``beta``: 0 forward KL(teacher || student), 1 reverse KL(student || teacher), the default as
  in TRL; in between the mixture JSD; the convention at the ends is stated in the objective module), at the sampling
  temperature on both sides (TRL's ``temperature``). The loss is the token mean over the batch (``loss_aggregation``
  ``dapo``: TRL divides the summed divergence by the number of completion tokens). Its gradient does not go through
  the sampling (GKD, sec. 3: "we do not backpropagate through the student's sampling"), so it is the gradient of the
  divergence at the sampled contexts; the teacher's logits are recomputed chunk by chunk from its final hidden states
  and never kept for all tokens (``algo.chunk_size`` positions at a time).
* ``teacher_reward``: plain RL on the per-token reward r_t = log pi_T(y_t) - log pi_old(y_t) (the objective's
  beta log pi_T / pi_ref with the k1 penalty in the reward, over beta: pi_ref cancels, so no reference is needed),
  reward-to-go with ``algo.discount`` (gamma: 1, the default, is the exact policy gradient of -KL(pi || pi_T) over whole
  sequences; Tinker's cookbook uses 0, each token's own log-ratio, lower variance and biased), no baseline, no
  whitening, then the family's per-token surrogate (``algo.policy_loss``: PPO's clip by default, ratio 1 with one
  optimizer step per rollout). One sample of the teacher's log-prob per token instead of its whole distribution:
  cheaper (one teacher pass at sampling time, no vocabulary-sized work in the loss) and noisier.

``objective.beta`` (0 by default, as TRL: no reference penalty) adds the family's KL to pi_ref on top (as a loss, or in
the reward, ``objective.kl_placement``), which moves the fixed point to pi ~ pi_T^(1/(1+beta)) pi_ref^(beta/(1+beta))
for the reverse-KL losses (maximise -KL(pi || pi_T) - beta KL(pi || pi_ref)).

The teacher: ``algo.teacher`` is a prefzoo run folder (its adapter over its own base model, as
``prefzoo.load_policy`` rebuilds it), a LoRA adapter folder (``adapter_config.json``) over this run's base model, or a
model path or id; it must share the student's tokenizer (checked on load). The loop loads it frozen, in eval mode,
beside the policy (:class:`~prefzoo.algos.base.Declaration`'s ``teacher``); an adapter is merged into a copy of its
base weights (one more copy of the base in memory; the student's own base is not shared with it).

Metrics: the online family's schema (with ``jsd``, the drift ``kl`` / ``kl_k1`` / ``kl_k3`` to pi_ref and the
``entropy`` come from the student's logits of the loss's pass: no second pass); ``divergence`` (``jsd``: the per-token JSD of ``jsd_beta``, nats, the loss's
value), ``teacher_kl`` (KL(pi_old || pi_T) per token from the samples, k1: ``teacher_reward``, and ``jsd`` with
``jsd_beta=1`` where it is the loss itself), ``teacher_logp`` (``teacher_reward``: the teacher's mean log-prob per token
of the student's samples).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.online import OnlinePolicyGradient, add_kl_loss, update_metrics
from prefzoo.algos.online_sampling import ScoredSamples
from prefzoo.algos.online_settings import (OnlineConfig, check_dynamic_sampling, check_online_settings,
                                           check_policy_clip, online_declaration)
from prefzoo.algos.trust_region import TokenLoss, TrustRegionConfig, check_trust_region, trust_region_token_loss
from prefzoo.errors import ConfigError
from prefzoo.objective import (TRUST_REGION_LOSSES, TokenLogits, chunked_generalized_jsd, gae, linear_token_logps,
                               masked_sum, teacher_log_ratio_rewards, token_entropy, token_logps)
from prefzoo.types import NO_STEP, DistillationPolicy, Experience, LossOutput, ObjectiveSettings, StepContext

log = logging.getLogger(__name__)

LOSS_TYPES = ("jsd", "teacher_reward")


@dataclass
class DistillConfig(TrustRegionConfig, OnlineConfig):
    """``algo=distill``'s settings (module docstring).

    Attributes:
        teacher: the teacher (required): a prefzoo run folder, a LoRA adapter folder, or a model path or id.
        loss_type: ``jsd`` | ``teacher_reward``.
        jsd_beta: the generalised JSD's beta in [0, 1] (0 forward KL, 1 reverse KL; ``jsd``).
        chunk_size: positions per chunk of the vocabulary-sized work (``jsd``).
        discount: gamma of the reward-to-go (``teacher_reward``).
    """

    name: str = "distill"
    default_beta: float = 0.0  # TRL: no reference-model KL penalty
    default_kl_estimator: str = "k3"
    default_kl_placement: str = "as_loss"
    default_temperature: float = 1.0  # TRL's temperature (sampling and the loss)
    teacher: Optional[str] = None  # required: validate_settings says what to give
    loss_type: str = "jsd"
    jsd_beta: float = 1.0  # TRL 1.16's default: reverse KL
    chunk_size: int = 256
    discount: float = 1.0
    num_samples: int = 1  # one completion per prompt (TRL); no group baseline is used
    loss_aggregation: str = "dapo"  # the token mean over the batch (TRL's sum / number of completion tokens)
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    policy_loss: str = "clipped"  # teacher_reward's surrogate: clipped | dppo_tv | dppo_kl | sapo | dro


@register
class Distill(OnlinePolicyGradient):
    """On-policy distillation plugin: the student's samples, the teacher's distributions (or log-probs) on them."""

    config_class = DistillConfig
    progress_keys = ("divergence", "reward")

    @staticmethod
    def validate_settings(cfg: DistillConfig, objective: ObjectiveSettings) -> None:
        if not cfg.teacher:
            raise ConfigError("algo=distill needs a teacher: algo.teacher=<a prefzoo run folder, a LoRA adapter folder, "
                              "or a model path or id sharing the student's tokenizer>.")
        if cfg.loss_type not in LOSS_TYPES:
            raise ConfigError(f"algo.loss_type={cfg.loss_type!r}; choose one of {', '.join(LOSS_TYPES)}.")
        if not 0.0 <= cfg.jsd_beta <= 1.0:
            raise ConfigError(f"algo.jsd_beta={cfg.jsd_beta} must be in [0, 1] (0: forward KL(teacher || student), "
                              "1: reverse KL(student || teacher), in between the generalised JSD).")
        if cfg.chunk_size < 1:
            raise ConfigError(f"algo.chunk_size={cfg.chunk_size} must be >= 1 (positions per chunk of the "
                              "vocabulary-sized work).")
        if not 0.0 <= cfg.discount <= 1.0:
            raise ConfigError(f"algo.discount={cfg.discount} must be in [0, 1] (1: the exact policy gradient of the "
                              "sequence's reverse KL; 0: each token's own log-ratio).")
        if cfg.loss_type == "jsd" and objective.beta > 0 and objective.kl_placement == "in_reward":
            raise ConfigError(f"objective.beta={objective.beta} with objective.kl_placement=in_reward: algo=distill's "
                              "jsd loss has no reward to put the KL in; use objective.kl_placement=as_loss, or "
                              "algo.loss_type=teacher_reward.")
        if cfg.loss_type == "teacher_reward" and cfg.jsd_beta != DistillConfig.jsd_beta:
            log.warning("algo.jsd_beta=%g is the jsd loss's; algo.loss_type=teacher_reward rewards the teacher's "
                        "log-ratio and ignores it: drop it.", cfg.jsd_beta)
        check_online_settings(cfg, objective)
        check_dynamic_sampling(cfg, "its loss has no reward baseline (the teacher is the target)")
        check_policy_clip(cfg)
        check_trust_region(cfg, ("clipped", *TRUST_REGION_LOSSES))

    def declare(self):
        keys = self.progress_keys if self.cfg.loss_type == "jsd" else ("teacher_kl", "reward")
        d = online_declaration(self, keys, group_baseline=False)
        # the JSD reads no advantage, so a sampler correction's weights (which scale advantages) would change nothing
        caps = d.capabilities - {"sampler_correction"} if self.cfg.loss_type == "jsd" else d.capabilities
        return replace(d, teacher=self.cfg.teacher, capabilities=caps)

    @property
    def rollout_logps(self) -> bool:  # the per-token reward needs log pi at sampling time
        return self.cfg.loss_type == "teacher_reward"

    @property
    def rollout_teacher_logps(self) -> bool:
        return self.cfg.loss_type == "teacher_reward"

    def advantages(self, scored: ScoredSamples, penalty: Tensor, step: StepContext) -> tuple[Tensor, dict[str, float]]:
        """``teacher_reward``: the reward-to-go of r_t = log pi_T - log pi_old (plus the KL penalty to pi_ref, 0 unless
        ``objective.beta`` > 0 in the reward) with gamma = ``algo.discount``. Shape (B, T). ``jsd``: zeros (its loss
        reads the teacher's distributions, not an advantage)."""
        mask = scored.samples.completion_mask
        if self.cfg.loss_type == "jsd":
            return torch.zeros(mask.shape, device=mask.device), {}
        rewards = teacher_log_ratio_rewards(scored.teacher_logps, scored.logps, mask)
        count = float(mask.sum().clamp(min=1))
        returns, _ = gae(rewards + penalty, torch.zeros_like(penalty), mask, self.cfg.discount, 1.0)
        return returns, {"teacher_kl": float(-masked_sum(rewards, mask)) / count,
                         "teacher_logp": float(masked_sum(scored.teacher_logps, mask)) / count}

    def token_loss(self, logps: Tensor, old_logps: Tensor, batch: Experience) -> TokenLoss:
        return trust_region_token_loss(self.cfg, logps, old_logps, batch)

    def loss(self, policy: DistillationPolicy, batch: Experience, step: StepContext = NO_STEP) -> LossOutput:
        if self.cfg.loss_type == "teacher_reward":
            return super().loss(policy, batch)
        mask, completion = batch.loss_mask, batch.completion_mask
        student = policy.token_logits(batch)
        with torch.no_grad():
            teacher = policy.token_logits(batch, teacher=True)
        per = chunked_generalized_jsd(student, teacher, self.cfg.jsd_beta, self.sampling.temperature,
                                      self.cfg.chunk_size)
        full = torch.zeros(completion.shape, dtype=per.dtype, device=completion.device)
        per_token = full.masked_scatter(completion, per).masked_fill(~mask, 0.0).float()
        tokens = {"divergence": (float(masked_sum(per_token.detach(), mask)), float(mask.sum()))}
        if self.cfg.jsd_beta == 1.0:
            tokens["teacher_kl"] = tokens["divergence"]
        anchored = self.beta > 0 and self.objective.kl_placement == "as_loss"
        if anchored:  # the reference anchor needs the sampled tokens' log-probs with their gradient: one more pass
            logps, entropy = policy.logps(batch, self.sampling.temperature, with_entropy=True)
        else:  # for the metrics only (drift from pi_ref, entropy): from the student's logits above, no second pass
            logps, entropy = sampled_token_logps(student, batch, self.sampling.temperature, self.cfg.chunk_size)
        metrics, more = update_metrics(logps, logps.detach(), mask, torch.zeros_like(mask), entropy, batch.ref_logps,
                                       batch.old_logps is None, completion)
        tokens.update({k: v for k, v in more.items() if k in ("entropy",)})
        if anchored:
            old = batch.old_logps if batch.old_logps is not None else logps.detach()
            per_token = add_kl_loss(per_token, logps, batch.ref_logps, mask, self.beta, self.objective, tokens,
                                    old_logps=old)
        return LossOutput(per_token, mask, metrics, tokens)


@torch.no_grad()
def sampled_token_logps(logits: TokenLogits, batch: Experience, temperature: float, chunk_size: int
                        ) -> tuple[Tensor, Tensor]:
    """log pi(y_t) of the sampled tokens and the entropy per position, Shape (B, T) each (0 where masked), without
    gradients, from the student's :class:`~prefzoo.objective.TokenLogits` of the JSD pass (chunked: the output layer
    again, not the transformer body)."""
    mask = batch.completion_mask
    labels = batch.completion_ids[mask]
    if logits.logits is None:
        logps, entropy = linear_token_logps(logits.states.detach(), logits.weight.detach(), labels,
                                            None if logits.bias is None else logits.bias.detach(), temperature,
                                            chunk_size, with_entropy=True)
    else:
        z = logits.logits.detach()
        logps = token_logps(z[None], labels[None], temperature)[0]
        entropy = token_entropy(z[None], temperature)[0]
    full = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return full.masked_scatter(mask, logps.float()), full.masked_scatter(mask, entropy.float())

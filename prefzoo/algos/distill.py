"""On-policy distillation by the generalised JSD (Agarwal et al. 2024, GKD, arXiv:2306.13649; TRL 1.16's
``DistillationTrainer``): the student samples its own completions and is trained toward a frozen teacher's next-token
distributions on them. Its sibling ``algo=teacher_reward`` (:mod:`prefzoo.algos.teacher_reward`; Thinking Machines'
"On-Policy Distillation", 2025) learns from the teacher's log-prob of each sampled token instead, as a reward.

On prefzoo's objective it is not a special case: with the reward r(x, y) = beta log pi_T(y|x) / pi_ref(y|x) the optimum
pi* = pi_ref exp(r / beta) / Z IS the teacher (Z = 1), for every beta > 0 (:mod:`prefzoo.objective.distillation`). The
loss reaches it when the student can represent the teacher (the conformance rows: TV(pi, pi_T) = 0 on the tabular bed).

The loss: per token of the student's sample, the generalised JSD between the student's and the teacher's whole
next-token distributions, :func:`prefzoo.objective.chunked_generalized_jsd` with ``algo.jsd_beta`` (TRL's ``beta``: 0
forward KL(teacher || student), 1 reverse KL(student || teacher), the default as in TRL; in between the mixture JSD;
the convention at the ends is stated in the objective module), at the sampling temperature on both sides (TRL's
``temperature``). The loss is the token mean over the batch (``loss_aggregation`` ``dapo``: TRL divides the summed
divergence by the number of completion tokens). Its gradient does not go through the sampling (GKD, sec. 3: "we do
not backpropagate through the student's sampling"), so it is the gradient of the divergence at the sampled contexts;
the teacher's logits are recomputed chunk by chunk from its final hidden states and never kept for all tokens
(``algo.chunk_size`` positions at a time).

``objective.beta`` (0 by default, as TRL: no reference penalty) adds the family's KL to pi_ref on top, as a loss (the
JSD has no reward to put it in), which moves the fixed point to pi ~ pi_T^(1/(1+beta)) pi_ref^(beta/(1+beta)) at
jsd_beta = 1 (maximise -KL(pi || pi_T) - beta KL(pi || pi_ref)).

The teacher: ``algo.teacher`` is a prefzoo run folder (its adapter over its own base model, as
``prefzoo.load_policy`` rebuilds it), a LoRA adapter folder (``adapter_config.json``) over this run's base model, or a
model path or id; it must share the student's tokenizer (checked before the model loads). The loop loads it frozen,
in eval mode, beside the policy (:class:`~prefzoo.algos.base.Declaration`'s ``teacher``); an adapter is merged into a
copy of its base weights (one more copy of the base in memory; the student's own base is not shared with it).

Metrics: the online family's schema (the drift ``kl`` / ``kl_k1`` / ``kl_k3`` to pi_ref and the ``entropy`` come from
the student's logits of the loss's pass: no second pass); ``divergence`` (the per-token JSD of ``jsd_beta``, nats, the
loss's value), ``teacher_kl`` (KL(pi || pi_T) per token, at ``jsd_beta=1`` where it is the loss itself).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.online import OnlinePolicyGradient, add_kl_loss, update_metrics
from prefzoo.algos.online_sampling import ScoredSamples
from prefzoo.algos.online_settings import (OnlineConfig, check_dynamic_sampling, check_online_settings,
                                           check_teacher, online_declaration)
from prefzoo.errors import ConfigError
from prefzoo.objective import (TokenLogits, chunked_generalized_jsd, linear_token_logps, masked_sum, token_entropy,
                               token_logps)
from prefzoo.types import NO_STEP, DistillationPolicy, Experience, LossOutput, ObjectiveSettings, StepContext


@dataclass
class DistillConfig(OnlineConfig):
    """``algo=distill``'s settings (module docstring).

    Attributes:
        teacher: the teacher (required): a prefzoo run folder, a LoRA adapter folder, or a model path or id.
        jsd_beta: the generalised JSD's beta in [0, 1] (0 forward KL, 1 reverse KL).
        chunk_size: positions per chunk of the vocabulary-sized work.
    """

    name: str = "distill"
    default_beta: float = 0.0  # TRL: no reference-model KL penalty
    default_kl_estimator: str = "k3"
    default_kl_placement: str = "as_loss"
    default_temperature: float = 1.0  # TRL's temperature (sampling and the loss)
    teacher: Optional[str] = None  # required: check_teacher says what to give
    jsd_beta: float = 1.0  # TRL 1.16's default: reverse KL
    chunk_size: int = 256
    num_samples: int = 1  # one completion per prompt (TRL); no group baseline is used
    loss_aggregation: str = "dapo"  # the token mean over the batch (TRL's sum / number of completion tokens)


@register
class Distill(OnlinePolicyGradient):
    """GKD plugin: the student's samples, the generalised JSD to the teacher's distributions on them."""

    config_class = DistillConfig
    progress_keys = ("divergence", "reward")

    @staticmethod
    def validate_settings(cfg: DistillConfig, objective: ObjectiveSettings) -> None:
        check_teacher(cfg)
        if not 0.0 <= cfg.jsd_beta <= 1.0:
            raise ConfigError(f"algo.jsd_beta={cfg.jsd_beta} must be in [0, 1] (0: forward KL(teacher || student), "
                              "1: reverse KL(student || teacher), in between the generalised JSD).")
        if cfg.chunk_size < 1:
            raise ConfigError(f"algo.chunk_size={cfg.chunk_size} must be >= 1 (positions per chunk of the "
                              "vocabulary-sized work).")
        if objective.beta > 0 and objective.kl_placement == "in_reward":
            raise ConfigError(f"objective.beta={objective.beta} with objective.kl_placement=in_reward: algo=distill's "
                              "JSD has no reward to put the KL in; use objective.kl_placement=as_loss, or "
                              "algo=teacher_reward (the teacher's log-ratio as a reward).")
        # (before the group-size check, whose message would not say why)
        check_dynamic_sampling(cfg, "its loss has no reward baseline (the teacher is the target)")
        check_online_settings(cfg, objective)
        masks = [f"algo.{k}={getattr(cfg, k)}" for k in ("off_policy_mask_threshold", "top_entropy_quantile")
                 if getattr(cfg, k) != getattr(OnlineConfig, k)]
        if masks:
            raise ConfigError(f"{' and '.join(masks)} mask a policy-gradient term, and algo=distill's loss is the JSD "
                              "to the teacher on every token (no advantage); drop them.")

    def declare(self):
        d = online_declaration(self, self.progress_keys, group_baseline=False)
        # the JSD reads no advantage, so a sampler correction's weights (which scale advantages) would change nothing
        return replace(d, teacher=self.cfg.teacher, capabilities=d.capabilities - {"sampler_correction"})

    def advantages(self, scored: ScoredSamples, penalty: Tensor, step: StepContext) -> tuple[Tensor, dict[str, float]]:
        """Zeros, Shape (B, T): the loss reads the teacher's distributions, not an advantage."""
        mask = scored.samples.completion_mask
        return torch.zeros(mask.shape, device=mask.device), {}

    def loss(self, policy: DistillationPolicy, batch: Experience, step: StepContext = NO_STEP) -> LossOutput:
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

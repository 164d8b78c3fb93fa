"""The online policy-gradient family, composed once: GRPO, GSPO, CISPO, RLOO and REINFORCE++ (and the parts PPO and
Online DPO share).

A member of the family is a plugin class (``@register``) deriving from :class:`OnlinePolicyGradient`, the family's
body (not a plugin: no name, never registered), that gives only what makes it itself:

* its config, a dataclass deriving from :class:`OnlineConfig` (G = ``num_samples``, ``loss_aggregation``,
  ``epochs``, ``num_minibatches``, ``mask_truncated``) with its own fields and defaults;
* its checks, ``validate_settings``, which calls :func:`check_online_settings` (or
  :func:`check_group_relative_settings`; and :func:`check_policy_clip` when it clips a ratio);
* optionally its ``progress_keys`` (the body's ``declare`` is :func:`online_declaration` with them; a member whose
  group is not its baseline declares itself, REINFORCE++'s batch baseline);
* ``advantages(scored, penalty, step)``: per-sequence (B,) or per-token (B, T) advantages of the step's scored samples
  (:class:`~prefzoo.algos.online_sampling.ScoredSamples`), from a function of :mod:`prefzoo.objective`
  (group-relative, leave-one-out, reward-to-go); ``step`` is the loop's :class:`~prefzoo.types.StepContext` (the
  all-reduce of a batch statistic);
* ``token_loss(logps, old_logps, batch)``: the per-token loss and where it clipped, from a function of
  :mod:`prefzoo.objective` (the clipped surrogate, the sequence clip, CISPO's weight, REINFORCE).

The family's settings and checks are :mod:`prefzoo.algos.online_settings`, the trust-region surrogates
:mod:`prefzoo.algos.trust_region`, the sampling and scoring :mod:`prefzoo.algos.online_sampling`.

One step, top to bottom (the loop calls ``make_experience`` once per step, then ``loss`` per micro-batch):

1. :func:`sample_and_score`: G completions per prompt, their rewards; without gradients, log pi at sampling time
   when it is needed (:func:`stores_old_logps`, or the KL in the reward) and log pi_ref when the run has a
   reference; the shared rollout metrics.
2. The KL penalty per token, -beta k(log pi_old/pi_ref) (0 unless ``objective.kl_placement=in_reward``, beta > 0).
3. The member's ``advantages``; a sequence advantage is repeated over its row's tokens (0 on padding); a rollout
   engine's truncated importance weights multiply them (:func:`corrected_advantages`).
4. The experience keeps log pi_old whenever an update after the first sees the rollout (:func:`stores_old_logps`):
   several epochs OR several mini-batches. Once the first mini-batch's optimizer step has moved the policy, every
   later mini-batch is off-policy and its ratio must be taken against the sampling policy (TRL does the same
   when ``steps_per_generation > gradient_accumulation_steps``). With one optimizer step per rollout, log pi_old
   is the update's own ``logps.detach()`` (ratio exactly 1) and no extra pass is made.
5. ``loss``: one forward pass (log-probs and entropy at the sampling temperature), the member's
   ``token_loss`` over the loss tokens (``batch.loss_mask``), the KL-as-loss term (:func:`add_kl_loss`), and the
   metrics of :func:`update_metrics`.

The loss tokens. Every loss, KL and entropy term and every per-token count runs over ``batch.loss_mask``: the
policy's own tokens (the completion mask, minus the rows ``mask_truncated`` drops). The drift metrics (``kl``)
are over the completion mask.

Metrics (the schema every online plugin shares): ``reward``, ``reward_std``, ``kl`` / ``kl_k1`` / ``kl_k3``
(KL(pi || pi_ref) per sequence, nats), ``non_score_reward`` (mean over sequences of the summed KL penalty in the
reward), ``kl_loss`` (the KL loss term's token mean), ``clip_fraction``, ``ratio_mean``, ``approx_kl``
(KL(pi_old || pi_theta) per token, k3), ``entropy`` (nats per token), ``frac_zero_std_groups``,
``completion_length``, ``completion_length_max``, ``frac_truncated``, ``generated_tokens_per_second``; timings;
with a rollout engine that reports its log-probs, ``engine/*`` (:func:`engine_correction`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from prefzoo.algos.base import Algorithm, Declaration
from prefzoo.algos.online_sampling import (ScoredSamples, corrected_advantages, drift_metrics, dynamic_sampling,
                                           sample_and_score)
from prefzoo.algos.online_settings import advantage_eps, online_declaration, stores_old_logps
from prefzoo.algos.trust_region import TokenLoss
from prefzoo.errors import ConfigError
from prefzoo.objective import (group_advantages, high_entropy_mask, kl_loss, kl_penalty_rewards, masked_sum,
                               off_policy_sequence_mask, ratio_statistics)
from prefzoo.types import (NO_STEP, Experience, LossOutput, ObjectiveSettings, Policy, PromptBatch, Scorer,
                           StepContext)

__all__ = ["OnlinePolicyGradient", "group_relative_advantages", "update_metrics", "mask_policy_term", "add_kl_loss"]


def group_relative_advantages(algo: Algorithm, scored: ScoredSamples, penalty: Tensor, step: StepContext = NO_STEP
                              ) -> tuple[Tensor, dict[str, float]]:
    """GRPO's advantages (Shao et al. 2024, sec. 4.1.2), the ``advantages`` of GRPO, GSPO and CISPO:

        A_i = (R_i - mean of R over its group) / (std of R over its group + eps),   R_i = r_i + sum_t penalty_{i,t}

    scaled as ``algo.cfg.scale_rewards`` says (:func:`prefzoo.objective.group_advantages`), eps as
    :func:`~prefzoo.algos.online_settings.advantage_eps` says. Shape (B,). Under data parallelism
    ``scale_rewards=batch``'s std is the global batch's (``step.all_reduce``)."""
    c = algo.cfg
    shaped = scored.rewards + penalty.sum(-1)
    extra = {}
    if c.scale_rewards == "mean":  # MaxRL: a group of mean <= 0 gets advantage 0 (MAXRL_WARNING watches the share)
        extra["frac_nonpositive_groups"] = (shaped.view(-1, c.num_samples).mean(-1) <= 0).float().mean().item()
    return group_advantages(shaped, c.num_samples, c.scale_rewards, advantage_eps(c), all_reduce=step.all_reduce), extra


# -------------------------------------------------------------------------------------------------- the loss
def update_metrics(logps: Tensor, old_logps: Tensor, mask: Tensor, clipped: Tensor, entropy: Tensor | None,
                   ref_logps: Tensor | None, on_policy_pass: bool, completion_mask: Tensor
                   ) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
    """The loss side of the schema: (per-row metrics, per-token (sum, count) pairs).

    ``clip_fraction``, ``ratio_mean``, ``approx_kl`` (:func:`prefzoo.objective.ratio_statistics`), ``entropy``;
    and, when ``on_policy_pass`` (no stored old log-probs: these log-probs ARE the sampling policy's) and a
    reference exists, the drift metrics of the rollout from this very forward pass (no extra pass).
    """
    metrics = drift_metrics(logps, ref_logps, completion_mask) if on_policy_pass and ref_logps is not None else {}
    tokens = ratio_statistics(logps, old_logps, mask, clipped)
    if entropy is not None:
        tokens["entropy"] = (float(masked_sum(entropy, mask)), float(mask.sum()))
    return metrics, tokens


def mask_policy_term(cfg, per_token: Tensor, logps: Tensor, old_logps: Tensor, entropy: Tensor | None,
                     batch: Experience, tokens: dict[str, tuple[float, float]]) -> Tensor:
    """The member's per-token policy loss with the masks the config asks for, before the KL term is added (a masked
    token still pays its KL, as in TRL 1.16):

    * ``algo.off_policy_mask_threshold``: :func:`prefzoo.objective.off_policy_sequence_mask` against the log-probs the
      rollout was drawn with: the engine's when it reported them (``batch.sample_logps``), else log pi_old; logs
      ``frac_off_policy_masked`` (share of loss tokens dropped);
    * ``algo.top_entropy_quantile`` < 1: :func:`prefzoo.objective.high_entropy_mask` over this micro-batch's loss
      tokens; logs ``frac_low_entropy_masked``.

    Shape: per_token, logps, old_logps, entropy (B, T) -> (B, T); ``tokens`` gains the (sum, count) pairs.

    Raises:
        ConfigError: the entropy mask on a policy that reports no entropy."""
    mask = batch.loss_mask
    keep = None
    if cfg.off_policy_mask_threshold is not None:
        sampling = batch.sample_logps.to(logps.dtype) if batch.sample_logps is not None else old_logps
        keep, _ = off_policy_sequence_mask(logps, sampling, batch.advantages, mask, cfg.off_policy_mask_threshold)
        tokens["frac_off_policy_masked"] = (float((mask & ~keep).sum()), float(mask.sum()))
    if cfg.top_entropy_quantile < 1.0:
        if entropy is None:
            raise ConfigError(f"algo.top_entropy_quantile={cfg.top_entropy_quantile} needs the policy's per-token "
                              "entropy, and this policy reports none; set it to 1.0.")
        high = high_entropy_mask(entropy, mask, cfg.top_entropy_quantile)
        tokens["frac_low_entropy_masked"] = (float((mask & ~high).sum()), float(mask.sum()))
        keep = high if keep is None else keep & high
    return per_token if keep is None else torch.where(keep, per_token, torch.zeros_like(per_token))


def add_kl_loss(per_token: Tensor, logps: Tensor, ref_logps: Tensor | None, mask: Tensor, beta: float,
                objective: ObjectiveSettings, tokens: dict[str, tuple[float, float]],
                weights: Tensor | None = None, old_logps: Tensor | None = None) -> Tensor:
    """``per_token + beta * w * k(log pi/pi_ref)`` when the objective puts the KL in the loss (beta > 0), logging
    ``kl_loss`` (the term's token mean, unweighted); ``per_token`` unchanged otherwise.

    ``weights`` (Shape (B, T), detached): the sampler correction's importance weights w = pi_trainer / pi_sampler
    (``rollout.correction.weight_kl``). The KL term's gradient on a sample y is beta grad k(y), whose expectation under
    the SAMPLER is not the trainer's KL gradient; weighted by w it is (E_sampler[w grad k] = E_trainer[grad k]).
    Without the weight a persistent sampler/trainer mismatch moves the fixed point even with the policy-gradient
    term corrected (the off-policy rows of the conformance table). TRL 1.16 leaves the KL term unweighted."""
    if not (beta > 0 and objective.kl_placement == "as_loss"):
        return per_token
    kl_tokens = kl_loss(logps, ref_logps, mask, objective.kl_estimator,
                        old_logps if objective.kl_bias_correction else None)
    tokens["kl_loss"] = (float(masked_sum(kl_tokens.detach(), mask)), float(mask.sum()))
    if weights is not None:
        kl_tokens = kl_tokens * weights.detach().to(kl_tokens.dtype)
    return per_token + beta * kl_tokens


class OnlinePolicyGradient(Algorithm):
    """The family's body (see the module docstring): rollout, advantages' broadcast, log pi_old, loss, KL term and
    metrics, once. Not a plugin: a member derives from it and gives its config, checks, ``advantages`` and
    ``token_loss`` (and its ``progress_keys``, or a ``declare`` of its own).

    Class attributes:
        progress_keys: the metrics on the progress bar (:func:`online_declaration`).
        rollout_logps: the member's ``advantages`` read log pi at sampling time (``rollout.logps``) even with one
            optimizer step per rollout (on-policy distillation's per-token reward).
        rollout_teacher_logps: the member's ``advantages`` read the teacher's log-probs (``rollout.teacher_logps``).
    """

    progress_keys: tuple[str, ...] = ("reward", "kl_k3", "clip_fraction")
    rollout_logps: bool = False
    rollout_teacher_logps: bool = False

    def __init__(self, cfg, objective: ObjectiveSettings, sampling=None):
        super().__init__(cfg, objective, sampling)
        mode = self.sampling.correction.mode
        if self.loss_takes_is_weights() and mode is not None and mode.startswith("sequence"):
            raise ConfigError(f"rollout.correction.mode={mode} with algo.policy_loss={cfg.policy_loss}: the loss "
                              "folds the sampler's per-token weights into its own sequence weight, and a sequence "
                              "mode has already made them one; use token_truncate or token_mask (as TRL requires).")

    def declare(self) -> Declaration:
        """:func:`online_declaration` with the member's ``progress_keys``; the group is the baseline."""
        return online_declaration(self, self.progress_keys)

    def loss_mask(self, batch: Experience) -> Tensor:
        return batch.loss_mask

    def loss_takes_is_weights(self) -> bool:
        """Whether the member's ``token_loss`` weighs the sampler correction's importance weights itself (read from
        ``batch.is_weights``; VESPO folds them into its sequence weight); else the body multiplies the advantages by
        them (:func:`corrected_advantages`). False here."""
        return False

    def stores_old_logps(self) -> bool:
        """Whether this plugin's rollouts keep log pi_old (:func:`stores_old_logps` of its epochs x mini-batches)."""
        return stores_old_logps(self.cfg.epochs, self.cfg.num_minibatches)

    def advantages(self, scored: ScoredSamples, penalty: Tensor, step: StepContext) -> tuple[Tensor, dict[str, float]]:
        """The member's advantages: (Shape (B,) per sequence or (B, T) per token, extra rollout metrics).
        ``penalty`` (B, T) is the per-token KL penalty -beta k(log pi_old/pi_ref) (0 unless the KL is in the reward);
        ``step``: the step's context (``step.all_reduce`` for a batch statistic under data parallelism)."""
        raise NotImplementedError(f"{type(self).__name__} must implement advantages()")

    def token_loss(self, logps: Tensor, old_logps: Tensor, batch: Experience) -> TokenLoss:
        """The member's per-token loss on ``batch.loss_mask`` (logps with gradients, old_logps without)."""
        raise NotImplementedError(f"{type(self).__name__} must implement token_loss()")

    @torch.no_grad()
    def make_experience(self, policy: Policy, prompts: PromptBatch, score: Scorer,
                        step: StepContext = NO_STEP) -> tuple[Experience, dict[str, float]]:
        c, o = self.cfg, self.objective
        in_reward = self.beta > 0 and o.kl_placement == "in_reward"
        # a no-grad pass of the policy only where log pi at sampling time is needed before the update; with one
        # optimizer step the drift metrics come from the update's own forward pass (update_metrics)
        settings = dict(need_logps=self.stores_old_logps() or in_reward or self.rollout_logps,
                        teacher=self.rollout_teacher_logps,
                        reference=self.declaration.reference or step.drift_metrics_due)
        r = sample_and_score(policy, prompts, score, c.num_samples, self.sampling, **settings)
        dynamic = {}
        if c.dynamic_sampling:
            if step.draw_prompts is None:
                raise ConfigError("algo.dynamic_sampling=true needs the training loop to draw more prompts, and it "
                                  "cannot here (data parallelism or asynchronous rollouts); set it to false.")
            r, dynamic = dynamic_sampling(self, policy, r, score, step.draw_prompts, **settings)
        mask = r.samples.completion_mask
        penalty = (kl_penalty_rewards(r.logps, r.ref_logps, mask, self.beta, o.kl_estimator) if in_reward
                   else torch.zeros(mask.shape, device=mask.device))
        advantages, extra = self.advantages(r, penalty, step)
        if advantages.dim() == 1:  # a sequence advantage on every token of its row
            advantages = torch.where(mask, advantages[:, None].float(), torch.zeros((), device=mask.device))
        in_loss = self.loss_takes_is_weights()  # rollout.correction.mode: the loss's weights, or the advantages'
        advantages = advantages.float() if in_loss else corrected_advantages(advantages.float(), r.is_weights)
        loss_mask = mask & ~r.samples.truncated[:, None] if c.mask_truncated else mask
        metrics = dict(r.metrics, non_score_reward=penalty.sum(-1).mean().item(), **extra, **dynamic)
        return Experience.from_samples(r.samples, rewards=r.rewards, advantages=advantages, loss_mask=loss_mask,
                                       old_logps=r.logps if self.stores_old_logps() or self.sampling.correction.bypass
                                       else None,
                                       sample_weights=r.is_weights if self.sampling.correction.weight_kl else None,
                                       is_weights=r.is_weights if in_loss else None,
                                       ref_logps=r.ref_logps), metrics

    def loss(self, policy: Policy, batch: Experience, step: StepContext = NO_STEP) -> LossOutput:
        logps, entropy = policy.logps(batch, self.sampling.temperature, with_entropy=True)
        old_logps = batch.old_logps if batch.old_logps is not None else logps.detach()
        mask = batch.loss_mask
        out = self.token_loss(logps, old_logps, batch)
        metrics, tokens = update_metrics(logps, old_logps, mask, out.clipped, entropy, batch.ref_logps,
                                         batch.old_logps is None, batch.completion_mask)
        metrics.update(out.metrics)
        tokens.update(out.tokens)
        per_token = mask_policy_term(self.cfg, out.per_token, logps, old_logps, entropy, batch, tokens)
        per_token = add_kl_loss(per_token, logps, batch.ref_logps, mask, self.beta, self.objective, tokens,
                                batch.sample_weights, old_logps)
        return LossOutput(per_token, mask, metrics, tokens)

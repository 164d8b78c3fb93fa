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
* ``advantages(rollout, penalty)``: per-sequence (B,) or per-token (B, T) advantages of a scored rollout, from a
  function of :mod:`prefzoo.objective` (group-relative, leave-one-out, reward-to-go);
* ``policy_loss(logps, old_logps, batch)``: the per-token loss and where it clipped, from a function of
  :mod:`prefzoo.objective` (the clipped surrogate, the sequence clip, CISPO's weight, REINFORCE).

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
   ``policy_loss`` over the loss tokens (``batch.loss_mask``), the KL-as-loss term (:func:`add_kl_loss`), and the
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

import logging
import time
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from prefzoo.algos.base import AlgoConfig, Algorithm, Declaration, MetricWarning
from prefzoo.errors import ConfigError
from prefzoo.objective import (ADVANTAGE_SCALES, TRUST_REGION_LOSSES, add_sequence_reward, clipped_surrogate_loss,
                               correction_metrics, correction_weights, dppo_loss, dro_loss, group_advantages, kl_loss,
                               kl_penalty_rewards, masked_sum, ratio_statistics, sampler_mismatch, sapo_loss,
                               sequence_kl)
from prefzoo.types import (Experience, LossOutput, ObjectiveSettings, Policy, PromptBatch, SamplingParams, Scorer,
                           SequenceBatch, episode_metrics, pad_cat)

__all__ = ["AGGREGATION_OF", "OnlineConfig", "GroupRelativeConfig", "OnlinePolicyGradient", "group_relative_advantages",
           "check_group_relative_settings", "check_adaptive_start", "PolicyLoss", "Rollout", "drift_metrics",
           "sample_and_score", "sample_metrics", "update_metrics", "add_kl_loss", "bypass_logps", "check_online_settings",
           "check_policy_clip", "online_declaration", "stores_old_logps", "zero_spread_warning", "ZERO_SPREAD_STEPS",
           "engine_correction", "corrected_advantages", "place_rewards", "TrustRegionConfig", "check_trust_region",
           "trust_region_policy_loss", "DPPO_DELTA", "dynamic_sampling", "informative_groups",
           "cat_rollouts", "check_dynamic_sampling"]

log = logging.getLogger(__name__)

#: ``algo.loss_aggregation`` -> the loss reduction (:data:`prefzoo.objective.AGGREGATIONS`): GRPO eq. 3 (mean over
#: each sequence, then over sequences), Dr. GRPO (a constant: the generation budget), DAPO eq. 8 (token mean)
AGGREGATION_OF = {"grpo": "sequence_mean", "dr_grpo": "constant", "dapo": "token_mean"}


@dataclass
class OnlineConfig(AlgoConfig):
    """The settings every member of the family has (its config derives from this one).

    Attributes:
        num_samples: G, completions sampled per prompt.
        loss_aggregation: ``grpo`` | ``dr_grpo`` | ``dapo`` (:data:`AGGREGATION_OF`).
        epochs: passes over each rollout (GRPO's mu, TRL's ``num_iterations``).
        num_minibatches: optimizer steps per pass.
        mask_truncated: completions without EOS contribute no loss.
        dynamic_sampling: DAPO's dynamic sampling (:func:`dynamic_sampling`): groups whose rewards are all equal are
            dropped and more prompts drawn until the step holds ``trainer.batch_size`` informative groups.
        max_extra_draws: the cap on dynamic sampling's extra rounds per step (each of ``trainer.batch_size`` prompts).
    """

    # With the arithmetic task's exact-match reward, G = 4 and SmolLM2-135M: at temperature 1.0 only ~4% of samples
    # are right and most groups are all-wrong (zero advantage, no gradient); at 0.7 ~15% are. 8 prompts per step
    # double the informative groups per step.
    default_temperature: float = 0.7
    default_batch_size: int = 8
    num_samples: int = 4
    loss_aggregation: str = "grpo"
    epochs: int = 1
    num_minibatches: int = 1
    mask_truncated: bool = False
    dynamic_sampling: bool = False
    max_extra_draws: int = 3


@dataclass
class GroupRelativeConfig(OnlineConfig):
    """The config of the members whose advantage is GRPO's group-relative one (GRPO, GSPO, CISPO), with their common
    defaults: no KL term (beta = 0: DeepSeek-R1, Dr. GRPO, DAPO, GSPO and CISPO drop it); with beta > 0, k3 as a loss.

    Attributes:
        scale_rewards: ``group`` | ``batch`` | ``none`` (:data:`prefzoo.objective.ADVANTAGE_SCALES`).
        advantage_eps: added to the std before dividing.
    """

    default_beta: float = 0.0
    default_kl_estimator: str = "k3"
    default_kl_placement: str = "as_loss"
    scale_rewards: str = "group"
    advantage_eps: float = 1e-4


def check_online_settings(cfg: OnlineConfig, objective: ObjectiveSettings, min_samples: int = 1,
                          why: str = "") -> None:
    """The checks every member's config shares: ``num_samples`` >= ``min_samples`` (``why``: what the others are
    for), ``loss_aggregation``, ``epochs`` and ``num_minibatches`` >= 1, and the adaptive controller's starting beta.

    Raises:
        ConfigError: the first bad value, naming its key and the valid range.
    """
    if not cfg.num_samples >= min_samples:
        raise ConfigError(f"algo.num_samples={cfg.num_samples}: algo={cfg.name} needs at least {min_samples} "
                          f"completion{'s' if min_samples > 1 else ''} per prompt{f' ({why})' if why else ''}.")
    if cfg.loss_aggregation not in AGGREGATION_OF:
        raise ConfigError(f"algo.loss_aggregation={cfg.loss_aggregation!r}; choose one of {', '.join(AGGREGATION_OF)}.")
    if cfg.epochs < 1 or cfg.num_minibatches < 1:
        raise ConfigError(f"algo.epochs={cfg.epochs} and algo.num_minibatches={cfg.num_minibatches} must be >= 1.")
    if cfg.dynamic_sampling and (cfg.num_samples < 2 or cfg.max_extra_draws < 0):
        raise ConfigError(f"algo.dynamic_sampling=true drops the groups of algo.num_samples={cfg.num_samples} "
                          f"completions whose rewards are all equal: it needs num_samples >= 2 and "
                          f"algo.max_extra_draws={cfg.max_extra_draws} >= 0.")
    if cfg.dynamic_sampling and objective.beta > 0 and objective.kl_placement == "in_reward":
        raise ConfigError(f"algo.dynamic_sampling=true with the KL in the reward (objective.beta={objective.beta}, "
                          "kl_placement=in_reward): a group of equal rewards still carries the KL penalty's "
                          "advantages, so dropping it would change the update; put the KL in the loss "
                          "(objective.kl_placement=as_loss) or set objective.beta=0.")
    check_adaptive_start(objective)


def check_dynamic_sampling(cfg: OnlineConfig, why: str) -> None:
    """A member whose baseline is not the group refuses ``algo.dynamic_sampling`` (``why``: what its baseline is):
    a group of equal rewards still carries advantages there, so dropping it would change the update.

    Raises:
        ConfigError: naming the key and the reason.
    """
    if cfg.dynamic_sampling:
        raise ConfigError(f"algo.dynamic_sampling=true is for plugins whose baseline is the group (GRPO, GSPO, CISPO, "
                          f"RLOO); algo={cfg.name}: {why}.")


def check_adaptive_start(objective: ObjectiveSettings) -> None:
    """The adaptive KL controller (Ziegler et al. 2019) scales beta multiplicatively: it needs a starting beta > 0.

    Raises:
        ConfigError: naming ``objective.beta``.
    """
    if objective.kl_controller == "adaptive" and not objective.beta > 0:
        raise ConfigError("the adaptive KL controller needs a starting objective.beta > 0.")


def check_group_relative_settings(cfg: GroupRelativeConfig, objective: ObjectiveSettings) -> None:
    """The checks of a member with GRPO's advantages: :func:`check_online_settings` with G >= 2 (the group is the
    baseline), and ``algo.scale_rewards`` one of :data:`prefzoo.objective.ADVANTAGE_SCALES`.

    Raises:
        ConfigError: the first bad value, naming its key and the valid values.
    """
    check_online_settings(cfg, objective, min_samples=2, why="the group is the baseline")
    if cfg.scale_rewards not in ADVANTAGE_SCALES:
        raise ConfigError(f"algo.scale_rewards={cfg.scale_rewards!r}; choose one of {', '.join(ADVANTAGE_SCALES)}.")


def check_policy_clip(cfg) -> None:
    """PPO's ratio clip: ``algo.clip_eps_low`` in [0, 1) and ``algo.clip_eps_high`` >= 0.

    Raises:
        ConfigError: naming both keys and their ranges.
    """
    if not 0 <= cfg.clip_eps_low < 1 or cfg.clip_eps_high < 0:
        raise ConfigError(f"algo.clip_eps_low={cfg.clip_eps_low} must be in [0, 1) and algo.clip_eps_high="
                          f"{cfg.clip_eps_high} >= 0.")


#: ``algo.dppo_delta``'s default per divergence: the DPPO paper's recipe (verl's example: TV 0.15, binary KL 0.05)
DPPO_DELTA = {"dppo_tv": 0.15, "dppo_kl": 0.05}


@dataclass
class TrustRegionConfig:
    """The settings of the surrogates a member with PPO's per-token clip can use instead (``algo.policy_loss``:
    GRPO, RLOO, REINFORCE++), :func:`trust_region_policy_loss`. Mixed into the member's config as its FIRST base, so
    that its fields come after the algorithm's own (``name`` first) in the saved config.

    Attributes:
        dppo_delta: DPPO's divergence threshold (both signs); None: :data:`DPPO_DELTA` of the chosen divergence.
        dppo_ratio_cap: DPPO's truncation of the (detached) ratio that weighs a kept token.
        sapo_temperature_pos / sapo_temperature_neg: SAPO's gate temperatures for A > 0 / A < 0.
        dro_beta: DRO's quadratic penalty on log pi - log pi_old (not ``objective.beta``, the KL to pi_ref).
    """

    dppo_delta: float | None = None
    dppo_ratio_cap: float = 1e4
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    dro_beta: float = 0.05


def check_trust_region(cfg, losses: tuple[str, ...]) -> None:
    """``algo.policy_loss`` one of ``losses`` (the member's own and :data:`prefzoo.objective.TRUST_REGION_LOSSES`), and
    the chosen surrogate's settings in range. ``clip`` is refused with the spelling prefzoo uses (``clipped``).

    Raises:
        ConfigError: naming the key and its valid values.
    """
    name = cfg.policy_loss
    if not name.startswith("dppo") and (cfg.dppo_delta is not None
                                         or cfg.dppo_ratio_cap != TrustRegionConfig.dppo_ratio_cap):
        log.warning("algo.dppo_delta / algo.dppo_ratio_cap are DPPO's (algo.policy_loss=dppo_tv|dppo_kl), and "
                    "algo.policy_loss=%s: they are ignored; drop them.", name)
    if name == "clip":
        raise ConfigError("algo.policy_loss=clip: prefzoo spells PPO's ratio clip 'clipped' (as RLOO's and TRL's "
                          "names for it); write algo.policy_loss=clipped.")
    if name not in losses:
        raise ConfigError(f"algo.policy_loss={name!r}; choose one of {', '.join(losses)}.")
    if name.startswith("dppo") and ((cfg.dppo_delta is not None and not cfg.dppo_delta > 0) or not cfg.dppo_ratio_cap > 0):
        raise ConfigError(f"algo.dppo_delta={cfg.dppo_delta} and algo.dppo_ratio_cap={cfg.dppo_ratio_cap} must be > 0 "
                          f"(null: {DPPO_DELTA[name]}, the paper's for {name}).")
    if name == "sapo" and not (cfg.sapo_temperature_pos > 0 and cfg.sapo_temperature_neg > 0):
        raise ConfigError(f"algo.sapo_temperature_pos={cfg.sapo_temperature_pos} and algo.sapo_temperature_neg="
                          f"{cfg.sapo_temperature_neg} must be > 0 (the paper's: 1.0 and 1.05).")
    if name == "dro" and not cfg.dro_beta >= 0:
        raise ConfigError(f"algo.dro_beta={cfg.dro_beta} must be >= 0 (Tinker's example: 0.05).")


def trust_region_policy_loss(cfg, logps: Tensor, old_logps: Tensor, batch: Experience) -> PolicyLoss:
    """The per-token loss ``cfg.policy_loss`` names: ``clipped`` (PPO's clip, :func:`prefzoo.objective.clipped_surrogate_loss`
    with ``clip_eps_low`` / ``clip_eps_high``) or one of :data:`prefzoo.objective.TRUST_REGION_LOSSES`: ``dppo_tv`` /
    ``dppo_kl`` (:func:`prefzoo.objective.dppo_loss`; ``clip_fraction`` = the tokens its mask dropped), ``sapo``
    (:func:`prefzoo.objective.sapo_loss`; ``clip_fraction`` = tokens whose gate weight fell below 1/2, and
    ``gate_weight_mean``), ``dro`` (:func:`prefzoo.objective.dro_loss`; ``clip_fraction`` = tokens past the point where
    the penalty outweighs the advantage). All equal REINFORCE's gradient on a rollout's first pass (ratio 1), so with
    one optimizer step per rollout they differ from ``clipped`` only in the loss's logged value; they part from it on
    the later mini-batches and epochs. Shapes: (B, T)."""
    mask, a, name = batch.loss_mask, batch.advantages, cfg.policy_loss
    if name == "clipped":
        return PolicyLoss(*clipped_surrogate_loss(logps, old_logps, a, mask, cfg.clip_eps_low, cfg.clip_eps_high))
    if name in ("dppo_tv", "dppo_kl"):
        delta = DPPO_DELTA[name] if cfg.dppo_delta is None else cfg.dppo_delta
        return PolicyLoss(*dppo_loss(logps, old_logps, a, mask, name[5:], delta, delta, cfg.dppo_ratio_cap))
    if name == "sapo":
        per_token, weight, low = sapo_loss(logps, old_logps, a, mask, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        return PolicyLoss(per_token, low, tokens={"gate_weight_mean": (float(masked_sum(weight, mask)), float(mask.sum()))})
    if name == "dro":
        return PolicyLoss(*dro_loss(logps, old_logps, a, mask, cfg.dro_beta))
    raise ConfigError(f"algo.policy_loss={name!r}; choose clipped or one of {', '.join(TRUST_REGION_LOSSES)}.")


def stores_old_logps(epochs: int, num_minibatches: int) -> bool:
    """Whether a rollout must keep log pi_old (one no-grad pass at sampling time): True when any update after the
    first sees it, i.e. ``epochs * num_minibatches > 1`` (the later optimizer steps are off-policy)."""
    return epochs * num_minibatches > 1


#: steps in a row with every group's rewards equal before :func:`zero_spread_warning` is printed
ZERO_SPREAD_STEPS = 5


def zero_spread_warning(num_samples: int, temperature: float, steps: int = ZERO_SPREAD_STEPS) -> MetricWarning:
    """The warning of a plugin whose baseline is the group: every group of ``num_samples`` completions scored alike
    (``frac_zero_std_groups`` = 1) means every advantage is 0, and the reward teaches the policy nothing."""
    return MetricWarning(
        "frac_zero_std_groups", 1.0, steps,
        f"every group of algo.num_samples={num_samples} completions got one reward, so every advantage is 0 and the "
        "policy learns nothing from the reward. The reward is likely too hard (all 0) or too easy (all the same high "
        f"value) for this model, or the samples too alike: raise rollout.temperature={temperature:g} or "
        "algo.num_samples, or use an easier task or a reward that gives partial credit.")


#: MaxRL (``algo.scale_rewards=mean``): the advantage (r - mean) / mean is 0 for a group whose mean reward is <= 0
MAXRL_WARNING = MetricWarning(
    "frac_nonpositive_groups", 1.0, ZERO_SPREAD_STEPS,
    "every group's mean reward was <= 0, where MaxRL's advantage (r - mean) / mean is 0 (algo.scale_rewards=mean), so "
    "the loss and its gradient are 0 and nothing trains. MaxRL is for rewards >= 0 with some > 0 (e.g. 0/1 "
    "correctness); for rewards that can be negative use algo.scale_rewards=group (or none).")


def online_declaration(algo: Algorithm, progress_keys: tuple[str, ...], group_baseline: bool = True,
                       capabilities: frozenset[str] = frozenset()) -> Declaration:
    """The declaration of a member: a reference only when beta > 0 (or adaptive), rollouts scored by the run's reward,
    the loss reduction of ``algo.cfg.loss_aggregation`` (Dr. GRPO's constant is the sampling budget
    ``max_new_tokens``), the config's epochs, mini-batches and G; with ``group_baseline`` (the group is each sample's
    baseline) the :func:`zero_spread_warning`; ``capabilities`` as :class:`~prefzoo.algos.base.Declaration`'s, plus
    ``sampler_correction`` (every member weights its loss by :func:`engine_correction`'s weights)."""
    cfg, aggregation = algo.cfg, AGGREGATION_OF[algo.cfg.loss_aggregation]
    warnings = (zero_spread_warning(cfg.num_samples, algo.sampling.temperature),) if group_baseline else ()
    if isinstance(cfg, GroupRelativeConfig) and cfg.scale_rewards == "mean":
        warnings += (MAXRL_WARNING,)
    return Declaration(
        reference=algo.beta > 0 or algo.objective.kl_controller == "adaptive", online=True, reward=True,
        aggregation=aggregation,
        aggregation_constant=algo.sampling.max_new_tokens if aggregation == "constant" else None,
        epochs=cfg.epochs, num_minibatches=cfg.num_minibatches, num_samples=cfg.num_samples,
        progress_keys=progress_keys, warnings=warnings, capabilities=capabilities | {"sampler_correction"},
        draws_prompts=cfg.dynamic_sampling)


# ----------------------------------------------------------------------------------------------- the rollout
def drift_metrics(logps: Tensor, ref_logps: Tensor, mask: Tensor) -> dict[str, float]:
    """KL(pi || pi_ref) per sequence (k1 and k3 estimates, nats, mean over rows) of sampled completions."""
    out = {f"kl_{k}": sequence_kl(logps, ref_logps, mask, k).mean().item() for k in ("k1", "k3")}
    out["kl"] = out["kl_k1"]
    return out


@dataclass
class Rollout:
    """A scored rollout. B = prompts x G rows, T = completion positions.

    Attributes:
        samples: the completions (grouped: rows [i*G, (i+1)*G) answer prompt i).
        rewards: Shape (B,) float32, the run's reward of each completion.
        logps: Shape (B, T), log pi at sampling time (no grad) when asked for, else None.
        ref_logps: Shape (B, T), log pi_ref when the run has a reference, else None.
        metrics: :func:`sample_metrics`, drift (``kl``, ``kl_k1``, ``kl_k3``: KL(pi || pi_ref) per sequence, nats,
            when both log-probs exist), timings; with a sampler that reports its log-probs, the mismatch
            (:func:`engine_correction`).
        is_weights: Shape (B, T), the importance weights of the sampler's samples (``rollout.correction.mode`` set
            and the sampler reported log-probs), else None.
        teacher_logps: Shape (B, T), log pi_T of a teacher (:class:`~prefzoo.types.DistillationPolicy`) when the
            member asks for it (:attr:`OnlinePolicyGradient.rollout_teacher_logps`), else None.
    """

    samples: SequenceBatch
    rewards: Tensor
    logps: Tensor | None
    ref_logps: Tensor | None
    metrics: dict[str, float] = field(default_factory=dict)
    is_weights: Tensor | None = None
    teacher_logps: Tensor | None = None


def place_rewards(penalty: Tensor, scores: Tensor, samples: SequenceBatch) -> Tensor:
    """Per-token rewards of a rollout: ``penalty`` on every token; each environment step reward on the last token of
    the turn it rewards (``env.reward_placement=turn``, :meth:`~prefzoo.types.SequenceBatch.turn_rewards`); the rest
    of each row's score on its last policy token. Without per-turn rewards: :func:`~prefzoo.objective.add_sequence_reward`.

    ``scores`` hold the whole episode's reward (the step rewards included, as the scorer adds them), so the step
    rewards are moved, not added twice: every row's rewards sum to ``scores + penalty.sum(-1)`` either way, and with
    gamma = 1 the first token's return is the same. What changes is the credit of later turns: a turn's tokens
    do not collect the rewards of the turns before it (the reward-to-go of a multi-step MDP, Sutton & Barto 2018,
    eq. 3.8).

    Shape: penalty (B, T) float, scores (B,), samples with (B, T) completions -> (B, T) in penalty's dtype.
    Units: reward units.
    Capability ``turn_rewards`` (:mod:`prefzoo.algos.base`): the plugins whose returns are per token use this.
    """
    mask, per_turn = samples.completion_mask, samples.turn_rewards()
    if per_turn is None:
        return add_sequence_reward(penalty, scores, mask)
    per_turn = per_turn.to(penalty.dtype)
    return add_sequence_reward(penalty + per_turn, scores - per_turn.sum(-1).to(scores.dtype), mask)


def engine_correction(policy: Policy, samples: SequenceBatch, logps: Tensor | None, sampling: SamplingParams
                      ) -> tuple[Tensor | None, dict[str, float]]:
    """The sampler/trainer mismatch of a rollout and, with ``sampling.correction.mode``, its importance weights.

    ``samples.sample_logps`` are the log-probs the sampler drew with (a vLLM engine's, the hf engine's merged copy's;
    None when the trainer sampled itself: then nothing to report); ``logps`` the trainer's recomputation at sampling
    time (no grad, the sampling temperature), Shape (B, T). With top-k / top-p sampling and
    ``correction.match_support`` the trainer's log-probs are first renormalised over the sampler's support
    (the policy's ``support_log_mass``, :meth:`prefzoo.models.policy.CausalLMPolicy.support_log_mass`: one more no-grad
    pass; not part of the :class:`~prefzoo.types.Policy` protocol, needed only here), so that a matched sampler gives
    w = 1 exactly.

    Metrics: ``engine/logp_diff_mean``, ``engine/logp_diff_max``, ``engine/logp_diff_signed`` (nats per token, the
    plain recomputation against the sampler's); ``correction/mismatch_k1``, ``correction/mismatch_k3``,
    ``correction/ratio_mean`` (of the log-probs the weight uses); with a mode, ``correction/weight_mean``,
    ``_min``, ``_max``, ``correction/frac_rejected`` (tokens, or sequences, truncated or masked) and
    ``correction/ess`` (:func:`prefzoo.objective.correction_metrics`). With ``correction.bypass`` there is no
    recomputation: nothing is measured (the ratio of the update is pi_theta / pi_sampler).

    Returns:
        (weights Shape (B, T) or None without a mode, metrics); (None, {}) when the sampler reported no log-probs or
        under bypass.
    """
    c = sampling.correction
    if samples.sample_logps is None and c.mode is not None:
        raise ConfigError(f"rollout.correction.mode={c.mode} needs a sampler that reports its log-probs, and this "
                          "rollout came back without them (the hf engine reports them from its merged copy only: "
                          "LoRA, model.fast.merged_rollout=true, rollout.log_mismatch=true); or set the mode to null.")
    if samples.sample_logps is None or c.bypass or logps is None:
        return None, {}
    mask = samples.completion_mask
    metrics = {f"engine/{k}": v for k, v in sampler_mismatch(logps, samples.sample_logps, mask).items()}
    trainer = logps
    if c.match_support and (sampling.top_p < 1.0 or sampling.top_k) and not sampling.greedy:
        trainer = logps - policy.support_log_mass(samples, sampling.temperature, sampling.top_p, sampling.top_k)
    weights = rejected = None
    if c.mode is not None:
        weights, rejected = correction_weights(trainer, samples.sample_logps, mask, c.mode, c.clip_min, c.clip_max)
    stats = correction_metrics(trainer, samples.sample_logps, mask, weights, rejected,
                               sequence_level=bool(c.mode and c.mode.startswith("sequence")))
    metrics.update({f"correction/{k}": v for k, v in stats.items()})
    return weights, metrics


def bypass_logps(samples: SequenceBatch) -> Tensor:
    """``rollout.correction.bypass``: the sampler's log-probs as log pi_old, Shape (B, T) float32, 0 where masked.

    Raises:
        ConfigError: the rollout came back without the sampler's log-probs.
    """
    if samples.sample_logps is None:
        raise ConfigError("rollout.correction.bypass=true needs a sampler that reports its log-probs, and this "
                          "rollout came back without them; use rollout.engine=vllm or rollout.log_mismatch=true.")
    return samples.sample_logps.float().masked_fill(~samples.completion_mask, 0.0)


def corrected_advantages(advantages: Tensor, is_weights: Tensor | None) -> Tensor:
    """Per-token advantages times the sampler correction's importance weights (unchanged when None).

    For a loss linear in the advantage with a factor w >= 0 (the clipped surrogate: -min(rho w A, clip(rho) w A) =
    -w min(rho A, clip(rho) A); REINFORCE; CISPO) this is the weighted loss itself, TRL's ``per_token_loss *
    importance_sampling_ratio`` (:func:`prefzoo.objective.correction_weights`). The KL-as-loss term gets the same
    weights in :func:`add_kl_loss` (``rollout.correction.weight_kl``; TRL leaves it unweighted). Shape (B, T) ->
    (B, T)."""
    return advantages if is_weights is None else advantages * is_weights.to(advantages.dtype)


def sample_metrics(samples: SequenceBatch, rewards: Tensor, generation_seconds: float) -> dict[str, float]:
    """The rollout metrics every online plugin logs: ``reward`` / ``reward_std`` (over completions),
    ``completion_length`` / ``completion_length_max`` (tokens, EOS included), ``frac_truncated`` (no EOS),
    ``generated_tokens_per_second`` and ``time/generation`` (seconds). Multi-turn episodes: the lengths count the
    policy's tokens only, ``frac_truncated`` is the share the budget cut, and :func:`~prefzoo.types.episode_metrics`
    adds ``episode/turns``, ``episode/tool_calls``, ``episode/tool_errors`` and ``episode/frac_cut``."""
    lengths = samples.completion_mask.sum(-1).float()
    return {
        "reward": rewards.mean().item(), "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "completion_length": lengths.mean().item(), "completion_length_max": lengths.max().item(),
        "frac_truncated": samples.truncated.float().mean().item() if samples.truncated is not None else 0.0,
        "generated_tokens_per_second": int(samples.completion_mask.sum()) / max(generation_seconds, 1e-9),
        "time/generation": generation_seconds,
        **{f"episode/{k}": v for k, v in episode_metrics(samples.episodes or []).items()},
    }


def sample_and_score(policy: Policy, prompts: PromptBatch, score: Scorer, num_samples: int, sampling: SamplingParams,
                     need_logps: bool, teacher: bool = False, reference: bool = True) -> Rollout:
    """Sample ``num_samples`` completions per prompt with ``sampling``, score them, and (without gradients) compute
    log pi at sampling time if ``need_logps``, log pi_ref if the policy has a reference and ``reference`` (False: a
    step that needs pi_ref for no loss term and measures no drift, ``trainer.kl_metric_every``), and log pi_T of its
    teacher if ``teacher`` (a :class:`~prefzoo.types.DistillationPolicy`), all at the sampling temperature.

    When the sampler reports its own log-probs (``samples.sample_logps``: ``rollout.engine=vllm``, the hf engine's
    merged copy), log pi at sampling time is computed whatever ``need_logps`` (one no-grad pass) for the mismatch
    metrics and, with ``rollout.correction.mode``, the rollout's ``is_weights`` (:func:`engine_correction`). Under
    ``rollout.correction.bypass`` the sampler's log-probs stand for log pi at sampling time: no pass at all."""
    t0 = time.perf_counter()
    samples = policy.sample(prompts, num_samples, sampling)
    t1 = time.perf_counter()
    rewards = score(samples, prompts).float()
    mask = samples.completion_mask
    bypass = sampling.correction.bypass
    need_logps = need_logps or (samples.sample_logps is not None and not bypass)
    if bypass:
        logps = bypass_logps(samples)
    else:
        logps = policy.logps(samples, sampling.temperature)[0].detach() if need_logps else None
    ref_logps = policy.ref_logps(samples, sampling.temperature) if reference and policy.reference is not None else None
    teacher_logps = policy.teacher_logps(samples, sampling.temperature) if teacher else None
    t2 = time.perf_counter()
    metrics = drift_metrics(logps, ref_logps, mask) if logps is not None and ref_logps is not None else {}
    is_weights, engine_metrics = engine_correction(policy, samples, logps, sampling)
    metrics.update(engine_metrics)
    grouped = rewards.view(-1, num_samples)
    metrics.update(sample_metrics(samples, rewards, t1 - t0))
    metrics.update({"frac_zero_std_groups": (grouped.max(-1).values == grouped.min(-1).values).float().mean().item(),
                    "time/scoring_and_ref": t2 - t1})
    return Rollout(samples, rewards, logps, ref_logps, metrics, is_weights, teacher_logps)


def _pad_rows(tensors: list[Tensor | None]) -> Tensor | None:
    """(B_i, T_i) tensors stacked row-wise, right-padded with 0 (:func:`~prefzoo.types.pad_cat`); None if any is None."""
    return None if any(t is None for t in tensors) else pad_cat(tensors, "right", 0.0)


def cat_rollouts(rollouts: list[Rollout], pad_id: int = 0) -> Rollout:
    """Rollouts stacked row-wise (completions re-padded; ``prompt_index`` offset so that it keeps naming each row's
    prompt among all the rollouts' prompts); the metrics are the first rollout's."""
    offset, shifted = 0, []
    for r in rollouts:
        index = r.samples.prompt_index
        shifted.append(r.samples if index is None else replace(r.samples, prompt_index=index + offset))
        if index is not None and len(index):
            offset += int(index.max()) + 1
    return Rollout(SequenceBatch.cat(shifted, pad_id), torch.cat([r.rewards for r in rollouts]),
                   _pad_rows([r.logps for r in rollouts]), _pad_rows([r.ref_logps for r in rollouts]),
                   dict(rollouts[0].metrics), _pad_rows([r.is_weights for r in rollouts]),
                   _pad_rows([r.teacher_logps for r in rollouts]))


def informative_groups(rewards: Tensor, num_samples: int) -> Tensor:
    """Which groups of ``num_samples`` consecutive rewards are not all equal (DAPO's filter), Shape (B / G,) bool."""
    grouped = rewards.view(-1, num_samples)
    return grouped.max(-1).values != grouped.min(-1).values


def dynamic_sampling(algo: "OnlinePolicyGradient", policy: Policy, first: Rollout, score: Scorer, draw, **sampling
                     ) -> tuple[Rollout, dict[str, float]]:
    """DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2, eq. 11: 0 < |{o_i correct}| < G): keep the groups whose
    rewards are not all equal; while fewer than the first round's number of groups are kept and fewer than
    ``algo.cfg.max_extra_draws`` extra rounds were drawn, sample and score ``draw(round)``'s prompts (the next
    ``trainer.batch_size`` of the training data) and keep theirs. The kept groups (at most the first round's number,
    in the order drawn) are the step's batch. If the cap is reached first, the step trains on fewer groups (logged);
    if no group at all is informative, on the first round unchanged (every advantage of a group baseline is 0, as
    without dynamic sampling).

    Departure: DAPO (and verl's ``max_num_gen_batches``) keep drawing, or stop the run, when the cap is reached;
    prefzoo trains on what it has, so a hard stretch of the data slows a run instead of ending it.

    Metrics: ``dynamic/extra_draws`` (rounds beyond the first), ``dynamic/dropped_groups`` (over all rounds),
    ``dynamic/kept_groups``, ``dynamic/reward`` (the kept completions' mean reward; ``reward`` stays the first
    round's, comparable with a run without dynamic sampling).
    """
    g = algo.cfg.num_samples
    target = len(first.rewards) // g
    kept, dropped, rounds = [], 0, 0
    current = first
    while True:
        keep = informative_groups(current.rewards, g)
        dropped += int((~keep).sum())
        rows = keep.repeat_interleave(g).nonzero()[:, 0]
        if len(rows):
            kept.append(_select_rollout(current, rows))
        have = sum(len(r.rewards) for r in kept) // g
        if have >= target or rounds >= algo.cfg.max_extra_draws:
            break
        rounds += 1
        current = sample_and_score(policy, draw(rounds), score, g, algo.sampling, **sampling)
    if not kept:
        out = first
    else:
        out = cat_rollouts(kept, 0)  # (padding ids are never read: the masks say which tokens count)
        if len(out.rewards) > target * g:
            out = _select_rollout(out, torch.arange(target * g))
        out.metrics = dict(first.metrics)
    return out, {"dynamic/extra_draws": float(rounds), "dynamic/dropped_groups": float(dropped),
                 "dynamic/kept_groups": float(len(out.rewards) // g if kept else 0),
                 "dynamic/reward": out.rewards.mean().item()}


def _select_rollout(r: Rollout, rows: Tensor) -> Rollout:
    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    return Rollout(r.samples.select(rows), r.rewards[rows], pick(r.logps), pick(r.ref_logps), dict(r.metrics),
                   pick(r.is_weights), pick(r.teacher_logps))


def group_relative_advantages(algo: Algorithm, rollout: Rollout, penalty: Tensor) -> tuple[Tensor, dict[str, float]]:
    """GRPO's advantages (Shao et al. 2024, sec. 4.1.2), the ``advantages`` of GRPO, GSPO and CISPO:

        A_i = (R_i - mean of R over its group) / (std of R over its group + eps),   R_i = r_i + sum_t penalty_{i,t}

    scaled as ``algo.cfg.scale_rewards`` says (:func:`prefzoo.objective.group_advantages`). Shape (B,). Under data
    parallelism ``scale_rewards=batch``'s std is the global batch's (``algo.all_reduce``)."""
    c = algo.cfg
    shaped = rollout.rewards + penalty.sum(-1)
    extra = {}
    if c.scale_rewards == "mean":  # MaxRL: a group of mean <= 0 gets advantage 0 (MAXRL_WARNING watches the share)
        extra["frac_nonpositive_groups"] = (shaped.view(-1, c.num_samples).mean(-1) <= 0).float().mean().item()
    return group_advantages(shaped, c.num_samples, c.scale_rewards, c.advantage_eps, all_reduce=algo.all_reduce), extra


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


@dataclass
class PolicyLoss:
    """What a member's ``policy_loss`` returns.

    Attributes:
        per_token: Shape (B, T), the loss of each loss token (0 elsewhere), with gradients.
        clipped: Shape (B, T) bool, the tokens where the clip was active (``clip_fraction``).
        metrics: extra per-row metrics (e.g. GSPO's ``sequence_clip_fraction``).
        tokens: extra per-token (sum, count) metrics; a name here replaces the shared one (GSPO's ``ratio_mean``).
    """

    per_token: Tensor
    clipped: Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, tuple[float, float]] = field(default_factory=dict)


class OnlinePolicyGradient(Algorithm):
    """The family's body (see the module docstring): rollout, advantages' broadcast, log pi_old, loss, KL term and
    metrics, once. Not a plugin: a member derives from it and gives its config, checks, ``advantages`` and
    ``policy_loss`` (and its ``progress_keys``, or a ``declare`` of its own).

    Class attributes:
        progress_keys: the metrics on the progress bar (:func:`online_declaration`).
        rollout_logps: the member's ``advantages`` read log pi at sampling time (``rollout.logps``) even with one
            optimizer step per rollout (on-policy distillation's per-token reward).
        rollout_teacher_logps: the member's ``advantages`` read the teacher's log-probs (``rollout.teacher_logps``).
    """

    progress_keys: tuple[str, ...] = ("reward", "kl_k3", "clip_fraction")
    rollout_logps: bool = False
    rollout_teacher_logps: bool = False

    def declare(self) -> Declaration:
        """:func:`online_declaration` with the member's ``progress_keys``; the group is the baseline."""
        return online_declaration(self, self.progress_keys)

    def loss_mask(self, batch: Experience) -> Tensor:
        return batch.loss_mask

    def stores_old_logps(self) -> bool:
        """Whether this plugin's rollouts keep log pi_old (:func:`stores_old_logps` of its epochs x mini-batches)."""
        return stores_old_logps(self.cfg.epochs, self.cfg.num_minibatches)

    def advantages(self, rollout: Rollout, penalty: Tensor) -> tuple[Tensor, dict[str, float]]:
        """The member's advantages: (Shape (B,) per sequence or (B, T) per token, extra rollout metrics).
        ``penalty`` (B, T) is the per-token KL penalty -beta k(log pi_old/pi_ref) (0 unless the KL is in the reward)."""
        raise NotImplementedError(f"{type(self).__name__} must implement advantages()")

    def policy_loss(self, logps: Tensor, old_logps: Tensor, batch: Experience) -> PolicyLoss:
        """The member's per-token loss on ``batch.loss_mask`` (logps with gradients, old_logps without)."""
        raise NotImplementedError(f"{type(self).__name__} must implement policy_loss()")

    @torch.no_grad()
    def make_experience(self, policy: Policy, prompts: PromptBatch, score: Scorer) -> tuple[Experience, dict[str, float]]:
        c, o = self.cfg, self.objective
        in_reward = self.beta > 0 and o.kl_placement == "in_reward"
        # a no-grad pass of the policy only where log pi at sampling time is needed before the update; with one
        # optimizer step the drift metrics come from the update's own forward pass (update_metrics)
        settings = dict(need_logps=self.stores_old_logps() or in_reward or self.rollout_logps,
                        teacher=self.rollout_teacher_logps,
                        reference=self.declaration.reference or self.drift_metrics_due)
        r = sample_and_score(policy, prompts, score, c.num_samples, self.sampling, **settings)
        dynamic = {}
        if c.dynamic_sampling:
            if self.draw_prompts is None:
                raise ConfigError("algo.dynamic_sampling=true needs the training loop to draw more prompts, and it "
                                  "cannot here (data parallelism or asynchronous rollouts); set it to false.")
            r, dynamic = dynamic_sampling(self, policy, r, score, self.draw_prompts, **settings)
        mask = r.samples.completion_mask
        penalty = (kl_penalty_rewards(r.logps, r.ref_logps, mask, self.beta, o.kl_estimator) if in_reward
                   else torch.zeros(mask.shape, device=mask.device))
        advantages, extra = self.advantages(r, penalty)
        if advantages.dim() == 1:  # a sequence advantage on every token of its row
            advantages = torch.where(mask, advantages[:, None].float(), torch.zeros((), device=mask.device))
        advantages = corrected_advantages(advantages.float(), r.is_weights)  # rollout.correction.mode
        loss_mask = mask & ~r.samples.truncated[:, None] if c.mask_truncated else mask
        metrics = dict(r.metrics, non_score_reward=penalty.sum(-1).mean().item(), **extra, **dynamic)
        return Experience.from_samples(r.samples, rewards=r.rewards, advantages=advantages, loss_mask=loss_mask,
                                       old_logps=r.logps if self.stores_old_logps() or self.sampling.correction.bypass
                                       else None,
                                       sample_weights=r.is_weights if self.sampling.correction.weight_kl else None,
                                       ref_logps=r.ref_logps), metrics

    def loss(self, policy: Policy, batch: Experience) -> LossOutput:
        logps, entropy = policy.logps(batch, self.sampling.temperature, with_entropy=True)
        old_logps = batch.old_logps if batch.old_logps is not None else logps.detach()
        mask = batch.loss_mask
        out = self.policy_loss(logps, old_logps, batch)
        metrics, tokens = update_metrics(logps, old_logps, mask, out.clipped, entropy, batch.ref_logps,
                                         batch.old_logps is None, batch.completion_mask)
        metrics.update(out.metrics)
        tokens.update(out.tokens)
        per_token = add_kl_loss(out.per_token, logps, batch.ref_logps, mask, self.beta, self.objective, tokens,
                                batch.sample_weights, old_logps)
        return LossOutput(per_token, mask, metrics, tokens)

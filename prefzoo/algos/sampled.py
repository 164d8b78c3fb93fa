"""The parts of an online step that the group-sampling plugins share (GRPO and its GSPO / CISPO, RLOO, REINFORCE++,
Online DPO).

Not a plugin: :func:`sample_and_score` samples G completions per prompt, scores them, runs the no-grad passes a
plugin asks for and returns the metrics of the shared online schema; :func:`update_metrics` is the loss side
(clip, ratio, drift, entropy as (sum, count) pairs) and :func:`add_kl_loss` the "as_loss" KL term;
:func:`check_rollout_settings` and :func:`rollout_declaration` the settings and the declaration those plugins have
in common (loss aggregation, epochs x mini-batches, policy clip, the reference they need);
:func:`engine_correction` the rollout engine's mismatch metrics and truncated importance-sampling weights, which
:func:`corrected_advantages` applies (every online plugin, PPO included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from torch import Tensor

from prefzoo.algos.base import Declaration, MetricWarning
from prefzoo.errors import ConfigError
from prefzoo.objective import (kl_loss, masked_sum, ratio_statistics, sampler_mismatch, sequence_kl,
                               truncated_is_weights)
from prefzoo.types import ObjectiveSettings, Policy, PromptBatch, SamplingParams, Scorer, SequenceBatch

__all__ = ["AGGREGATION_OF", "Rollout", "drift_metrics", "sample_and_score", "update_metrics", "add_kl_loss",
           "check_rollout_settings", "rollout_declaration", "zero_spread_warning", "ZERO_SPREAD_STEPS",
           "engine_correction", "corrected_advantages"]

#: ``algo.loss_aggregation`` -> the loss reduction (:data:`prefzoo.objective.AGGREGATIONS`): GRPO eq. 3 (mean over
#: each sequence, then over sequences), Dr. GRPO (a constant: the generation budget), DAPO eq. 8 (token mean)
AGGREGATION_OF = {"grpo": "sequence_mean", "dr_grpo": "constant", "dapo": "token_mean"}


def drift_metrics(logps: Tensor, ref_logps: Tensor, mask: Tensor) -> dict[str, float]:
    """KL(pi || pi_ref) per sequence (k1 and k3 estimates, nats, mean over rows) of sampled completions."""
    out = {f"kl_{k}": sequence_kl(logps, ref_logps, mask, k).mean().item() for k in ("k1", "k3")}
    out["kl"] = out["kl_k1"]
    return out


def check_rollout_settings(cfg, objective: ObjectiveSettings) -> None:
    """The checks every group-sampling plugin's config shares (``loss_aggregation``, ``epochs``,
    ``num_minibatches``, ``clip_eps_low`` / ``clip_eps_high``) and the adaptive controller's starting beta.

    Raises:
        ConfigError: the first bad value, naming its key and the valid range.
    """
    if cfg.loss_aggregation not in AGGREGATION_OF:
        raise ConfigError(f"algo.loss_aggregation={cfg.loss_aggregation!r}; choose one of {', '.join(AGGREGATION_OF)}.")
    if cfg.epochs < 1 or cfg.num_minibatches < 1:
        raise ConfigError(f"algo.epochs={cfg.epochs} and algo.num_minibatches={cfg.num_minibatches} must be >= 1.")
    if not 0 <= cfg.clip_eps_low < 1 or cfg.clip_eps_high < 0:
        raise ConfigError(f"algo.clip_eps_low={cfg.clip_eps_low} must be in [0, 1) and algo.clip_eps_high="
                          f"{cfg.clip_eps_high} >= 0.")
    if objective.kl_controller == "adaptive" and not objective.beta > 0:
        raise ConfigError("the adaptive KL controller needs a starting objective.beta > 0.")


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


def rollout_declaration(algo, progress_keys: tuple[str, ...], group_baseline: bool = True) -> Declaration:
    """The declaration of a group-sampling plugin: a reference only when beta > 0 (or adaptive), rollouts scored
    by the run's reward, the loss reduction of ``algo.cfg.loss_aggregation`` (Dr. GRPO's constant is the sampling
    budget ``max_new_tokens``), the config's epochs, mini-batches and group size; with ``group_baseline`` (the
    group is each sample's baseline) the :func:`zero_spread_warning`."""
    cfg, aggregation = algo.cfg, AGGREGATION_OF[algo.cfg.loss_aggregation]
    warnings = (zero_spread_warning(cfg.num_samples, algo.sampling.temperature),) if group_baseline else ()
    return Declaration(
        reference=algo.beta > 0 or algo.objective.kl_controller == "adaptive", online=True, reward=True,
        aggregation=aggregation,
        aggregation_constant=algo.sampling.max_new_tokens if aggregation == "constant" else None,
        epochs=cfg.epochs, num_minibatches=cfg.num_minibatches, num_samples=cfg.num_samples,
        progress_keys=progress_keys, warnings=warnings)


@dataclass
class Rollout:
    """A scored rollout. B = prompts x G rows, T = completion positions.

    Attributes:
        samples: the completions (grouped: rows [i*G, (i+1)*G) answer prompt i).
        rewards: Shape (B,) float32, the run's reward of each completion.
        logps: Shape (B, T), log pi at sampling time (no grad) when asked for, else None.
        ref_logps: Shape (B, T), log pi_ref when the run has a reference, else None.
        metrics: ``reward``, ``reward_std``, drift (``kl``, ``kl_k1``, ``kl_k3``: KL(pi || pi_ref) per sequence,
            nats, when both log-probs exist), ``frac_zero_std_groups``, lengths, truncation, timings; with a rollout
            engine that reports its log-probs, the mismatch (:func:`engine_correction`).
        is_weights: Shape (B, T), the truncated importance-sampling weights of the engine's samples
            (``sampling.is_correction_cap`` set and the engine reported log-probs), else None.
    """

    samples: SequenceBatch
    rewards: Tensor
    logps: Tensor | None
    ref_logps: Tensor | None
    metrics: dict[str, float]
    is_weights: Tensor | None = None


def engine_correction(samples: SequenceBatch, logps: Tensor, cap: float | None
                      ) -> tuple[Tensor | None, dict[str, float]]:
    """The engine/trainer mismatch of a rollout and, with ``cap``, its truncated importance-sampling weights.

    ``samples.sample_logps`` are the log-probs the rollout engine sampled with (None for the hf engine, which is the
    trainer's own model: then nothing to report); ``logps`` the trainer's recomputation at sampling time (no grad,
    the sampling temperature), Shape (B, T). Metrics, in nats per token over the counted tokens:
    ``engine/logp_diff_mean`` and ``engine/logp_diff_max`` (mean and max |log pi_trainer - log pi_engine|),
    ``engine/logp_diff_signed``; with ``cap``, ``engine/is_weight_mean``, ``engine/is_weight_min`` and
    ``engine/is_weight_capped`` (the share of tokens whose weight is the cap).

    Returns:
        (weights Shape (B, T) or None without ``cap``, metrics); (None, {}) when the engine reported no log-probs.
    """
    if samples.sample_logps is None:
        return None, {}
    mask = samples.completion_mask
    metrics = {f"engine/{k}": v for k, v in sampler_mismatch(logps, samples.sample_logps, mask).items()}
    if cap is None:
        return None, metrics
    weights = truncated_is_weights(logps, samples.sample_logps, mask, cap)
    n = max(int(mask.sum()), 1)
    metrics.update({"engine/is_weight_mean": float(weights[mask].sum() / n),
                    "engine/is_weight_min": float(weights[mask].min()) if mask.any() else 1.0,
                    "engine/is_weight_capped": float((weights[mask] >= cap).sum() / n)})
    return weights, metrics


def corrected_advantages(advantages: Tensor, is_weights: Tensor | None) -> Tensor:
    """Per-token advantages times the truncated importance-sampling weights (unchanged when None).

    For a loss linear in the advantage with a positive factor (the clipped surrogate, REINFORCE, CISPO) this is the
    truncated IS correction of the loss itself (:func:`prefzoo.objective.truncated_is_weights`); the KL term is not
    weighted (as in TRL). Shape (B, T) -> (B, T)."""
    return advantages if is_weights is None else advantages * is_weights.to(advantages.dtype)


def sample_and_score(policy: Policy, prompts: PromptBatch, score: Scorer, num_samples: int, sampling: SamplingParams,
                     need_logps: bool) -> Rollout:
    """Sample ``num_samples`` completions per prompt with ``sampling``, score them, and (without gradients) compute
    log pi at sampling time if ``need_logps`` and log pi_ref if the policy has a reference.

    When the rollout engine reports its own log-probs (``samples.sample_logps``: ``rollout.engine=vllm``), log pi at
    sampling time is computed whatever ``need_logps`` (one no-grad pass) for the mismatch metrics and, with
    ``sampling.is_correction_cap``, the rollout's ``is_weights`` (:func:`engine_correction`)."""
    t0 = time.perf_counter()
    samples = policy.sample(prompts, num_samples, sampling)
    t1 = time.perf_counter()
    rewards = score(samples, prompts).float()
    mask = samples.completion_mask
    need_logps = need_logps or samples.sample_logps is not None
    logps = policy.logps(samples, sampling.temperature)[0].detach() if need_logps else None
    ref_logps = policy.ref_logps(samples, sampling.temperature) if policy.reference is not None else None
    t2 = time.perf_counter()
    metrics = drift_metrics(logps, ref_logps, mask) if logps is not None and ref_logps is not None else {}
    is_weights, engine_metrics = engine_correction(samples, logps, sampling.is_correction_cap)
    metrics.update(engine_metrics)
    lengths = mask.sum(-1).float()
    grouped = rewards.view(-1, num_samples)
    metrics.update({
        "reward": rewards.mean().item(), "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "frac_zero_std_groups": (grouped.max(-1).values == grouped.min(-1).values).float().mean().item(),
        "completion_length": lengths.mean().item(), "completion_length_max": lengths.max().item(),
        "frac_truncated": samples.truncated.float().mean().item() if samples.truncated is not None else 0.0,
        "generated_tokens_per_second": int(mask.sum()) / max(t1 - t0, 1e-9),
        "time/generation": t1 - t0, "time/scoring_and_ref": t2 - t1,
    })
    return Rollout(samples, rewards, logps, ref_logps, metrics, is_weights)


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
                objective: ObjectiveSettings, tokens: dict[str, tuple[float, float]]) -> Tensor:
    """``per_token + beta * k(log pi/pi_ref)`` when the objective puts the KL in the loss (beta > 0), logging
    ``kl_loss`` (the term's token mean); ``per_token`` unchanged otherwise."""
    if not (beta > 0 and objective.kl_placement == "as_loss"):
        return per_token
    kl_tokens = kl_loss(logps, ref_logps, mask, objective.kl_estimator)
    tokens["kl_loss"] = (float(masked_sum(kl_tokens.detach(), mask)), float(mask.sum()))
    return per_token + beta * kl_tokens

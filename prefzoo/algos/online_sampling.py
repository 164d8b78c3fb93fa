"""How a member of the online family gets its experience: the scored samples of a step (:class:`ScoredSamples`), the
sampler/trainer mismatch and its correction, the rollout metrics, where per-token rewards land, and DAPO's dynamic
sampling (:mod:`prefzoo.algos.online` is the family's body)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from prefzoo.algos.base import Algorithm
from prefzoo.errors import ConfigError
from prefzoo.objective import (add_sequence_reward, correction_metrics, correction_weights, equal_reward_groups,
                               sampler_mismatch, sequence_kl)
from prefzoo.types import Policy, PromptBatch, SamplingParams, Scorer, SequenceBatch, episode_metrics, pad_cat

__all__ = ["ScoredSamples", "drift_metrics", "place_rewards", "engine_correction", "bypass_logps", "corrected_advantages",
           "sample_metrics", "sample_and_score", "cat_scored", "informative_groups", "dynamic_sampling"]


def drift_metrics(logps: Tensor, ref_logps: Tensor, mask: Tensor) -> dict[str, float]:
    """KL(pi || pi_ref) per sequence (k1 and k3 estimates, nats, mean over rows) of sampled completions."""
    out = {f"kl_{k}": sequence_kl(logps, ref_logps, mask, k).mean().item() for k in ("k1", "k3")}
    out["kl"] = out["kl_k1"]
    return out


@dataclass
class ScoredSamples:
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
                     need_logps: bool, teacher: bool = False, reference: bool = True) -> ScoredSamples:
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
    return ScoredSamples(samples, rewards, logps, ref_logps, metrics, is_weights, teacher_logps)


def _pad_rows(tensors: list[Tensor | None]) -> Tensor | None:
    """(B_i, T_i) tensors stacked row-wise, right-padded with 0 (:func:`~prefzoo.types.pad_cat`); None if any is None."""
    return None if any(t is None for t in tensors) else pad_cat(tensors, "right", 0.0)


def cat_scored(rollouts: list[ScoredSamples], pad_id: int = 0) -> ScoredSamples:
    """Rollouts stacked row-wise (completions re-padded; ``prompt_index`` offset so that it keeps naming each row's
    prompt among all the rollouts' prompts); the metrics are the first rollout's."""
    offset, shifted = 0, []
    for r in rollouts:
        index = r.samples.prompt_index
        shifted.append(r.samples if index is None else replace(r.samples, prompt_index=index + offset))
        if index is not None and len(index):
            offset += int(index.max()) + 1
    return ScoredSamples(SequenceBatch.cat(shifted, pad_id), torch.cat([r.rewards for r in rollouts]),
                   _pad_rows([r.logps for r in rollouts]), _pad_rows([r.ref_logps for r in rollouts]),
                   dict(rollouts[0].metrics), _pad_rows([r.is_weights for r in rollouts]),
                   _pad_rows([r.teacher_logps for r in rollouts]))


def informative_groups(rewards: Tensor, num_samples: int) -> Tensor:
    """Which groups of ``num_samples`` consecutive rewards are not all equal (DAPO's filter), Shape (B / G,) bool.
    Equal means equal up to rounding, as for the advantages (:func:`prefzoo.objective.equal_reward_groups`): a group
    kept here gets advantages that are not all zero. Departs from DAPO's exact ``max != min``, which kept groups such
    as (0.5, 0.5, 0.5, 0.5000001) that then trained nothing."""
    return ~equal_reward_groups(rewards, num_samples)


def dynamic_sampling(algo: Algorithm, policy: Policy, first: ScoredSamples, score: Scorer, draw, **sampling
                     ) -> tuple[ScoredSamples, dict[str, float]]:
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
            kept.append(_select_scored(current, rows))
        have = sum(len(r.rewards) for r in kept) // g
        if have >= target or rounds >= algo.cfg.max_extra_draws:
            break
        rounds += 1
        current = sample_and_score(policy, draw(rounds), score, g, algo.sampling, **sampling)
    if not kept:
        out = first
    else:
        out = cat_scored(kept, 0)  # (padding ids are never read: the masks say which tokens count)
        if len(out.rewards) > target * g:
            out = _select_scored(out, torch.arange(target * g))
        out.metrics = dict(first.metrics)
    return out, {"dynamic/extra_draws": float(rounds), "dynamic/dropped_groups": float(dropped),
                 "dynamic/kept_groups": float(len(out.rewards) // g if kept else 0),
                 "dynamic/reward": out.rewards.mean().item()}


def _select_scored(r: ScoredSamples, rows: Tensor) -> ScoredSamples:
    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    return ScoredSamples(r.samples.select(rows), r.rewards[rows], pick(r.logps), pick(r.ref_logps), dict(r.metrics),
                   pick(r.is_weights), pick(r.teacher_logps))

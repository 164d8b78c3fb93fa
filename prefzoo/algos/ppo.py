"""PPO with a per-token KL penalty: the RLHF recipe of Ziegler et al. 2019 and InstructGPT (Ouyang et al. 2022).

One step (Ziegler et al. 2019, sec. 2.2; Ouyang et al. 2022, sec. 3.5 and eq. 2; Stiennon et al. 2020):

1. Sample: for each prompt x sample ``num_samples`` completions y ~ pi_old (the current policy).
2. Score: r(x, y) from the reward source (a program, VADER, or a learned reward model).
3. Without gradients: old log-probs log pi_old(y_t), reference log-probs log pi_ref(y_t), old values V_old(s_t)
   (s_t = prompt + y_<t, the state before token t).
4. Per-token rewards over the completion tokens t = 0..L-1 of each row (never on padding):

       r~_t = -beta * k(rho_t) + [t = L-1] * (r(x, y) - missing_eos_penalty * [no EOS])
       rho_t = log pi_old(y_t) - log pi_ref(y_t)

   k is the objective layer's KL estimator (default k1, "in_reward": Ziegler's R(x,y) = r - beta log(pi/rho)
   spread over tokens, whose expected gradient is exactly that of -beta KL(pi||pi_ref); see
   :mod:`prefzoo.objective.kl`). With ``objective.kl_placement=as_loss`` the term moves to the loss instead.
5. GAE(``gae_gamma``, ``gae_lambda``) over the completion tokens only (:func:`prefzoo.objective.gae`; Schulman et al. 2016):
   advantages A_t and returns R_t = A_t + V_old(s_t); the value of the state after the last token is 0.
   Advantages are whitened over the valid tokens of the whole rollout (:func:`masked_whiten`).
6. ``epochs`` passes over the rollout, each split into ``num_minibatches`` optimizer steps (the loop does the
   passes), minimising per token

       loss_t = -min(ratio_t A_t, clip(ratio_t, 1-eps_low, 1+eps_high) A_t) + vf_coef * 0.5 max((V-R)^2, (V_clip-R)^2)

   (Schulman et al. 2017, eq. 7; PPO2 value clipping, V_clip = V_old + clip(V - V_old, +-value_clip_eps);
   ``clip_eps_low`` = ``clip_eps_high`` = 0.2 by default) averaged over all valid tokens of the mini-batch.
7. beta: fixed, or adapted once per step from the measured KL (k1, summed over tokens, nats per sequence)
   by the controller of Ziegler et al. 2019 (``objective.kl_controller=adaptive objective.kl_target=...``).

Departures and choices:

* Entropy bonus (``entropy_coef``, default 0): added to the per-token REWARD as ``-entropy_coef * log pi_old(y_t)``,
  the k1-style estimate of the entropy, placed like the KL penalty. On-policy its expected policy gradient is
  exactly the gradient of entropy_coef * H(pi) (same argument as k1 "in reward", with a uniform reference), and
  it needs nothing from the policy but log-probs (the policy's entropy output carries no gradient).
* Value model: separate parameters from the policy by default (see :mod:`prefzoo.models.value`), zero-initialised.
  Log-probs and values come from one call (``policy.logps_and_values``): with ``value_adapter=shared`` that is ONE
  forward of the trunk for both (the head reads the policy's hidden states); with the default separate adapter it
  is two (the value adapter changes every layer, so there is nothing to share but the call).
* ``epochs`` = 2 by default (Ziegler et al. 2019 and TRL use 4), chosen by measurement on SmolLM2-135M with the
  separate value adapter (``bench/ppo_epochs.py``, arithmetic, 4 prompts a step, runs of ~equal training time,
  437-496 s; held-out accuracy from 0.255): 1 epoch 0.400 +- 0.049, 2 epochs 0.510 +- 0.050, 4 epochs 0.430 +- 0.050
  (one seed; on VADER sentiment the three were within noise). A step at 2 epochs costs 2.4x GRPO's on the same
  rollout, at 4 epochs 4.2x (``bench/bench_online.py``); ``algo.value_adapter=shared`` brings 4 epochs to 2.3x.
* Multi-turn episodes (``env=...``): the completion is the whole trajectory; steps 4-6 run over the policy's own
  tokens (the completion mask), the environment's tokens being part of the state. r(x, y) is the episode's reward
  (the reward functions' and the environment's); with ``env.reward_placement=turn`` each step reward of a text
  environment is instead placed on the last token of the turn it rewards (:func:`~prefzoo.algos.online_sampling.place_rewards`),
  so GAE credits each turn with the rewards from that turn on.
* The reference is always available (with LoRA it is free): the KL is measured even when beta = 0.
* Log-probs are recomputed with the sampling temperature, as the sampler drew them.

Metrics (per step; the KL and clip names are those of every online plugin): ``reward`` (mean r(x, y) from the reward
source), ``non_score_reward`` (mean over sequences of the summed KL penalty -beta sum_t k(rho_t), the KL part of the
reward), ``reward_total`` (sum of all per-token rewards incl. penalties), ``kl`` / ``kl_k3`` (k1 / k3 estimates of
KL(pi_old||pi_ref) summed over tokens, nats per sequence), ``beta`` (after the controller's update), ``entropy`` (mean
per-token entropy of pi_old over the completion tokens, nats), ``policy_loss``, ``value_loss``, ``clip_fraction``
(tokens where the clipped surrogate was active), ``value_clip_fraction``, ``ratio_mean``, ``approx_kl`` (k3 estimate of
KL(pi_old||pi_theta) per token, from samples of pi_old), ``explained_variance`` (1 - Var[R - V_old] / Var[R] over valid
tokens), ``completion_length`` (tokens, EOS included), ``frac_truncated`` (no EOS).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.base import AlgoConfig, Algorithm, Declaration
from prefzoo.algos.online import add_kl_loss
from prefzoo.algos.online_sampling import (bypass_logps, corrected_advantages, drift_metrics, engine_correction,
                                           place_rewards, sample_metrics)
from prefzoo.algos.online_settings import check_adaptive_start, check_range
from prefzoo.errors import ConfigError
from prefzoo.objective import (clipped_surrogate_loss, clipped_value_loss, explained_variance, gae,
                               kl_penalty_rewards, masked_mean, masked_sum, masked_whiten, ratio_statistics)
from prefzoo.types import (NO_STEP, Experience, LossOutput, ObjectiveSettings, PromptBatch, Scorer, StepContext,
                           ValueHeadSpec, ValuePolicy)


@dataclass
class PPOConfig(AlgoConfig):
    name: str = "ppo"
    default_beta: float = 0.05
    num_samples: int = 1  # completions per prompt
    epochs: int = 2  # PPO epochs over each rollout (chosen by measurement: see the module docstring)
    num_minibatches: int = 1  # optimizer steps per epoch
    gae_gamma: float = 1.0  # discount over completion tokens
    gae_lambda: float = 0.95  # GAE lambda
    clip_eps_low: float = 0.2  # epsilon of the clipped surrogate (lower side)
    clip_eps_high: float = 0.2  # upper side (DAPO's clip-higher when larger)
    value_clip_eps: float = 0.2  # clip of the value update around the old values (reward units)
    vf_coef: float = 0.1  # weight of the value loss
    entropy_coef: float = 0.0  # entropy bonus in the reward (see the module docstring)
    whiten_advantages: bool = True
    missing_eos_penalty: Optional[float] = None  # subtracted from r(x, y) when the completion has no EOS
    value_adapter: str = "separate"  # separate | shared (see prefzoo.models.value)


@register
class PPO(Algorithm):
    """PPO plugin: online rollouts, per-token KL penalty, GAE with a value model, clipped updates."""

    config_class = PPOConfig

    @staticmethod
    def validate_settings(cfg: PPOConfig, objective: ObjectiveSettings) -> None:
        check_range(cfg, ("num_samples", "epochs", "num_minibatches"), lambda v: v >= 1, ">= 1")
        check_range(cfg, ("gae_gamma", "gae_lambda"), lambda v: 0 <= v <= 1, "in [0, 1]")
        check_range(cfg, ("clip_eps_low", "clip_eps_high"), lambda v: 0 < v < 1, "in (0, 1), e.g. 0.2")
        check_range(cfg, ("value_clip_eps", "vf_coef", "entropy_coef"), lambda v: v >= 0, ">= 0")
        if cfg.value_adapter not in ("separate", "shared"):
            raise ConfigError(f"algo.value_adapter={cfg.value_adapter!r}; choose separate or shared.")
        check_adaptive_start(objective)

    def declare(self) -> Declaration:
        # the reference is always loaded (with LoRA it is free): the KL is measured even when beta = 0
        return Declaration(reference=True, online=True, reward=True, value_head=ValueHeadSpec(self.cfg.value_adapter),
                           aggregation="token_mean", epochs=self.cfg.epochs, num_minibatches=self.cfg.num_minibatches,
                           num_samples=self.cfg.num_samples, progress_keys=("reward", "kl", "beta", "value_loss"),
                           capabilities=frozenset({"adaptive_beta", "turn_rewards", "sampler_correction"}))

    def loss_mask(self, batch: Experience) -> Tensor:
        return batch.completion_mask

    @torch.no_grad()
    def make_experience(self, policy: ValuePolicy, prompts: PromptBatch, score: Scorer,
                        step: StepContext = NO_STEP) -> tuple[Experience, dict[str, float]]:
        c, o, temperature = self.cfg, self.objective, self.sampling.temperature
        t0 = time.perf_counter()
        samples = policy.sample(prompts, c.num_samples, self.sampling)
        t1 = time.perf_counter()
        scores = score(samples, prompts).float()
        t2 = time.perf_counter()
        mask = samples.completion_mask
        old_logps, entropy, old_values = policy.logps_and_values(samples, temperature, with_entropy=True)
        old_values = old_values.float()
        if self.sampling.correction.bypass:  # the sampler's log-probs are log pi_old (rollout.correction.bypass)
            old_logps = bypass_logps(samples)
        ref_logps = policy.ref_logps(samples, temperature)
        t3 = time.perf_counter()

        # per-token rewards: KL penalty (and entropy bonus) on every token, r(x, y) on the last one
        rewards = scores
        if c.missing_eos_penalty is not None:
            rewards = rewards - c.missing_eos_penalty * samples.truncated.float()
        kl_rewards = torch.zeros_like(old_logps)
        if o.kl_placement == "in_reward":
            kl_rewards = kl_penalty_rewards(old_logps, ref_logps, mask, self.beta, o.kl_estimator)
        bonus = torch.where(mask, -c.entropy_coef * old_logps, torch.zeros_like(old_logps))
        token_rewards = place_rewards(kl_rewards + bonus, rewards, samples)  # step rewards on their turns (env=)

        advantages, returns = gae(token_rewards, old_values, mask, c.gae_gamma, c.gae_lambda)
        if c.whiten_advantages:
            advantages = masked_whiten(advantages, mask, all_reduce=step.all_reduce)  # global stats under DP
        # a sampler's own log-probs (rollout.engine=vllm, rollout.log_mismatch): mismatch metrics, importance weights
        is_weights, engine_metrics = engine_correction(policy, samples, old_logps, self.sampling)
        advantages = corrected_advantages(advantages, is_weights)

        metrics = dict(sample_metrics(samples, scores, t1 - t0), **drift_metrics(old_logps, ref_logps, mask))
        metrics.update({
            "non_score_reward": kl_rewards.sum(-1).mean().item(), "reward_total": token_rewards.sum(-1).mean().item(),
            "entropy": masked_mean(entropy, mask).item(), "values_mean": masked_mean(old_values, mask).item(),
            "explained_variance": explained_variance(old_values, returns, mask),
            "returns_mean": masked_mean(returns, mask).item(), "time/scoring": t2 - t1, "time/old_ref_values": t3 - t2})
        if c.entropy_coef:
            metrics["entropy_bonus"] = bonus.sum(-1).mean().item()
        metrics.update(engine_metrics)
        return Experience.from_samples(samples, rewards=scores, advantages=advantages, loss_mask=mask,
                                       sample_weights=is_weights if self.sampling.correction.weight_kl else None,
                                       old_logps=old_logps, ref_logps=ref_logps, old_values=old_values,
                                       returns=returns), metrics

    def loss(self, policy: ValuePolicy, batch: Experience, step: StepContext = NO_STEP) -> LossOutput:
        c = self.cfg
        mask = batch.completion_mask
        logps, _, values = policy.logps_and_values(batch, self.sampling.temperature)
        policy_loss, policy_clipped = clipped_surrogate_loss(logps, batch.old_logps, batch.advantages, mask,
                                                             c.clip_eps_low, c.clip_eps_high)
        value_loss, value_clipped = clipped_value_loss(values, batch.old_values, batch.returns, mask, c.value_clip_eps)
        per_token = policy_loss + c.vf_coef * value_loss
        tokens = ratio_statistics(logps, batch.old_logps, mask, policy_clipped)
        n = float(mask.sum())
        tokens.update({"policy_loss": (float(masked_sum(policy_loss.detach(), mask)), n),
                       "value_loss": (float(masked_sum(value_loss.detach(), mask)), n),
                       "value_clip_fraction": (float((value_clipped & mask).sum()), n)})
        per_token = add_kl_loss(per_token, logps, batch.ref_logps, mask, self.beta, self.objective, tokens,
                                batch.sample_weights, batch.old_logps)
        return LossOutput(per_token, mask, {}, tokens)

    def after_step(self, metrics: dict[str, float], num_samples: int) -> dict[str, float]:
        """Adapt beta (adaptive controller) to the rollout's KL, k1 in nats per sequence, over its samples."""
        beta_used = self.beta
        self.kl_ctl.update(metrics["kl"], num_samples)
        return {"beta_used": beta_used}

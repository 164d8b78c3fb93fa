"""PPO with a per-token KL penalty: the RLHF recipe of Ziegler et al. 2019 and InstructGPT (Ouyang et al. 2022).

One step (Ziegler et al. 2019, sec. 2.2; Ouyang et al. 2022, sec. 3.5 and eq. 2; Stiennon et al. 2020):

1. Rollout: for each prompt x sample ``num_samples`` completions y ~ pi_old (the current policy).
2. Score: r(x, y) from the reward source (a program, VADER, or a learned reward model).
3. Without gradients: old log-probs log pi_old(y_t), reference log-probs log pi_ref(y_t), old values V_old(s_t)
   (s_t = prompt + y_<t, the state before token t).
4. Per-token rewards over the completion tokens t = 0..L-1 of each row (never on padding):

       r~_t = -beta * k(rho_t) + [t = L-1] * (r(x, y) - missing_eos_penalty * [no EOS])
       rho_t = log pi_old(y_t) - log pi_ref(y_t)

   k is the objective layer's KL estimator (default k1, "in_reward": Ziegler's R(x,y) = r - beta log(pi/rho)
   spread over tokens, whose expected gradient is exactly that of -beta KL(pi||pi_ref); see
   :mod:`prefzoo.objective.kl`). With ``objective.kl_placement=as_loss`` the term moves to the loss instead.
5. GAE(gamma, lambda) over the completion tokens only (:func:`prefzoo.objective.gae`; Schulman et al. 2016):
   advantages A_t and returns R_t = A_t + V_old(s_t); the value of the state after the last token is 0.
   Advantages are whitened over the valid tokens of the whole rollout (:func:`masked_whiten`).
6. ``epochs`` passes over the rollout, each split into ``num_minibatches`` optimizer steps (the loop does the
   passes), minimising per token

       loss_t = -min(ratio_t A_t, clip(ratio_t, 1-eps, 1+eps) A_t) + vf_coef * 0.5 max((V-R)^2, (V_clip-R)^2)

   (Schulman et al. 2017, eq. 7; PPO2 value clipping) averaged over all valid tokens of the mini-batch.
7. beta: fixed, or adapted once per step from the measured KL (k1, summed over tokens, nats per sequence)
   by the controller of Ziegler et al. 2019 (``objective.kl_controller=adaptive objective.kl_target=...``).

Departures and choices:

* Entropy bonus (``entropy_coef``, default 0): added to the per-token REWARD as ``-entropy_coef * log pi_old(y_t)``,
  the k1-style estimate of the entropy, placed like the KL penalty. On-policy its expected policy gradient is
  exactly the gradient of entropy_coef * H(pi) (same argument as k1 "in reward", with a uniform reference), and
  it needs nothing from the policy but log-probs (the policy's entropy output carries no gradient).
* Value model: separate parameters from the policy by default (see :mod:`prefzoo.models.value`), zero-initialised.
* The reference is always available (with LoRA it is free): the KL is measured even when beta = 0.
* Log-probs are recomputed with the sampling temperature, as the sampler drew them.

Metrics (per step): ``score`` (mean r(x, y) from the reward source), ``non_score_reward`` (mean over sequences
of the summed KL penalty -beta sum_t k(rho_t), the KL part of the reward), ``reward_total`` (sum of all
per-token rewards incl. penalties), ``kl`` / ``kl_k3`` (k1 / k3 estimates of KL(pi_old||pi_ref) summed over
tokens, nats per sequence), ``beta`` (after the controller's update), ``entropy`` (mean per-token entropy of
pi_old over the completion tokens, nats), ``policy_loss``, ``value_loss``, ``policy_clip_fraction`` (tokens
where the clipped surrogate was active), ``value_clip_fraction``, ``approx_kl`` (k3 estimate of
KL(pi_old||pi_theta) per token, from samples of pi_old), ``explained_variance`` (1 - Var[R - V_old] / Var[R]
over valid tokens), ``completion_length`` (tokens, EOS included), ``frac_truncated`` (no EOS).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch import Tensor

from prefzoo.algos import register
from prefzoo.algos.base import AlgoConfig, Algorithm, LossOutput, Policy, PromptBatch, SamplingParams, Scorer, SequenceBatch
from prefzoo.objective import (ObjectiveError, clipped_surrogate_loss, clipped_value_loss, gae, kl_estimate, kl_loss,
                               kl_penalty_rewards, masked_mean, masked_sum, masked_var, masked_whiten)


@dataclass
class PPOConfig(AlgoConfig):
    name: str = "ppo"
    num_samples: int = 1  # completions per prompt
    epochs: int = 4  # PPO epochs over each rollout
    num_minibatches: int = 1  # optimizer steps per epoch
    gamma: float = 1.0  # discount over completion tokens
    lam: float = 0.95  # GAE lambda
    clip_range: float = 0.2  # epsilon of the clipped surrogate
    value_clip_range: float = 0.2  # clip of the value update around the old values (reward units)
    vf_coef: float = 0.1  # weight of the value loss
    entropy_coef: float = 0.0  # entropy bonus in the reward (see the module docstring)
    whiten_advantages: bool = True
    missing_eos_penalty: Optional[float] = None  # subtracted from r(x, y) when the completion has no EOS
    value_adapter: str = "separate"  # separate | shared (see prefzoo.models.value)


def add_sequence_reward(token_rewards: Tensor, rewards: Tensor, mask: Tensor) -> Tensor:
    """Put each sequence's reward on its LAST counted completion token.

    ``out[b, t] = token_rewards[b, t] + rewards[b]`` at t = the last position where ``mask[b]`` is True,
    ``token_rewards[b, t]`` elsewhere. Works for any mask (right padding is the usual layout); a row with no
    counted token gets nothing (its reward has no token to land on).

    Shape: token_rewards (B, T) float, rewards (B,), mask (B, T) bool -> (B, T) in token_rewards' dtype;
    B = sequences, T = completion token positions.
    Units: reward units.

    Raises:
        ObjectiveError: shapes disagree, or mask is not bool.

    Source: Ziegler et al. 2019, sec. 2.2 (the reward r(x, y) of the whole completion, the KL penalty per
    token); Ouyang et al. 2022, eq. 2.
    """
    if token_rewards.dim() != 2 or mask.shape != token_rewards.shape or rewards.shape != token_rewards.shape[:1]:
        raise ObjectiveError(f"add_sequence_reward: token_rewards {tuple(token_rewards.shape)} must be (B, T), "
                             f"mask {tuple(mask.shape)} (B, T) and rewards {tuple(rewards.shape)} (B,)")
    if mask.dtype != torch.bool:
        raise ObjectiveError(f"add_sequence_reward: mask must be bool (True = counts), got {mask.dtype}")
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, positions, -1).amax(dim=-1)
    rows = (last >= 0).nonzero()[:, 0]
    out = token_rewards.clone()
    out[rows, last[rows]] += rewards[rows].to(out.dtype)
    return out


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var[returns - values] / Var[returns] over the True positions (nan when Var[returns] = 0).

    1 is a perfect value function, 0 one no better than a constant, < 0 worse.
    """
    var_returns = float(masked_var(returns, mask))
    if var_returns == 0:
        return float("nan")
    return 1.0 - float(masked_var(returns - values, mask)) / var_returns


@dataclass
class PPOExperience(SequenceBatch):
    """A scored rollout with what the loss needs. B = prompts x num_samples, C = completion length.

    Attributes:
        old_logps: Shape (B, C) float32, log pi_old of each completion token at sampling time.
        ref_logps: Shape (B, C) float32, log pi_ref.
        old_values: Shape (B, C) float32, V_old of the state before each token.
        advantages: Shape (B, C), GAE advantages (whitened over valid tokens if asked), 0 on padding.
        returns: Shape (B, C), value targets A + V_old, 0 on padding.
        temperature: the sampling temperature (log-probs in the loss are recomputed with it).
    """

    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None
    old_values: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None
    temperature: float = 1.0

    def num_tokens(self) -> int:
        return int(self.prompt_mask.sum() + self.completion_mask.sum())


@register
class PPO(Algorithm):
    """PPO plugin: online rollouts, per-token KL penalty, GAE with a value model, clipped updates."""

    name = "ppo"
    config_class = PPOConfig
    default_beta: ClassVar[float] = 0.05
    default_kl_estimator: ClassVar[str] = "k1"
    default_kl_placement: ClassVar[str] = "in_reward"
    online = True
    needs_value_head = True
    aggregation = "token_mean"
    progress_keys = ("score", "kl", "beta", "value_loss")

    @staticmethod
    def validate_config(cfg) -> None:
        from prefzoo.errors import ConfigError

        a = cfg.algo
        for key in ("num_samples", "epochs", "num_minibatches"):
            if getattr(a, key) < 1:
                raise ConfigError(f"algo.{key}={getattr(a, key)} must be >= 1.")
        for key in ("gamma", "lam"):
            if not 0 <= getattr(a, key) <= 1:
                raise ConfigError(f"algo.{key}={getattr(a, key)} must be in [0, 1].")
        if not 0 < a.clip_range < 1:
            raise ConfigError(f"algo.clip_range={a.clip_range} must be in (0, 1), e.g. 0.2.")
        for key in ("value_clip_range", "vf_coef", "entropy_coef"):
            if getattr(a, key) < 0:
                raise ConfigError(f"algo.{key}={getattr(a, key)} must be >= 0.")
        if a.value_adapter not in ("separate", "shared"):
            raise ConfigError(f"algo.value_adapter={a.value_adapter!r}; choose separate or shared.")
        if a.num_minibatches > cfg.trainer.batch_size * a.num_samples:
            raise ConfigError(f"algo.num_minibatches={a.num_minibatches} exceeds the rollout's "
                              f"{cfg.trainer.batch_size * a.num_samples} rows (trainer.batch_size x algo.num_samples).")
        if cfg.objective.kl_controller == "adaptive" and not (cfg.objective.beta is None or cfg.objective.beta > 0):
            raise ConfigError("the adaptive KL controller needs a starting objective.beta > 0.")

    @property
    def needs_reference(self) -> bool:
        return True

    def loss_mask(self, batch: PPOExperience) -> Tensor:
        return batch.completion_mask

    @torch.no_grad()
    def make_experience(self, policy: Policy, prompts: PromptBatch, score: Scorer, sampling: SamplingParams
                        ) -> tuple[PPOExperience, dict[str, float]]:
        c, o = self.cfg, self.objective
        t0 = time.perf_counter()
        samples = policy.sample(prompts, c.num_samples, sampling)
        t1 = time.perf_counter()
        scores = score(samples, prompts).float()
        t2 = time.perf_counter()
        mask = samples.completion_mask
        old_logps, entropy = policy.logps(samples, sampling.temperature, with_entropy=True)
        ref_logps = policy.ref_logps(samples, sampling.temperature)
        old_values = policy.values(samples).float()
        t3 = time.perf_counter()

        # per-token rewards: KL penalty (and entropy bonus) on every token, r(x, y) on the last one
        rewards = scores
        if c.missing_eos_penalty is not None:
            rewards = rewards - c.missing_eos_penalty * samples.truncated.float()
        kl_rewards = torch.zeros_like(old_logps)
        if o.kl_placement == "in_reward":
            kl_rewards = kl_penalty_rewards(old_logps, ref_logps, mask, self.beta, o.kl_estimator)
        bonus = torch.where(mask, -c.entropy_coef * old_logps, torch.zeros_like(old_logps))
        token_rewards = add_sequence_reward(kl_rewards + bonus, rewards, mask)

        advantages, returns = gae(token_rewards, old_values, mask, c.gamma, c.lam)
        if c.whiten_advantages:
            advantages = masked_whiten(advantages, mask, all_reduce=self.all_reduce)  # global stats under DP

        log_ratio = (old_logps - ref_logps).masked_fill(~mask, 0.0)
        lengths = mask.sum(-1).float()
        metrics = {
            "score": scores.mean().item(), "score_std": scores.std().item() if len(scores) > 1 else 0.0,
            "non_score_reward": kl_rewards.sum(-1).mean().item(),
            "reward_total": token_rewards.sum(-1).mean().item(),
            "kl": masked_sum(kl_estimate(log_ratio, "k1"), mask, dim=-1).mean().item(),
            "kl_k3": masked_sum(kl_estimate(log_ratio, "k3"), mask, dim=-1).mean().item(),
            "entropy": masked_mean(entropy, mask).item(),
            "explained_variance": explained_variance(old_values, returns, mask),
            "values_mean": masked_mean(old_values, mask).item(), "returns_mean": masked_mean(returns, mask).item(),
            "completion_length": lengths.mean().item(), "frac_truncated": samples.truncated.float().mean().item(),
            "generated_tokens_per_second": int(mask.sum()) / max(t1 - t0, 1e-9),
            "time/generation": t1 - t0, "time/scoring": t2 - t1, "time/old_ref_values": t3 - t2,
        }
        if c.entropy_coef:
            metrics["entropy_bonus"] = bonus.sum(-1).mean().item()
        exp = PPOExperience(**{f: getattr(samples, f) for f in ("prompt_ids", "prompt_mask", "completion_ids",
                                                                 "completion_mask", "prompt_index", "truncated")},
                            old_logps=old_logps, ref_logps=ref_logps, old_values=old_values, advantages=advantages,
                            returns=returns, temperature=sampling.temperature)
        return exp, metrics

    def loss(self, policy: Policy, batch: PPOExperience) -> LossOutput:
        c, o = self.cfg, self.objective
        mask = batch.completion_mask
        logps, _ = policy.logps(batch, batch.temperature)
        values = policy.values(batch)
        policy_loss, policy_clipped = clipped_surrogate_loss(logps, batch.old_logps, batch.advantages, mask,
                                                             c.clip_range)
        value_loss, value_clipped = clipped_value_loss(values, batch.old_values, batch.returns, mask,
                                                       c.value_clip_range)
        per_token = policy_loss + c.vf_coef * value_loss
        metrics: dict[str, float] = {}
        if o.kl_placement == "as_loss" and self.beta > 0:
            kl_tokens = kl_loss(logps, batch.ref_logps, mask, o.kl_estimator)
            per_token = per_token + self.beta * kl_tokens
            metrics["kl_loss"] = masked_mean(kl_tokens.detach(), mask).item()
        with torch.no_grad():
            log_ratio = (logps - batch.old_logps).detach()
            metrics.update({
                "policy_loss": masked_mean(policy_loss.detach(), mask).item(),
                "value_loss": masked_mean(value_loss.detach(), mask).item(),
                "policy_clip_fraction": masked_mean(policy_clipped.float(), mask).item(),
                "value_clip_fraction": masked_mean(value_clipped.float(), mask).item(),
                "approx_kl": masked_mean(kl_estimate(-log_ratio, "k3"), mask).item(),
                "ratio_mean": masked_mean(log_ratio.exp(), mask).item(),
            })
        return LossOutput(per_token, mask, metrics)

    def after_step(self, metrics: dict[str, float], num_samples: int) -> dict[str, float]:
        """Adapt beta (adaptive controller) to the rollout's KL, k1 in nats per sequence, over its samples."""
        beta_used = self.beta
        self.kl_ctl.update(metrics["kl"], num_samples)
        return {"beta_used": beta_used}

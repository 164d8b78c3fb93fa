"""Advantages: group-relative (GRPO family) and generalised advantage estimation (PPO).

- :func:`group_advantages`: one scalar per sampled completion, computed from the rewards of the
  other completions of the same prompt (no value function).
- :func:`leave_one_out_advantages`: RLOO's, each reward minus the mean of the OTHER completions of its prompt.
- :func:`gae`: per-token advantages and returns from per-token rewards and a value head,
  over the completion tokens only.
"""

from __future__ import annotations

from typing import Callable

import torch

from .logprobs import last_token_index
from .errors import (
    ObjectiveError,
    check_choice,
    check_mask,
    check_ndim,
    check_number,
    check_same_shape,
)

__all__ = ["ADVANTAGE_SCALES", "group_advantages", "equal_reward_groups", "leave_one_out_advantages", "gae", "add_sequence_reward"]

ADVANTAGE_SCALES = ("group", "batch", "none", "mean")

# Rewards of one group that differ by no more than this many units in the last place (of float32,
# or of the input dtype if finer, relative to the group's largest magnitude) are treated as
# equal: such differences are rounding noise, and dividing them by an equally tiny std would
# blow them up to O(1). (bf16/fp16 rewards are judged at float32 resolution, so that distinct
# low-precision values are never merged.)
_EQUAL_ULPS = 8


def equal_reward_groups(rewards: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Which groups of ``num_samples`` consecutive rewards are all equal up to rounding: their spread (max - min) is at
    most ``_EQUAL_ULPS`` units in the last place of the group's largest magnitude (float32's, or the input dtype's if
    finer). Such a group has no signal: :func:`group_advantages` gives it all-zero advantages, and dynamic sampling
    (:func:`prefzoo.algos.online_sampling.informative_groups`) drops it: one definition for both.

    Shape: ``rewards`` (B,), B a multiple of ``num_samples``, rows [i*G, (i+1)*G) one prompt's group; returns (B / G,)
    bool. Units: the rewards' own (the rule is relative to the group's largest magnitude).

    Raises:
        RuntimeError: B not a multiple of ``num_samples`` (:func:`group_advantages` checks its arguments first).

    Source: DAPO (Yu et al. 2025), sec. 3.2, keeps groups whose rewards are not all equal (exactly); here equal up to
    rounding, the rule :func:`group_advantages` has always used for its zero advantages.
    """
    r = rewards.detach().double().view(-1, num_samples)
    magnitude = r.abs().amax(dim=1)
    spread = r.amax(dim=1) - r.amin(dim=1)
    resolution = torch.finfo(torch.promote_types(rewards.dtype, torch.float32)).eps
    return spread <= _EQUAL_ULPS * resolution * magnitude


def _check_group_rewards(rewards: torch.Tensor, num_samples: int, scale: str, eps: float) -> float:
    """:func:`group_advantages`'s argument checks (its Raises); returns ``eps`` as a float."""
    check_ndim("rewards", rewards, 1, "(B,) — one reward per completion")
    if not rewards.is_floating_point():
        raise ObjectiveError(f"rewards must be floating point, got {rewards.dtype}; use .float()")
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise ObjectiveError(f"num_samples must be a positive int, got {num_samples!r}")
    check_choice("scale", scale, ADVANTAGE_SCALES)
    eps = check_number("eps", eps, low=0.0)
    if rewards.shape[0] % num_samples != 0:
        raise ObjectiveError(
            f"the batch has {rewards.shape[0]} rewards, which is not a multiple of num_samples={num_samples}; "
            "rewards must hold num_prompts * num_samples entries, grouped consecutively"
        )
    if not bool(torch.isfinite(rewards).all()):
        raise ObjectiveError("rewards contain NaN or inf; check the reward function")
    return eps


def group_advantages(rewards: torch.Tensor, num_samples: int, scale: str,
                     eps: float,
                     all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Group-relative advantages: each reward minus the mean of its prompt's group, scaled.

    ``rewards`` holds ``num_prompts * num_samples`` sequence rewards; consecutive blocks of
    ``num_samples`` belong to one prompt. With mean_g and std_g the group's mean and UNBIASED
    sample standard deviation (Bessel's correction, torch's default; the paper writes std(r)
    without saying which):

        scale="group":  A = (r - mean_g) / (std_g + eps)      (GRPO)
        scale="batch":  A = (r - mean_g) / (std_B + eps)      std_B: unbiased std of all rewards
        scale="none":   A = r - mean_g                        (Dr. GRPO)
        scale="mean":   A = (r - mean_g) / (mean_g + eps)     (MaxRL); 0 for a group with mean_g <= 0

    MaxRL: for rewards r >= 0, E[(r - mean) grad log pi] / mean = grad E[r] / E[r] = grad log E[r] (to the baseline's
    (G-1)/G factor): the update follows the log of the expected reward (for a 0/1 reward, the log pass rate: the
    maximum-likelihood objective of the correct answer), so the prompts a policy rarely solves weigh more. A group
    whose mean is <= 0 gets advantage 0: for 0/1 rewards it is all wrong (no signal), and a negative mean would flip
    the advantages' signs (prime-rl sets them to 0 likewise; SkyRL divides by mean + 1e-6 whatever its sign). The
    authors' code divides by mean + 1e-6 (eps enters the denominator as here); prefzoo's plugins pass that eps for
    MaxRL and 1e-4 for a std (:data:`prefzoo.algos.online_settings.ADVANTAGE_EPS`): this function takes eps as given.

    Robustness: the centring is done in float64, and a group whose rewards differ by at most
    8 ulps (of float32, or of float64 for float64 rewards; relative to the group's largest
    magnitude) is treated as constant,
    so a group of equal rewards gets advantages that are exactly 0 for any eps (e.g. eight
    float32 rewards of 0.35, whose float32 std is ~3e-8, give exact zeros). A group of one has
    no std and gets advantage 0; ``std_B`` of a batch of one is taken as 0.

    Data parallelism: groups never straddle processes (each process holds whole groups), so
    mean_g and std_g are local and exact. Only ``std_B`` is a batch statistic: ``all_reduce`` (a
    callable returning the element-wise SUM of a tensor over all processes, as in
    :func:`masked_whiten`) is then called exactly twice, only for scale="batch", by every process:
    on float64 ``[sum of rewards, count]`` (shape (2,)), then on float64 ``[sum of squared
    deviations from the global mean]`` (shape (1,)); std_B is then the unbiased std of the
    global batch. Default None: one process (torch's ``std`` of the local batch).

    Shape: rewards (B,) -> (B,) in rewards' (floating) dtype; B = num_prompts * num_samples
    sampled completions. Broadcast over the completion tokens by the caller.
    Units: rewards' units for "none"; standard deviations (dimensionless) otherwise.

    Raises:
        ObjectiveError: rewards not 1-D or not floating point; rewards with NaN/inf (a host
            sync); num_samples not a positive int; B not divisible by num_samples; unknown scale
            (lists ADVANTAGE_SCALES); eps < 0.

    Source: Shao et al. 2024, "DeepSeekMath", sec. 4.1.2 (outcome supervision: the normalised
    reward is the advantage of every token), used in the GRPO objective eq. 3; Liu et al. 2025,
    "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO: no std division);
    Tajwar et al. 2026, "Maximum Likelihood Reinforcement Learning" (MaxRL) for scale="mean", as the authors' code,
    prime-rl and SkyRL ship it.
    """
    eps = _check_group_rewards(rewards, num_samples, scale, eps)
    r = rewards.detach().double().view(-1, num_samples)
    centred = r - r.mean(dim=1, keepdim=True)
    centred = torch.where(equal_reward_groups(rewards, num_samples)[:, None], torch.zeros_like(centred), centred)

    if scale == "group":
        std = r.std(dim=1, keepdim=True) if num_samples > 1 else torch.zeros_like(r[:, :1])
        advantages = _scaled(centred, std + eps)
    elif scale == "batch":
        if all_reduce is None:
            std = r.std() if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
        else:
            std = _global_std(r.reshape(-1), all_reduce)
        advantages = _scaled(centred, std + eps)
    elif scale == "mean":
        mean = r.mean(dim=1, keepdim=True)
        advantages = torch.where(mean > 0, _scaled(centred, mean + eps), torch.zeros_like(centred))
    else:
        advantages = centred
    return advantages.reshape(-1).to(rewards.dtype)


def leave_one_out_advantages(rewards: torch.Tensor, num_samples: int) -> torch.Tensor:
    """RLOO advantages: each reward minus the mean reward of the OTHER completions of its prompt.

    With G = ``num_samples`` consecutive rewards per prompt,

        A_i = r_i - b_i,   b_i = 1/(G-1) sum_{j != i} r_j   =  G/(G-1) (r_i - mean_g)

    (since sum_{j != i} r_j = G mean_g - r_i). b_i does not depend on y_i, so E[A_i grad log pi(y_i)] =
    grad E[r] exactly: unlike GRPO's r_i - mean_g, whose mean contains r_i and shrinks the gradient by
    (G-1)/G. Computed as ``group_advantages(rewards, G, "none", 0)`` times G/(G-1) (in float64), so it
    inherits its robustness: a group whose rewards differ by at most 8 ulps (of the rewards' dtype) is constant
    and gets exact zeros. No division by a standard deviation (Ahmadian et al. 2024 use the raw difference).

    Data parallelism: groups never straddle processes, so the baseline is local and exact (no all-reduce).

    Shape: rewards (B,) floating -> (B,) in rewards' dtype; B = num_prompts * G sampled completions,
    grouped consecutively. Broadcast over the completion tokens by the caller.
    Units: reward units.

    Raises:
        ObjectiveError: rewards not 1-D floating point, or with NaN/inf; num_samples not an int >= 2 (one
            sample has no other member to be its baseline); B not a multiple of num_samples.

    Source: Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!" (the leave-one-out baseline
    b_i = 1/(k-1) sum_{j != i} R(y_j)); Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs" (RLOO).
    """
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 2:
        raise ObjectiveError(f"num_samples must be an int of at least 2 for a leave-one-out baseline, got "
                             f"{num_samples!r}; sample G >= 2 completions per prompt")
    check_ndim("rewards", rewards, 1, "(B,) — one reward per completion")
    if not rewards.is_floating_point():
        raise ObjectiveError(f"rewards must be floating point, got {rewards.dtype}; use .float()")
    centred = group_advantages(rewards.detach(), num_samples, "none", 0.0).double()
    return (centred * (num_samples / (num_samples - 1))).to(rewards.dtype)


def _scaled(centred: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """centred / scale, with an exactly-0 advantage wherever centred is 0 (also when scale is 0: eps = 0 and a
    constant group, where 0 / 0 would be NaN)."""
    return torch.where(centred == 0, torch.zeros_like(centred), centred / torch.where(scale == 0, 1.0, scale))


def _global_std(values: torch.Tensor, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Unbiased std of ``values`` (1-D float64) concatenated over all processes (two-pass, float64); 0 for
    a global batch of one."""
    first = all_reduce(torch.stack([values.sum(), torch.tensor(float(values.numel()), dtype=values.dtype,
                                                                      device=values.device)]))
    count = float(first[1])
    mean = first[0] / max(count, 1.0)
    second = all_reduce(((values - mean) ** 2).sum().reshape(1))
    if count < 2:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return torch.sqrt(second[0] / (count - 1))


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
        gae_gamma: float, gae_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the completion tokens of each row.

    Only positions where ``mask`` is True are time steps. Walking backwards over each row,
    with V_next the value at the NEXT VALID position of the same row (0 after the last one:
    the episode ends there),

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next          (A_next = 0 after the last)
        R_t     = A_t + V_t                               (the value target, "returns")

    Masked positions neither receive nor pass on anything (their rewards/values may be any
    finite or non-finite garbage) and are exactly 0 in both outputs. Correct for any mask
    (right padding is the usual layout, but holes are skipped too). Outputs are detached.

    Shape: token_rewards (B, T), values (B, T), mask (B, T) bool -> (advantages (B, T),
    returns (B, T)); B = sequences, T = completion token positions.
    Units: reward units.

    Raises:
        ObjectiveError: shapes differ or not 2-D; mask not bool; gae_gamma or gae_lambda outside [0, 1].

    Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation", eqs. 11-16 (delta_t^V and A^GAE(gamma, lambda) = sum_l
    (gamma lambda)^l delta_{t+l}).
    """
    check_ndim("token_rewards", token_rewards, 2, "(B, T)")
    check_same_shape("token_rewards", token_rewards, "values", values)
    check_mask(mask, token_rewards, "token_rewards")
    gamma = check_number("gae_gamma", gae_gamma, low=0.0, high=1.0)
    lam = check_number("gae_lambda", gae_lambda, low=0.0, high=1.0)

    with torch.no_grad():
        dtype = torch.promote_types(token_rewards.dtype, values.dtype)
        rewards_, values_ = token_rewards.to(dtype), values.to(dtype)
        batch, length = rewards_.shape
        zero = torch.zeros(batch, dtype=dtype, device=rewards_.device)
        next_value, next_adv = zero, zero
        advantages = torch.zeros_like(rewards_)
        for t in reversed(range(length)):
            valid = mask[:, t]
            delta = rewards_[:, t] + gamma * next_value - values_[:, t]
            adv_t = delta + gamma * lam * next_adv
            advantages[:, t] = torch.where(valid, adv_t, zero)
            next_value = torch.where(valid, values_[:, t], next_value)
            next_adv = torch.where(valid, adv_t, next_adv)
        returns = torch.where(mask, advantages + values_, torch.zeros_like(advantages))
    return advantages, returns


def add_sequence_reward(token_rewards: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence's reward on its LAST counted completion token (:func:`last_token_index`).

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
    last = last_token_index(mask)
    rows = (last >= 0).nonzero()[:, 0]
    out = token_rewards.clone()
    out[rows, last[rows]] += rewards[rows].to(out.dtype)
    return out

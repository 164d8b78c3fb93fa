"""Reward functions: ``fn(prompts, completions, **columns) -> list[float]``, one float per completion.

Built-in: ``"correctness"`` and ``"format"`` (arithmetic, :mod:`prefzoo.rewards.arithmetic`),
``"sentiment"`` (VADER) and ``"fluent_sentiment"`` (VADER times distinct-2, :mod:`prefzoo.rewards.sentiment`), ``"reasoning_gym"`` (the reasoning-gym
task's own verifier, :mod:`prefzoo.rewards.reasoning_gym`). :func:`make_reward` combines names, import
paths ``"package.module:function"`` and callables into one checked, weighted :class:`CombinedReward`
(:mod:`prefzoo.rewards.registry`).
"""

from prefzoo.rewards.arithmetic import correctness, extract_final_number, format_reward
from prefzoo.rewards.registry import (
    BUILTIN_REWARDS,
    CombinedReward,
    RewardFn,
    check_reward_signature,
    make_reward,
    resolve_reward,
    reward_name,
)
from prefzoo.rewards.sentiment import fluent_sentiment, sentiment

__all__ = [
    "BUILTIN_REWARDS",
    "CombinedReward",
    "RewardFn",
    "check_reward_signature",
    "correctness",
    "extract_final_number",
    "fluent_sentiment",
    "format_reward",
    "make_reward",
    "resolve_reward",
    "reward_name",
    "sentiment",
]

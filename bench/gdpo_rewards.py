"""A reward on another scale than the task's, for the GDPO comparison (docs/algorithms.md, "several rewards").

    python train.py +recipe=algo_compare algo=grpo trainer.max_steps=20 eval.before=false \
        'reward.functions=[correctness,bench.gdpo_rewards:format_x10]' [reward.aggregation=gdpo algo.scale_rewards=batch]

``format_x10`` is :func:`prefzoo.rewards.arithmetic.format_reward` times 10 (values 0, 5, 10): the same preference
as the built-in ``format`` reward, in other units, as a reward in tokens or characters would be. Summed with
``correctness`` (0 or 1) before the group normalisation (``reward.aggregation=sum``), its spread sets the sign of
most advantages; GDPO (``reward.aggregation=gdpo``) normalises each reward within its group first, so the units
cancel and both count alike.
"""

from __future__ import annotations

from prefzoo.rewards.arithmetic import format_reward


def format_x10(prompts, completions, **columns):
    """10 x ``format_reward`` per completion (0, 5 or 10). Length B."""
    return [10.0 * s for s in format_reward(prompts, completions, **columns)]


def period_x10(prompts, completions, **_):
    """10 if the completion, trailing whitespace stripped, ends with a full stop, else 0. Length B.

    A second reward that does not fight the task's: "65 + 92 = 157." and "157." both earn it, right or wrong, so a
    policy can have both; what it measures is whether the sum's units let it crowd the correctness signal out."""
    return [10.0 if c.rstrip().endswith(".") else 0.0 for c in completions]

"""Reward functions for the registry tests, loaded by import path ("tests.rewards.helpers:const_one")."""

NOT_CALLABLE = 42


def const_one(prompts, completions, **_):
    return [1.0] * len(completions)


def length_reward(prompts, completions, **_):
    return [float(len(c)) for c in completions]

"""Reward functions for the registry tests, loaded by import path ("tests.rewards.helpers:const_one")."""

NOT_CALLABLE = 42


def const_one(prompts, completions, **_):
    return [1.0] * len(completions)


def length_reward(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def one_argument(completions):
    """Wrong: a reward function is called as fn(prompts, completions, **columns)."""
    return [0.0] * len(completions)


def no_columns(prompts, completions):
    """Takes no columns: fine for a task without columns, a TypeError for one with an 'answer' column."""
    return [0.0] * len(completions)


def needs_subject(prompts, completions, subject, **_):
    """Needs a 'subject' column (the sentiment task has one, arithmetic has not)."""
    return [0.0] * len(completions)

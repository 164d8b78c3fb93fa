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


# TRL's reward functions, written from TRL's documented signatures (GRPOTrainer, "Using a custom reward function"):
# called with keywords (prompts=, completions=, completion_ids=, every dataset column), **kwargs taking the rest.
def reward_len(completions, **kwargs):
    """TRL's example 1: reward completions close to 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """TRL's format example (standard format): 1.0 for '<think>...</think><answer>...</answer>', else 0.0."""
    import re

    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    return [1.0 if re.match(pattern, content) else 0.0 for content in completions]


def conversational_format_reward(completions, **kwargs):
    """TRL's format example for conversational data: each completion is a list of messages."""
    import re

    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, content) else 0.0 for content in contents]


def reward_with_ground_truth(completions, answer, **kwargs):
    """TRL's 'reference' example with a dataset column as a keyword: 1.0 where the completion holds the answer."""
    return [1.0 if str(a) in c else 0.0 for c, a in zip(completions, answer)]


def only_even_answers(completions, answer, **kwargs):
    """Returns None (not applicable, as TRL allows) for samples whose answer is odd, else 1.0."""
    return [None if int(a) % 2 else 1.0 for a in answer]


def seen(prompts, completions, completion_ids, **kwargs):
    """Records what it was given (keywords: TRL's required names, so it is called the keyword way)."""
    seen.calls.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **kwargs})
    return [0.0] * len(completions)


seen.calls = []


# reward functions that break the protocol in each way a user's may (hardening round 3, item 7)
def raises(prompts, completions, **_):
    raise KeyError("score")


def returns_nan(prompts, completions, **_):
    return [float("nan")] * len(completions)


def wrong_length(prompts, completions, **_):
    return [1.0]


def returns_strings(prompts, completions, **_):
    return ["1.0"] * len(completions)


def returns_a_scalar(prompts, completions, **_):
    return 1.0

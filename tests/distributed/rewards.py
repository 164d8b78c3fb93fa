"""A reward for runs of the untrained tiny model, whose random completions never solve a sum: it must vary
between the samples of a prompt, or every GRPO advantage (and gradient) is zero."""


def length(prompts: list[str], completions: list[str], **_) -> list[float]:
    """Characters of the completion / 10."""
    return [len(c) / 10 for c in completions]

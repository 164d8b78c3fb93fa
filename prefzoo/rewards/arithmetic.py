"""Verifiable rewards for arithmetic answers: correctness of the final number, and answer format.

Both follow the rule-based rewards of DeepSeek-R1 (2025, Sec. 2.2.2): an accuracy reward that checks
the final answer, and a format reward that checks the answer is stated where the prompt asked.
A reward function takes ``(prompts, completions, **columns)`` (lists aligned by sample) and returns
one float per completion; see :mod:`prefzoo.rewards.registry`.
"""

from __future__ import annotations

from numbers import Real
from typing import Any

from prefzoo.data.tasks import PLAIN_INSTRUCTION, WORD_PROBLEM_INSTRUCTION
from prefzoo.errors import RewardError
from prefzoo.text import NUMBER_PATTERN, extract_final_number

__all__ = ["NUMBER_PATTERN", "FORMAT_MAX_TRAILING_CHARS", "extract_final_number", "correctness", "format_reward"]

#: The most characters ``format_reward`` allows after the final number for it to count as "at the end"
#: (e.g. "." or "**" or "}$."); they must not be letters or digits.
FORMAT_MAX_TRAILING_CHARS = 3


def _as_answer(value: Any, index: int) -> int | float:
    if isinstance(value, Real) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        parsed = extract_final_number(value)
        if parsed is not None and NUMBER_PATTERN.fullmatch(value.strip()):
            return parsed
    raise RewardError(
        f"correctness: answer[{index}] is {value!r}, not a number; the 'answer' column must hold the "
        f"exact numeric answer (int, float or a numeric string such as '78')."
    )


def correctness(prompts: list[str], completions: list[str], answer: list[Any], **_: Any) -> list[float]:
    """1.0 where the completion's final number equals the answer, else 0.0.

    The final number is :func:`extract_final_number` of the completion; equality is exact numeric
    equality (so "78.0" matches 78). A completion without a number scores 0.0.

    Args:
        prompts: the prompt texts (unused). Length B.
        completions: the generated texts. Length B.
        answer: the exact answers (int, float or numeric string). Length B.

    Returns:
        B floats in {0.0, 1.0}.

    Raises:
        RewardError: ``answer`` is not aligned with ``completions``, or an answer is not a number.
    """
    if len(answer) != len(completions):
        raise RewardError(
            f"correctness: got {len(completions)} completions but {len(answer)} answers; pass the "
            f"'answer' column aligned with the completions (one per sample, repeated for grouped samples)."
        )
    scores = []
    for i, (completion, target) in enumerate(zip(completions, answer)):
        found = extract_final_number(completion)
        scores.append(1.0 if found is not None and found == _as_answer(target, i) else 0.0)
    return scores


def _format_score(prompt: str, completion: str) -> float:
    text = completion.strip()
    matches = list(NUMBER_PATTERN.finditer(text))
    if not matches:
        return 0.0
    last = matches[-1]
    tail = text[last.end():]
    at_end = len(tail) <= FORMAT_MAX_TRAILING_CHARS and not any(c.isalnum() for c in tail)
    if PLAIN_INSTRUCTION in prompt and WORD_PROBLEM_INSTRUCTION not in prompt:
        head = text[: last.start()]
        only_number = len(matches) == 1 and len(head) <= FORMAT_MAX_TRAILING_CHARS and not any(
            c.isalnum() for c in head
        )
        return 1.0 if at_end and only_number else 0.5
    return 1.0 if at_end else 0.5


def format_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """How well each completion states its answer in the form the prompt asked for.

    Rule, applied to the completion with surrounding whitespace stripped; "at most 3" below is
    :data:`FORMAT_MAX_TRAILING_CHARS`, and those characters may not be letters or digits:

    - 0.0: the completion contains no number.
    - Prompt containing :data:`~prefzoo.data.tasks.PLAIN_INSTRUCTION` ("Reply with just the number."):
      1.0 if the completion is just one number, with at most 3 non-alphanumeric characters before
      and after it ("78", "78.", "**78**", "-1,234"); otherwise 0.5 ("The answer is 78.").
    - Any other prompt (in particular :data:`~prefzoo.data.tasks.WORD_PROBLEM_INSTRUCTION`, "Give the
      final answer as a number at the end."): 1.0 if the completion ends with a number, i.e. at most 3
      non-alphanumeric characters follow its last number ("... so the answer is 78.", "#### 78",
      "\\boxed{78}"); otherwise 0.5 ("78 apples are left.").

    The rule checks form only: a wrong number in the right place scores 1.0 (use ``correctness``
    for the value). Numbers are read with :data:`prefzoo.text.NUMBER_PATTERN`.

    Args:
        prompts: the prompt texts (the raw or chat-templated text). Length B.
        completions: the generated texts. Length B.

    Returns:
        B floats in {0.0, 0.5, 1.0}.

    Raises:
        RewardError: ``prompts`` and ``completions`` differ in length.
    """
    if len(prompts) != len(completions):
        raise RewardError(
            f"format: got {len(prompts)} prompts but {len(completions)} completions; pass one prompt per "
            f"completion (repeat a prompt for each of its samples)."
        )
    return [_format_score(p, c) for p, c in zip(prompts, completions)]

"""Arithmetic rewards: final-number extraction, correctness, format.

Expected values are written out by reading each string by hand.
"""

import pytest

from prefzoo.data.tasks import PLAIN_INSTRUCTION, WORD_PROBLEM_INSTRUCTION
from prefzoo.errors import RewardError
from prefzoo.rewards.arithmetic import correctness, extract_final_number, format_reward

PLAIN_PROMPT = f"What is 2 + 2? {PLAIN_INSTRUCTION}"
WORD_PROMPT = f"Tom has 23 apples and buys 45 more. How many apples does Tom have now? {WORD_PROBLEM_INSTRUCTION}"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("68", 68),
        ("The answer is 68.", 68),  # trailing period is not a decimal point
        ("23 + 45 = 68", 68),  # last number, not the first
        ("= 78", 78),
        ("1,234", 1234),  # thousands separator
        ("It costs 1,234,567 dollars.", 1234567),
        ("1,234.5", 1234.5),
        ("-5", -5),
        ("x = -12.", -12),
        ("(-4)", -4),
        ("\u22127", -7),  # Unicode minus sign
        ("10-3", 3),  # a hyphen between digits is not a sign
        ("f(3)-2", 2),  # nor after a closing parenthesis
        ("2.5", 2.5),
        ("3 apples and 4 pears", 4),
        ("1,2,3", 3),  # a list, not a grouped number
        ("1,2345", 2345),  # incomplete thousands group: two numbers
        ("12345", 12345),
        ("Tom has 68 apples now", 68),
        ("no number here", None),
        ("", None),
    ],
)
def test_extract_final_number(text, expected):
    assert extract_final_number(text) == expected


def test_extract_final_number_types():
    assert type(extract_final_number("answer: 68")) is int
    assert type(extract_final_number("answer: 6.5")) is float


def test_correctness_hand_examples():
    completions = ["68", "The answer is 68.", "67", "no idea", "68.0", "68, no wait, 69", "I got 1,068"]
    expected = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert correctness([""] * 7, completions, answer=[68] * 7) == expected


def test_correctness_per_sample_answers_and_numeric_strings():
    completions = ["= 12", "= 12", "result: -3"]
    assert correctness([""] * 3, completions, answer=[12, "13", "-3"]) == [1.0, 0.0, 1.0]


def test_correctness_misaligned_answer_raises():
    with pytest.raises(RewardError, match="correctness.*2 completions but 1 answers"):
        correctness(["", ""], ["1", "2"], answer=[1])


def test_correctness_non_numeric_answer_raises():
    with pytest.raises(RewardError, match=r"answer\[1\]"):
        correctness(["", ""], ["1", "2"], answer=[1, "two"])


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("4", 1.0),
        ("  4.\n", 1.0),
        ("**4**", 1.0),
        ("-1,234", 1.0),
        ("The answer is 4.", 0.5),  # number at the end, but not just the number
        ("4 apples", 0.5),
        ("2 + 2 = 4", 0.5),  # more than one number
        ("four", 0.0),
        ("", 0.0),
    ],
)
def test_format_plain_instruction_wants_just_the_number(completion, expected):
    assert format_reward([PLAIN_PROMPT], [completion]) == [expected]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("Tom has 23 + 45 = 68 apples now. The answer is 68.", 1.0),
        ("68", 1.0),
        ("#### 68", 1.0),
        ("\\boxed{68}", 1.0),
        ("He has 68 apples.\n\nFinal answer: 68\n", 1.0),  # final non-empty line ends with the number
        ("The answer is 68!!!", 1.0),  # 3 trailing characters: the limit
        ("The answer is 68!!!!", 0.5),  # 4 trailing characters: over it
        ("Tom has 68 apples.", 0.5),  # a number, but words after it
        ("68\nThat is my answer.", 0.5),
        ("I do not know.", 0.0),
    ],
)
def test_format_word_instruction_wants_number_at_end(completion, expected):
    assert format_reward([WORD_PROMPT], [completion]) == [expected]


def test_format_reads_instruction_per_sample():
    """The same completion scores differently under the two instructions."""
    assert format_reward([PLAIN_PROMPT, WORD_PROMPT], ["So it is 68.", "So it is 68."]) == [0.5, 1.0]


def test_format_checks_form_not_value():
    assert format_reward([PLAIN_PROMPT], ["5"]) == [1.0]


def test_format_misaligned_raises():
    with pytest.raises(RewardError, match="format.*2 prompts but 1 completions"):
        format_reward([PLAIN_PROMPT, PLAIN_PROMPT], ["4"])
